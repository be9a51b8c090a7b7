"""Two processes on gloo, started by Lightning's own launcher: InfinityStrategy and
InfinityFabricStrategy (stage 3, parameters and optimizer state on NVMe) against plain Lightning
DDP and plain Fabric DDP, and infinity's own loop at world size 2 (every rank sees its own
micro-batches; gradients are averaged over both). Per-rank losses agree within 1e-5 relative."""

import json

import pytest

from tests.distributed import run_distributed
from tests.integrations.lightning_runs import assert_close, engine_config, engine_run
from tests.integrations.subprocesses import ROOT, run, without_deepspeed

pytestmark = pytest.mark.distributed


def _own_loop(rank, nvme):
    losses, val_losses, _ = engine_run(engine_config(nvme), rank=rank, world_size=2)
    return losses, val_losses


def _launch(modes, tmp_path, nvme_dir):
    """Each mode's per-rank results, the modes run in turn by one launch (two interpreters: a
    Lightning import is most of a rank's start-up). The first mode's strategy launches rank 1."""
    run(
        ["tests/integrations/world_size_2.py", ",".join(modes), str(tmp_path), str(nvme_dir)],
        cwd=ROOT,
        env=without_deepspeed(tmp_path),
    )
    return [
        [json.loads((tmp_path / f"{mode}.rank{r}.json").read_text()) for r in range(2)]
        for mode in modes
    ]


def test_world_size_2(tmp_path, nvme_dir):
    own = run_distributed(_own_loop, str(nvme_dir), world_size=2)
    for framework in ("lightning", "fabric"):
        # infinity's strategy first, so that it is the one whose launcher starts rank 1
        ours, plain = _launch([f"{framework}-infinity", f"{framework}-ddp"], tmp_path, nvme_dir)
        for rank in range(2):
            what = f"{framework}, rank {rank}"
            assert_close(ours[rank]["losses"], plain[rank]["losses"], f"training loss ({what})")
            assert_close(
                ours[rank]["val_losses"], plain[rank]["val_losses"], f"evaluation loss ({what})"
            )
            assert_close(
                ours[rank]["losses"],
                own[rank][0],
                f"training loss against infinity's loop ({what})",
            )
