"""Two training steps through the installed wheel, and the same two in plain PyTorch.

Run by tests/wheel/test_wheel.py with the Python of a virtual environment that holds only the
wheel (torch reached through a .pth file): ``python train_in_venv.py NVME_PATH``. It imports
nothing from the source tree. It trains twice: with the aio engine ``io_uring`` (which refuses to
fall back, so success means io_uring did the I/O), then with ``auto`` under a refused io_uring
(INFINITY_AIO_IO_URING_REFUSE, the hook the C++ engine reads at each probe, as Docker's seccomp
profile would refuse it): the threads engine takes over and says so once on stderr. It prints one
JSON line of facts for the test to judge: where infinity and its extensions were imported from,
each run's losses and largest relative weight difference against plain PyTorch, and the shared
libraries mapped into the process.
"""

import json
import os
import sys

import torch

import infinity
import infinity._adam
import infinity._aio
from infinity.host import mapped_paths

LR, BETAS, EPS, WD, STEPS = 1e-2, (0.9, 0.95), 1e-6, 0.1, 2


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
        torch.nn.Linear(64, 8),
    )  # fmt: skip


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)


def config(engine: str, nvme_path: str) -> dict:
    """Stage 3, parameters and optimizer state on NVMe, the aio engine named (``io_uring`` refuses
    to fall back, so a run that succeeds with it used io_uring)."""
    nvme = {"device": "nvme", "nvme_path": nvme_path}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD},
        },
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {**nvme, "buffer_count": 4, "buffer_size": 1 << 16, "max_in_cpu": 0},
            "offload_optimizer": nvme,
        },
        "aio": {"engine": engine, "block_size": 1 << 20, "queue_depth": 8},
    }


def plain() -> tuple[list[float], dict[str, torch.Tensor]]:
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in m.named_parameters()}


def offloaded(engine_name: str, nvme_path: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    m = model()
    engine = infinity.initialize(m, config(engine_name, nvme_path))
    losses = []
    try:
        for step in range(STEPS):
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with infinity.GatheredParameters(engine):
            weights = {n: p.detach().clone() for n, p in m.named_parameters()}
    finally:
        engine.close()
    return losses, weights


def main() -> None:
    nvme_path = sys.argv[1]
    ref_losses, ref_weights = plain()
    runs = {}
    for name, engine_name in (("io_uring", "io_uring"), ("refused", "auto")):
        if name == "refused":
            os.environ["INFINITY_AIO_IO_URING_REFUSE"] = "EPERM"
            print("-- io_uring refused from here", file=sys.stderr, flush=True)
        losses, weights = offloaded(engine_name, nvme_path)
        error = max(
            ((weights[n] - ref).abs().max() / ref.abs().max()).item()
            for n, ref in ref_weights.items()
        )
        runs[name] = {"losses": losses, "weight_error": error}
    facts = {
        "infinity": infinity.__file__,
        "extensions": [infinity._aio.__file__, infinity._adam.__file__],
        "plain_losses": ref_losses,
        "runs": runs,
        "mapped": sorted(mapped_paths()),
    }
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
