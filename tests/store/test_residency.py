"""Residency on NVMe: what is read and when (observed through RecordingAio), caching, eviction, waiting."""

import threading
import time

import pytest
import torch

from infinity.memory import BufferPool, PoolTooSmallError
from infinity.store import Residency, StoreStateError
from infinity.store.record import KeyRecord
from tests.store.conftest import ENGINES, rand_tensor

KiB = 1 << 10


@pytest.fixture(params=ENGINES)
def engine(request):
    return request.param


def _fill(store, keys, shape=(16 * KiB,), dtype=torch.uint8):
    data = {k: rand_tensor(shape, dtype, i) for i, k in enumerate(keys)}
    store.register_many([(k, shape, dtype) for k in keys])
    for k in keys:
        store.write(k, data[k])
    store.flush_all().result(10)
    for k in keys:
        store.evict(k).result(10)
    return data


def test_keys_registered_together_come_back_in_one_read_into_one_region(make_store, engine):
    store, aio = make_store(engine=engine, recording=True, pool_size=1 << 20)
    keys = [f"p{i}" for i in range(32)]
    data = _fill(store, keys)
    aio.log.clear()
    in_use = store.pool.stats().in_use
    futs = store.fetch_many(keys)
    assert [torch.equal(f.result(10), data[k]) for k, f in zip(keys, futs, strict=True)] == [
        True
    ] * 32
    assert len(aio.reads()) == 1, "contiguous keys must be one request"
    assert len(aio.reads()[0].segments) == 1 and aio.reads()[0].nbytes == 32 * 16 * KiB
    assert store.pool.stats().regions == 1 and store.pool.stats().in_use == in_use + 32 * 16 * KiB
    store.release_many(keys)
    for k in keys[:-1]:
        store.evict(k).result(10)
    assert store.pool.stats().regions == 1, "the region lives while one of its keys is resident"
    store.evict(keys[-1]).result(10)
    assert store.pool.stats().in_use == 0


def test_fetch_many_packs_at_most_buffer_size_per_region(make_store):
    store, aio = make_store(recording=True, pool_count=8, pool_size=64 * KiB)
    keys = [f"q{i}" for i in range(10)]
    _fill(store, keys)
    aio.log.clear()
    futs = store.fetch_many(keys)
    for f in futs:
        f.result(10)
    assert [r.nbytes for r in aio.reads()] == [64 * KiB] * 2 + [32 * KiB]
    store.release_many(keys)


def test_a_fetch_of_a_key_being_read_shares_the_read(make_store, engine):
    store, aio = make_store(engine=engine, recording=True)
    data = _fill(store, ["k"])
    aio.log.clear()
    gate = aio.gate_next("read")
    f1 = store.fetch("k")
    f2 = store.fetch("k")
    assert not f1.done() and store.spec("k").state is Residency.READING
    with pytest.raises(StoreStateError, match="cannot write key 'k': it is held 2 time"):
        store.write("k", data["k"])
    with pytest.raises(
        StoreStateError, match="mark_dirty of key 'k' while its fetch is still in flight"
    ):
        store.mark_dirty("k")
    gate.set()
    assert f1.result(10).data_ptr() == f2.result(10).data_ptr()
    assert len(aio.reads()) == 1
    assert store.stats().shared == 1
    store.release_many(["k", "k"])


def test_writing_or_evicting_a_key_being_read_is_refused(make_store):
    store, aio = make_store(recording=True)
    _fill(store, ["k"])
    gate = aio.gate_next("read")
    f = store.fetch("k")
    store.release("k")  # a prefetch given up: the read still completes, into the cache
    with pytest.raises(StoreStateError, match="cannot write key 'k' while it is reading"):
        store.write("k", torch.zeros(16 * KiB, dtype=torch.uint8))
    with pytest.raises(StoreStateError, match="cannot evict key 'k' while it is reading"):
        store.evict("k")
    with pytest.raises(StoreStateError, match="cannot unregister key 'k' while it is reading"):
        store.unregister("k")
    gate.set()
    f.result(10)
    assert store.spec("k").state is Residency.IN_HOST and store.spec("k").holds == 0


def test_a_fetch_during_a_write_waits_for_it_and_reads_nothing(make_store):
    store, aio = make_store(recording=True)
    store.register("k", (1000,), torch.float32)
    gate = aio.gate_next("write")
    wf = store.write("k", torch.full((1000,), 7.0))
    assert store.spec("k").state is Residency.WRITING
    ff = store.fetch("k")
    time.sleep(0.05)
    assert not ff.done()
    gate.set()
    assert torch.equal(ff.result(10), torch.full((1000,), 7.0))
    assert wf.done() and aio.reads() == []
    store.release("k")


def test_a_second_write_waits_for_the_first(make_store):
    store, aio = make_store(recording=True)
    store.register("k", (10,), torch.int64)
    gate = aio.gate_next("write")
    store.write("k", torch.zeros(10, dtype=torch.int64))
    threading.Timer(0.05, gate.set).start()
    store.write("k", torch.ones(10, dtype=torch.int64)).result(10)
    store.evict("k").result(10)
    assert torch.equal(store.fetch("k").result(10), torch.ones(10, dtype=torch.int64))
    store.release("k")


def test_overwrite_reads_nothing(make_store):
    store, aio = make_store(recording=True)
    keys = [f"g{i}" for i in range(8)]
    store.register_many([(k, (4096,), torch.float32) for k in keys])
    for f in store.fetch_many(keys, overwrite=True):
        f.result(10).fill_(1.0)
    store.release_many(keys)
    assert aio.reads() == []
    store.flush_all().result(10)
    assert len(aio.writes()) == 1, "dirty keys of one region are written back in one request"
    assert aio.writes()[0].nbytes == 8 * 4096 * 4


