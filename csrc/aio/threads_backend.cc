// The portable back end: per worker, min(queue_depth, 64) threads that take
// pieces from one queue and run blocking pread/pwrite on them. Needs nothing
// from the kernel beyond POSIX; used where io_uring is refused (seccomp in
// containers, kernel.io_uring_disabled) or not built.
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <deque>
#include <thread>

#include "aio/aligned_buffer.h"
#include "aio/engine.h"

namespace infinity::aio {
namespace {

class ThreadsWorker final : public Worker {
 public:
  explicit ThreadsWorker(const EngineOptions& opts) : block_size_(opts.block_size) {
    unsigned n = opts.queue_depth < 64 ? opts.queue_depth : 64;
    for (unsigned i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
  }
  ~ThreadsWorker() override { stop_and_join(); }

  void enqueue(std::vector<Piece>&& pieces) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& p : pieces) queue_.push_back(std::move(p));
    }
    cv_.notify_all();
  }

  void stop_and_join() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

 private:
  void run() {
    char* bounce = nullptr;  // this thread's aligned bounce buffer, made on first need
    for (;;) {
      Piece p;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) break;  // stopping, and drained
        p = std::move(queue_.front());
        queue_.pop_front();
      }
      if (p.bounce && bounce == nullptr) {
        void* mem = nullptr;
        if (posix_memalign(&mem, kDirectAlignment, block_size_) != 0) {
          RequestError e;
          e.err = ENOMEM;
          e.write = p.write;
          e.path = p.file->path();
          e.offset = p.offset;
          e.nbytes = p.len;
          p.req->piece_done(&e);
          continue;
        }
        bounce = static_cast<char*>(mem);
      }
      piece_begin(p, bounce);
      for (;;) {
        char* ptr = piece_ptr(p, bounce);
        size_t n = p.len - p.done;
        off_t off = static_cast<off_t>(p.offset + p.done);
        ssize_t r = p.write ? ::pwrite(piece_fd(p), ptr, n, off) : ::pread(piece_fd(p), ptr, n, off);
        if (piece_advance(p, bounce, r < 0 ? -errno : r)) break;
      }
    }
    free(bounce);
  }

  const uint64_t block_size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Piece> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<Worker> make_threads_worker(const EngineOptions& opts) {
  return std::make_unique<ThreadsWorker>(opts);
}

}  // namespace infinity::aio
