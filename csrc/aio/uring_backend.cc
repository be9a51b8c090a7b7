// The io_uring back end: each worker thread creates and alone drives one ring
// (so IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN apply where the kernel has
// them), keeps up to queue_depth pieces in flight, submits them at most
// submit_batch per io_uring_enter (see [Note: submit batches]) and reaps
// completions in batches. Pieces whose memory lies in a registered range use
// READ_FIXED / WRITE_FIXED, sparing the kernel a page pin per request.
// Pieces enqueued while the worker waits in the kernel for a completion are
// taken at the next completion (within one I/O's latency); an idle worker
// waits on a condition variable and starts at once.
//
// [Note: submit batches]
// When one io_uring_enter submits more than two SQEs the kernel plugs the
// block queue (io_submit_state_start: need_plug = max_ios > 2), and the plug
// (or the I/O scheduler on insert) merges file-adjacent pieces into requests
// of several block_size. That defeats block_size, the one knob that says how
// large a device request should be: on the virtio disk here a batch of 32
// 1 MiB pieces reached the device as ~9 requests of 3.5 MiB, and writes ran
// at 3.0 GB/s instead of 4.7 (reads 2.4 vs 2.8; fio, which submits one SQE
// per call, merges nothing). So the Python layer asks for batches of at most
// two by default (one with single_submit); a larger block_size is the way to
// get larger requests. Syscalls stay cheap at these sizes: 1 MiB at 5 GB/s is
// 5,000 submissions a second.
//
// Built only when liburing was found at build time (INFINITY_HAVE_LIBURING).
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <system_error>
#include <thread>

#include "aio/aligned_buffer.h"
#include "aio/engine.h"

#ifdef INFINITY_HAVE_LIBURING
#include <liburing.h>
#endif

namespace infinity::aio {
namespace {

// Test hook: pretend the kernel refuses io_uring (as Docker's default seccomp
// profile does) so the fallback path can be exercised on any machine.
int simulated_refusal() {
  const char* v = std::getenv("INFINITY_AIO_IO_URING_REFUSE");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "0") == 0) return 0;
  if (std::strcmp(v, "ENOSYS") == 0) return ENOSYS;
  return EPERM;
}

}  // namespace

bool built_with_io_uring() {
#ifdef INFINITY_HAVE_LIBURING
  return true;
#else
  return false;
#endif
}

#ifdef INFINITY_HAVE_LIBURING
namespace {

int init_ring(io_uring* ring, unsigned entries) {
  if (int e = simulated_refusal()) return -e;
  // Newest flags first; older kernels reject them with EINVAL.
  const unsigned flag_sets[] = {
#if defined(IORING_SETUP_SINGLE_ISSUER) && defined(IORING_SETUP_DEFER_TASKRUN)
      IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
#endif
#ifdef IORING_SETUP_COOP_TASKRUN
      IORING_SETUP_COOP_TASKRUN,
#endif
      0u};
  int ret = -EINVAL;
  for (unsigned flags : flag_sets) {
    ret = io_uring_queue_init(entries, ring, flags);
    if (ret != -EINVAL) return ret;
  }
  return ret;
}

class UringWorker final : public Worker {
 public:
  explicit UringWorker(const EngineOptions& opts) : opts_(opts), slots_(opts.queue_depth) {
    std::promise<int> started;
    auto fut = started.get_future();
    thread_ = std::thread([this, &started] { run(started); });
    int err = fut.get();
    if (err != 0) {
      thread_.join();
      throw std::system_error(err, std::generic_category(), "io_uring_queue_init");
    }
  }
  ~UringWorker() override { stop_and_join(); }

