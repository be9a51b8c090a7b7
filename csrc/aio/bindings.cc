// pybind11 face of csrc/aio: converts, releases the GIL around anything that
// can block, and maps errors to OSError with errno. No policy lives here:
// buffer validation, fallback decisions and error messages are in
// infinity/aio (Python). Flags and options are keyword-only (py::kw_only), so
// a positional True cannot land in the wrong slot.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>
#include <system_error>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "aio/aligned_buffer.h"
#include "aio/checksum.h"
#include "aio/engine.h"
#include "aio/file.h"
#include "aio/request.h"

namespace py = pybind11;
using namespace infinity::aio;

namespace {

// Keeps a callable to run (with the GIL) when the buffer is freed: used to
// cudaHostUnregister pinned memory before it is unmapped. It is called with
// the address only, so a C-level callable (torch's cudart.cudaHostUnregister)
// can be passed as is: no Python code runs while the buffer is collected, so
// none can swallow a KeyboardInterrupt (see [Note: finalizers run no Python]
// in infinity/aio/handle.py).
class PyAlignedBuffer {
 public:
  PyAlignedBuffer(size_t nbytes, bool huge_pages, bool prefault)
      : buf_(std::make_unique<AlignedBuffer>(nbytes, huge_pages, prefault)) {}
  ~PyAlignedBuffer() {
    if (finalizer_) {
      try {
        finalizer_(ptr());
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("infinity._aio.AlignedBuffer finalizer");
      }
    }
  }
  uintptr_t ptr() const { return reinterpret_cast<uintptr_t>(buf_->data()); }
  size_t nbytes() const { return buf_->size(); }
  size_t mapped_size() const { return buf_->mapped_size(); }
  std::string page_kind() const {
    switch (buf_->page_kind()) {
      case PageKind::kSmall: return "small";
      case PageKind::kTransparentHuge: return "thp";
      case PageKind::kHugeTlb: return "hugetlb";
    }
    return "small";
  }
  void set_finalizer(py::object f) { finalizer_ = std::move(f); }
  AlignedBuffer& raw() { return *buf_; }

 private:
  std::unique_ptr<AlignedBuffer> buf_;
  py::object finalizer_;
};

// [Note: releasing the GIL at interpreter exit]
// Runs f() with the GIL released. pybind11's gil_scoped_release re-takes the
// GIL in a (noexcept) destructor; at interpreter exit CPython ends a daemon
// thread that re-takes the GIL with pthread_exit, whose forced unwind through
// a noexcept frame calls std::terminate ("terminate called without an active
// exception"). A daemon thread blocked in wait() when the interpreter exits
// hit exactly that. Here the GIL is re-taken in a plain frame, so the forced
// unwind passes through (pybind11 rethrows it) and the thread ends cleanly.
template <class F>
auto without_gil(F&& f) -> decltype(f()) {
  using R = decltype(f());
  PyThreadState* state = PyEval_SaveThread();
  std::exception_ptr error;
  if constexpr (std::is_void_v<R>) {
    try {
      f();
    } catch (...) {
      error = std::current_exception();
    }
    PyEval_RestoreThread(state);  // may end this thread at interpreter exit
    if (error) std::rethrow_exception(error);
  } else {
    R result{};
    try {
      result = f();
    } catch (...) {
      error = std::current_exception();
    }
    PyEval_RestoreThread(state);  // may end this thread at interpreter exit
    if (error) std::rethrow_exception(error);
    return result;
  }
}

// [Note: requests keep their buffers alive]
// A submitted request must keep its buffers (and per-request files) alive
// until the kernel is done with them, even when the caller drops it unwaited.
// The engine keeps them: submit() stores the caller's keepalive object by
// request, release() (after a wait) drops it, and submit() sweeps finished
// requests now and then. So AioRequest needs no __del__, and dropping one
// runs no Python code (a __del__ can swallow a KeyboardInterrupt that lands
// in it). The kept objects are touched only with the GIL held; the destructor
// drains the engine before dropping them, so nothing is freed under the I/O.
// Dropping a kept object can run Python code (a buffer's on-free callable),
// and Python code can hand the GIL to another thread, which may then submit or
// release on this engine: so an entry is moved out of kept_ and dropped only
// after kept_ is left consistent, never while it is being iterated or erased
// (a sweep that dropped entries in place crashed the store bench about once in
// six runs while another thread released a request).
class PyEngine {
 public:
  explicit PyEngine(const EngineOptions& o) : engine_(std::make_unique<Engine>(o)) {}
  ~PyEngine() {
    engine_->shutdown();  // drains: every kept buffer is free to go after this
    drop_all();
  }
  Engine& engine() { return *engine_; }

