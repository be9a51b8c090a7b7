"""The inference engine (issue 15): infinity.initialize with no optimizer at stage 3 streams the weights from
NVMe and allocates nothing else; its logits and greedy generations are plain PyTorch's.

Oracle: the same model (a deep copy made before initialize) run by plain PyTorch / transformers.
"""

from __future__ import annotations

import pytest
import torch

import infinity
from tests.inference.models import PAD, inference_config, pair, prompts

MODELS = ("gpt2", "llama", "opt")
# fp32: within 1e-5 relative; bf16 (weights at rest as loaded, computed in bf16): within bf16 rounding
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def _swap_dirs(nvme, name):
    return sorted((nvme / "rank0").glob(f"infinity-{name}-*"))


def test_no_optimizer_gives_the_inference_engine_with_no_gradient_or_optimizer_state(nvme_dir):
    model, _ = pair("gpt2")
    engine = infinity.initialize(model, inference_config(nvme_dir))
    try:
        assert isinstance(engine, infinity.InferenceEngine)
        rt = engine.runtime
        assert rt.plan.optimizer is None and rt.optimizer is None and rt.state_store is None
        assert rt.reducer is None and rt.grad_hooks is None
        assert _swap_dirs(nvme_dir, "optimizer") == []
        (param_dir,) = _swap_dirs(nvme_dir, "params")
        assert sum(f.stat().st_size for f in param_dir.rglob("*") if f.is_file()) > 0
        assert not engine.module.training
        ids, _ = prompts(1, padded=False)
        engine(ids)
        assert all(p.grad is None for p in model.parameters())
        assert (
            engine.io_stats()["read_nbytes"] > 0
        )  # the pool cannot hold the model: weights came from NVMe
    finally:
        engine.close()


def test_an_lr_scheduler_without_an_optimizer_is_refused(nvme_dir):
    model, _ = pair("gpt2")
    with pytest.raises(ValueError, match="nothing trains"):
        infinity.initialize(model, inference_config(nvme_dir), lr_scheduler=object())


@pytest.mark.parametrize("call", ["backward", "step", "zero_grad"])
def test_training_calls_on_the_inference_engine_name_the_missing_optimizer_section(call, nvme_dir):
    # a stage-3 config with no optimizer section gives the inference engine; its backward used to be an
    # AttributeError ('InferenceEngine' object has no attribute 'backward')
    model, _ = pair("gpt2")
    with infinity.initialize(model, inference_config(nvme_dir)) as engine:
        ids, _ = prompts(1, padded=False)
        args = (engine(ids).logits.sum(),) if call == "backward" else ()
        with pytest.raises(TypeError) as e:
            getattr(engine, call)(*args)
    msg = str(e.value)
    assert msg.startswith(f"engine.{call}(): this is an InferenceEngine, which does not train:")
    assert "no 'optimizer' section" in msg and "add an 'optimizer' section to the config" in msg
    assert "initialize(optimizer=...)" in msg and "lr=" in msg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("batch,padded", [(1, False), (3, True)])
def test_logits_equal_plain_pytorch(name, batch, padded, dtype, nvme_dir):
    model, plain = pair(name, dtype)
    ids, mask = prompts(batch, padded=padded)
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask).logits
    engine = infinity.initialize(model, inference_config(nvme_dir))
    try:
        for _ in range(2):  # the first forward records the trace, the second replays it
            got = engine(input_ids=ids, attention_mask=mask).logits
            assert got.dtype == dtype
            real = (
                mask.bool()
            )  # padded positions' logits are not defined the same way by every kernel
            tol = TOLERANCE[dtype]
            g, w = got[real].float(), want[real].float()
            assert torch.allclose(g, w, rtol=tol, atol=tol * w.abs().max().item())
    finally:
        engine.close()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    "batch,padded,dtype",
    [(1, False, torch.float32), (3, True, torch.float32), (3, True, torch.bfloat16)],
)
def test_greedy_generation_equals_plain_generate(name, batch, padded, dtype, nvme_dir):
    model, plain = pair(name, dtype)
    ids, mask = prompts(batch, padded=padded)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    want = plain.generate(ids, **kw)
    engine = infinity.initialize(model, inference_config(nvme_dir))
    try:
        got = engine.generate(ids, **kw)
        assert got.tolist() == want.tolist()
        st = engine.last_generation
        assert st.forwards == 8 and st.tokens == 8 * batch
        # one decode step's trace replayed for the rest: after the first, nothing is read on demand
        assert st.steps["recorded"] == 1 and st.steps["replayed"] == 7 and st.steps["diverged"] == 0
        assert st.read_nbytes > 0
        again = engine.generate(ids, **kw)  # a second generation replays from its first step
        assert again.tolist() == want.tolist()
        assert (
            engine.last_generation.steps["replayed"] == 8 and engine.last_generation.on_demand == 0
        )
    finally:
        engine.close()
