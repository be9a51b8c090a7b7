#include "adam/thread_pool.h"

#include <pthread.h>

#include <atomic>
#include <exception>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace infinity::adam {
namespace {

std::atomic<ThreadPool*> g_pool{nullptr};

unsigned read_control_word() {
#if defined(__x86_64__) || defined(_M_X64)
  return _mm_getcsr();
#else
  return 0;
#endif
}

void write_control_word(unsigned word) {
#if defined(__x86_64__) || defined(_M_X64)
  if (_mm_getcsr() != word) _mm_setcsr(word);
#else
  (void)word;
#endif
}

// The parent's pool (its mutexes possibly held, its threads gone) is
// abandoned in the child, never destroyed: destroying it would wait for
// threads that do not exist there.
void reset_in_child() { g_pool.store(new ThreadPool(), std::memory_order_release); }

ThreadPool* make_global() {
  pthread_atfork(nullptr, nullptr, &reset_in_child);
  return new ThreadPool();
}

}  // namespace

ThreadPool& ThreadPool::global() {
  static ThreadPool* const first = [] {
    ThreadPool* pool = make_global();
    g_pool.store(pool, std::memory_order_release);
    return pool;
  }();
  (void)first;
  return *g_pool.load(std::memory_order_acquire);
}

void ThreadPool::grow(int workers) {
  while (static_cast<int>(workers_.size()) < workers) {
    const int index = static_cast<int>(workers_.size()) + 1;
    workers_.emplace_back([this, index] { worker_main(index); });
  }
}

void ThreadPool::worker_main(int index) {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [&] { return generation_ != seen; });
    seen = generation_;
    if (index >= job_threads_) continue;
    const std::function<void(int)>* task = task_;
    const unsigned word = control_word_;
    lock.unlock();
    write_control_word(word);
    try {
      (*task)(index);
    } catch (...) {
      std::terminate();  // tasks are noexcept by contract
    }
    lock.lock();
    if (--pending_ == 0) done_.notify_one();
  }
}

void ThreadPool::run(int n, const std::function<void(int)>& task) {
  if (n <= 1) {
    task(0);
    return;
  }
  std::lock_guard<std::mutex> serial(run_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    grow(n - 1);
    task_ = &task;
    job_threads_ = n;
    pending_ = n - 1;
    control_word_ = read_control_word();
    ++generation_;
  }
  wake_.notify_all();
  task(0);
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return pending_ == 0; });
  task_ = nullptr;
}

}  // namespace infinity::adam
