"""Training striped over two drives: two ext4 file systems, each loop-mounted from its own image.

Both carry swap traffic (the sectors their block devices have written grow during training, and each
one's swap files hold data while the engine runs), and training gives plain PyTorch's losses and
weights, and bit for bit the losses of the same run on one drive. Skipped, with the reason, where
this process may not mount (not root, no loop devices, a container without CAP_SYS_ADMIN).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path

import pytest
import torch
from aio_util import mounted

import infinity
from infinity.zero.gathered import GatheredParameters
from tests.distributed import run_distributed
from tests.engine.models import MODELS, batch
from tests.engine.reference import engine_config, engine_run, reference_run
from tests.engine.test_equivalence import assert_equivalent

STEPS, GAS = 4, 2
BLOCK = 16 << 10
"""aio.block_size, and so the stripe unit: small enough that the test model's shards span both drives."""


@pytest.fixture
def drives(nvme_dir):
    """Two ext4 file systems of 256 MiB, each from its own image, mounted for the test."""
    with contextlib.ExitStack() as stack:
        mnts = []
        for i in range(2):
            where = nvme_dir / f"fs{i}"
            where.mkdir()
            mnts.append(stack.enter_context(mounted("ext4", where, "256M")))
        assert os.stat(mnts[0]).st_dev != os.stat(mnts[1]).st_dev
        yield mnts


def _config(paths, *, gas=GAS) -> dict:
    cfg = engine_config(3, "nvme", "nvme", paths[0], gas=gas)
    for section in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][section]["nvme_path"] = [str(p) for p in paths]
    cfg["aio"]["block_size"] = BLOCK
    return cfg


def _sectors_written(mnt: Path) -> int:
    """Sectors the block device under ``mnt`` has written (/sys/block/<dev>/stat, field 7)."""
    dev = next(
        line.split()[0]
        for line in Path("/proc/mounts").read_text().splitlines()
        if line.split()[1] == str(mnt)
    )
    return int(Path(f"/sys/block/{Path(dev).name}/stat").read_text().split()[6])


def _swap_files(mnt: Path, rank: int) -> list[Path]:
    return sorted((mnt / f"rank{rank}").glob("infinity-*/swap.*"))


def _holds_data(files: list[Path]) -> bool:
    return any(f.read_bytes().strip(b"\0") for f in files)


def _train(model_name: str, cfg: dict, *, rank: int, probe):
    """engine_run's loop; ``probe(engine)`` is called once initialize has returned and after every step
    (while the swap files exist); its results are returned in that order."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    engine = infinity.initialize(model, cfg)
    losses, seen = {}, [probe(engine)]
    try:
        for step in range(STEPS):
            for micro in range(GAS):
                x, y = batch(step, micro, rank)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses[(step, micro, rank)] = loss.item()
            seen.append(probe(engine))
        with GatheredParameters(engine):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        engine.close()
    return losses, weights, seen


def test_both_drives_carry_swap_traffic_and_training_is_unchanged(drives, nvme_dir):
    def look(engine):
        rt = engine.runtime
        dirs = rt.param_store.directories + rt.state_store.directories
        assert sorted({d.parent for d in dirs}) == sorted(m / "rank0" for m in drives)
        return [_holds_data(_swap_files(m, 0)) for m in drives], [
            _sectors_written(m) for m in drives
        ]

    losses, weights, seen = _train("gpt", _config(drives), rank=0, probe=look)
    assert all(holds == [True, True] for holds, _ in seen), "each drive's swap files hold data"
    written = [sectors for _, sectors in seen]  # after initialize, then after each step
    for before, after in itertools.pairwise(written):
        assert all(a > b for a, b in zip(after, before, strict=True)), (
            f"a step wrote nothing to a drive: {written}"
        )
    assert [_swap_files(m, 0) for m in drives] == [[], []], "the swap files are removed at close"
    ref_losses, ref_weights = reference_run("gpt", steps=STEPS, gas=GAS, world_size=1)
    assert_equivalent(losses, weights, ref_losses, ref_weights)
    one = nvme_dir / "one"
    one.mkdir()
    one_losses, _ = engine_run("gpt", _config([one]), steps=STEPS, gas=GAS)
    assert {k: v for k, v in one_losses.items() if k[1] != "eval"} == losses


def _rank(rank, paths):
    def look(engine):
        rt = engine.runtime
        return sorted(
            str(d.parent) for d in rt.param_store.directories + rt.state_store.directories
        )

    losses, weights, dirs = _train("gpt", _config([Path(p) for p in paths]), rank=rank, probe=look)
    return losses, weights, dirs[-1]


@pytest.mark.distributed
def test_each_rank_stripes_over_its_own_folder_on_every_drive(drives):
    per_rank = run_distributed(_rank, [str(m) for m in drives], world_size=2)
    for rank, (_losses, _weights, dirs) in enumerate(per_rank):
        assert set(dirs) == {str(m / f"rank{rank}") for m in drives}
    ref_losses, ref_weights = reference_run("gpt", steps=STEPS, gas=GAS, world_size=2)
    assert_equivalent({**per_rank[0][0], **per_rank[1][0]}, per_rank[0][1], ref_losses, ref_weights)
