#include "aio/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <system_error>

namespace infinity::aio {
namespace {

int open_flags(OpenMode mode) {
  switch (mode) {
    case OpenMode::kRead: return O_RDONLY;
    case OpenMode::kWrite: return O_WRONLY;
    case OpenMode::kReadWrite: return O_RDWR;
  }
  return O_RDONLY;
}

[[noreturn]] void throw_open_error(int err, const std::string& path) {
  throw std::system_error(err, std::generic_category(), path);
}

// See File::open: pretend the file system refuses O_DIRECT.
bool simulated_direct_refusal() {
  const char* v = std::getenv("INFINITY_AIO_O_DIRECT_REFUSE");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

}  // namespace

std::shared_ptr<File> File::open(const std::string& path, OpenMode mode, bool create,
                                 bool want_direct) {
  std::shared_ptr<File> f(new File());
  f->path_ = path;
  int flags = open_flags(mode) | O_CLOEXEC;
  int create_flags = (create && mode != OpenMode::kRead) ? O_CREAT : 0;
  // The buffered descriptor is opened first so that O_CREAT happens once.
  f->buffered_fd_ = ::open(path.c_str(), flags | create_flags, 0600);
  if (f->buffered_fd_ < 0) throw_open_error(errno, path);
  if (want_direct) {
    if (simulated_direct_refusal()) {
      f->direct_fd_ = -1;
      errno = EINVAL;
    } else {
      f->direct_fd_ = ::open(path.c_str(), flags | O_DIRECT);
    }
    if (f->direct_fd_ < 0) {
      int err = errno;
      if (err != EINVAL) {
        ::close(f->buffered_fd_);
        f->buffered_fd_ = -1;
        throw_open_error(err, path);
      }
      f->direct_refused_ = true;
    }
  }
  return f;
}

std::shared_ptr<File> File::from_fd(int fd) {
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0) throw std::system_error(errno, std::generic_category(), "fd " + std::to_string(fd));
  std::shared_ptr<File> f(new File());
  f->path_ = "<fd " + std::to_string(fd) + ">";
  char link[64];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  char target[4096];
  ssize_t n = readlink(link, target, sizeof target - 1);
  if (n > 0) {
    target[n] = '\0';
    f->path_ = std::string(target) + " (fd " + std::to_string(fd) + ")";
  }
  if (fl & O_DIRECT) {
    f->direct_fd_ = fd;
    f->owns_direct_ = false;
    f->buffered_fd_ = ::open(link, (fl & O_ACCMODE) | O_CLOEXEC);
    if (f->buffered_fd_ < 0) throw_open_error(errno, f->path_);
  } else {
    // Not direct: the caller's descriptor serves every piece; it is dup'ed so
    // close() never closes the caller's fd.
    f->buffered_fd_ = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (f->buffered_fd_ < 0) throw_open_error(errno, f->path_);
  }
  return f;
}

int64_t File::size() const {
  struct stat st;
  int fd = buffered_fd_ >= 0 ? buffered_fd_ : direct_fd_;
  if (fd < 0 || fstat(fd, &st) != 0) return -1;
  return st.st_size;
}

File::~File() {
  if (direct_fd_ >= 0 && owns_direct_) ::close(direct_fd_);
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
}

}  // namespace infinity::aio
