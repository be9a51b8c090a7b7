import torch

from infinity.aio import AioHandle, aligned_empty


def test_round_trip(engine, nvme_dir):
    with AioHandle(engine=engine) as h:
        assert h.engine == engine
        t = aligned_empty(3 << 20, torch.float32).uniform_()
        h.sync_pwrite(t, nvme_dir / "x")
        u = torch.empty_like(t)
        h.sync_pread(u, nvme_dir / "x")
        assert torch.equal(t, u)
