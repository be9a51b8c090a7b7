"""The store contract every home tier meets: run for home "nvme" (both aio engines) and home "cpu"."""

import pytest
import torch

from infinity.store import Residency, StoreStateError
from tests.store.conftest import rand_tensor

HOMES = [("nvme", "io_uring"), ("nvme", "threads"), ("cpu", "auto")]


@pytest.fixture(params=HOMES, ids=[f"{h}-{e}" for h, e in HOMES])
def tier(request, make_store):
    home, engine = request.param
    store = make_store(engine=engine, nvme=home == "nvme")
    return store, home


SHAPES = [
    ((1,), torch.uint8),
    ((4095,), torch.uint8),
    ((4096,), torch.uint8),
    ((4097,), torch.uint8),
    ((3, 5, 7), torch.float32),
    ((1000,), torch.bfloat16),
    ((17, 3), torch.int64),
    ((0,), torch.float32),
    ((2, 0, 3), torch.float16),
    ((33,), torch.bool),
    ((64, 1024), torch.float32),  # 256 KiB: a whole buffer
]


def test_round_trip_every_shape_and_dtype(tier):
    store, home = tier
    for i, (shape, dtype) in enumerate(SHAPES):
        store.register(("k", i), shape, dtype, home=home)
    data = [rand_tensor(shape, dtype, i) for i, (shape, dtype) in enumerate(SHAPES)]
    for f in [store.write(("k", i), t) for i, t in enumerate(data)]:
        assert f.result(10) is None
    for i in range(len(SHAPES)):
        store.evict(("k", i)).result(10)
    for i, t in enumerate(data):
        got = store.fetch(("k", i)).result(10)
        assert got.shape == t.shape and got.dtype == t.dtype
        assert torch.equal(got, t)
        store.release(("k", i))


def test_the_written_tensor_may_be_reused_at_once(tier):
    store, home = tier
    store.register("w", (1000,), torch.float32, home=home)
    t = torch.arange(1000, dtype=torch.float32)
    fut = store.write("w", t)
    t.zero_()  # the caller's buffer is free as soon as write() returns
    fut.result(10)
    store.evict("w").result(10)
    got = store.fetch("w").result(10)
    assert torch.equal(got, torch.arange(1000, dtype=torch.float32))
    store.release("w")


def test_fetch_is_a_view_of_resident_memory_and_is_shared(tier):
    store, home = tier
    store.register("a", (256,), torch.float32, home=home)
    store.write("a", torch.ones(256)).result(10)
    x = store.fetch("a").result(10)
    y = store.fetch("a").result(10)
    assert x.data_ptr() == y.data_ptr()
    assert store.spec("a").holds == 2
    # the device tier on a CPU device is the host view itself, no copy
    z = store.fetch("a", "device").result(10)
    assert z.data_ptr() == x.data_ptr() and z.device.type == "cpu"
    for _ in range(3):
        store.release("a")
    assert store.spec("a").holds == 0


def test_mark_dirty_changes_reach_home(tier):
    store, home = tier
    store.register("p", (100,), torch.float32, home=home)
    store.write("p", torch.zeros(100)).result(10)
    x = store.fetch("p").result(10)
    x.add_(3)
    store.mark_dirty("p")
    assert store.spec("p").dirty == (home == "nvme")
    store.release("p")
    store.flush("p").result(10)
    assert not store.spec("p").dirty
    store.evict("p").result(10)
    assert torch.equal(store.fetch("p").result(10), torch.full((100,), 3.0))
    store.release("p")


def test_overwrite_fetch_reads_nothing_and_makes_the_key_dirty(tier):
    store, home = tier
    store.register("g", (50, 2), torch.float16, home=home)
    g = store.fetch("g", overwrite=True).result(10)  # never written: overwrite is how it is filled
    g.copy_(torch.full((50, 2), 2.0))
    if home == "nvme":
        assert store.spec("g").state is Residency.DIRTY
    store.release("g")
    store.evict("g").result(10)  # written back before its memory is dropped
    assert store.spec("g").state is Residency.AT_REST
    assert torch.equal(store.fetch("g").result(10), torch.full((50, 2), 2.0, dtype=torch.float16))
    store.release("g")


def test_fetch_many_returns_each_key(tier):
    store, home = tier
    keys = [f"m{i}" for i in range(20)]
    store.register_many([(k, (i + 1, 7), torch.float32) for i, k in enumerate(keys)], home=home)
    data = {k: rand_tensor((i + 1, 7), torch.float32, i) for i, k in enumerate(keys)}
    for k in keys:
        store.write(k, data[k])
    store.flush_all().result(10)
    for k in keys:
        store.evict(k).result(10)
    futs = store.fetch_many(keys)
    for k, f in zip(keys, futs, strict=True):
        assert torch.equal(f.result(10), data[k])
    store.release_many(keys)


