"""The device tier. With a CPU device the host view is the device tier (tested in the conformance
suite); these tests need CUDA and run on the GPU machine with ``-m gpu``."""

import pytest
import torch

from infinity.memory import BufferPool
from infinity.store import Residency, TieredStore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(params=["nvme", "cpu"])
def store(request, nvme_dir):
    pool = BufferPool(8, 1 << 20, name="gpu-test")
    with TieredStore(nvme_dir, pool=pool, device="cuda") as s:
        s.home = request.param
        yield s


def test_device_fetch_copies_from_pinned_memory_and_is_shared(store):
    x = torch.randn(1000)
    store.register("w", x.shape, x.dtype, home=store.home)
    store.write("w", x).result(10)
    store.evict("w").result(10)
    d1 = store.fetch("w", "device").result(10)
    d2 = store.fetch("w", "device").result(10)
    assert d1.is_cuda and d1.data_ptr() == d2.data_ptr()
    assert torch.equal(d1.cpu(), x)
    assert store.spec("w").state is Residency.ON_DEVICE
    assert store.pool.slab.is_pinned()
    store.release_many(["w", "w"])
    assert store.spec("w").state is (
        Residency.IN_HOST if store.home == "nvme" else Residency.AT_REST
    )
    st = store.stats()
    assert st.h2d.nbytes == 4000 and st.h2d.requests == 1


def test_a_dirty_device_copy_is_copied_back_at_its_last_release(store):
    store.register("g", (256,), torch.float32, home=store.home)
    store.write("g", torch.zeros(256)).result(10)
    d = store.fetch("g", "device").result(10)
    d.add_(2)
    store.mark_dirty("g")
    store.release("g")
    store.flush("g").result(10)
    store.evict("g").result(10)
    assert torch.equal(store.fetch("g").result(10), torch.full((256,), 2.0))
    store.release("g")
    assert store.stats().d2h.nbytes == 1024
