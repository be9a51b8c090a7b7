// The async I/O engine: splits requests into block_size pieces and hands them
// to `thread_count` workers, each keeping up to `queue_depth` pieces in
// flight. Two back ends behind one Worker interface:
//   io_uring  one ring per worker, owned and driven by that worker's thread;
//   threads   per worker, min(queue_depth, 64) threads doing pread/pwrite.
//
// O_DIRECT rules applied when splitting (see [Note: unaligned I/O]):
//   a segment's aligned body goes direct (through an aligned bounce buffer
//   when the caller's memory is not aligned); its unaligned head and tail
//   (< 4 KiB each) go through the buffered descriptor of the same file.
//
// Threading: submit()/wait_all()/register_buffers() may be called from any
// thread. Workers are joined in shutdown() after draining what was queued.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "aio/file.h"
#include "aio/request.h"

namespace infinity::aio {

enum class BackendKind { kThreads, kIoUring };

struct EngineOptions {
  uint64_t block_size = uint64_t{1} << 20;
  unsigned queue_depth = 32;
  unsigned thread_count = 1;
  BackendKind backend = BackendKind::kIoUring;
  // io_uring: most SQEs handed to the kernel per io_uring_enter; 0 = all
  // that are prepared (see [Note: submit batches] in uring_backend.cc).
  unsigned submit_batch = 2;
  bool overlap_events = true;   // refill the queue as completions arrive
};

struct Segment {
  char* buf;
  uint64_t nbytes;
  uint64_t offset;
  std::shared_ptr<File> file;
};

struct RegisteredRange {
  char* start;
  uint64_t nbytes;
};

class Worker {
 public:
  virtual ~Worker() = default;
  virtual void enqueue(std::vector<Piece>&& pieces) = 0;
  // Replaces the registered (fixed) buffers; only the io_uring back end
  // uses them. Blocks until the worker has applied the change.
  virtual void register_buffers(const std::vector<RegisteredRange>& ranges) { (void)ranges; }
  virtual void stop_and_join() = 0;
};

std::unique_ptr<Worker> make_threads_worker(const EngineOptions& opts);
// Throws std::system_error when the ring cannot be created.
std::unique_ptr<Worker> make_uring_worker(const EngineOptions& opts);
// "" when this process may create an io_uring ring, else why not.
std::string probe_io_uring();
bool built_with_io_uring();

class Engine {
 public:
  // Throws std::invalid_argument for bad options and std::system_error when
  // the requested back end cannot start (the Python layer decides fallback).
  explicit Engine(const EngineOptions& opts);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  std::shared_ptr<Request> submit(bool write, const std::vector<Segment>& segments);
  // Waits until every submitted request has completed (< 0: forever).
  bool wait_all(double timeout_s);
  int64_t in_flight();
  void register_buffers(const std::vector<RegisteredRange>& ranges);
  void shutdown();
  const EngineOptions& options() const { return opts_; }

 private:
  static void request_finished(void* self);
  void split(bool write, const Segment& seg, std::vector<Piece>& out) const;

  EngineOptions opts_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<uint64_t> next_worker_{0};
  std::mutex mu_;
  std::condition_variable idle_cv_;
  int64_t in_flight_ = 0;
  bool shut_down_ = false;
};

// Shared by both back ends: where the next byte of a piece goes, and what a
// syscall result means for it.
int piece_fd(const Piece& p);
char* piece_ptr(const Piece& p, char* bounce);
// Called with the result of one read/write of a piece (bytes, or -errno).
// Returns true when the piece is finished (and reported to its request),
// false when it must be issued again for its remainder.
bool piece_advance(Piece& p, char* bounce, int64_t res);
// Prepares a bounce piece before its first issue (copies write data in).
void piece_begin(Piece& p, char* bounce);

}  // namespace infinity::aio
