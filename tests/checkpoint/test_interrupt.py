"""Ctrl-C during save_checkpoint always ends the program with KeyboardInterrupt.

It used to be lost about once in 70 saves: the interrupt landed in
AioRequest.__del__, was printed as "Exception ignored" and training went on
([Note: finalizers run no Python] in infinity/aio/handle.py). Each try is a
child (forked from tests/distributed.py's preloaded server) that trains a step, then saves in a loop until SIGINT arrives at a
random point of a save; it must exit with KeyboardInterrupt, never carry on.
tests/aio/test_finalizers.py and tests/store/test_finalizers.py check the
cause directly (dropping runtime objects runs no Python code); this is the
symptom, sampled.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import Child

TRIES = 5


def _save_until_interrupted(swap: Path, ckpt: Path, counter_path: Path) -> None:
    """The child: trains a step, then saves in a loop until SIGINT arrives."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's stack dump if it hangs
    # Ctrl-C as a terminal delivers it: a test run started in the background ("cmd &" in a script)
    # hands its children SIGINT ignored, and Python then installs no handler: every save went on.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    from tests.checkpoint.helpers import config, make_engine, train

    counter = os.open(counter_path, os.O_WRONLY | os.O_CREAT, 0o644)
    engine, _ = make_engine("gpt", config(3, "nvme", "nvme", swap), seed=0)
    train(engine, 0, 1)
    t = time.perf_counter()
    engine.save_checkpoint(ckpt, tag="t0")
    print("ready", time.perf_counter() - t, flush=True)
    i = 0
    while True:
        i += 1
        engine.save_checkpoint(ckpt, tag=f"t{i % 2}")
        # the parent tells a hang from a swallowed interrupt
        os.pwrite(counter, str(i).encode().ljust(12), 0)
        if i > 10_000:
            print("carried on", flush=True)
            sys.exit(3)


def _saves(counter: Path) -> int:
    """How many saves the child has finished since "ready" (it writes the count to ``counter``)."""
    try:
        return int(counter.read_text() or 0)
    except (OSError, ValueError):
        return 0


@pytest.mark.slow
def test_sigint_during_save_checkpoint_always_raises_keyboard_interrupt(nvme_dir, tmp_path):
    rng = random.Random(int(time.time()))
    for attempt in range(TRIES):
        ckpt = tmp_path / f"ckpt{attempt}"
        counter = tmp_path / f"saves{attempt}"
        child = Child(
            _save_until_interrupted, nvme_dir, ckpt, counter, logs=tmp_path / f"logs{attempt}"
        )
        try:
            line = child.first_line(timeout=300)
            assert line.startswith("ready"), (
                f"the child did not start saving: {line!r}\n{child.stderr()}"
            )
            save_s = float(line.split()[1])
            time.sleep(rng.uniform(0.0, 2 * save_s))
            child.send_signal(signal.SIGINT)
            if child.wait(timeout=60) is None:
                # Tell a swallowed interrupt (saves went on) from a hang (saves stopped): count the saves
                # made in the last seconds, and take every thread's stack.
                before = _saves(counter)
                time.sleep(2)
                after = _saves(counter)
                child.send_signal(signal.SIGUSR1)
                time.sleep(2)
                child.kill()
                err = child.stderr()
                what = (
                    "SIGINT was swallowed, the save loop carried on"
                    if after > before
                    else "a save hung"
                )
                pytest.fail(
                    f"try {attempt}: {what} ({before}, then {after} saves 2 s later); every thread's "
                    f"stack:\n{err[-12000:]}"
                )
        finally:
            child.kill()  # where it still runs
        err = child.stderr()
        assert "Exception ignored" not in err, (
            f"try {attempt}: the interrupt was lost in a finalizer:\n{err}"
        )
        last = err.strip().splitlines()[-1] if err.strip() else ""
        assert child.returncode != 0 and last == "KeyboardInterrupt", (
            f"try {attempt}: exit {child.returncode}, expected a KeyboardInterrupt traceback:\n{err[-3000:]}"
        )
