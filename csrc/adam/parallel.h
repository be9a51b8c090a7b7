// Runs the kernels on several threads: OpenMP, sharing torch's runtime.
//
// [Note: threads]
// torch's x86 wheels run their intra-op work on the libgomp they ship
// (torch/lib/libgomp.so.1). After each parallel region its worker threads
// spin-wait for the next one (about 10 ms under libgomp's default wait
// policy), so after any torch op the other cores are busy spinning. A thread
// pool of our own then fights those spinners for the cores: measured on the
// 2-core benchmark machine, an own-pool 2-thread step ran no faster than
// 1 thread right after torch ops (644 vs 620 us per 1M elements; 337 us with
// OMP_WAIT_POLICY=passive). Linking libgomp by its soname instead makes the
// dynamic linker bind us to the copy torch already loaded (infinity.optim
// imports torch first): one runtime, and our region is picked up by the very
// threads that are spinning. tests/optim/test_threads.py checks that only one
// OpenMP runtime is mapped.
//
// Rules: parallel_run(n, task) runs task() on each of t <= n threads (OpenMP
// may grant fewer; tasks take their work from a shared counter, see
// [Note: partitioning] in adam.cc) and returns when all have returned. Every thread runs under the caller's MXCSR (so
// torch.set_flush_denormal applies) and gets its own back afterwards. In a
// child process forked after a parallel region, libgomp's threads are gone
// and a region would hang: there everything runs on the calling thread.
// Built without OpenMP, everything runs on the calling thread.
#pragma once

#include <functional>

namespace infinity::adam {

void parallel_run(int n, const std::function<void()>& task);

// "openmp" or "serial" (a build without OpenMP).
const char* parallel_backend();

}  // namespace infinity::adam
