"""Several threads on one store (forward, backward, prefetch): holds, residency and pool stay consistent."""

import threading

import pytest
import torch

from tests.store.conftest import ENGINES, rand_tensor

KiB = 1 << 10


def _run(threads):
    errors = []

    def guard(fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # reported below, with the thread's failure
            errors.append(e)

    ts = [threading.Thread(target=guard, args=t) for t in threads]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts), "a thread is stuck"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("engine", ENGINES)
def test_concurrent_fetches_of_the_same_keys_read_each_once(make_store, engine):
    store, aio = make_store(engine=engine, recording=True, pool_count=16, pool_size=256 * KiB)
    keys = [f"w{i}" for i in range(24)]
    store.register_many([(k, (16 * KiB,), torch.float32) for k in keys])
    data = {k: rand_tensor((16 * KiB,), torch.float32, i) for i, k in enumerate(keys)}
    for k in keys:
        store.write(k, data[k])
    store.flush_all().result(10)
    for k in keys:
        store.evict(k).result(10)
    aio.log.clear()
    barrier = threading.Barrier(6)
    views = {}

    def reader(tid):
        order = keys[tid:] + keys[:tid]
        barrier.wait()
        futs = store.fetch_many(order) if tid % 2 else [store.fetch(k) for k in order]
        views[tid] = {k: f.result(30) for k, f in zip(order, futs, strict=True)}

    _run([(reader, t) for t in range(6)])
    read_keys = sum(r.nbytes for r in aio.reads()) // (64 * KiB)
    assert read_keys == len(keys), "every key read exactly once, however many threads fetched it"
    for k in keys:
        ptrs = {views[t][k].data_ptr() for t in range(6)}
        assert len(ptrs) == 1 and torch.equal(views[0][k], data[k])
        assert store.spec(k).holds == 6

    def releaser(tid):  # holds may be dropped from other threads (autograd's backward thread)
        store.release_many(keys)

    _run([(releaser, t) for t in range(6)])
    assert all(store.spec(k).holds == 0 for k in keys)
    assert store._check_invariants() == store.pool.stats().in_use


@pytest.mark.parametrize("engine", ENGINES)
def test_threads_updating_keys_through_a_small_pool(make_store, engine):
    # 6 × 32 KiB pool, 4 workers × 6 keys of 16 KiB (384 KiB): constant eviction and write-back.
    store = make_store(
        engine=engine, pool_count=6, pool_size=32 * KiB, integrity=True, pool_timeout=60
    )
    n_workers, per = 4, 6
    keys = {w: [(w, i) for i in range(per)] for w in range(n_workers)}
    shared = [("shared", i) for i in range(4)]
    for w in range(n_workers):
        store.register_many([(k, (4 * KiB,), torch.float32) for k in keys[w]])
    store.register_many([(k, (1 * KiB,), torch.float32) for k in shared])
    for i, k in enumerate(shared):
        store.write(k, torch.full((1 * KiB,), float(i))).result(10)

    def worker(w):
        for step in range(15):
            for i, k in enumerate(keys[w]):
                fut = store.fetch(k, overwrite=step == 0)
                t = fut.result(60)
                if step:
                    assert torch.equal(t, torch.full((4 * KiB,), float(step - 1 + i)))
                t.fill_(step + i)
                store.mark_dirty(k)
                store.release(k)
            if step % 5 == 4:
                for k in keys[w][::2]:
                    store.evict(k).result(60)

    def prefetcher():
        for _ in range(40):
            futs = store.fetch_many(shared)
            for i, f in enumerate(futs):
                assert torch.equal(f.result(60), torch.full((1 * KiB,), float(i)))
            store.release_many(shared)

    _run([(worker, w) for w in range(n_workers)] + [(prefetcher,)])
    store.flush_all().result(60)
    for w in range(n_workers):
        for i, k in enumerate(keys[w]):
            store.evict(k).result(60)
            assert torch.equal(store.fetch(k).result(60), torch.full((4 * KiB,), float(14 + i)))
            store.release(k)
    st = store.stats()
    assert st.evictions > 0 and st.writebacks > 0 and st.held_keys == 0
    assert store._check_invariants() == store.pool.stats().in_use


@pytest.mark.parametrize("engine", ENGINES)
def test_concurrent_writes_to_one_key_are_ordered(make_store, engine):
    store = make_store(engine=engine)
    store.register("k", (8 * KiB,), torch.float32)

    def writer(tid):
        for _ in range(20):
            store.write("k", torch.full((8 * KiB,), float(tid))).result(30)

    _run([(writer, t) for t in range(4)])
    store.evict("k").result(10)
    got = store.fetch("k").result(10)
    assert got[0].item() in range(4) and bool((got == got[0]).all()), "one whole write, not a mix"
    store.release("k")
    assert store.stats().writes == 80
