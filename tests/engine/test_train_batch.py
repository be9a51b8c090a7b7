"""engine.train_batch (layer-major accumulation) against the micro-batch loop it replaces.

The oracle is the engine's own micro-batch loop, ``engine.backward(engine(mb)); engine.step()`` per
micro-batch, itself held to plain PyTorch by test_equivalence.py: the same losses and weights
([Note: layer-major accumulation] in infinity/engine/layer_major.py), each unit read and each
gradient written once per step instead of once per micro-batch, and bad input refused or run
micro-batch-major with one warning.

Tolerance (fp32, 1e-6 relative): the forwards are the same computations, so the losses agree to the
last bit or nearly; the gradient of each parameter is the same g-term fp32 sum taken in another
order (autograd's InputBuffer rather than the shard's running sum), within g * 2^-24 of the terms'
magnitudes. Adam's first steps divide the gradient by |g| + eps, so for an element whose micro-batch
contributions cancel that rounding is amplified by |terms| / eps: with the reference's eps = 1e-6
the weights differ by ~1e-6 of their largest element after one step, with eps = 1e-4 (used here)
by ~2e-7. 16-bit: autograd sums the g gradients in the training dtype (the loop sums them in fp32),
so the weights after n steps may differ by what n Adam updates can move (|update| <= lr(1 + wd|w|)
for these betas) plus one rounding of the dtype.
"""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import infinity
from infinity.models import GPT, GPTConfig
from infinity.zero.gathered import GatheredParameters
from tests.engine.models import MODELS, VOCAB, batch
from tests.engine.reference import engine_config

G, STEPS, EPS = 4, 2, 1e-4


def _config(nvme_dir, stage=3, offload_param="nvme", offload_optimizer="nvme", gas=G):
    cfg = engine_config(stage, offload_param, offload_optimizer, nvme_dir, gas=gas)
    cfg["optimizer"]["params"]["eps"] = EPS
    return cfg


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def _call(engine, mb):
    return engine(**mb) if isinstance(mb, dict) else engine(*mb)


def train(make_model, cfg, batches, *, layer_major, inspect=None):
    """Per-micro-batch losses and final weights; ``batches[step]`` is one step's micro-batches."""
    torch.manual_seed(0)
    model = make_model()
    engine = infinity.initialize(model, cfg)
    losses = []
    try:
        for step, mbs in enumerate(batches):
            if hasattr(model, "step"):
                model.step = step
            if layer_major:
                mean, each = engine.train_batch(mbs, return_losses=True)
                assert mean.dim() == 0 and mean.item() == pytest.approx(
                    sum(x.item() for x in each) / len(each), rel=1e-6
                )
                losses += [x.item() for x in each]
            else:
                for mb in mbs:
                    loss = _loss(_call(engine, mb))
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
        if inspect is not None:
            inspect(engine)
        with GatheredParameters(engine):
            weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    finally:
        engine.close()
    return losses, weights


def assert_same(a, b, *, rel=1e-6):
    assert a[0] == pytest.approx(b[0], rel=rel)
    for name, ref in a[1].items():
        err = (b[1][name] - ref).abs().max().item() / ref.abs().max().item()
        assert err < rel, f"{name}: relative difference {err:.2e}"


def gpt_batches(steps=STEPS, g=G):
    return [[batch(step, micro, 0) for micro in range(g)] for step in range(steps)]


def checkpointed_gpt():
    model = MODELS["gpt"]()
    model.gradient_checkpointing = True
    return model


@pytest.mark.parametrize(
    "model,stage,offload_param,offload_optimizer",
    [
        ("gpt", 3, "nvme", "nvme"),
        ("checkpointed", 3, "nvme", "nvme"),
        ("twice", 3, "nvme", "nvme"),
        ("alternating", 3, "nvme", "cpu"),
        ("gpt", 2, "none", "nvme"),
        ("checkpointed", 1, "none", "nvme"),
    ],
)
def test_same_math_as_the_micro_batch_loop(
    model, stage, offload_param, offload_optimizer, nvme_dir
):
    make = checkpointed_gpt if model == "checkpointed" else MODELS[model]
    cfg = _config(nvme_dir, stage, offload_param, offload_optimizer)
    batches = gpt_batches()
    assert_same(
        train(make, cfg, batches, layer_major=False), train(make, cfg, batches, layer_major=True)
    )


