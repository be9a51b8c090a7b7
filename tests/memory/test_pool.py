"""BufferPool: one slab, 4 KiB-aligned regions spanning buffers, FIFO waiting, refusals that say what to raise."""

import threading
import time

import pytest
import torch

from infinity.memory import BufferPool, PoolTooSmallError

MiB = 1 << 20


def test_regions_are_aligned_views_of_one_slab():
    pool = BufferPool(4, MiB, name="p")
    a = pool.acquire(5000, name="a")
    b = pool.acquire(100, name="b")
    base = pool.slab.data_ptr()
    for r in (a, b):
        assert r.tensor.data_ptr() % 4096 == 0
        assert base <= r.tensor.data_ptr() < base + pool.capacity
    assert a.tensor.numel() == 5000 and a.size == 8192
    a.view(torch.float32, (10, 5)).fill_(1.5)
    assert torch.all(a.tensor[:200].view(torch.float32) == 1.5)
    assert b.tensor.data_ptr() >= a.tensor.data_ptr() + 8192  # no overlap
    a.release()
    b.release()
    assert pool.stats().in_use == 0


def test_a_tensor_larger_than_buffer_size_spans_several_buffers():
    pool = BufferPool(4, MiB)
    r = pool.acquire(3 * MiB + 1, name="embedding")
    assert r.size == 3 * MiB + 4096
    assert pool.stats().in_use == r.size
    r.release()


def test_request_larger_than_the_pool_is_refused_up_front_naming_key_and_sizes():
    pool = BufferPool(4, MiB, name="param", config_hint="offload_param.buffer_count / buffer_size")
    with pytest.raises(PoolTooSmallError) as e:
        pool.acquire(5 * MiB, name="emb.weight")
    msg = str(e.value)
    assert "'emb.weight'" in msg and "5242880 bytes" in msg and "4.0 MiB" in msg
    assert "offload_param.buffer_count / buffer_size" in msg
    with pytest.raises(PoolTooSmallError):
        pool.try_acquire(5 * MiB, name="emb.weight")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="count"):
        BufferPool(0, MiB)
    with pytest.raises(ValueError, match="size"):
        BufferPool(1, 0)
    pool = BufferPool(1, MiB)
    with pytest.raises(ValueError):
        pool.acquire(-1)


def test_double_release_and_use_after_release_raise():
    pool = BufferPool(1, MiB, name="p")
    r = pool.acquire(10, name="x")
    r.release()
    with pytest.raises(RuntimeError, match="already released"):
        pool.release(r)
    with pytest.raises(RuntimeError, match="released"):
        _ = r.tensor
    other = BufferPool(1, MiB, name="q")
    r2 = other.acquire(10)
    with pytest.raises(ValueError, match="does not belong"):
        pool.release(r2)


def test_zero_byte_request_costs_nothing():
    pool = BufferPool(1, MiB)
    r = pool.acquire(0)
    assert r.tensor.numel() == 0 and pool.stats().in_use == 0
    r.release()


def test_timeout_names_the_waiter_and_the_holders():
    pool = BufferPool(2, MiB, name="param", config_hint="offload_param.buffer_count")
    held = pool.acquire(2 * MiB, name="layer0.weight")
    with pytest.raises(TimeoutError) as e:
        pool.acquire(MiB, timeout=0.2, name="layer1.weight")
    msg = str(e.value)
    assert (
        "layer1.weight" in msg
        and "'layer0.weight' 2.0 MiB" in msg
        and "offload_param.buffer_count" in msg
    )
    st = pool.stats()
    assert st.waits == 1 and st.wait_s >= 0.2 and st.waiting == 0
    held.release()


def test_waiting_is_fifo_so_a_large_request_is_not_starved():
    pool = BufferPool(4, MiB)
    smalls = [pool.acquire(MiB, name=f"s{i}") for i in range(4)]
    order = []
    got = {}

    def take(name, n):
        got[name] = pool.acquire(n, timeout=10, name=name)
        order.append(name)

    big = threading.Thread(target=take, args=("big", 3 * MiB))
    big.start()
    while pool.stats().waiting < 1:
        time.sleep(0.001)
    small = threading.Thread(target=take, args=("late-small", MiB))
    small.start()
    while pool.stats().waiting < 2:
        time.sleep(0.001)
    # One buffer frees up: the late small request fits but must not jump the queue.
    smalls[0].release()
    time.sleep(0.05)
    assert order == [] and pool.try_acquire(4096) is None
    smalls[1].release()
    smalls[2].release()
    big.join(5)
    assert order == ["big"]
    got["big"].release()
    small.join(5)
    assert order == ["big", "late-small"]
    got["late-small"].release()
    smalls[3].release()
    assert pool.stats().in_use == 0


def test_reclaimers_are_asked_for_room_by_the_waiter():
    pool = BufferPool(2, MiB)
    cache = [pool.acquire(MiB, name="cached0"), pool.acquire(MiB, name="cached1")]
    asked = []

    class Owner:
        def reclaim(self, nbytes):
            asked.append(nbytes)
            if cache:
                cache.pop(0).release()

    owner = Owner()
    pool.add_reclaimer(owner.reclaim)
    r = pool.acquire(2 * MiB, timeout=5, name="big")
    assert asked and asked[0] == 2 * MiB and not cache
    r.release()
    pool.remove_reclaimer(owner.reclaim)
    assert pool._reclaimers == []


def test_many_threads_never_overlap_and_account_exactly():
    pool = BufferPool(8, 64 << 10)
    errors = []

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        for i in range(200):
            n = int(torch.randint(1, 200 << 10, (1,), generator=g))
            r = pool.acquire(n, timeout=20, name=f"t{seed}-{i}")
            r.tensor.fill_(seed)
            if not bool((r.tensor == seed).all()):
                errors.append((seed, i))
            r.release()

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    st = pool.stats()
    assert (
        st.in_use == 0
        and st.regions == 0
        and st.acquires == 800
        and st.peak_in_use <= pool.capacity
    )


def test_a_long_wait_for_pool_space_is_logged_naming_the_holders(monkeypatch, caplog):
    import logging

    from infinity.aio import waits

    monkeypatch.setattr(waits, "LOG_EVERY_S", 0.05)
    pool = BufferPool(1, MiB, name="params")
    held = pool.acquire(MiB, name="unit 'h.0'")
    with caplog.at_level(logging.WARNING, logger="infinity.memory"):
        with pytest.raises(TimeoutError, match="waited 0.5 s"):
            pool.acquire(MiB, name="fetch of key 'h.1'", timeout=0.5)
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        "still waiting after" in m
        and "1.0 MiB of contiguous pinned buffer space in pool 'params' for fetch of key 'h.1'" in m
        and "held by 1 region(s) ('unit 'h.0'' 1.0 MiB)" in m
        for m in lines
    ), lines
    held.release()


def test_a_cause_ends_a_wait_for_pool_space_at_once_and_wake_makes_it_look():
    pool = BufferPool(1, MiB, name="p")
    held = pool.acquire(MiB, name="dirty data")
    failure: list[BaseException] = []
    errors: list[BaseException] = []

    def waiter():
        try:
            pool.acquire(
                MiB, name="fetch", timeout=300, cause=lambda: failure[0] if failure else None
            )
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    while pool.stats().waiting == 0:
        time.sleep(0.001)
    failure.append(OSError(5, "write-back of 'dirty data' failed"))
    pool.wake()
    t.join(30)
    assert not t.is_alive(), "the wait went on after its cause was known"
    assert len(errors) == 1 and "write-back of 'dirty data' failed" in str(errors[0])
    assert pool.stats().waiting == 0
    held.release()
