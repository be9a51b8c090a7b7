"""Type stub of the C++ extension built from csrc/aio (bindings.cc).

Private: use ``infinity.aio``. Pointers are plain ints (addresses), sizes and
offsets are byte counts; errors are OSError with errno (ValueError for bad
arguments). Flags and options are keyword-only (after ``*``), as bindings.cc declares them.
"""

from collections.abc import Callable, Sequence
from typing import Literal, TypedDict

DIRECT_ALIGNMENT: int
"""Alignment (bytes) of buffer address, file offset and length for O_DIRECT."""
HUGE_PAGE_SIZE: int

class AlignedBuffer:
    """Page-aligned host memory, 2 MiB pages where asked and large enough; buffer protocol (bytes)."""

    def __init__(self, nbytes: int, *, huge_pages: bool = True, prefault: bool = True) -> None: ...
    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def mapped_size(self) -> int: ...
    @property
    def page_kind(self) -> Literal["small", "thp", "hugetlb"]: ...
    def set_finalizer(self, fn: Callable[[int], object], /) -> None:
        """Called with the address just before the memory is unmapped; pass a C-level callable
        (no Python code may run while an object is collected)."""

class File:
    """An open file: an O_DIRECT descriptor where accepted, plus a buffered one."""

    @property
    def path(self) -> str: ...
    @property
    def direct(self) -> bool: ...
    @property
    def direct_refused(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    @property
    def fileno(self) -> int: ...
    def size(self) -> int: ...
    def close(self) -> None:
        """Refuses new requests; descriptors close with the last reference."""

def open_file(path: str, mode: Literal["r", "w", "rw"], *, create: bool, direct: bool) -> File: ...
def file_from_fd(fd: int) -> File: ...

class RequestErrorInfo(TypedDict):
    errno: int
    eof: bool
    write: bool
    path: str
    offset: int
    nbytes: int
    file_size: int

class Request:
    @property
    def nbytes(self) -> int: ...
    @property
    def write(self) -> bool: ...
    def done(self) -> bool: ...
    def wait(self, timeout: float = -1.0) -> bool:
        """True once done; False after ``timeout`` seconds (< 0: forever). GIL released."""
    def error(self) -> RequestErrorInfo | None: ...

Segment = tuple[int, int, int, File]
"""(address, nbytes, file offset, file)."""

class Engine:
    def __init__(
        self,
        *,
        block_size: int,
        queue_depth: int,
        thread_count: int,
        backend: Literal["io_uring", "threads"],
        submit_batch: int,
        overlap_events: bool,
    ) -> None: ...
    def submit(self, segments: Sequence[Segment], *, write: bool, keep: object) -> Request:
        """``keep`` (the buffers and files) is held until the request is released or found done."""
    def release(self, request: Request) -> None:
        """Lets go of what ``submit`` kept for ``request`` (after waiting for it)."""
    def wait_all(self, timeout: float = -1.0) -> bool:
        """Also lets go of everything kept for finished requests."""
    def in_flight(self) -> int: ...
    def kept(self) -> int:
        """Requests whose buffers the engine still keeps."""
    def register_buffers(self, ranges: Sequence[tuple[int, int]]) -> None: ...
    def shutdown(self) -> None:
        """Drains the requests in flight, stops the workers, lets go of every kept buffer."""

def crc32c(ptr: int, nbytes: int, value: int = 0) -> int: ...
def crc32c_is_hardware() -> bool: ...
def probe_io_uring() -> str:
    """'' when this process may create an io_uring ring, else why not."""

def built_with_io_uring() -> bool: ...