def without_dropout(model):
    """Dropout draws its masks in the order the forwards run, which train_batch interleaves: the
    same distribution, other masks. The comparison is of everything else."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


@pytest.mark.parametrize("arch,checkpointing", [("gpt2", False), ("llama", True)])
def test_transformers_models_from_config(arch, checkpointing, nvme_dir):
    from tests.hf.models import batch as hf_batch
    from tests.hf.models import build, ds_config

    def make():
        model = without_dropout(build(arch))
        if checkpointing:
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        return model

    cfg = ds_config(nvme_dir)
    cfg["gradient_accumulation_steps"] = G
    cfg["optimizer"]["params"]["eps"] = EPS
    batches = [[hf_batch(arch, G * step + i) for i in range(G)] for step in range(STEPS)]
    assert_same(
        train(make, cfg, batches, layer_major=False), train(make, cfg, batches, layer_major=True)
    )


def test_bf16_within_its_rounding(nvme_dir):
    from tests.engine.reference import LR, WD
    from tests.hf.models import batch as hf_batch
    from tests.hf.models import build, ds_config

    cfg = ds_config(nvme_dir, precision="bf16")
    cfg["gradient_accumulation_steps"] = G
    batches = [[hf_batch("gpt2", G * step + i) for i in range(G)] for step in range(STEPS)]
    loop = train(lambda: without_dropout(build("gpt2")), cfg, batches, layer_major=False)
    layer = train(lambda: without_dropout(build("gpt2")), cfg, batches, layer_major=True)
    # The first step's forwards see the same weights: the same losses.
    assert layer[0][:G] == loop[0][:G]
    for name, ref in loop[1].items():
        bound = STEPS * 2 * LR * (1 + WD * ref.abs()) + ref.abs() * 2.0**-8
        assert ((layer[1][name] - ref).abs() <= bound).all(), name


def _wide_gpt(checkpointing=False):
    """Eight blocks, six units each (sub_group_size): far more than the pool holds."""
    model = GPT(
        GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=8, n_head=2, d_model=32, bias=False)
    )
    model.gradient_checkpointing = checkpointing
    return model


def _step_traffic(make, nvme_dir, g, *, layer_major, block=None):
    """NVMe bytes of the second step: parameter bytes read, gradient bytes written. The pool holds
    six units of the model's eight blocks' 48. ``block``: train_batch's micro-batches per block."""
    cfg = _config(nvme_dir, gas=g)
    if block is not None:
        cfg["zero_optimization"]["layer_major"] = {"block": block}
    largest = max(p.numel() for p in make().parameters())
    cfg["zero_optimization"]["offload_param"].update(buffer_count=6, buffer_size=largest)
    seen = {}

    def snapshot(engine):
        engine.synchronize()
        return (engine.runtime.param_store.key_traffic(), engine.runtime.state_store.key_traffic())

    torch.manual_seed(0)
    engine = infinity.initialize(make(), cfg)
    try:
        for step in range(2):
            if step == 1:
                seen["before"] = snapshot(engine)
            mbs = gpt_batches(steps=2, g=g)[step]
            if layer_major:
                engine.train_batch(mbs)
            else:
                for x, y in mbs:
                    engine.backward(engine(x, y))
                    engine.step()
        after = snapshot(engine)
    finally:
        engine.close()
    params = after[0].since(seen["before"][0])
    state = after[1].since(seen["before"][1])
    grads_written = sum(n for key, n in state.written.items() if key[1] == "g")
    return sum(params.read.values()), grads_written


