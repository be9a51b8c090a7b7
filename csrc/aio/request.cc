#include "aio/request.h"

#include <chrono>

namespace infinity::aio {

Request::Request(bool write, uint64_t nbytes, int64_t pieces)
    : write_(write), nbytes_(nbytes), pending_(pieces) {}

void Request::piece_done(const RequestError* error) {
  void (*fn)(void*) = nullptr;
  void* arg = nullptr;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // Of several failing pieces, report the one at the lowest offset (the
    // first the caller would hit), whatever order they completed in.
    bool have = error_.err != 0 || error_.eof;
    if (error != nullptr && (!have || error->offset < error_.offset)) error_ = *error;
    if (--pending_ == 0) {
      fn = on_complete_;
      arg = on_complete_arg_;
      cv_.notify_all();
    }
  }
  // Outside the lock: the callback may wake waiters of the whole engine.
  if (fn != nullptr) fn(arg);
}

bool Request::done() {
  std::lock_guard<std::mutex> lk(mu_);
  return pending_ == 0;
}

bool Request::wait(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout_s < 0) {
    cv_.wait(lk, [&] { return pending_ == 0; });
    return true;
  }
  return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return pending_ == 0; });
}

RequestError Request::error() {
  std::lock_guard<std::mutex> lk(mu_);
  return error_;
}

}  // namespace infinity::aio
