"""Failures: I/O errors (injected through RecordingAio, and real ones) and corrupted data name the key;
state stays consistent and nothing leaks from the pool."""

import errno
import logging
import os
import time

import pytest
import torch

from infinity.store import IntegrityError, Residency, StoreIOError, StoreStateError
from tests.store.conftest import ENGINES

KiB = 1 << 10


def _written(store, keys, shape=(4 * KiB,)):
    store.register_many([(k, shape, torch.float32) for k in keys])
    data = {k: torch.full(shape, float(i)) for i, k in enumerate(keys)}
    for k in keys:
        store.write(k, data[k]).result(10)
        store.evict(k).result(10)
    return data


@pytest.mark.parametrize("engine", ENGINES)
def test_a_failed_read_names_the_key_and_leaves_it_at_rest(make_store, engine):
    store, aio = make_store(engine=engine, recording=True)
    data = _written(store, ["w.0", "w.1"])
    in_use = store.pool.stats().in_use
    aio.fail_next("read", errno=errno.EIO)
    f0, f1 = store.fetch_many(["w.0", "w.1"])
    with pytest.raises(StoreIOError) as e:
        f0.result(10)
    msg = str(e.value)
    assert "fetch of key 'w.0'" in msg and "swap.0 at offset" in msg and "Input/output error" in msg
    assert e.value.errno == errno.EIO and e.value.key == "w.0"
    with pytest.raises(StoreIOError, match="'w.1'"):
        f1.result(10)
    for k in ("w.0", "w.1"):
        assert store.spec(k).state is Residency.AT_REST and store.spec(k).holds == 0
    assert store.pool.stats().in_use == in_use, "the region went back to the pool"
    assert torch.equal(store.fetch("w.0").result(10), data["w.0"])  # the next read works
    store.release("w.0")


def test_a_failed_write_keeps_the_data_resident_and_dirty(make_store):
    store, aio = make_store(recording=True)
    store.register("opt.m", (1000,), torch.float32)
    aio.fail_next("write", errno=errno.ENOSPC)
    f = store.write("opt.m", torch.full((1000,), 5.0))
    with pytest.raises(StoreIOError, match=r"write of key 'opt.m'.*No space left on device") as e:
        f.result(10)
    assert e.value.errno == errno.ENOSPC
    assert store.spec("opt.m").state is Residency.DIRTY  # nothing lost
    store.flush("opt.m").result(10)  # retried
    store.evict("opt.m").result(10)
    assert torch.equal(store.fetch("opt.m").result(10), torch.full((1000,), 5.0))
    store.release("opt.m")


def test_a_failed_background_write_back_fails_the_fetch_waiting_for_its_room_at_once(make_store):
    """The fetch that needs the room the unwritten data holds raises the write's error (errno, file,
    offset, key) as soon as the write-back fails, not at the pool timeout; nothing is lost, and
    flush_all() after the drive recovers lets the store carry on."""
    store, aio = make_store(recording=True, pool_count=1, pool_size=16 * KiB, pool_timeout=300)
    store.register_many([("a", (4 * KiB,), torch.float32), ("b", (4 * KiB,), torch.float32)])
    store.fetch("a", overwrite=True).result(10).fill_(1)
    store.release("a")
    aio.fail_next("write", errno=errno.EIO)
    t0 = time.monotonic()
    # b needs a's room; a's write-back fails, so a stays resident and b cannot get in
    with pytest.raises(StoreIOError) as e:
        store.fetch("b", overwrite=True).result(60)
    assert time.monotonic() - t0 < 30, "the fetch waited for the pool timeout instead"
    msg = str(e.value)
    assert "fetch of key 'b'" in msg and "write of key 'a'" in msg, msg
    assert "swap.0 at offset 0" in msg and "Input/output error" in msg and "flush_all()" in msg, msg
    assert e.value.errno == errno.EIO and store.fault is not None
    assert store.spec("a").state is Residency.DIRTY and store.spec("a").dirty
    assert store.spec("b").state is Residency.AT_REST and store.spec("b").holds == 0
    with pytest.raises(StoreIOError, match="fetch of key 'a' refused.*write of key 'a'"):
        store.fetch("a")  # every call that needs the drive says so until the retry
    with pytest.raises(StoreIOError, match="write of key 'b' refused"):
        store.write("b", torch.zeros(4 * KiB))
    with pytest.raises(StoreStateError, match="evict of key 'a': its last write home failed"):
        store.evict("a")
    store.flush_all().result(10)  # the retry succeeds: the store carries on
    assert store.fault is None
    store.fetch("b", overwrite=True).result(10)  # a is clean now: dropped for b
    assert store.spec("a").state is Residency.AT_REST
    store.release("b")
    assert torch.equal(store.fetch("a").result(10), torch.ones(4 * KiB))
    store.release("a")


def test_a_failed_write_back_is_logged_at_once(make_store, caplog):
    store, aio = make_store(recording=True, pool_count=1, pool_size=16 * KiB)
    store.register_many([("a", (4 * KiB,), torch.float32), ("b", (4 * KiB,), torch.float32)])
    store.fetch("a", overwrite=True).result(10).fill_(1)
    store.release("a")
    aio.fail_next("write", errno=errno.ENOSPC)
    with caplog.at_level(logging.ERROR, logger="infinity.store"):
        with pytest.raises(StoreIOError):
            store.fetch("b", overwrite=True).result(60)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("write of key 'a'" in m and "No space left on device" in m for m in lines), lines
    with pytest.raises(StoreIOError, match="No space left on device"):
        store.check_writebacks("engine.step()")


