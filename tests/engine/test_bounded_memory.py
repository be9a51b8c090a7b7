"""Bounded memory: a model with more than 4 GiB of fp32 training state (params + grads + two
moments), params and optimizer on NVMe, trains with peak RSS (VmHWM) under 1.5 GiB."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    import infinity
    from infinity.models import GPT, GPTConfig, TextCorpus

    nvme = sys.argv[1]
    cfg = {
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3, "sub_group_size": 5e6,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4, "buffer_size": 8e6,
                              "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
    }
    gpt = GPTConfig(vocab_size=256, seq_len=64, n_layer=22, n_head=16, d_model=1024)
    torch.manual_seed(0)
    with infinity.zero.Init(cfg):
        model = GPT(gpt)
    engine = infinity.initialize(model, cfg)
    swap = sum(f.stat().st_size for f in __import__("pathlib").Path(nvme).rglob("*") if f.is_file())
    corpus = TextCorpus(1 << 16)
    losses = []
    for step in range(2):
        x, y = corpus.batch(step, 1, 64)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    from infinity.host import peak_resident_host_nbytes
    hwm = peak_resident_host_nbytes()  # VmHWM + hugetlb pages, where the pools may live
    engine.close()
    print(json.dumps({"params": gpt.num_params, "hwm": hwm, "swap": swap, "losses": losses}))
""")


@pytest.mark.slow
def test_4gib_of_training_state_in_1_5gib_of_rss(nvme_dir):
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(nvme_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    state = out["params"] * 16  # fp32 params, grads, exp_avg, exp_avg_sq
    assert state >= 4 << 30
    assert out["swap"] >= state * 0.95, "the training state is not on NVMe"
    assert out["hwm"] <= 1.5 * (1 << 30), (
        f"peak RSS {out['hwm'] / 2**30:.2f} GiB for {state / 2**30:.2f} GiB of state"
    )
    assert all(x == x and x < 10 for x in out["losses"])  # finite, sane