  std::shared_ptr<Request> submit(bool write, const std::vector<Segment>& v, py::object keep) {
    auto req = without_gil([&] { return engine_->submit(write, v); });
    if (!req->done()) {
      if (kept_.size() >= sweep_at_) sweep();
      kept_.emplace(req.get(), Kept{req, std::move(keep)});
    }
    return req;
  }
  void release(const std::shared_ptr<Request>& req) {
    auto it = kept_.find(req.get());
    if (it == kept_.end()) return;
    Kept gone = std::move(it->second);
    kept_.erase(it);
  }  // gone is dropped here, with kept_ consistent
  bool wait_all(double timeout) {
    bool idle = without_gil([&] { return engine_->wait_all(timeout); });
    sweep();
    return idle;
  }
  void shutdown() {
    without_gil([&] { engine_->shutdown(); });
    drop_all();
  }
  size_t kept() const { return kept_.size(); }

 private:
  struct Kept {
    std::shared_ptr<Request> req;
    py::object keep;
  };
  void sweep() {
    std::vector<Kept> gone;
    for (auto it = kept_.begin(); it != kept_.end();) {
      if (it->second.req->done()) {
        gone.push_back(std::move(it->second));
        it = kept_.erase(it);
      } else {
        ++it;
      }
    }
    sweep_at_ = std::max<size_t>(64, 2 * kept_.size());
  }  // gone is dropped here, after the loop
  void drop_all() {
    std::unordered_map<const Request*, Kept> gone;
    gone.swap(kept_);
  }

  std::unique_ptr<Engine> engine_;
  std::unordered_map<const Request*, Kept> kept_;
  size_t sweep_at_ = 64;
};

OpenMode parse_mode(const std::string& m) {
  if (m == "r") return OpenMode::kRead;
  if (m == "w") return OpenMode::kWrite;
  if (m == "rw") return OpenMode::kReadWrite;
  throw std::invalid_argument("mode must be 'r', 'w' or 'rw', got '" + m + "'");
}

py::object error_dict(const RequestError& e) {
  if (e.err == 0 && !e.eof) return py::none();
  py::dict d;
  d["errno"] = e.err;
  d["eof"] = e.eof;
  d["write"] = e.write;
  d["path"] = e.path;
  d["offset"] = e.offset;
  d["nbytes"] = e.nbytes;
  d["file_size"] = e.file_size;
  return std::move(d);
}

}  // namespace

