// One submitted request (possibly vectored: many buffer/offset segments) and
// the pieces it is split into. A request completes when its last piece does;
// the failing piece at the lowest offset decides its error.
//
// Threading: pieces complete on worker threads; wait()/done()/error() may be
// called from any thread. Lifetime: every piece holds the request and the
// file by shared_ptr; the Python layer holds the buffers.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "aio/file.h"

namespace infinity::aio {

struct RequestError {
  int err = 0;            // errno; 0 = no error
  bool eof = false;       // a read ran past the end of the file
  bool write = false;
  std::string path;
  uint64_t offset = 0;    // offset and size of the failing piece
  uint64_t nbytes = 0;
  int64_t file_size = -1; // for eof: the file's size when it was hit
};

class Request {
 public:
  Request(bool write, uint64_t nbytes, int64_t pieces);

  bool write() const { return write_; }
  uint64_t nbytes() const { return nbytes_; }

  // Called by a worker when one piece ends (err = 0 on success).
  void piece_done(const RequestError* error);

  bool done();
  // Waits until done or timeout (< 0: forever). Returns done().
  bool wait(double timeout_s);
  RequestError error();

  // Set by the engine; called once when the request completes.
  void set_on_complete(void (*fn)(void*), void* arg) {
    on_complete_ = fn;
    on_complete_arg_ = arg;
  }

 private:
  const bool write_;
  const uint64_t nbytes_;
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t pending_;
  RequestError error_;
  void (*on_complete_)(void*) = nullptr;
  void* on_complete_arg_ = nullptr;
};

// A piece is at most block_size bytes of one segment, performed with one
// syscall / one SQE (requeued while short).
struct Piece {
  std::shared_ptr<Request> req;
  std::shared_ptr<File> file;
  char* buf = nullptr;    // caller's memory for this piece
  uint64_t offset = 0;    // file offset of buf[0]
  uint64_t len = 0;
  uint64_t done = 0;      // bytes already transferred (short I/O progress)
  bool write = false;
  bool direct = false;    // use the O_DIRECT descriptor
  bool bounce = false;    // buf is not aligned: go through an aligned bounce buffer
};

}  // namespace infinity::aio
