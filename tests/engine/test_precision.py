"""bf16 and fp16 training against mixed precision written by hand in plain PyTorch.

The oracle keeps fp32 master weights stepped by torch AdamW, a 16-bit model
for forward and backward, and fp32 gradient accumulation — DeepSpeed's bf16 /
fp16 recipe. The engine's 16-bit parameters must equal the oracle's masters
rounded to 16 bits, and its losses must match.
"""

import math

import pytest
import torch

import infinity
from infinity.engine.loss_scaler import LossScaler
from tests.engine.models import batch, tiny_gpt
from tests.engine.reference import engine_config, engine_run, reference_mixed_run

STEPS, GAS = 6, 2


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize(
    "stage,offload_param,offload_optimizer",
    [
        (0, "none", "none"),
        (1, "none", "cpu"),
        (2, "none", "nvme"),
        (3, "cpu", "cpu"),
        (3, "nvme", "nvme"),
    ],
)
def test_mixed_precision_matches_hand_written_reference(
    precision, stage, offload_param, offload_optimizer, nvme_dir
):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scale = 1024.0 if precision == "fp16" else 1.0
    cfg = engine_config(stage, offload_param, offload_optimizer, nvme_dir, gas=GAS)
    cfg[precision] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"]["loss_scale"] = scale  # static: the oracle uses the same
    ref_losses, ref_masters = reference_mixed_run(
        "gpt", dtype, steps=STEPS, gas=GAS, loss_scale=scale
    )
    losses, weights = engine_run("gpt", cfg, steps=STEPS, gas=GAS)
    for k, ref in ref_losses.items():
        assert losses[k] == pytest.approx(ref, rel=1e-4), k
    for name, master in ref_masters.items():
        assert weights[name].dtype == dtype
        # the same bits on any CPU (tests/engine/reference.py [Note: a 16-bit oracle that does not
        # depend on the CPU]); torch's default 16-bit tolerance leaves room for a rounding tie
        torch.testing.assert_close(weights[name], master.to(dtype), msg=name)


def test_dynamic_loss_scale_skips_overflowing_steps(nvme_dir):
    """An inf loss overflows the fp16 grads: the step is skipped, the scale drops after
    `hysteresis` overflows, and the weights do not move."""
    from infinity.zero.gathered import GatheredParameters

    cfg = engine_config(3, "nvme", "nvme", nvme_dir, gas=1)
    cfg["fp16"] = {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 8,
        "hysteresis": 2,
        "loss_scale_window": 2,
        "min_loss_scale": 1,
    }
    torch.manual_seed(0)
    model = tiny_gpt()
    engine = infinity.initialize(model, cfg)
    scales = []
    try:
        with GatheredParameters(engine):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for step in range(5):
            x, y = batch(step, 0, 0)
            loss = engine(x, y)
            if step in (0, 1):
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
            scales.append(engine.loss_scale)
            if step == 1:
                with GatheredParameters(engine):
                    for n, p in model.named_parameters():
                        assert torch.equal(p, before[n]), f"{n} moved on a skipped step"
        assert engine.skipped_steps == 2
        assert not math.isfinite(engine.last_grad_norm or float("nan")) or engine.global_steps == 5
    finally:
        engine.close()
    # 256: first overflow eats the hysteresis, second halves; then 2 clean steps double it.
    assert scales == [256.0, 128.0, 128.0, 256.0, 256.0]


def test_loss_scaler_follows_deepspeed():
    s = LossScaler(dynamic=True, scale=2.0**4, window=3, hysteresis=2, min_scale=2.0)
    seen = []
    for overflow in [True, True, True, False, False, False, True, True, True, True]:
        s.update(overflow)
        seen.append(s.scale)
    # hysteresis 2: the first overflow is absorbed, then each halves (never below 2); growth
    # after `window` clean steps restores the hysteresis, so the next overflow is absorbed again
    assert seen == [16, 8, 4, 4, 4, 8, 8, 4, 2, 2]
    static = LossScaler.static(128.0)
    static.update(True)
    assert static.scale == 128.0
