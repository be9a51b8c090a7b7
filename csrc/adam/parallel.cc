#include "adam/parallel.h"

#include <pthread.h>

#include <atomic>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace infinity::adam {
namespace {

std::atomic<bool> g_forked{false};

void mark_forked() { g_forked.store(true, std::memory_order_relaxed); }

[[maybe_unused]] const bool g_atfork_registered = [] {
  pthread_atfork(nullptr, nullptr, &mark_forked);
  return true;
}();

[[maybe_unused]] unsigned read_control_word() {
#if defined(__x86_64__) || defined(_M_X64)
  return _mm_getcsr();
#else
  return 0;
#endif
}

// Sets the FP control word for the lifetime of the object, then restores it:
// the threads are torch's, and must leave as they came.
class ControlWordScope {
 public:
  explicit ControlWordScope(unsigned word) {
#if defined(__x86_64__) || defined(_M_X64)
    saved_ = _mm_getcsr();
    if (saved_ != word) _mm_setcsr(word);
#else
    (void)word;
#endif
  }
  ~ControlWordScope() {
#if defined(__x86_64__) || defined(_M_X64)
    if (_mm_getcsr() != saved_) _mm_setcsr(saved_);
#endif
  }
  ControlWordScope(const ControlWordScope&) = delete;
  ControlWordScope& operator=(const ControlWordScope&) = delete;

 private:
  unsigned saved_ = 0;
};

}  // namespace

void parallel_run(int n, const std::function<void()>& task) {
#if defined(_OPENMP)
  if (n > 1 && !g_forked.load(std::memory_order_relaxed)) {
    const unsigned word = read_control_word();
#pragma omp parallel num_threads(n)
    {
      ControlWordScope scope(word);
      task();
    }
    return;
  }
#endif
  (void)n;
  task();
}

const char* parallel_backend() {
#if defined(_OPENMP)
  return "openmp";
#else
  return "serial";
#endif
}

}  // namespace infinity::adam