  void enqueue(std::vector<Piece>&& pieces) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& p : pieces) queue_.push_back(std::move(p));
    }
    cv_.notify_one();
  }

  void register_buffers(const std::vector<RegisteredRange>& ranges) override {
    std::unique_lock<std::mutex> lk(mu_);
    // A stopping worker may already have exited; one that has not will apply
    // the registration before it does (its exit test requires none pending).
    if (stopping_) throw std::system_error(EBADF, std::generic_category(), "the engine is shut down");
    control_ranges_ = ranges;
    control_pending_ = true;
    cv_.notify_one();
    control_cv_.wait(lk, [&] { return !control_pending_; });
    if (control_err_ != 0)
      throw std::system_error(control_err_, std::generic_category(), "io_uring_register_buffers");
  }

  void stop_and_join() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_ && !thread_.joinable()) return;
      stopping_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct Slot {
    Piece piece;
    char* bounce = nullptr;
  };

  void run(std::promise<int>& started) {
    int ret = init_ring(&ring_, opts_.queue_depth);
    if (ret < 0) {
      started.set_value(-ret);
      return;
    }
    started.set_value(0);
    for (uint32_t i = 0; i < slots_.size(); ++i) free_slots_.push_back(i);
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (in_flight_ == 0 && local_.empty() && retry_.empty()) {
          cv_.wait(lk, [&] { return stopping_ || !queue_.empty() || control_pending_; });
        }
        if (control_pending_ && in_flight_ == 0) apply_registration();
        while (!queue_.empty()) {
          local_.push_back(std::move(queue_.front()));
          queue_.pop_front();
        }
        if (stopping_ && local_.empty() && retry_.empty() && in_flight_ == 0 && !control_pending_)
          break;
      }
      bool hold_new = control_pending_unlocked();
      fill(hold_new);
      if (in_flight_ == 0) continue;
      if (opts_.overlap_events) {
        reap(1);
      } else {
        while (in_flight_ > 0) reap(1);
      }
    }
    if (registered_) io_uring_unregister_buffers(&ring_);
    io_uring_queue_exit(&ring_);
    for (auto& s : slots_) free(s.bounce);
  }

  bool control_pending_unlocked() {
    std::lock_guard<std::mutex> lk(mu_);
    return control_pending_;
  }

  // Called with mu_ held and nothing in flight.
  void apply_registration() {
    control_err_ = 0;
    if (registered_) {
      io_uring_unregister_buffers(&ring_);
      registered_ = false;
    }
    fixed_.clear();
    if (!control_ranges_.empty()) {
      std::vector<iovec> iov;
      for (auto& r : control_ranges_) iov.push_back(iovec{r.start, static_cast<size_t>(r.nbytes)});
      int r = io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
      if (r < 0) {
        control_err_ = -r;
      } else {
        registered_ = true;
        fixed_ = control_ranges_;
      }
    }
    control_pending_ = false;
    control_cv_.notify_all();
  }

  int fixed_index(const char* p, uint64_t n) const {
    for (size_t i = 0; i < fixed_.size(); ++i) {
      const char* s = fixed_[i].start;
      if (p >= s && p + n <= s + fixed_[i].nbytes) return static_cast<int>(i);
    }
    return -1;
  }

  // Prepares SQEs for retried pieces, then new ones (unless a registration
  // is waiting for the ring to drain), up to queue_depth in flight.
  unsigned fill(bool hold_new) {
    unsigned prepared = 0;
    while (in_flight_ < slots_.size() && (!retry_.empty() || (!hold_new && !local_.empty()))) {
      uint32_t idx;
      if (!retry_.empty()) {
        idx = retry_.front();
        retry_.pop_front();
      } else {
        idx = free_slots_.front();
        free_slots_.pop_front();
        Slot& s = slots_[idx];
        s.piece = std::move(local_.front());
        local_.pop_front();
        if (s.piece.bounce && s.bounce == nullptr) {
          void* mem = nullptr;
          if (posix_memalign(&mem, kDirectAlignment, opts_.block_size) != 0) {
            fail(s.piece, ENOMEM);
            free_slots_.push_back(idx);
            continue;
          }
          s.bounce = static_cast<char*>(mem);
        }
        piece_begin(s.piece, s.bounce);
      }
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) {  // SQ full: submit what we have and retry
        submit_all();
        sqe = io_uring_get_sqe(&ring_);
      }
      Slot& s = slots_[idx];
      Piece& p = s.piece;
      char* ptr = piece_ptr(p, s.bounce);
      unsigned n = static_cast<unsigned>(p.len - p.done);
      uint64_t off = p.offset + p.done;
      int fi = p.bounce ? -1 : fixed_index(ptr, n);
      if (fi >= 0) {
        if (p.write)
          io_uring_prep_write_fixed(sqe, piece_fd(p), ptr, n, off, fi);
        else
          io_uring_prep_read_fixed(sqe, piece_fd(p), ptr, n, off, fi);
      } else if (p.write) {
        io_uring_prep_write(sqe, piece_fd(p), ptr, n, off);
      } else {
        io_uring_prep_read(sqe, piece_fd(p), ptr, n, off);
      }
      io_uring_sqe_set_data64(sqe, idx);
      ++in_flight_;
      ++prepared;
      if (opts_.submit_batch != 0 && io_uring_sq_ready(&ring_) >= opts_.submit_batch) submit_all();
    }
    if (io_uring_sq_ready(&ring_) > 0) submit_all();
    return prepared;
  }

  // Hands every prepared SQE to the kernel (see [Note: submit batches]).
  void submit_all() {
    for (;;) {
      int r = io_uring_submit(&ring_);
      if (r >= 0) return;
      if (r == -EINTR) continue;
      if ((r == -EAGAIN || r == -EBUSY) && in_flight_ > 0) {
        reap(1);  // make room, then submit the rest
        continue;
      }
      std::this_thread::yield();
    }
  }

  // Waits for at least `min` completions, then takes every available one.
  void reap(unsigned min) {
    io_uring_cqe* cqe = nullptr;
    if (min > 0) {
      int r;
      do {
        r = io_uring_wait_cqe(&ring_, &cqe);
      } while (r == -EINTR || r == -EAGAIN);
    }
    unsigned head;
    unsigned count = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++count;
      auto idx = static_cast<uint32_t>(io_uring_cqe_get_data64(cqe));
      Slot& s = slots_[idx];
      --in_flight_;
      if (piece_advance(s.piece, s.bounce, cqe->res)) {
        s.piece = Piece();  // drop the request/file references now
        free_slots_.push_back(idx);
      } else {
        retry_.push_back(idx);
      }
    }
    io_uring_cq_advance(&ring_, count);
  }

  static void fail(Piece& p, int err) {
    RequestError e;
    e.err = err;
    e.write = p.write;
    e.path = p.file->path();
    e.offset = p.offset;
    e.nbytes = p.len;
    p.req->piece_done(&e);
  }

  const EngineOptions opts_;
  io_uring ring_{};
  std::thread thread_;
  std::vector<Slot> slots_;
  std::deque<uint32_t> free_slots_;
  std::deque<uint32_t> retry_;
  std::deque<Piece> local_;
  unsigned in_flight_ = 0;
  std::vector<RegisteredRange> fixed_;
  bool registered_ = false;

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable control_cv_;
  std::deque<Piece> queue_;
  bool stopping_ = false;
  bool control_pending_ = false;
  std::vector<RegisteredRange> control_ranges_;
  int control_err_ = 0;
};

}  // namespace

std::unique_ptr<Worker> make_uring_worker(const EngineOptions& opts) {
  return std::make_unique<UringWorker>(opts);
}

std::string probe_io_uring() {
  if (int e = simulated_refusal())
    return std::string("io_uring_setup: ") + std::strerror(e) +
           " (simulated by INFINITY_AIO_IO_URING_REFUSE)";
  io_uring ring;
  int r = io_uring_queue_init(2, &ring, 0);
  if (r < 0) return std::string("io_uring_setup: ") + std::strerror(-r);
  io_uring_queue_exit(&ring);
  return "";
}

#else  // !INFINITY_HAVE_LIBURING

std::unique_ptr<Worker> make_uring_worker(const EngineOptions&) {
  throw std::system_error(ENOSYS, std::generic_category(),
                          "this build has no io_uring back end (liburing was not found at build time)");
}

std::string probe_io_uring() {
  return "this build has no io_uring back end (liburing was not found at build time)";
}

#endif

}  // namespace infinity::aio
