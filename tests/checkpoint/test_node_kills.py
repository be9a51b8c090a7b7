"""SIGKILL of one node at random points in a node-local save, then torchrun --max-restarts 1 resumes.

Each trial is one job of two nodes x one rank under the multi-node harness (each node its own
storage; tests/multinode/harness.py) that saves after every step (node_kill_worker.py). One node's
agent is killed a random time after the line its rank prints just before a save, and rebooted;
torchrun restarts the job, which resumes from the newest checkpoint complete on both nodes. Every
trial must: finish; resume at the step of the save under way or the one before it (never anything
half-written, never from scratch); give every step the losses of an uninterrupted run, bit for
bit; and leave on each node a `latest` naming a checkpoint of the same save as the other node's.
The trials run side by side (each is mostly waiting for torchrun), seeded, so a failure repeats.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
from pathlib import Path

import pytest

from tests.multinode.harness import Kill, run_nodes, skip_unless_namespaces

WORKER = Path(__file__).with_name("node_kill_worker.py")
STEPS = 3
TRIALS = 10
SIDE_BY_SIDE = int(os.environ.get("INFINITY_TEST_KILL_TRIALS_AT_ONCE", "6"))

pytestmark = pytest.mark.distributed


def _trial(workdir: Path, seed: int | None):
    kill = None
    if seed is not None:
        rng = random.Random(seed)
        step = rng.randint(1, STEPS - 1)
        kill = Kill(
            node=rng.randint(0, 1),
            marker=f"saving {step}",
            watch=0,
            after_s=rng.uniform(0.0, 0.4),
            reboot=True,
        )
    run = run_nodes(
        WORKER,
        2,
        1,
        workdir=workdir,
        args=[str(STEPS)],
        max_restarts=1,
        kill=kill,
        timeout=600,
    )
    return run, kill


def _losses(run) -> dict[tuple[int, int], float]:
    """(rank, step) -> the loss reported last (a restarted job's, where it ran the step again)."""
    out = {}
    for rep in run.reports:
        if "loss" in rep:
            out[(rep["rank"], rep["step"])] = rep["loss"]
    return out


def _save_ids(run, node: int) -> dict[str, str]:
    root = run.node_dir(node, run.node_paths[1])
    out = {}
    for d in root.iterdir():
        if not d.name.startswith(".") and (d / "manifest.json").is_file():
            out[d.name] = json.loads((d / "manifest.json").read_text())["save_id"]
    return out


@pytest.mark.timeout(
    1800
)  # 11 torchrun jobs of two nodes, each restarted once: minutes, not seconds
def test_kill_a_node_mid_save_and_resume(nvme_dir):
    skip_unless_namespaces()
    seeds = [None, *range(TRIALS)]
    with concurrent.futures.ThreadPoolExecutor(SIDE_BY_SIDE) as pool:
        runs = list(pool.map(lambda s: _trial(nvme_dir / f"trial-{s}", s), seeds))
    (plain, _), trials = runs[0], runs[1:]
    plain.check()
    want = _losses(plain)
    assert len(want) == 2 * STEPS
    for seed, (run, kill) in zip(range(TRIALS), trials, strict=True):
        where = f"trial {seed} ({kill})"
        run.check()
        assert run.nodes[kill.node].kills == 1, where
        step = int(kill.marker.split()[-1])
        resumed = [
            r["resumed"]
            for r in run.reports
            if "resumed" in r and r["restart_count"] + r["launch"] > 0
        ]
        assert resumed and set(resumed) <= {step - 1, step} and len(set(resumed)) == 1, (
            where,
            resumed,
        )
        assert _losses(run) == want, where
        ids = [_save_ids(run, k) for k in (0, 1)]
        assert ids[0] == ids[1], where  # every checkpoint on both nodes, of one save each
        for k in (0, 1):
            latest = (run.node_dir(k, run.node_paths[1]) / "latest").read_text().strip()
            assert latest == f"global_step{STEPS}", where