def test_holds_guard_evict_write_flush_unregister(tier):
    store, home = tier
    store.register("h", (10,), torch.int32, home=home)
    store.write("h", torch.arange(10, dtype=torch.int32)).result(10)
    store.fetch("h").result(10)
    store.mark_dirty("h")
    for action in (
        lambda: store.evict("h"),
        lambda: store.write("h", torch.zeros(10, dtype=torch.int32)),
        lambda: store.unregister("h"),
    ):
        with pytest.raises(StoreStateError, match=r"cannot \w+ key 'h': it is held 1 time"):
            action()
    if home == "nvme":
        with pytest.raises(StoreStateError, match="held"):
            store.flush("h")
        with pytest.raises(StoreStateError, match="dirty key.*still held.*'h'"):
            store.flush_all()
    store.release("h")
    with pytest.raises(StoreStateError, match="release of key 'h', which is not held"):
        store.release("h")
    with pytest.raises(StoreStateError, match="mark_dirty of key 'h', which is not held"):
        store.mark_dirty("h")
    store.unregister("h")
    assert "h" not in store


def test_never_written_keys_are_refused_unless_overwritten(tier):
    store, home = tier
    store.register("n", (4,), torch.float32, home=home)
    with pytest.raises(StoreStateError, match="'n', which was registered but never written"):
        store.fetch("n")
    assert store.spec("n").holds == 0


def test_errors_name_the_key(tier):
    store, home = tier
    store.register(("layer", 3), (4, 4), torch.float32, home=home)
    with pytest.raises(KeyError, match=r"key 'nope' is not registered in store"):
        store.fetch("nope")
    with pytest.raises(KeyError, match="already registered"):
        store.register(("layer", 3), (1,), torch.float32, home=home)
    with pytest.raises(
        ValueError, match=r"key \('layer', 3\).*registered as torch.float32 \(4, 4\)"
    ):
        store.write(("layer", 3), torch.zeros(3))
    with pytest.raises(ValueError, match="tier"):
        store.fetch(("layer", 3), "gpu")


def test_spec_reports_layout_and_state(tier):
    store, home = tier
    spec = store.register("s", (3, 4), torch.bfloat16, home=home)
    assert (spec.shape, spec.dtype, spec.nbytes, spec.home) == ((3, 4), torch.bfloat16, 24, home)
    assert spec.state is Residency.AT_REST and spec.holds == 0 and not spec.dirty
    assert store.keys() == ["s"] and len(store) == 1


def test_unregister_then_register_again(tier):
    store, home = tier
    store.register("u", (1000,), torch.float32, home=home)
    store.write("u", torch.ones(1000)).result(10)
    store.unregister("u")
    store.register("u", (10,), torch.int8, home=home)
    with pytest.raises(StoreStateError, match="never written"):
        store.fetch("u")


def test_stats_count_what_happened(tier):
    store, home = tier
    store.register("x", (1024,), torch.float32, home=home)
    store.write("x", torch.ones(1024)).result(10)
    store.fetch("x").result(10)
    store.release("x")
    st = store.stats()
    assert st.keys == 1 and st.fetches == 1 and st.writes == 1 and st.held_keys == 0
    assert st.as_dict()["pool"]["capacity"] == store.pool.capacity
    if home == "nvme":
        assert st.write.nbytes == 4096 and st.write.requests == 1 and st.hits == 1
    else:
        assert st.write.nbytes == 0 and st.read.nbytes == 0


def test_key_traffic_counts_each_keys_nvme_bytes(tier):
    """Per key, as the totals count them: a written key's extent once per write home, a read key's
    once per read; a key that moved nothing has no row; ``since`` keeps what moved after a snapshot."""
    store, home = tier
    for key in ("a", "b"):
        store.register(key, (1024,), torch.float32, home=home)
    store.write("a", torch.ones(1024)).result(10)
    start = store.key_traffic()
    store.write("b", torch.ones(1024)).result(10)
    store.evict("b").result(10)
    store.fetch("b").result(10)
    store.release("b")
    now, st = store.key_traffic(), store.stats()
    moved = now.since(start)
    if home == "nvme":
        assert now.written == {"a": 4096, "b": 4096} and now.read == {"b": 4096}
        assert sum(now.written.values()) == st.write.nbytes
        assert sum(now.read.values()) == st.read.nbytes
        assert moved.written == {"b": 4096} and moved.read == {"b": 4096}
    else:
        assert now.written == now.read == {} and moved.written == moved.read == {}


def test_close_is_idempotent_and_later_calls_are_refused(tier):
    store, home = tier
    store.register("c", (8,), torch.float32, home=home)
    store.write("c", torch.ones(8)).result(10)
    dirs = store.directories
    store.close()
    store.close()
    assert store.closed and all(not d.exists() for d in dirs)
    assert store.pool.stats().in_use == 0
    with pytest.raises(StoreStateError, match="is closed"):
        store.fetch("c")


def test_a_store_dropped_without_close_gives_everything_back(nvme_dir):
    import gc

    from infinity.memory import BufferPool
    from infinity.store import TieredStore, finalizer

    pool = BufferPool(4, 1 << 20)
    store = TieredStore(nvme_dir, pool=pool, name="dropped")
    store.register("x", (1000,), torch.float32)
    store.write("x", torch.ones(1000)).result(10)
    dirs = store.directories
    assert pool.stats().in_use > 0 and dirs[0].exists()
    del store
    gc.collect()
    assert finalizer.drain(30), "the finalizer thread did not run the store's cleanup"
    assert pool.stats().in_use == 0 and not dirs[0].exists()