PYBIND11_MODULE(_aio, m) {
  m.doc() = "infinity's async I/O engine (io_uring + threads). Use infinity.aio, not this module.";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::system_error& e) {
      // what() is "<context>: <strerror>"; keep the context as the filename.
      std::string what = e.what();
      std::string msg = e.code().message();
      std::string ctx = what;
      if (what.size() > msg.size() + 2 && what.compare(what.size() - msg.size(), msg.size(), msg) == 0)
        ctx = what.substr(0, what.size() - msg.size() - 2);
      py::object exc = py::module_::import("builtins").attr("OSError")(e.code().value(), msg, ctx);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  py::class_<PyAlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol())
      .def(py::init<size_t, bool, bool>(), py::arg("nbytes"), py::kw_only(),
           py::arg("huge_pages") = true, py::arg("prefault") = true)
      .def_property_readonly("ptr", &PyAlignedBuffer::ptr)
      .def_property_readonly("nbytes", &PyAlignedBuffer::nbytes)
      .def_property_readonly("mapped_size", &PyAlignedBuffer::mapped_size)
      .def_property_readonly("page_kind", &PyAlignedBuffer::page_kind)
      .def("set_finalizer", &PyAlignedBuffer::set_finalizer)
      .def_buffer([](PyAlignedBuffer& b) -> py::buffer_info {
        return py::buffer_info(b.raw().data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes())}, {1});
      });

  py::class_<File, std::shared_ptr<File>>(m, "File")
      .def_property_readonly("path", &File::path)
      .def_property_readonly("direct", &File::direct)
      .def_property_readonly("direct_refused", &File::direct_refused)
      .def_property_readonly("closed", &File::closed)
      .def_property_readonly("fileno", &File::buffered_fd)
      .def("size", &File::size)
      .def("close", &File::close);

  m.def(
      "open_file",
      [](const std::string& path, const std::string& mode, bool create, bool direct) {
        OpenMode om = parse_mode(mode);
        return without_gil([&] { return File::open(path, om, create, direct); });
      },
      py::arg("path"), py::arg("mode"), py::kw_only(), py::arg("create"), py::arg("direct"));
  m.def("file_from_fd", &File::from_fd, py::arg("fd"));

  py::class_<Request, std::shared_ptr<Request>>(m, "Request")
      .def_property_readonly("nbytes", &Request::nbytes)
      .def_property_readonly("write", &Request::write)
      .def("done", &Request::done)  // a mutex held for a few instructions: keep the GIL
      .def(
          "wait", [](Request& r, double t) { return without_gil([&] { return r.wait(t); }); },
          py::arg("timeout") = -1.0)
      .def("error", [](Request& r) { return error_dict(r.error()); });

  py::class_<PyEngine>(m, "Engine")
      .def(py::init([](uint64_t block_size, unsigned queue_depth, unsigned thread_count,
                       const std::string& backend, unsigned submit_batch, bool overlap_events) {
             EngineOptions o;
             o.block_size = block_size;
             o.queue_depth = queue_depth;
             o.thread_count = thread_count;
             if (backend == "io_uring")
               o.backend = BackendKind::kIoUring;
             else if (backend == "threads")
               o.backend = BackendKind::kThreads;
             else
               throw std::invalid_argument("backend must be 'io_uring' or 'threads', got '" + backend + "'");
             o.submit_batch = submit_batch;
             o.overlap_events = overlap_events;
             return without_gil([&] { return new PyEngine(o); });
           }),
           py::kw_only(), py::arg("block_size"), py::arg("queue_depth"), py::arg("thread_count"),
           py::arg("backend"), py::arg("submit_batch"), py::arg("overlap_events"))
      .def(
          "submit",
          [](PyEngine& e,
             const std::vector<std::tuple<uintptr_t, uint64_t, uint64_t, std::shared_ptr<File>>>& segs,
             bool write, py::object keep) {
            std::vector<Segment> v;
            v.reserve(segs.size());
            for (auto& [ptr, n, off, f] : segs) {
              if (!f) throw std::invalid_argument("segment without a file");
              if (f->closed()) throw std::system_error(EBADF, std::generic_category(), f->path());
              v.push_back(Segment{reinterpret_cast<char*>(ptr), n, off, f});
            }
            return e.submit(write, v, std::move(keep));
          },
          py::arg("segments"), py::kw_only(), py::arg("write"), py::arg("keep"))
      .def("release", &PyEngine::release, py::arg("request"))
      .def("wait_all", &PyEngine::wait_all, py::arg("timeout") = -1.0)
      .def("in_flight", [](PyEngine& e) { return e.engine().in_flight(); })
      .def("kept", &PyEngine::kept)
      .def(
          "register_buffers",
          [](PyEngine& e, const std::vector<std::pair<uintptr_t, uint64_t>>& ranges) {
            std::vector<RegisteredRange> v;
            for (auto& [p, n] : ranges) v.push_back(RegisteredRange{reinterpret_cast<char*>(p), n});
            without_gil([&] { e.engine().register_buffers(v); });
          },
          py::arg("ranges"))
      .def("shutdown", &PyEngine::shutdown);

  m.def(
      "crc32c",
      [](uintptr_t ptr, size_t nbytes, uint32_t value) {
        return without_gil([&] { return crc32c(reinterpret_cast<const void*>(ptr), nbytes, value); });
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("value") = 0);
  m.def("crc32c_is_hardware", &crc32c_is_hardware);
  m.def("probe_io_uring", [] { return without_gil([] { return probe_io_uring(); }); });
  m.def("built_with_io_uring", &built_with_io_uring);

#ifdef INFINITY_PLANT_UAF
  // Planted bugs, compiled only into the sanitizer build (CMake's
  // INFINITY_SANITIZE): tests/test_sanitizers.py calls them and expects the
  // sanitizer's report, which proves the sanitized run of the tests is real.
  m.def("_planted_use_after_free", [] {
    auto* segments = new std::vector<int64_t>(64, 7);
    const volatile int64_t* first = segments->data();
    delete segments;
    return static_cast<int64_t>(*first);  // read after free
  });
  m.def("_planted_signed_overflow", [](int x) {
    volatile int big = x;
    return big + std::numeric_limits<int>::max();  // overflows for x > 0
  }, py::arg("x"));
#endif
  m.attr("DIRECT_ALIGNMENT") = kDirectAlignment;
  m.attr("HUGE_PAGE_SIZE") = kHugePageSize;
}
