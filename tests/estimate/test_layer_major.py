"""The estimate of a run trained by engine.train_batch ([Note: layer-major accumulation]): the saved
activations of the window's micro-batches are alive at once, and each array on NVMe moves once per
step, as with one micro-batch ([Note: traffic model])."""

import pytest
import torch

from infinity.estimate import ZeroSetting, estimate_memory
from infinity.models import GPT, GPTConfig
from tests.engine.reference import engine_config
from tests.estimate.test_reality import _config as reality_config
from tests.estimate.test_reality import _probe as probe

MODEL = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, bias=False)


def _breakdown(nvme_dir, gas, **kw):
    cfg = engine_config(3, "nvme", "nvme", nvme_dir, gas=gas)
    est = estimate_memory(
        GPT(MODEL), config=cfg, device="cpu", machine=False, micro_batch=2, seq=16, **kw
    )
    return est.focus.breakdown


def _saved(breakdown):
    (item,) = [i for i in breakdown.items if i.name == "activations saved for backward"]
    return item


def test_the_windows_activations_at_once_and_each_array_moved_once(nvme_dir):
    loop = _breakdown(nvme_dir, 4)
    layer = _breakdown(nvme_dir, 4, layer_major=True)
    single = _breakdown(nvme_dir, 1)
    assert _saved(layer).nbytes == 4 * _saved(loop).nbytes > 0
    assert "4 micro-batches at once" in _saved(layer).detail
    assert layer.nvme_traffic_nbytes == single.nvme_traffic_nbytes < loop.nvme_traffic_nbytes


def test_the_command_takes_layer_major(capsys):
    from infinity.cli.main import main

    args = ["estimate", "--params", "2M", "--seq", "16", "--micro-batch", "1", "--json"]
    assert main([*args, "--layer-major"]) == 0
    assert main(["estimate", "--params", "2M", "--inference", "--layer-major"]) == 2
    assert "--layer-major are training's" in capsys.readouterr().err


# name: (GPT shape, micro-batch, seq, gradient_accumulation_steps): a deeper stack of small units, a
# large vocabulary (what each micro-batch of a block keeps beyond its peak), and width at sequence 256
# (the forward threads' heaps, untrimmed, kept a share growing with the width: [Note: layer-major
# accumulation])
REALITY = {
    "g8-4-layers": (dict(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=256), 2, 64, 8),
    "g32-vocab-8192": (
        dict(vocab_size=8192, seq_len=32, n_layer=2, n_head=4, d_model=128),
        1,
        32,
        32,
    ),
    "g2-width-1024-seq-256": (
        dict(vocab_size=256, seq_len=256, n_layer=2, n_head=16, d_model=1024),
        1,
        256,
        2,
    ),
}


@pytest.mark.parametrize("name", list(REALITY))
def test_the_estimate_holds_train_batchs_peak(name, tmp_path):
    """train_batch over the window as one block (zero_optimization.layer_major.block = g) in a fresh
    process: its peak RSS against estimate_memory(layer_major=True), at least it and at most the
    reality tests' 15% above ([Note: layer-major blocks])."""
    shape, mb, seq, g = REALITY[name]
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cfg = reality_config(
        3, "nvme", "nvme", micro_batch=mb, nvme=str(nvme), sub_group_size=1_000_000
    )
    cfg["gradient_accumulation_steps"] = g
    cfg["zero_optimization"]["layer_major"] = {"block": g}
    param = cfg["zero_optimization"]["offload_param"]  # a buffer holds the largest (the MLP's 4d·d)
    param["buffer_size"] = max(param["buffer_size"], 4 * shape["d_model"] ** 2)
    spec = dict(model=shape, config=cfg, micro_batch=mb, seq=seq, steps=2, nvme_path=str(nvme))
    m = probe({**spec, "train_batch": True})
    est = estimate_memory(
        GPTConfig(**shape),
        config=cfg,
        micro_batch=mb,
        seq=seq,
        device="cpu",
        zero_init=False,
        baseline_nbytes=m["baseline"],
        machine=False,
        settings=[ZeroSetting(3, "nvme", "nvme")],
        layer_major=True,
    )
    plan = est.settings[0].breakdown
    assert plan.layer_major_block == g
    ram, peak = plan.ram_nbytes, m["peak"]
    line = f"{name}: peak RSS {peak / 2**20:.1f} MiB, estimate {ram / 2**20:.1f} MiB ({ram / peak:.3f})"
    print(line)
    assert peak <= ram <= 1.15 * peak, line