@pytest.mark.parametrize("checkpointing", [False, True])
def test_each_unit_read_and_each_gradient_written_once_per_step(checkpointing, nvme_dir):
    def make():
        return _wide_gpt(checkpointing)

    read_1, written_1 = _step_traffic(make, nvme_dir, 1, layer_major=False)
    read_8, written_8 = _step_traffic(make, nvme_dir, 8, layer_major=True)
    assert read_1 > 0 and written_1 > 0
    assert read_8 <= 1.1 * read_1 and written_8 <= 1.1 * written_1
    if not checkpointing:  # the loop reads units again for each micro-batch: the test can tell
        loop_read, loop_written = _step_traffic(make, nvme_dir, 2, layer_major=False)
        assert loop_read > 1.5 * read_1 and loop_written > 1.5 * written_1


@pytest.mark.parametrize("block", [1, 3, G])
def test_blocks_of_micro_batches_same_math_as_the_loop(block, nvme_dir):
    """[Note: layer-major blocks]: the window in blocks of 1 (the loop's order), 3 (which does not
    divide 4: blocks of 3 and 1) or all 4, gradients accumulated over the blocks."""
    cfg = _config(nvme_dir)
    cfg["zero_optimization"]["layer_major"] = {"block": block}
    batches = gpt_batches()
    make = MODELS["gpt"]
    seen = []
    loop = train(make, cfg, batches, layer_major=False)
    layer = train(
        make,
        cfg,
        batches,
        layer_major=True,
        inspect=lambda e: seen.append(e.runtime.plan.layer_major_block),
    )
    assert seen == [block]
    assert_same(loop, layer)


def test_two_blocks_read_as_two_micro_batches_do(nvme_dir):
    """Each block reads every unit once in its forward and once in its backward, and writes each
    gradient once: 8 micro-batches in blocks of 4 move what the loop moves for 2 micro-batches."""

    def make():
        return _wide_gpt(False)

    read_2, written_2 = _step_traffic(make, nvme_dir, 2, layer_major=False)
    read_blocks, written_blocks = _step_traffic(make, nvme_dir, 8, layer_major=True, block=4)
    assert read_blocks == pytest.approx(read_2, rel=0.1)
    assert written_blocks == pytest.approx(written_2, rel=0.1)


def test_micro_batches_of_different_lengths(nvme_dir):
    """Shapes the model takes: each micro-batch its own sequence length, the same math."""
    cfg = _config(nvme_dir)
    batches = [
        [(x[:, : 16 - 4 * i], y[:, : 16 - 4 * i]) for i, (x, y) in enumerate(mbs)]
        for mbs in gpt_batches()
    ]
    make = MODELS["gpt"]
    assert_same(
        train(make, cfg, batches, layer_major=False), train(make, cfg, batches, layer_major=True)
    )


