"""SIGKILL during a save, at each step of the protocol ([Note: publishing a checkpoint] in atomic.py):
the previous checkpoint still loads, and what the killed save left is ignored with a warning.

Each case is a child process that trains, saves checkpoint "first", trains one more step, and is
killed (SIGKILL, by itself, at the named point) while saving "second". The parent then loads the
directory in a fresh engine.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infinity.engine.checkpoint.lock import LOCK_NAME
from tests.checkpoint.helpers import config, make_engine, train, weights
from tests.distributed import Child


def _save_and_die(swap: Path, ckpt: Path, point: str) -> None:
    """The child: trains, saves "first", trains a step, and is killed at ``point`` saving "second"."""
    from safetensors.torch import save_file

    import infinity.engine.checkpoint.atomic as atomic
    import infinity.engine.checkpoint.window as window

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    def kill_when(fn, test):
        def wrapped(*args, **kwargs):
            if test(*args, **kwargs):
                die()
            return fn(*args, **kwargs)

        return wrapped

    engine, _ = make_engine("gpt", config(3, "nvme", "nvme", swap), seed=0)
    train(engine, 0, 1)
    engine.save_checkpoint(ckpt, tag="first")
    save_file(weights(engine), str(ckpt.parent / "first-weights.safetensors"))
    train(engine, 1, 1)
    calls = [0]
    if point == "writing-shards":  # some unit shards written, others in flight or not yet read

        def counted(*args):
            calls[0] += 1
            return calls[0] == 4

        window.Window.add = kill_when(window.Window.add, counted)
    elif point == "before-rank-file":
        atomic.write_durably = kill_when(
            atomic.write_durably, lambda path, *a: path.name.startswith("rank-")
        )
    elif point == "before-manifest":
        atomic.write_durably = kill_when(
            atomic.write_durably, lambda path, *a: path.name == "manifest.json"
        )
    elif point == "before-rename":
        atomic.publish = kill_when(atomic.publish, lambda *a: True)
    elif point == "before-latest":
        atomic.write_latest = kill_when(atomic.write_latest, lambda *a: True)
    elif point == "writing-latest":  # the new 'latest' written and fsynced under its temporary name
        atomic.os.replace = kill_when(
            atomic.os.replace, lambda src, dst: Path(dst).name == "latest"
        )
    engine.save_checkpoint(ckpt, tag="second")
    print("the save was not interrupted")


# point: (whether "second" is complete afterwards, whether temporary files are left)
POINTS = {
    "writing-shards": (False, True),
    "before-rank-file": (False, True),
    "before-manifest": (False, True),
    "before-rename": (False, True),
    "before-latest": (True, False),  # killed between two steps: nothing half-written
    "writing-latest": (True, True),
}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """All children run at once (each waits mostly for its own start-up). Each is a fresh process
    forked from tests/distributed.py's server, torch already imported ([Note: ranks forked from a
    preloaded server]): the module under test is imported anew in each, so its patches are its own."""
    base = Path(os.environ.get("INFINITY_TEST_NVME", Path.home() / ".cache" / "infinity-tests"))
    root = base / f"{os.getpid()}-crash"
    procs = {}
    for point in POINTS:
        (root / point / "swap").mkdir(parents=True, exist_ok=True)
        procs[point] = Child(
            _save_and_die, root / point / "swap", root / point / "ckpt", point, logs=root / point
        )
    results = {}
    for point, proc in procs.items():
        rc = proc.wait(timeout=300)
        if rc is None:  # a hung save: killed here, which must not read as killed at the point
            proc.kill()
            rc = "still running after 300 s"
        results[point] = (rc, proc.stdout() + proc.stderr())
    yield root, results
    import shutil

    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("point", list(POINTS))
def test_sigkill_during_save_leaves_the_previous_checkpoint_loadable(
    point, killed, tmp_path, caplog
):
    root, results = killed
    rc, output = results[point]
    assert rc == -signal.SIGKILL, (
        f"the child was not killed at {point!r}: rc={rc}\n{output[-3000:]}"
    )
    ckpt = root / point / "ckpt"
    second_complete, left = POINTS[point]
    assert (ckpt / "second" / "manifest.json").is_file() == second_complete
    assert (ckpt / "latest").read_text().strip() == "first"
    leftovers = sorted(
        p.name for p in ckpt.iterdir() if p.name.startswith(".") and p.name != LOCK_NAME
    )
    assert bool(leftovers) == left, leftovers

    engine, _ = make_engine("gpt", config(3, "nvme", "nvme", tmp_path), seed=1)
    try:
        with caplog.at_level(logging.WARNING, logger="infinity.checkpoint"):
            engine.load_checkpoint(ckpt)
        assert engine.global_steps == 1
        first = load_file(str(ckpt.parent / "first-weights.safetensors"))
        for name, w in weights(engine).items():
            assert torch.equal(w, first[name]), name
        warned = " ".join(r.getMessage() for r in caplog.records)
        for name in leftovers:
            assert f"ignoring '{ckpt / name}'" in warned and "interrupted" in warned
        if second_complete:  # complete, just not yet 'latest'
            engine.load_checkpoint(ckpt, tag="second")
            assert engine.global_steps == 2
        # Saving the same tag again works and clears what the killed save of it left.
        train(engine, engine.global_steps, 1)
        engine.save_checkpoint(ckpt, tag="second")
        assert not [p for p in ckpt.iterdir() if p.name.startswith(".second.")]
        assert (ckpt / "latest").read_text().strip() == "second"
    finally:
        engine.close()