def test_cache_hits_and_lru_eviction_under_pressure(make_store, engine):
    # 4 × 64 KiB pool; 6 keys of 64 KiB: at most 4 resident.
    store, aio = make_store(engine=engine, recording=True, pool_count=4, pool_size=64 * KiB)
    keys = [f"c{i}" for i in range(6)]
    data = _fill(store, keys, shape=(64 * KiB,))
    aio.log.clear()
    for k in keys[:4]:
        store.fetch(k).result(10)
        store.release(k)
    assert len(aio.reads()) == 4
    store.fetch("c0").result(10)  # hit: c0 becomes most recently used
    store.release("c0")
    assert len(aio.reads()) == 4 and store.stats().hits == 1
    store.fetch("c4").result(10)  # evicts the least recently used: c1
    store.release("c4")
    assert store.spec("c1").state is Residency.AT_REST
    assert all(store.spec(k).state is Residency.IN_HOST for k in ("c0", "c2", "c3", "c4"))
    assert torch.equal(store.fetch("c1").result(10), data["c1"])  # read again, c2 evicted
    store.release("c1")
    assert store.spec("c2").state is Residency.AT_REST and store.stats().evictions >= 2


def test_dirty_entries_are_written_back_when_the_pool_needs_room(make_store):
    store, aio = make_store(recording=True, pool_count=2, pool_size=64 * KiB)
    store.register_many([(k, (16 * KiB,), torch.float32) for k in ("a", "b", "c")])
    for k in ("a", "b"):
        store.fetch(k, overwrite=True).result(10).fill_(ord(k))
        store.release(k)
    assert aio.writes() == []
    store.fetch("c", overwrite=True).result(10)  # needs room: 'a' is written back, then dropped
    assert [w.nbytes for w in aio.writes()] == [64 * KiB]
    store.release("c")
    for k in ("a", "b"):
        assert torch.equal(store.fetch(k).result(10), torch.full((16 * KiB,), float(ord(k))))
        store.release(k)


def test_a_fetch_waits_for_room_and_proceeds_when_a_key_is_released(make_store):
    store = make_store(pool_count=2, pool_size=64 * KiB)
    keys = ["a", "b", "c"]
    _fill(store, keys, shape=(64 * KiB,))
    store.fetch("a").result(10)
    store.fetch("b").result(10)
    waits = store.stats().pool.waits
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("c", store.fetch("c").result(10)))
    t.start()
    while store.pool.stats().waiting == 0:
        time.sleep(0.001)
    assert "c" not in got
    store.release("a")  # unheld while someone waits: given to the waiter at once
    t.join(10)
    assert got["c"].numel() == 64 * KiB
    assert store.spec("a").state is Residency.AT_REST
    assert store.stats().pool.waits == waits + 1 and store.stats().pool_wait_s > 0
    store.release_many(["b", "c"])


def test_waiting_too_long_fails_the_fetch_and_leaves_the_key_at_rest(make_store):
    store = make_store(pool_count=1, pool_size=64 * KiB, pool_timeout=0.2)
    _fill(store, ["a", "b"], shape=(64 * KiB,))
    store.fetch("a").result(10)
    f = store.fetch("b")
    with pytest.raises(TimeoutError, match=r"fetch of key 'b'.*'.*fetch of key 'a'' 64.0 KiB"):
        f.result(10)
    assert store.spec("b").state is Residency.AT_REST and store.spec("b").holds == 0
    store.release("a")
    store.fetch("b").result(10)
    store.release("b")


def test_a_tensor_larger_than_the_pool_is_refused_naming_key_and_config(nvme_dir):
    from infinity.store import TieredStore

    pool = BufferPool(
        2, 64 * KiB, name="param", config_hint="offload_param.buffer_count / buffer_size"
    )
    with TieredStore(nvme_dir, pool=pool) as store:
        store.register("emb.weight", (64 * KiB,), torch.float32)
        with pytest.raises(PoolTooSmallError) as e:
            store.fetch("emb.weight", overwrite=True)
        msg = str(e.value)
        assert "'emb.weight'" in msg and "262144 bytes" in msg and "128.0 KiB" in msg
        assert "offload_param.buffer_count / buffer_size" in msg
        assert store.spec("emb.weight").holds == 0
        # larger than buffer_size but within the pool: served by contiguous buffers
        store.register("mid", (100 * KiB,), torch.uint8)
        store.fetch("mid", overwrite=True).result(10)
        store.release("mid")


def test_completion_is_noticed_when_nobody_waits(make_store):
    store = make_store()
    store.register_many([(f"k{i}", (4096,), torch.float32) for i in range(8)])
    for i in range(8):
        store.write(f"k{i}", torch.ones(4096))  # futures dropped
    deadline = time.monotonic() + 10
    while store.stats().in_flight and time.monotonic() < deadline:
        time.sleep(0.005)
    assert store.stats().in_flight == 0
    assert all(store.spec(f"k{i}").state is Residency.IN_HOST for i in range(8))


def test_illegal_transitions_name_the_key_and_both_states():
    rec = KeyRecord(("blk", 0), (4,), torch.float32, 16, "nvme")
    with pytest.raises(
        StoreStateError, match=r"key \('blk', 0\): illegal transition at rest → in host"
    ):
        rec.to_in_host()
    rec.to_reading()
    with pytest.raises(StoreStateError, match="illegal transition reading → writing"):
        rec.to_writing()
    with pytest.raises(StoreStateError, match="illegal transition reading → on device"):
        rec.to_on_device()
    rec.to_dirty()
    with pytest.raises(StoreStateError, match="illegal transition dirty → at rest"):
        rec.to_at_rest()
    for state in Residency:
        assert state.__doc__  # every state says what it means
