#include "aio/engine.h"

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include "aio/aligned_buffer.h"

namespace infinity::aio {

// [Note: unaligned I/O]
// O_DIRECT needs the buffer address, file offset and length aligned (we use
// 4 KiB, safe for every device). Rather than refusing or zero-padding (which
// would change the file's size, and DeepSpeed's padding bug #1070 shows what
// that costs), a segment is cut into an unaligned head and tail that go
// through the buffered descriptor and an aligned body that goes direct. A
// body whose memory is misaligned relative to its offset is bounced through
// an aligned per-slot buffer (memcpy runs ~5x faster than the disk). A short
// direct read (end of file mid-block) continues buffered, so a read past the
// end is reported as such instead of failing with EINVAL.

namespace {

bool aligned(uint64_t v) { return v % kDirectAlignment == 0; }
uint64_t round_down(uint64_t v) { return v / kDirectAlignment * kDirectAlignment; }
uint64_t round_up(uint64_t v) { return (v + kDirectAlignment - 1) / kDirectAlignment * kDirectAlignment; }

}  // namespace

int piece_fd(const Piece& p) { return p.direct ? p.file->direct_fd() : p.file->buffered_fd(); }

char* piece_ptr(const Piece& p, char* bounce) { return (p.bounce ? bounce : p.buf) + p.done; }

void piece_begin(Piece& p, char* bounce) {
  if (p.bounce && p.write) std::memcpy(bounce, p.buf, p.len);
}

bool piece_advance(Piece& p, char* bounce, int64_t res) {
  if (res == -EAGAIN || res == -EINTR) return false;
  if (res < 0 || (res == 0 && p.done < p.len)) {
    RequestError e;
    e.write = p.write;
    e.path = p.file->path();
    e.offset = p.offset + p.done;
    e.nbytes = p.len - p.done;
    if (res < 0) {
      e.err = static_cast<int>(-res);
    } else if (p.write) {
      e.err = ENOSPC;  // a write that makes no progress: the device is full
    } else {
      e.eof = true;
      e.file_size = p.file->size();
    }
    p.req->piece_done(&e);
    return true;
  }
  if (p.bounce && !p.write) std::memcpy(p.buf + p.done, bounce + p.done, static_cast<size_t>(res));
  p.done += static_cast<uint64_t>(res);
  if (p.done >= p.len) {
    p.req->piece_done(nullptr);
    return true;
  }
  // Short transfer: continue with the remainder, buffered if it is no longer
  // aligned (see [Note: unaligned I/O]).
  if (p.direct && (!aligned(p.offset + p.done) || !aligned(p.len - p.done))) {
    p.direct = false;
    p.bounce = false;  // the caller's buffer holds (or receives) the rest
  }
  return false;
}

Engine::Engine(const EngineOptions& opts) : opts_(opts) {
  if (opts.block_size == 0 || opts.block_size % kDirectAlignment != 0)
    throw std::invalid_argument("block_size must be a positive multiple of 4096 bytes, got " +
                                std::to_string(opts.block_size));
  if (opts.queue_depth == 0 || opts.queue_depth > 4096)
    throw std::invalid_argument("queue_depth must be in [1, 4096], got " +
                                std::to_string(opts.queue_depth));
  if (opts.thread_count == 0 || opts.thread_count > 256)
    throw std::invalid_argument("thread_count must be in [1, 256], got " +
                                std::to_string(opts.thread_count));
  try {
    for (unsigned i = 0; i < opts.thread_count; ++i) {
      workers_.push_back(opts.backend == BackendKind::kIoUring ? make_uring_worker(opts)
                                                               : make_threads_worker(opts));
    }
  } catch (...) {
    for (auto& w : workers_) w->stop_and_join();
    throw;
  }
}

Engine::~Engine() { shutdown(); }

void Engine::split(bool write, const Segment& seg, std::vector<Piece>& out) const {
  const uint64_t end = seg.offset + seg.nbytes;
  auto emit = [&](uint64_t from, uint64_t to, bool direct, bool bounce) {
    for (uint64_t off = from; off < to; off += opts_.block_size) {
      Piece p;
      p.file = seg.file;
      p.buf = seg.buf + (off - seg.offset);
      p.offset = off;
      p.len = std::min<uint64_t>(opts_.block_size, to - off);
      p.write = write;
      p.direct = direct;
      p.bounce = bounce;
      out.push_back(std::move(p));
    }
  };
  if (!seg.file->direct()) {
    emit(seg.offset, end, false, false);
    return;
  }
  uint64_t body_start = std::min(round_up(seg.offset), end);
  uint64_t body_end = std::max(round_down(end), body_start);
  if (body_start > seg.offset) emit(seg.offset, body_start, false, false);
  if (body_end > body_start) {
    auto mem = reinterpret_cast<uintptr_t>(seg.buf + (body_start - seg.offset));
    emit(body_start, body_end, true, !aligned(mem));
  }
  if (end > body_end) emit(body_end, end, false, false);
}

std::shared_ptr<Request> Engine::submit(bool write, const std::vector<Segment>& segments) {
  std::vector<Piece> pieces;
  uint64_t total = 0;
  for (const auto& seg : segments) {
    if (!seg.file) throw std::invalid_argument("segment without a file");
    split(write, seg, pieces);
    total += seg.nbytes;
  }
  auto req = std::make_shared<Request>(write, total, static_cast<int64_t>(pieces.size()));
  if (pieces.empty()) return req;
  req->set_on_complete(&Engine::request_finished, this);
  // Spread pieces round-robin from a rotating start, so that many one-piece
  // requests still use every worker.
  const size_t nw = workers_.size();
  std::vector<std::vector<Piece>> per_worker(nw);
  uint64_t start = next_worker_.fetch_add(1, std::memory_order_relaxed);
  for (size_t i = 0; i < pieces.size(); ++i) {
    pieces[i].req = req;
    per_worker[(start + i) % nw].push_back(std::move(pieces[i]));
  }
  // Enqueue under mu_: shutdown() sets shut_down_ under it, so every request
  // accepted here reaches the workers before they are told to stop (and they
  // drain what they hold). Enqueueing is a push under each worker's lock.
  std::lock_guard<std::mutex> lk(mu_);
  if (shut_down_) throw std::system_error(EBADF, std::generic_category(), "the engine is shut down");
  ++in_flight_;
  for (size_t w = 0; w < nw; ++w)
    if (!per_worker[w].empty()) workers_[w]->enqueue(std::move(per_worker[w]));
  return req;
}

void Engine::request_finished(void* self) {
  auto* e = static_cast<Engine*>(self);
  std::lock_guard<std::mutex> lk(e->mu_);
  if (--e->in_flight_ == 0) e->idle_cv_.notify_all();
}

bool Engine::wait_all(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout_s < 0) {
    idle_cv_.wait(lk, [&] { return in_flight_ == 0; });
    return true;
  }
  return idle_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s),
                           [&] { return in_flight_ == 0; });
}

int64_t Engine::in_flight() {
  std::lock_guard<std::mutex> lk(mu_);
  return in_flight_;
}

void Engine::register_buffers(const std::vector<RegisteredRange>& ranges) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (shut_down_) throw std::system_error(EBADF, std::generic_category(), "the engine is shut down");
  }
  // A shutdown racing with this makes the worker refuse (EBADF), never hang.
  for (auto& w : workers_) w->register_buffers(ranges);
}

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  // Workers drain their queues before exiting: nothing in flight is dropped.
  // They are freed with the engine, not here: a register_buffers() racing
  // with this call may still be talking to them.
  for (auto& w : workers_) w->stop_and_join();
}

}  // namespace infinity::aio
