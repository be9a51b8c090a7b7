"""Plain PyTorch training: the oracle every offload configuration is compared with."""

import math

import torch
from torch.overrides import TorchFunctionMode

from infinity.zero.cpu_linear import Fp32Linears
from tests.engine.models import MODELS, batch

# eps = 1e-6, not 1e-8: some coordinates have a true gradient of exactly zero
# (attention is invariant to a constant added to every key, so e.g. a
# LayerNorm bias seen through W_k gets only rounding noise). Adam divides that
# noise by sqrt(v) + eps and turns it into full-size updates that differ at
# any last-bit change — with eps = 1e-8 two correct implementations then
# disagree by ~2e-5 on such tensors. 1e-6 keeps the comparison about the
# implementation, not about amplified noise.
LR, BETAS, EPS, WD, CLIP = 3e-3, (0.9, 0.95), 1e-6, 0.1, 0.05


def trainable_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """torch's AdamW (foreach=False) with the constants above over the parameters that require grad:
    a frozen parameter gets no state, as in the engine."""
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        foreach=False,
    )


def update(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """One optimizer step after the window's backward: the gradient clipped to CLIP, stepped, dropped."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)


def eval_loss(forward, model_name: str, step: int) -> float:
    """An eval forward under no_grad between training steps (the same batch on every rank)."""
    x, y = batch(step, 99, 0)
    with torch.no_grad():
        return forward(x, y).item()


def reference_run(model_name: str, *, steps: int, gas: int, world_size: int, seed: int = 0):
    """Per (step, micro, rank) losses and final weights of torch AdamW (foreach=False) with clipping."""
    torch.manual_seed(seed)
    model = MODELS[model_name]()
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False
    )
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
        update(model, opt)
        model.eval()
        losses[(step, "eval")] = eval_loss(model, model_name, step)
        model.train()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_config(
    stage: int, offload_param: str, offload_optimizer: str, nvme_path, *, gas: int
) -> dict:
    zero = {"stage": stage, "sub_group_size": 3000, "stage3_param_persistence_threshold": 100}
    if offload_param != "none":
        zero["offload_param"] = {
            "device": offload_param,
            "nvme_path": str(nvme_path),
            "buffer_count": 4,
            "buffer_size": 1 << 16,
            "max_in_cpu": 0,
        }
    if offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": offload_optimizer, "nvme_path": str(nvme_path)}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD},
        },
        "zero_optimization": zero,
        "aio": {"block_size": 1 << 20, "queue_depth": 8},
    }


def engine_run(
    model_name: str,
    config: dict,
    *,
    steps: int,
    gas: int,
    rank: int = 0,
    seed: int = 0,
    placement=None,
    inspect=None,
):
    """The same training through infinity.initialize; returns losses and the final full weights.
    ``placement(units)``: instead, the engine built from a plan with that Placement of the "auto"
    sections' state (a placement forced, where initialize would let the planner choose).
    ``inspect(engine)``: called after training, before the engine closes."""
    import infinity
    from infinity.zero.gathered import GatheredParameters

    torch.manual_seed(seed)
    model = MODELS[model_name]()
    engine = (
        infinity.initialize(model, config)
        if placement is None
        else _forced(model, config, placement)
    )
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
        if inspect is not None:
            inspect(engine)
    finally:
        engine.close()
    return losses, weights


def _forced(model, config: dict, placement):
    """An Engine (world size 1, CPU) allocated from the plan with ``placement(units)``."""
    from infinity.config import load_config
    from infinity.engine import Engine
    from infinity.estimate.runtime_plan import cut_units, plan_runtime

    cfg = load_config(config)
    device = torch.device("cpu")
    units = cut_units(model, cfg, world_size=1, device=device)
    plan = plan_runtime(
        model, cfg, world_size=1, device=device, unit_map=units, placement=placement(units.units)
    )
    return Engine(model, cfg, plan=plan, device=device)


# [Note: a 16-bit oracle that does not depend on the CPU]
# In 16-bit training an fp32 master weight one ulp off rounds to another 16-bit
# weight now and then (about 2^-13 of the elements per step); from there the
# forwards differ and the two runs drift apart, so a last-bit difference in the
# fp32 update becomes a visible one within a few steps. Two fp32 roundings
# depend on the machine in plain PyTorch, so the mixed-precision oracle fixes both:
# - torch's x86 wheels take sqrt from MKL, whose result depends on the CPU
#   (an ulp off for ~1% of inputs on an Intel Xeon, ~15% on an AMD EPYC here);
#   the oracle's AdamW step runs with a correctly rounded sqrt, as IEEE sqrt
#   (and the engine's kernel) is;
# - clip_grad_norm_ sums fp32 norms in an order set by torch's vector width;
#   the oracle sums the squares in float64 (exact to ~1e-16, so its fp32
#   coefficient does not depend on the order), as the engine does.
# - on a CPU without 16-bit matrix hardware the engine multiplies 16-bit Linear
#   layers in fp32 and rounds once ([Note: 16-bit Linear on the CPU] in
#   infinity/zero/cpu_linear.py), where torch's reference loops add in another
#   order; the oracle's linears take the same path (``Fp32Linears``, a no-op on
#   CPUs with the hardware), and tests/zero/test_cpu_linear.py checks that path
#   against float64.
# The fp32 equivalence tests keep torch's own AdamW and clipping: there an ulp
# stays an ulp, far inside their 1e-5.


class CorrectlyRoundedSqrt(TorchFunctionMode):
    """fp32 sqrt computed in float64 and rounded once: the correctly rounded result, on any CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.sqrt, torch.Tensor.sqrt) and args[0].dtype == torch.float32:
            return args[0].double().sqrt().float()
        return func(*args, **(kwargs or {}))


def clip_in_float64(params, max_norm: float) -> None:
    """torch's clip_grad_norm_ rule, max_norm / (norm + 1e-6) capped at 1, with the norm summed and
    the coefficient computed in float64 (see [Note: a 16-bit oracle that does not depend on the CPU])."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = math.sqrt(
        sum(float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in grads)
    )
    coef = min(1.0, max_norm / (norm + 1e-6))
    for g in grads:
        g.mul_(coef)


def reference_mixed_run(
    model_name: str,
    dtype: torch.dtype,
    *,
    steps: int,
    gas: int,
    loss_scale: float = 1.0,
    seed: int = 0,
):
    """Mixed precision by hand in plain PyTorch: a 16-bit model for forward/backward, fp32 master
    weights stepped by torch AdamW, grads accumulated in fp32 — what DeepSpeed's bf16/fp16 modes do.
    The clip norm and AdamW's sqrt are made machine-independent (see the note above)."""
    torch.manual_seed(seed)
    model = MODELS[model_name]()
    masters = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    model.to(dtype)
    Fp32Linears(model).install()
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
        clip_in_float64(masters, CLIP)
        with CorrectlyRoundedSqrt():
            opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters, strict=True):
                p.copy_(m)
    names = [n for n, _ in model.named_parameters()]
    return losses, {n: m.detach().clone() for n, m in zip(names, masters, strict=True)}