def test_a_failed_retry_keeps_the_fault(make_store):
    store, aio = make_store(recording=True, pool_count=1, pool_size=16 * KiB)
    store.register_many([("a", (4 * KiB,), torch.float32), ("b", (4 * KiB,), torch.float32)])
    store.fetch("a", overwrite=True).result(10).fill_(2)
    store.release("a")
    aio.fail_next("write", errno=errno.EIO, count=2)
    with pytest.raises(StoreIOError):
        store.fetch("b", overwrite=True).result(60)
    with pytest.raises(StoreIOError, match="write of key 'a'"):
        store.flush_all().result(10)
    assert store.fault is not None and store.spec("a").dirty
    with pytest.raises(StoreIOError, match="refused"):
        store.fetch("b")
    store.flush("a").result(10)
    assert store.fault is None
    store.evict("a").result(10)
    assert torch.equal(store.fetch("a").result(10), torch.full((4 * KiB,), 2.0))
    store.release("a")


def test_a_real_short_read_names_the_key(make_store):
    store = make_store()
    _written(store, ["t"])
    f = store.directories[0] / "swap.0"
    os.truncate(f, 0)  # the file lost its data behind the store's back
    with pytest.raises(StoreIOError, match=r"fetch of key 't'.*runs past the end of the file"):
        store.fetch("t").result(10)
    assert store.spec("t").state is Residency.AT_REST and store.pool.stats().in_use == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_checksum_mismatch_names_key_file_and_offset(make_store, engine):
    store = make_store(engine=engine, integrity=True)
    _written(store, ["a", "b"])
    path = store.directories[0] / "swap.0"
    with open(path, "r+b") as fh:
        fh.seek(4 * 4 * KiB + 100)  # inside b's extent
        fh.write(b"\xff\xfe")
        fh.flush()
        os.fsync(fh.fileno())
    assert torch.equal(store.fetch("a").result(10), torch.full((4 * KiB,), 0.0))
    with pytest.raises(IntegrityError) as e:
        store.fetch("b").result(10)
    msg = str(e.value)
    assert "checksum mismatch for key 'b'" in msg and f"{path} at offset 16384" in msg
    assert store.spec("b").state is Residency.AT_REST and store.spec("b").holds == 0
    assert store.stats().integrity_checks == 2
    store.release("a")


def test_integrity_covers_write_back_of_overwritten_keys(make_store):
    store = make_store(integrity=True)
    store.register("g", (2048,), torch.float32)
    store.fetch("g", overwrite=True).result(10).fill_(3)
    store.release("g")
    store.evict("g").result(10)
    assert torch.equal(store.fetch("g").result(10), torch.full((2048,), 3.0))
    assert store.stats().integrity_checks == 1
    store.release("g")


def test_a_write_whose_copy_fails_gives_its_region_back(make_store):
    store = make_store()
    store.register("k", (1024,), torch.float32)
    # Right dtype and size, so the write is admitted; copying out of a meta tensor then raises.
    fut = store.write("k", torch.empty(1024, device="meta"))
    with pytest.raises(Exception, match="meta tensor"):  # torch: cannot copy out of a meta tensor
        fut.result()
    assert store.spec("k").state is Residency.AT_REST and not store.spec("k").holds
    assert store.pool.stats().in_use == 0
    assert store._check_invariants() == 0
    store.write("k", torch.ones(1024)).result()  # the key is writable again
    assert torch.equal(store.fetch("k").result(), torch.ones(1024))
    store.release("k")


def test_unregistering_the_key_whose_write_failed_ends_the_fault(make_store):
    store, aio = make_store(recording=True)
    store.register_many([("a", (1024,), torch.float32), ("b", (1024,), torch.float32)])
    aio.fail_next("write", errno=errno.EIO)
    with pytest.raises(StoreIOError):
        store.write("a", torch.ones(1024)).result(10)
    with pytest.raises(StoreIOError, match="write of key 'b' refused"):
        store.write("b", torch.ones(1024))
    store.unregister("a")  # its data is discarded on purpose: nothing is left unwritten
    assert store.fault is None
    store.write("b", torch.ones(1024)).result(10)


def test_a_read_interrupted_before_submission_does_not_hang_close(make_store, monkeypatch):
    """KeyboardInterrupt landing between a read's registration (under the lock) and its submission
    (after it) left an op no thread would submit, and close() waited for it forever (seen as a save
    loop that never exited after Ctrl-C). The thread that registered it now fails it when it waits."""
    import faulthandler

    import infinity.store.read_path as read_path

    store = make_store()
    _written(store, ["k.0", "k.1"])
    submit = read_path.submit_read

    def interrupted(st, op, items):
        monkeypatch.setattr(read_path, "submit_read", submit)
        raise KeyboardInterrupt

    monkeypatch.setattr(read_path, "submit_read", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.fetch_many(["k.0", "k.1"])
    faulthandler.dump_traceback_later(
        60, exit=True
    )  # a hang ends the run with tracebacks, not never
    try:
        store.close()  # by the registering thread itself, as interpreter exit does
    finally:
        faulthandler.cancel_dump_traceback_later()
