"""Two processes saving the same tag into one directory ([Note: one save per root] in lock.py).

The first saves "one", then starts saving "two" and stops half-way (its part file written, its rank
file not yet). The second, a separate process, then saves "two" into the same directory: it is
refused, naming the first, and removes nothing. It loads "one" meanwhile, and the first's directory
in progress is reported as such, not as debris to delete. The first then finishes, and "two" loads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import json, logging, sys, time
    from pathlib import Path
    import infinity.engine.checkpoint.atomic as atomic
    from infinity.engine.checkpoint import CheckpointBusyError
    from tests.checkpoint.helpers import config, make_engine, train

    role, swap, root, sync = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])

    def wait_for(name):
        deadline = time.monotonic() + 300
        while not (sync / name).exists():
            if time.monotonic() > deadline:
                sys.exit(f"{role}: {name} never came")
            time.sleep(0.05)

    engine, _ = make_engine("gpt", config(3, "nvme", "nvme", swap), seed=0)
    train(engine, 0, 1)
    if role == "first":
        engine.save_checkpoint(root, tag="one")
        train(engine, 1, 1)
        write = atomic.write_durably

        def paused(path, *args):
            if path.name.startswith("rank-"):  # the part file is written: half-way through the save
                (sync / "first-paused").touch()
                wait_for("second-done")
            return write(path, *args)

        atomic.write_durably = paused
        engine.save_checkpoint(root, tag="two")
        engine.load_checkpoint(root)  # every checksum of "two" is verified
        print(json.dumps({"steps": engine.global_steps}))
    else:
        wait_for("first-paused")
        logger = logging.getLogger("infinity.checkpoint")
        logger.setLevel(logging.INFO)
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger.addHandler(handler)
        out = {"error": None}
        try:
            engine.save_checkpoint(root, tag="two")
        except CheckpointBusyError as e:
            out["error"] = str(e)
        out["hidden"] = sorted(p.name for p in root.iterdir() if ".partial-" in p.name)
        engine.load_checkpoint(root)  # "one", while the first process is writing "two"
        out["steps"] = engine.global_steps
        out["log"] = [r.getMessage() for r in records]
        (sync / "second-done").touch()
        print(json.dumps(out))
""")


@pytest.fixture
def base():
    root = (
        Path(os.environ.get("INFINITY_TEST_NVME", Path.home() / ".cache" / "infinity-tests"))
        / f"{os.getpid()}-two"
    )
    shutil.rmtree(root, ignore_errors=True)
    for d in ("swap1", "swap2", "sync"):
        (root / d).mkdir(parents=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_a_second_save_into_the_same_directory_is_refused_and_removes_nothing(base):
    ckpt, sync = base / "ckpt", base / "sync"
    procs = {
        role: subprocess.Popen(
            [sys.executable, "-c", CHILD, role, str(base / swap), str(ckpt), str(sync)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role, swap in (("first", "swap1"), ("second", "swap2"))
    }
    try:
        second_out, second_err = procs["second"].communicate(timeout=600)
        first_out, first_err = procs["first"].communicate(timeout=600)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs["second"].returncode == 0, second_err[-3000:]
    second = json.loads(second_out.strip().splitlines()[-1])
    first_pid = procs["first"].pid
    assert second["error"] is not None, "the second save was not refused"
    assert f"another save into '{ckpt}' is in progress (pid {first_pid} on host" in second["error"]
    assert "saving tag 'two'" in second["error"]
    (hidden,) = second["hidden"]  # the first's directory in progress, untouched, and no other
    assert hidden.startswith(".two.partial-")
    assert second["steps"] == 1  # it loaded "one"
    said = [m for m in second["log"] if hidden in m]
    assert said and all(
        "a save in progress is writing it" in m and f"pid {first_pid}" in m for m in said
    ), said
    assert not [m for m in second["log"] if "can be deleted" in m], second["log"]

    assert procs["first"].returncode == 0, first_err[-3000:]
    assert json.loads(first_out.strip().splitlines()[-1]) == {"steps": 2}
    assert (ckpt / "latest").read_text().strip() == "two"
    assert not [p for p in ckpt.iterdir() if ".partial-" in p.name]
