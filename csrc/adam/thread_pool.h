// A persistent pool of worker threads for the Adam kernels (not OpenMP; see
// [Note: why not OpenMP]). run(n, task) calls task(0) .. task(n - 1) on n
// threads, the caller being thread 0, and returns when all have returned.
//
// Threading: run() may be called from any thread; calls are serialized. The
// workers take the caller's floating-point control word (MXCSR) for each job,
// so flush-to-zero settings made by the caller (torch.set_flush_denormal)
// apply to every thread alike. Workers start on first use and grow to the
// largest n asked for; they sleep on a condition variable between jobs.
// After fork() the child gets a fresh, empty pool (threads do not survive
// fork), so a forked child can use the kernels too.
//
// [Note: why not OpenMP]
// torch's wheels ship their own libgomp.so.1 under the same soname as the
// system's; an extension linked with -fopenmp binds to whichever loaded first,
// and two OpenMP runtimes in one process (or libgomp vs. Intel's libiomp)
// oversubscribe the cores or clash. A small pool of our own has no such
// dependency, costs one wake-up per call (measured in bench/adam.py's
// dispatch figure), and keeps the extension free of link-time surprises.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace infinity::adam {

class ThreadPool {
 public:
  // The process-wide pool (replaced by a fresh one in a forked child).
  static ThreadPool& global();

  // task must not throw.
  void run(int n, const std::function<void(int)>& task);

  ThreadPool() = default;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

 private:
  void grow(int workers);
  void worker_main(int index);

  std::mutex run_mu_;  // one job at a time
  std::mutex mu_;      // guards everything below
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int)>* task_ = nullptr;
  int job_threads_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  unsigned control_word_ = 0;
  std::vector<std::thread> workers_;  // never joined: they live as long as the process
};

}  // namespace infinity::adam
