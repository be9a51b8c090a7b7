// An open file as the engine sees it: a direct (O_DIRECT) descriptor where
// the file system accepts one, plus a buffered descriptor on the same file
// for the pieces O_DIRECT cannot take (unaligned heads and tails, short reads
// that end mid-block). Linux keeps the two coherent: a direct read flushes
// dirty cached pages of its range first, a direct write invalidates them.
//
// Threading: the descriptors are immutable after open. close() only marks the
// file closed (new requests are refused); the descriptors are closed when the
// last reference goes, and every piece in flight holds one, so a close never
// pulls a descriptor from under the kernel (nor lets its number be reused for
// another file while a piece still targets it).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace infinity::aio {

enum class OpenMode { kRead, kWrite, kReadWrite };

class File {
 public:
  // Opens `path`. kWrite/kReadWrite create the file (0600 | umask) when
  // `create`. When `want_direct` and the file system refuses O_DIRECT
  // (EINVAL, e.g. ramfs), the file is opened buffered and direct() is false.
  // Throws std::system_error naming the path. Test hook: the environment
  // variable INFINITY_AIO_O_DIRECT_REFUSE=1 makes every O_DIRECT open fail
  // with EINVAL, as such a file system would.
  static std::shared_ptr<File> open(const std::string& path, OpenMode mode, bool create,
                                    bool want_direct);
  // Wraps a descriptor the caller owns (it is not closed here). Its O_DIRECT
  // flag is read with fcntl; a buffered twin is opened via /proc/self/fd.
  static std::shared_ptr<File> from_fd(int fd);

  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  int direct_fd() const { return direct_fd_; }      // -1 when not direct
  int buffered_fd() const { return buffered_fd_; }
  bool direct() const { return direct_fd_ >= 0; }
  bool direct_refused() const { return direct_refused_; }
  const std::string& path() const { return path_; }
  int64_t size() const;  // current size (fstat), -1 on error
  // Refuses new requests; the descriptors close with the last reference.
  void close() { closed_.store(true, std::memory_order_release); }
  bool closed() const { return closed_.load(std::memory_order_acquire); }

 private:
  File() = default;
  std::string path_;
  int direct_fd_ = -1;
  int buffered_fd_ = -1;
  bool owns_direct_ = true;
  bool direct_refused_ = false;
  std::atomic<bool> closed_{false};
};

}  // namespace infinity::aio