class VariableDepth(nn.Module):
    """Applies ``shared`` once or twice, as the micro-batch's first token says: micro-batches visit
    the units a different number of times."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 24)
        self.shared = nn.Linear(24, 24)
        self.head = nn.Linear(24, VOCAB)

    def forward(self, x, y):
        h = self.emb(x)
        for _ in range(1 + int(x[0, 0]) % 2):
            h = torch.tanh(self.shared(h))
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))


def test_micro_batches_that_diverge_run_micro_batch_major_with_one_warning(nvme_dir, caplog):
    cfg = _config(nvme_dir)
    batches = gpt_batches()
    for mbs in batches:  # one pass, then two
        mbs[0][0][0, 0], mbs[1][0][0, 0] = 2, 3
    loop = train(VariableDepth, cfg, batches, layer_major=False)
    with caplog.at_level(logging.WARNING, logger="infinity.engine"):
        layer = train(VariableDepth, cfg, batches, layer_major=True)
    notices = [r.getMessage() for r in caplog.records if "micro-batch-major" in r.getMessage()]
    assert len(notices) == STEPS and "micro-batch 1 reached" in notices[0], notices
    assert_same(loop, layer)


def test_a_micro_batch_the_model_cannot_take_is_named(nvme_dir):
    cfg = _config(nvme_dir)
    torch.manual_seed(0)
    engine = infinity.initialize(MODELS["gpt"](), cfg)
    try:
        mbs = gpt_batches(steps=1)[0]
        bad = list(mbs)
        bad[2] = (torch.randint(0, VOCAB, (2, 40)),) * 2  # longer than the model's seq_len
        with pytest.raises(ValueError, match="longer than seq_len") as info:
            engine.train_batch(bad)
        assert any("micro-batch 2 of 4" in n for n in info.value.__notes__)
        assert engine.global_steps == 0
        # Nothing is left held: the next step runs, with every unit released after it.
        engine.train_batch(mbs)
        assert engine.global_steps == 1
        assert engine.runtime.partitioner.gathered_units() == []
    finally:
        engine.close()


def test_bad_calls_are_refused(nvme_dir):
    torch.manual_seed(0)
    engine = infinity.initialize(MODELS["gpt"](), _config(nvme_dir))
    try:
        mbs = gpt_batches(steps=1)[0]
        with pytest.raises(ValueError, match="gradient_accumulation_steps = 4"):
            engine.train_batch(mbs[:3])
        with pytest.raises(TypeError, match="not both"):
            engine.train_batch(mbs, data_iter=iter(mbs))
        with pytest.raises(ValueError, match="ended after 3 of the 4"):
            engine.train_batch(data_iter=iter(mbs[:3]))
        with pytest.raises(ValueError, match="micro-batch 0 gave"):
            engine.train_batch([(x,) for x, _ in mbs])  # logits, not a loss
        with torch.no_grad(), pytest.raises(RuntimeError, match="no_grad"):
            engine.train_batch(mbs)
        x, y = mbs[0]
        engine.backward(engine(x, y))
        with pytest.raises(RuntimeError, match="already has 1 backward"):
            engine.train_batch(mbs)
        engine.zero_grad()  # the window is empty again
        engine.train_batch(data_iter=iter(mbs))
        assert engine.global_steps == 1
    finally:
        engine.close()


def _token_sum_loss(module, mb):
    """A per-micro-batch loss of its own (summed over the tokens, divided by a fixed count, as the
    Trainer's compute_loss does with num_items_in_batch), from the model's logits."""
    x, y = mb
    logits = module(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum") / 100.0


def test_loss_fn_runs_each_micro_batch_and_equals_the_loop(nvme_dir):
    """``loss_fn(module, batch)`` in the model's place: the loop's oracle is
    ``engine.backward(loss_fn(engine, batch))`` per micro-batch; train_batch hands loss_fn the
    engine's module (a plain module: its forward inside the micro-batch's thread)."""
    cfg = _config(nvme_dir)
    batches = gpt_batches()

    def run(layer_major):
        torch.manual_seed(0)
        model = MODELS["gpt"]()
        engine = infinity.initialize(model, cfg)
        seen, losses = [], []

        def loss_fn(module, mb):
            seen.append(module)
            return _token_sum_loss(module, mb)

        try:
            for mbs in batches:
                if layer_major:
                    _, each = engine.train_batch(mbs, loss_fn=loss_fn, return_losses=True)
                    losses += [x.item() for x in each]
                else:
                    for mb in mbs:
                        loss = _token_sum_loss(engine, mb)
                        engine.backward(loss)
                        engine.step()
                        losses.append(loss.item())
            with GatheredParameters(engine):
                weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        finally:
            engine.close()
        assert all(m is model for m in seen) and len(seen) == (G * STEPS if layer_major else 0)
        return losses, weights

    assert_same(run(False), run(True))


def test_a_loss_fn_that_returns_no_scalar_is_named(nvme_dir):
    torch.manual_seed(0)
    engine = infinity.initialize(MODELS["gpt"](), _config(nvme_dir))
    try:
        mbs = gpt_batches(steps=1)[0]
        with pytest.raises(ValueError, match=r"loss_fn to return a scalar.*micro-batch 0.*\(2, 16"):
            engine.train_batch(mbs, loss_fn=lambda module, mb: module(mb[0]).sum(-1))
        assert engine.global_steps == 0
        engine.train_batch(mbs, loss_fn=_token_sum_loss)
        assert engine.global_steps == 1
    finally:
        engine.close()
