"""Resume equals not stopping (world size 1): N steps, save, M more steps in the same process gives the
same losses, weights and buffers, bit for bit, as loading the checkpoint in a fresh process (whose model
starts from other random weights) and training M steps. Dropout's RNG, the BatchNorm buffers, the lr
schedule and Adam's moments and step counts all have to come back for that."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint.helpers import (
    M_STEPS,
    N_STEPS,
    config,
    eval_logits,
    make_engine,
    train,
    weights,
)
from tests.distributed import run_distributed

# name: (stage, offload_param, offload_optimizer, dtype, model)
CASES = {
    "stage3-params-and-optimizer-on-nvme": (3, "nvme", "nvme", "fp32", "gpt"),
    "stage3-tied-buffers-nvme": (3, "nvme", "nvme", "fp32", "tied"),
    "stage3-cpu-offload": (3, "cpu", "cpu", "fp32", "tied"),
    "stage2-optimizer-on-nvme": (2, "none", "nvme", "fp32", "tied"),
    "stage0": (0, "none", "none", "fp32", "gpt"),
    "stage3-bf16-nvme": (3, "nvme", "nvme", "bf16", "gpt"),
}


def continue_run(case: str, root) -> dict:
    stage, param, optim, dtype, model = CASES[case]
    (root / "swap").mkdir(parents=True, exist_ok=True)
    engine, _ = make_engine(model, config(stage, param, optim, root / "swap", dtype=dtype), seed=0)
    try:
        train(engine, 0, N_STEPS)
        engine.save_checkpoint(root / "ckpt", client_state={"epoch": 7, "order": torch.arange(5)})
        at_save = {"weights": weights(engine), "logits": eval_logits(engine.eval())}
        engine.train()
        losses = train(engine, N_STEPS, M_STEPS)
        return {
            "losses": losses,
            "weights": {n: w.float() for n, w in weights(engine).items()},
            "buffers": {n: b.clone() for n, b in engine.module.named_buffers()},
            "lr": engine.get_lr(),
            "at_save": at_save,
        }
    finally:
        engine.close()


def resume_run(case: str, root) -> dict:
    stage, param, optim, dtype, model = CASES[case]
    (root / "swap2").mkdir(parents=True, exist_ok=True)
    engine, _ = make_engine(model, config(stage, param, optim, root / "swap2", dtype=dtype), seed=1)
    try:
        client = engine.load_checkpoint(root / "ckpt")
        steps = engine.global_steps
        losses = train(engine, N_STEPS, M_STEPS)
        # Weights cross the process boundary as numpy arrays: fp32 (exact for bf16 values).
        return {
            "losses": losses,
            "weights": {n: w.float() for n, w in weights(engine).items()},
            "buffers": {n: b.clone() for n, b in engine.module.named_buffers()},
            "lr": engine.get_lr(),
            "client": client,
            "steps": steps,
        }
    finally:
        engine.close()


def _resume_all(rank, roots):
    from pathlib import Path

    return {case: resume_run(case, Path(root)) for case, root in roots.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import os
    import shutil
    from pathlib import Path

    base = Path(os.environ.get("INFINITY_TEST_NVME", Path.home() / ".cache" / "infinity-tests"))
    root = base / f"{os.getpid()}-resume"
    shutil.rmtree(root, ignore_errors=True)
    roots = {case: root / case for case in CASES}
    try:
        cont = {case: continue_run(case, r) for case, r in roots.items()}
        # A fresh process: nothing of the first engine survives but the checkpoint.
        (resumed,) = run_distributed(
            _resume_all, {c: str(r) for c, r in roots.items()}, world_size=1
        )
        yield cont, resumed, roots
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("case", list(CASES))
def test_resume_equals_continue(case, runs):
    cont, resumed, _ = runs
    a, b = cont[case], resumed[case]
    assert b["steps"] == N_STEPS
    assert a["losses"] == b["losses"]  # bitwise: the same floats
    for name, w in a["weights"].items():
        assert torch.equal(w, torch.as_tensor(b["weights"][name])), name
    for name, buf in a["buffers"].items():
        assert torch.equal(buf, torch.as_tensor(b["buffers"][name])), name
    assert a["lr"] == b["lr"]
    assert b["client"]["epoch"] == 7
    assert torch.equal(torch.as_tensor(b["client"]["order"]), torch.arange(5))
