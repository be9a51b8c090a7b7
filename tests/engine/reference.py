"""Plain PyTorch training: the oracle every offload configuration is compared with."""

import torch

from tests.engine.models import MODELS, batch

# eps = 1e-6, not 1e-8: some coordinates have a true gradient of exactly zero
# (attention is invariant to a constant added to every key, so e.g. a
# LayerNorm bias seen through W_k gets only rounding noise). Adam divides that
# noise by sqrt(v) + eps and turns it into full-size updates that differ at
# any last-bit change — with eps = 1e-8 two correct implementations then
# disagree by ~2e-5 on such tensors. 1e-6 keeps the comparison about the
# implementation, not about amplified noise.
LR, BETAS, EPS, WD, CLIP = 3e-3, (0.9, 0.95), 1e-6, 0.1, 0.05


def eval_loss(forward, model_name: str, step: int) -> float:
    """An eval forward under no_grad between training steps (the same batch on every rank)."""
    x, y = batch(step, 99, 0)
    with torch.no_grad():
        return forward(x, y).item()


def reference_run(model_name: str, *, steps: int, gas: int, world_size: int, seed: int = 0):
    """Per (step, micro, rank) losses and final weights of torch AdamW (foreach=False) with clipping."""
    torch.manual_seed(seed)
    model = MODELS[model_name]()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    losses = {}
    for step in range(steps):
        if hasattr(model, "step"):
            model.step = step
        for micro in range(gas):
            for rank in range(world_size):
                x, y = batch(step, micro, rank)
                loss = model(x, y)
                (loss / gas / world_size).backward()
                losses[(step, micro, rank)] = loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.eval()
        losses[(step, "eval")] = eval_loss(model, model_name, step)
        model.train()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_config(stage: int, offload_param: str, offload_optimizer: str, nvme_path, *, gas: int) -> dict:
    zero = {"stage": stage, "sub_group_size": 3000, "stage3_param_persistence_threshold": 100}
    if offload_param != "none":
        zero["offload_param"] = {"device": offload_param, "nvme_path": str(nvme_path), "buffer_count": 4,
                                 "buffer_size": 1 << 16, "max_in_cpu": 0}
    if offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": offload_optimizer, "nvme_path": str(nvme_path)}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
        "zero_optimization": zero,
        "aio": {"block_size": 1 << 20, "queue_depth": 8},
    }


def engine_run(model_name: str, config: dict, *, steps: int, gas: int, rank: int = 0, seed: int = 0):
    """The same training through infinity.initialize; returns losses and the final full weights."""
    import infinity
    from infinity.zero.gathered import GatheredParameters

    torch.manual_seed(seed)
    model = MODELS[model_name]()
    engine = infinity.initialize(model, config)
    losses = {}
    try:
        for step in range(steps):
            if hasattr(model, "step"):
                model.step = step
            for micro in range(gas):
                x, y = batch(step, micro, rank)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses[(step, micro, rank)] = loss.item()
            engine.eval()
            losses[(step, "eval")] = eval_loss(engine, model_name, step)
            engine.train()
        with GatheredParameters(engine):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        engine.close()
    return losses, weights


def reference_mixed_run(model_name: str, dtype: torch.dtype, *, steps: int, gas: int, loss_scale: float = 1.0, seed: int = 0):
    """Mixed precision by hand in plain PyTorch: a 16-bit model for forward/backward, fp32 master
    weights stepped by torch AdamW, grads accumulated in fp32 — what DeepSpeed's bf16/fp16 modes do."""
    torch.manual_seed(seed)
    model = MODELS[model_name]()
    masters = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    model.to(dtype)
    opt = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    losses = {}
    for step in range(steps):
        if hasattr(model, "step"):
            model.step = step
        acc = [torch.zeros_like(m) for m in masters]
        for micro in range(gas):
            x, y = batch(step, micro, 0)
            loss = model(x, y)
            (loss * (loss_scale / gas)).backward()
            for a, p in zip(acc, model.parameters(), strict=True):
                if p.grad is not None:
                    a.add_(p.grad.float())
                p.grad = None
            losses[(step, micro, 0)] = loss.item()
        for m, a in zip(masters, acc, strict=True):
            m.grad = a / loss_scale
        torch.nn.utils.clip_grad_norm_(masters, CLIP)
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters, strict=True):
                p.copy_(m)
    names = [n for n, _ in model.named_parameters()]
    return losses, {n: m.detach().clone() for n, m in zip(names, masters, strict=True)}