# A vocabulary large next to the model: each micro-batch's logits dominate what a block keeps.
BUDGET_MODEL = GPTConfig(vocab_size=4096, seq_len=32, n_layer=2, n_head=2, d_model=32, bias=False)


def _config(nvme_dir, gas, device, budget=None):
    from tests.engine.test_train_batch import EPS

    cfg = engine_config(3, "nvme", "nvme", nvme_dir, gas=gas)
    # The layer-major sum of the micro-batches' gradients is taken in another order than the
    # loop's; Adam magnifies that rounding by |g| / eps (tests/engine/test_train_batch.py's
    # docstring gives the arithmetic), so these runs use its eps.
    cfg["optimizer"]["params"]["eps"] = EPS
    zero = cfg["zero_optimization"]
    if device == "auto":
        for section in ("offload_param", "offload_optimizer"):
            zero[section] = {"device": "auto", "nvme_path": str(nvme_dir)}
        del zero["sub_group_size"]
    zero["layer_major"] = {"block": "auto"}
    if budget is not None:
        cfg["host_memory_budget"] = budget
    return cfg


def _least_need(cfg, block):
    """The least host memory a plan needs with ``block`` micro-batches per block (the planner's
    with nothing kept in host memory, under "auto")."""
    import dataclasses

    from infinity.config import load_config
    from infinity.estimate.context import run_context
    from infinity.estimate.placement import is_auto, place_in_budget
    from infinity.estimate.runtime_plan import plan_runtime

    model = GPT(BUDGET_MODEL)
    c = load_config(cfg)
    ctx = dataclasses.replace(run_context(model, c, device="cpu", world_size=1), block=block)
    if is_auto(c):
        plan = place_in_budget(model, c, ctx, budget_nbytes=0, budget_source="test")
        return plan.chosen.need_nbytes
    return ctx.host_need(ctx.itemise(c, plan_runtime(model, c, world_size=1)))


@pytest.mark.parametrize("device", ["nvme", "auto"])
def test_a_budget_too_small_for_the_window_picks_a_smaller_block(device, nvme_dir):
    """[Note: layer-major blocks]: host_memory_budget between what blocks of 4 and of 8 need (at
    the least, under "auto"): the block is below 8 and fits — with fixed homes the largest that
    fits, 4 (fewer blocks move fewer bytes) — and train_batch gives the loop's numbers."""
    from tests.engine.test_train_batch import assert_same, train

    g = 8
    four = _least_need(_config(nvme_dir, g, device), 4)
    eight = _least_need(_config(nvme_dir, g, device), 8)
    assert eight > four
    cfg = _config(nvme_dir, g, device, budget=(four + eight) // 2)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, BUDGET_MODEL.vocab_size, (2, 32), generator=gen) for _ in range(g)]
    batches = [[(x, x) for x in xs]]
    plans = []
    layer = train(
        lambda: GPT(BUDGET_MODEL),
        cfg,
        batches,
        layer_major=True,
        inspect=lambda e: plans.append(e.runtime.plan),
    )
    (plan,) = plans
    assert plan.layer_major_block == 4 if device == "nvme" else plan.layer_major_block < g
    if device == "auto":
        assert plan.chosen.need_nbytes <= plan.chosen.budget_nbytes
    loop = train(lambda: GPT(BUDGET_MODEL), cfg, batches, layer_major=False)
    assert_same(loop, layer)


def test_a_budget_too_small_for_one_micro_batch_is_refused(nvme_dir):
    import infinity
    from infinity.config import ConfigError

    cfg = _config(nvme_dir, 8, "auto")
    cfg["host_memory_budget"] = _least_need(cfg, 1) - (1 << 20)
    with pytest.raises(ConfigError, match="host_memory_budget"):
        infinity.initialize(GPT(BUDGET_MODEL), cfg)


def test_the_command_shows_the_block(tmp_path, capsys):
    import json

    from infinity.cli.main import main

    cfg = engine_config(3, "nvme", "nvme", tmp_path, gas=8)
    cfg["zero_optimization"]["layer_major"] = {"block": 3}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    args = ["estimate", "--params", "2M", "--seq", "16", "--config", str(path), "--layer-major"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "engine.train_batch: 3 of the 8 micro-batches per layer-major block, 3 block(s)" in out
