"""`torchrun --nproc-per-node 2`: initialize() joins the process group torchrun describes (gloo on
CPU) and each rank swaps under nvme_path/rank<N>/; the ranks agree on every loss."""

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    sys.path.insert(0, sys.argv[2])
    import infinity
    from tests.engine.models import batch, tiny_gpt
    from tests.engine.reference import engine_config

    nvme = sys.argv[1]
    torch.manual_seed(0)
    engine = infinity.initialize(tiny_gpt(), engine_config(3, "nvme", "nvme", nvme, gas=1))
    rank, world = engine.group.rank, engine.group.world_size
    dirs = sorted(os.listdir(nvme))
    losses = []
    for step in range(3):
        x, y = batch(step, 0, rank)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        t = torch.tensor([loss.item()])
        torch.distributed.all_reduce(t)
        losses.append(t.item())
    engine.close()
    torch.distributed.destroy_process_group()  # as torch asks: a gloo group left to exit can abort
    print("RESULT " + json.dumps({"rank": rank, "world": world, "dirs": dirs, "losses": losses}))
""")


@pytest.mark.distributed
def test_torchrun_two_ranks(nvme_dir, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
        str(script),
        str(nvme_dir),
        str(ROOT),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = [
        json.loads(line.split("RESULT ", 1)[1])
        for line in r.stdout.splitlines()
        if "RESULT " in line
    ]
    assert sorted(x["rank"] for x in results) == [0, 1]
    assert all(x["world"] == 2 for x in results)
    assert {d for x in results for d in x["dirs"]} >= {"rank0", "rank1"}
    assert results[0]["losses"] == results[1]["losses"]
