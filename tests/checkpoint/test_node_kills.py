"""SIGKILL at random points in a node-local save, then torchrun --max-restarts 1 resumes.

Each trial is one job of two nodes x one rank under the multi-node harness (each node its own
storage; tests/multinode/harness.py) that saves after every step (node_kill_worker.py). One rank
is killed (SIGKILL, sent by itself from a timer) a random time into one of the saves; torchrun
restarts every node's workers, which resume from the newest checkpoint complete on both nodes.
(Killing a node's agent from the harness instead lands seconds late on a busy machine, after the
save: the harness acts on the output lines it reads.) Every
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

from tests.multinode.harness import run_nodes, skip_unless_namespaces

WORKER = Path(__file__).with_name("node_kill_worker.py")
STEPS = 3
TRIALS = 10
SIDE_BY_SIDE = int(os.environ.get("INFINITY_TEST_KILL_TRIALS_AT_ONCE", "6"))

pytestmark = pytest.mark.distributed


def _trial(workdir: Path, seed: int | None):
    kill = (0, 0, 0.0)  # (step, rank, delay): none
    if seed is not None:
        rng = random.Random(seed)
        kill = (rng.randint(1, STEPS - 1), rng.randint(0, 1), rng.uniform(0.0, 0.3))
    run = run_nodes(
        WORKER,
        2,
        1,
        workdir=workdir,
        args=[str(STEPS), *map(str, kill)],
        max_restarts=1,
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
        where = f"trial {seed} (step, rank, delay: {kill})"
        run.check()
        assert max(run.restarts().values()) == 1, where  # killed once, restarted once
        step = kill[0]
        resumed = [r["resumed"] for r in run.reports if "resumed" in r and r["restart_count"] > 0]
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
