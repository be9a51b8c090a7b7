"""Every failure is an exception naming the operation, path, offset, size and errno, and saying what
to do; none is a silent zero fill. Each case runs on both engines.

Permission denied: the tests run as root, which file modes do not stop, so that case opens the file
in a child process that has dropped to uid 65534 (nobody) with os.setuid after importing
infinity. ENOSPC and EROFS use small file systems mounted for the test (a loop-mounted ext4
image, a size-limited tmpfs, a read-only tmpfs), skipped with the reason where mounting is not
allowed.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from aio_util import mounted, random_bytes

from infinity.aio import AioConfig, AioEOFError, AioError, AioHandle, aligned_empty


def test_missing_directory(handle, nvme_dir):
    path = nvme_dir / "no" / "such" / "dir" / "f"
    for call in (handle.pwrite, handle.pread):
        with pytest.raises(AioError) as ei:
            call(bytearray(10), path)
        e = ei.value
        assert e.errno == errno.ENOENT
        assert e.filename == str(path)
        assert (
            f"the directory {path.parent} does not exist; create it or choose another path"
            in str(e)
        )


def test_missing_file_for_reading(handle, nvme_dir):
    with pytest.raises(
        AioError, match=r"cannot open '.*/absent' \(No such file or directory\): no such file"
    ):
        handle.pread(bytearray(10), nvme_dir / "absent")


PERMISSION_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from infinity.aio import AioError, AioHandle
    engine, path = sys.argv[1], sys.argv[2]
    h = AioHandle(engine=engine)
    os.setgid(65534)
    os.setuid(65534)  # nobody: file modes apply from here on
    for name, call in (("pread", h.pread), ("pwrite", h.pwrite)):
        try:
            call(bytearray(10), path)
        except AioError as e:
            print(name, e.errno, e)
        else:
            print(name, "no error")
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_permission_denied(engine, nvme_dir):
    path = nvme_dir / "private"
    path.write_bytes(b"x" * 100)
    path.chmod(0o600)
    r = subprocess.run(
        [sys.executable, "-c", PERMISSION_SCRIPT, engine, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2, r.stdout
    for line, op, mode in zip(lines, ("pread", "pwrite"), ("r", "rw"), strict=True):
        assert line.startswith(f"{op} {errno.EACCES} "), line
        assert (
            f"cannot open '{path}' (Permission denied): permission denied for mode '{mode}'" in line
        )
        assert "check the owner and mode of the path" in line


@pytest.mark.parametrize(
    ("file_size", "offset", "nbytes", "bad_offset", "bad_nbytes"),
    [
        (
            10_000,
            4096,
            8192,
            10_000,
            2288,
        ),  # straddles the end: aligned body, then a short direct read
        (10_000, 9000, 2000, 10_000, 1000),  # unaligned head and tail, buffered
        (8192, 8192, 4096, 8192, 4096),  # starts exactly at the end
        (0, 0, 1, 0, 1),  # empty file
        (100, 200_000, 10, 200_000, 10),  # far past the end
    ],
)
def test_read_past_end_of_file(handle, nvme_dir, file_size, offset, nbytes, bad_offset, bad_nbytes):
    path = nvme_dir / "short"
    path.write_bytes(random_bytes(file_size).tobytes())
    buf = aligned_empty(nbytes)
    with pytest.raises(AioEOFError) as ei:
        handle.sync_pread(buf, path, offset)
    e = ei.value
    assert isinstance(e, EOFError) and isinstance(e, OSError)
    assert (e.filename, e.offset, e.nbytes, e.op) == (str(path), bad_offset, bad_nbytes, "pread")
    part = f" (part of a {nbytes}-byte request)" if nbytes != bad_nbytes else ""
    assert str(e) == (
        f"pread of {bad_nbytes} bytes at offset {bad_offset} from '{path}'{part} runs past the end "
        f"of the file, which has {file_size} bytes"
    )


def test_read_past_end_reports_the_first_failing_piece(engine, nvme_dir):
    """Many pieces fail (in any order); the error names the lowest offset, the one the caller hits first."""
    path = nvme_dir / "short"
    path.write_bytes(b"a" * 5000)
    with AioHandle(engine=engine, block_size=4096, queue_depth=32) as h:
        with pytest.raises(
            AioEOFError, match=r"pread of 3192 bytes at offset 5000 .* which has 5000 bytes"
        ):
            h.sync_pread(aligned_empty(1 << 20), path, 0)


@pytest.mark.parametrize("fs", ["ext4", "tmpfs"])
def test_no_space_left(engine, nvme_dir, fs):
    """A write larger than a small file system: ENOSPC named, with the fix, for direct and buffered pieces."""
    with mounted(fs, nvme_dir, size="8M") as mnt:
        with AioHandle(engine=engine, block_size=1 << 20, queue_depth=4) as h:
            data = torch.from_numpy(random_bytes((16 << 20) + 123))
            with pytest.raises(AioError) as ei:
                h.sync_pwrite(data, mnt / "big")
            e = ei.value
            assert e.errno == errno.ENOSPC
            assert e.filename == str(mnt / "big") and e.op == "pwrite"
            assert re.fullmatch(
                rf"\[Errno {errno.ENOSPC}\] pwrite of \d+ bytes at offset \d+ to '{re.escape(str(mnt / 'big'))}' "
                rf"\(part of a {data.numel()}-byte request\) failed: No space left on device: the file system "
                r"is full; free space or point nvme_path at a larger drive",
                str(e),
            ), str(e)


def test_read_only_file_system(engine, nvme_dir):
    with mounted("tmpfs", nvme_dir, size="4M", options="ro") as mnt:
        with AioHandle(engine=engine) as h:
            with pytest.raises(AioError) as ei:
                h.pwrite(bytearray(10), mnt / "f")
    assert ei.value.errno == errno.EROFS
    assert (
        f"cannot open '{mnt / 'f'}' (Read-only file system): the file system is read-only"
        in str(ei.value)
    )


def test_bad_file_descriptors(handle, nvme_dir):
    fd = os.open(nvme_dir / "f", os.O_RDWR | os.O_CREAT)
    os.close(fd)
    with pytest.raises(AioError) as ei:
        handle.pread(bytearray(10), fd)
    assert ei.value.errno == errno.EBADF
    assert str(ei.value) == f"[Errno {errno.EBADF}] bad file descriptor {fd}: Bad file descriptor"

    # A descriptor opened read-only cannot be written: the syscall's EBADF, named.
    ro = os.open(nvme_dir / "f", os.O_RDONLY)
    try:
        with pytest.raises(AioError) as ei:
            handle.sync_pwrite(bytearray(b"abc"), ro, 5)
    finally:
        os.close(ro)
    assert ei.value.errno == errno.EBADF
    assert str(ei.value) == (
        f"[Errno {errno.EBADF}] pwrite of 3 bytes at offset 5 to '{nvme_dir / 'f'} (fd {ro})' failed: "
        "Bad file descriptor"
    )


def test_a_bool_is_not_a_file_descriptor(handle):
    # bool is an int, but True is never meant as descriptor 1 (nor as a path): named, not fspath'd.
    with pytest.raises(
        TypeError, match="file must be an AioFile, a path or a file descriptor, got True"
    ):
        handle.pread(bytearray(10), True)


def test_a_directory_is_not_a_file(handle, nvme_dir):
    with pytest.raises(AioError) as ei:
        handle.pwrite(bytearray(10), nvme_dir)
    assert ei.value.errno == errno.EISDIR
    assert f"cannot open '{nvme_dir}' (Is a directory)" in str(ei.value)


def test_closed_handle(engine, nvme_dir):
    h = AioHandle(engine=engine)
    h.close()
    for call, op in ((h.pread, "pread"), (h.pwrite, "pwrite")):
        with pytest.raises(AioError) as ei:
            call(bytearray(10), nvme_dir / "f", 4096)
        assert ei.value.errno == errno.EBADF
        assert str(ei.value) == (
            f"[Errno {errno.EBADF}] {op} of 10 bytes at offset 4096 on '{nvme_dir / 'f'}': the AioHandle is closed"
        )
    with pytest.raises(
        AioError, match="open of 0 bytes at offset 0 on '.*': the AioHandle is closed"
    ):
        h.open(nvme_dir / "f")
    h.wait_all()  # a closed handle has nothing in flight
    assert h.in_flight() == 0


def test_closed_file(handle, nvme_dir):
    f = handle.open(nvme_dir / "f")
    f.close()
    with pytest.raises(
        AioError, match=rf"pread on '{re.escape(str(nvme_dir / 'f'))}': the file was closed"
    ):
        handle.pread(bytearray(1), f)
    with pytest.raises(AioError, match="size on '.*': the file was closed"):
        f.size()


def test_bad_arguments_are_named(handle, nvme_dir):
    path = nvme_dir / "f"
    with pytest.raises(ValueError, match="offset must be a non-negative int, got -1"):
        handle.pwrite(bytearray(1), path, -1)
    with pytest.raises(
        ValueError, match=r"must be contiguous; got a tensor of shape \(4, 4\) and strides \(1, 4\)"
    ):
        handle.pwrite(torch.zeros(4, 4).t(), path)
    with pytest.raises(ValueError, match="cannot read into a read-only buffer"):
        handle.pread(b"immutable", path)
    with pytest.raises(
        TypeError, match="expected a CPU tensor or an object with the buffer protocol, got str"
    ):
        handle.pwrite("text", path)
    with pytest.raises(ValueError, match="C-contiguous"):
        handle.pwrite(np.zeros((4, 4))[:, 1], path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"block_size": 1000},
            "aio.block_size must be a multiple of 4096 bytes (O_DIRECT alignment), got 1000",
        ),
        ({"queue_depth": 0}, "aio.queue_depth must be in [1, 4096], got 0"),
        ({"thread_count": 0}, "aio.thread_count must be in [1, 256], got 0"),
        ({"engine": "libaio"}, "aio.engine must be one of auto, io_uring, threads; got 'libaio'"),
        (
            {"thread_count": 2, "intra_op_parallelism": 4},
            "aio.thread_count and aio.intra_op_parallelism are the same setting and disagree (2 vs 4)",
        ),
        ({"single_submit": "yes"}, "aio.single_submit must be true or false, got 'yes'"),
        ({"blocksize": 4096}, "unknown aio key(s) blocksize; known keys: block_size, queue_depth"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    """A handle's keywords and a config file's aio section are checked by the same code."""
    with pytest.raises(ValueError, match=re.escape(message)):
        AioHandle(**kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        AioConfig.from_dict(kwargs)
