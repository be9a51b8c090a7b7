#include "aio/aligned_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <system_error>

namespace infinity::aio {
namespace {

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Touch every page now so the cost of faulting is paid once, at allocation.
void prefault_range(void* p, size_t n) {
#ifdef MADV_POPULATE_WRITE
  if (madvise(p, n, MADV_POPULATE_WRITE) == 0) return;
#endif
  auto* bytes = static_cast<volatile char*>(p);
  for (size_t off = 0; off < n; off += kDirectAlignment) bytes[off] = 0;
}

}  // namespace

AlignedBuffer::AlignedBuffer(size_t nbytes, bool huge_pages, bool prefault)
    : nbytes_(nbytes) {
  if (nbytes == 0) return;
  // Below one huge page there is nothing to gain from 2 MiB pages.
  if (huge_pages && nbytes >= kHugePageSize) {
    size_t n = round_up(nbytes, kHugePageSize);
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (p != MAP_FAILED) {
      data_ = p;
      mapped_ = n;
      kind_ = PageKind::kHugeTlb;
    } else {
      // Over-allocate by one huge page and trim, so the start is 2 MiB
      // aligned and THP can back every page.
      size_t span = n + kHugePageSize;
      void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (raw == MAP_FAILED)
        throw std::system_error(errno, std::generic_category(),
                                "mmap of " + std::to_string(span) + " bytes");
      auto base = reinterpret_cast<uintptr_t>(raw);
      uintptr_t aligned = round_up(base, kHugePageSize);
      if (aligned > base) munmap(raw, aligned - base);
      uintptr_t end = aligned + n;
      if (base + span > end) munmap(reinterpret_cast<void*>(end), base + span - end);
      data_ = reinterpret_cast<void*>(aligned);
      mapped_ = n;
      kind_ = PageKind::kSmall;
#ifdef MADV_HUGEPAGE
      if (madvise(data_, n, MADV_HUGEPAGE) == 0) kind_ = PageKind::kTransparentHuge;
#endif
    }
  } else {
    size_t n = round_up(nbytes, kDirectAlignment);
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      throw std::system_error(errno, std::generic_category(),
                              "mmap of " + std::to_string(n) + " bytes");
    data_ = p;
    mapped_ = n;
  }
  if (prefault) prefault_range(data_, mapped_);
}

AlignedBuffer::~AlignedBuffer() {
  if (data_ != nullptr) munmap(data_, mapped_);
}

}  // namespace infinity::aio
