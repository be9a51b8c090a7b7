"""Frozen parameters get no optimizer state, and a model with nothing to train needs no optimizer (issue 17).

Oracles: plain PyTorch (torch's AdamW over the trainable parameters, which
skips the frozen ones) for the losses and weights; the swap files on disk
(st_blocks, as tests/estimate/probe.py measures them) for the bytes; the
estimate for the same model and config for what both should be.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import infinity
from infinity.estimate import ZeroSetting, estimate_memory
from infinity.estimate.rules import swap_dir_overhead_nbytes, swap_nbytes
from infinity.zero.gathered import GatheredParameters
from tests.engine.models import batch, tiny_gpt
from tests.engine.reference import engine_config, trainable_adamw, update

STEPS, GAS = 4, 2
FROZEN = ("wte.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight")


def frozen_gpt(names=FROZEN, *, seed: int = 0):
    """tiny_gpt with ``names`` frozen: the tied embedding (read by the head outside its owner's forward)
    and the first block's attention."""
    torch.manual_seed(seed)
    model = tiny_gpt()
    for n, p in model.named_parameters():
        if names is None or n in names:
            p.requires_grad_(False)
    return model


def reference(steps: int = STEPS):
    model = frozen_gpt()
    opt = trainable_adamw(model)
    losses = []
    for step in range(steps):
        for micro in range(GAS):
            loss = model(*batch(step, micro, 0))
            (loss / GAS).backward()
            losses.append(loss.item())
        update(model, opt)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def swap_dirs(nvme: Path, name: str) -> list[Path]:
    return sorted((nvme / "rank0").glob(f"infinity-{name}-*"))


def disk_nbytes(d: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in d.rglob("*") if f.is_file())


@pytest.mark.parametrize(
    "stage,offload_param,offload_optimizer",
    [
        (0, "none", "none"),
        (1, "none", "nvme"),
        (2, "none", "cpu"),
        (3, "nvme", "nvme"),
        (3, "cpu", "cpu"),
    ],
)
def test_partially_frozen_model_trains_as_plain_pytorch(
    stage, offload_param, offload_optimizer, nvme_dir
):
    ref_losses, ref_weights = reference()
    model = frozen_gpt()
    start = {n: p.detach().clone() for n, p in model.named_parameters() if n in FROZEN}
    engine = infinity.initialize(
        model, engine_config(stage, offload_param, offload_optimizer, nvme_dir, gas=GAS)
    )
    try:
        assert all(
            not u.trainable
            for u in engine.runtime.unit_map.units
            if any(n in FROZEN for n in u.names)
        )
        losses = []
        for step in range(STEPS):
            for micro in range(GAS):
                loss = engine(*batch(step, micro, 0))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        with GatheredParameters(engine):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        engine.close()
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for n, ref in ref_weights.items():
        err = (weights[n] - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-5, f"{n}: relative difference {err:.2e}"
    for n, before in start.items():
        assert torch.equal(weights[n], before), f"frozen {n} changed"


def _plan(model, cfg):
    z = cfg["zero_optimization"]
    setting = ZeroSetting(
        z["stage"],
        z.get("offload_param", {}).get("device", "none"),
        z.get("offload_optimizer", {}).get("device", "none"),
    )
    est = estimate_memory(model, config=cfg, device="cpu", machine=False, settings=[setting])
    return est.settings[0].breakdown


def test_only_trainable_units_have_optimizer_state_on_nvme(nvme_dir):
    """The optimizer's swap files hold m, v and g (fp32 stage 3: the shard is its own master) of the
    trainable units only: exactly the plan's reserve, as the estimate itemises it, and 12 B per
    trainable parameter, not per parameter."""
    cfg = engine_config(3, "nvme", "nvme", nvme_dir, gas=GAS)
    model = frozen_gpt()
    plan = _plan(model, cfg)
    rt = plan.runtime
    trainable = [u for u in rt.units if u.trainable]
    frozen = [u for u in rt.units if not u.trainable]
    assert frozen and trainable
    numel = sum(u.layout.shard_numel for u in trainable)
    assert rt.state_store.reserve_nbytes == 12 * numel
    assert {i for g in rt.optimizer.sub_groups for i in g} == {u.index for u in trainable}
    adam = next(i for i in plan.items if i.name == "Adam moments m, v")
    assert adam.nbytes == 8 * numel
    engine = infinity.initialize(model, cfg)
    try:
        (opt_dir,) = swap_dirs(nvme_dir, "optimizer")
        files = sum(
            f.stat().st_blocks * 512 for f in opt_dir.iterdir() if f.name != "infinity.lock"
        )
        reserved = swap_nbytes(rt.state_store.reserve_nbytes, cfg["aio"]["block_size"])
        # st_blocks may count a file-system extent block besides the data (the estimate's swap directory)
        assert reserved <= files <= reserved + swap_dir_overhead_nbytes(reserved)
        (param_dir,) = swap_dirs(nvme_dir, "params")
        on_disk = disk_nbytes(opt_dir) + disk_nbytes(param_dir)
        assert on_disk <= plan.nvme_nbytes <= 1.15 * on_disk
        assert sorted(engine.optimizer.state_store.keys()) == sorted(
            (u.index, k) for u in trainable for k in ("m", "v", "g")
        )
    finally:
        engine.close()


@pytest.mark.parametrize("with_optimizer_section", [False, True])
def test_a_frozen_model_needs_no_optimizer_and_allocates_no_state(with_optimizer_section, nvme_dir):
    """A teacher (every parameter frozen) under stage 3 with both offloads on NVMe, in the training engine:
    it needs no optimizer; there is no optimizer store, pool or swap file (nor with an optimizer section:
    it has nothing to hold); the estimate agrees; forward gives plain PyTorch's losses; step() updates
    nothing. (infinity.initialize with no optimizer at stage 3 builds the inference engine instead:
    tests/inference.)"""
    cfg = engine_config(3, "nvme", "nvme", nvme_dir, gas=1)
    if not with_optimizer_section:
        del cfg["optimizer"]
    teacher = frozen_gpt(None)
    plain = frozen_gpt(None)
    plan = _plan(teacher, cfg)
    assert plan.runtime.optimizer is None and plan.runtime.state_store is None
    assert not [
        i for i in plan.items if "optimizer" in i.name or "Adam" in i.name or "master" in i.name
    ]
    assert plan.nvme_nbytes == sum(
        i.nbytes for i in plan.items if i.resource == "nvme" and i.name.startswith("parameter")
    )
    engine = infinity.engine.initialize(teacher, cfg)
    try:
        assert isinstance(engine, infinity.Engine)
        assert engine.optimizer is None and engine.runtime.state_store is None
        assert swap_dirs(nvme_dir, "optimizer") == []
        (param_dir,) = swap_dirs(nvme_dir, "params")
        assert disk_nbytes(param_dir) <= plan.nvme_nbytes <= 1.15 * disk_nbytes(param_dir)
        for step in range(3):
            x, y = batch(step, 0, 0)
            with torch.no_grad():
                assert engine(x, y).item() == pytest.approx(plain(x, y).item(), rel=1e-6)
            engine.step()
        assert engine.global_steps == 3 and engine.get_lr() == []
        with GatheredParameters(engine):
            for (n, p), q in zip(teacher.named_parameters(), plain.parameters(), strict=True):
                assert torch.equal(p, q), n
    finally:
        engine.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_frozen_model_runs_at_stages_0_to_2_without_an_optimizer(stage, nvme_dir):
    cfg = engine_config(stage, "none", "nvme" if stage else "none", nvme_dir, gas=1)
    del cfg["optimizer"]
    teacher, plain = frozen_gpt(None), frozen_gpt(None)
    engine = infinity.initialize(teacher, cfg)
    try:
        assert engine.optimizer is None and swap_dirs(nvme_dir, "optimizer") == []
        x, y = batch(0, 0, 0)
        with torch.no_grad():
            assert engine(x, y).item() == pytest.approx(plain(x, y).item(), rel=1e-6)
        engine.step()
    finally:
        engine.close()


def test_a_model_with_trainable_parameters_still_needs_an_optimizer(nvme_dir):
    cfg = engine_config(3, "nvme", "nvme", nvme_dir, gas=1)
    del cfg["optimizer"]
    with pytest.raises(ValueError, match="no optimizer"):
        infinity.engine.initialize(frozen_gpt(), cfg)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_frozen_parameter_changed_under_gathered_parameters_keeps_the_change(dtype, nvme_dir):
    """A frozen unit has no fp32 master: the change lives in its parameter shard, and training steps
    (which update only the trainable units) leave it as written."""
    cfg = engine_config(3, "nvme", "nvme", nvme_dir, gas=1)
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    model = frozen_gpt()
    engine = infinity.initialize(model, cfg)
    try:
        with GatheredParameters(model.wte.weight, modifier_rank=0):
            model.wte.weight[3].fill_(0.25)
        for step in range(2):
            loss = engine(*batch(step, 0, 0))
            engine.backward(loss)
            engine.step()
        with GatheredParameters(model.wte.weight):
            assert torch.all(model.wte.weight[3] == 0.25)
    finally:
        engine.close()


def test_a_partially_frozen_model_checkpoints_its_frozen_units_once(nvme_dir, tmp_path):
    """The frozen units (no file holds them) are saved once, as weights: a fresh engine whose every unit
    starts elsewhere loads them back, and the export holds them ([Note: frozen units in a checkpoint])."""
    import safetensors.torch

    from infinity.engine.checkpoint import export_checkpoint

    cfg = engine_config(3, "nvme", "nvme", nvme_dir, gas=1)
    engine = infinity.initialize(frozen_gpt(), cfg)
    try:
        x, y = batch(0, 0, 0)
        engine.backward(engine(x, y))
        engine.step()
        engine.save_checkpoint(tmp_path / "ckpt")
        with GatheredParameters(engine):
            want = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    finally:
        engine.close()
    other = infinity.initialize(frozen_gpt(seed=1), cfg)
    try:
        other.load_checkpoint(tmp_path / "ckpt")
        with GatheredParameters(other):
            got = {n: p.detach().clone() for n, p in other.module.named_parameters()}
    finally:
        other.close()
    exported = safetensors.torch.load_file(
        export_checkpoint(tmp_path / "ckpt", tmp_path / "m.safetensors")
    )
    assert got.keys() == want.keys() and set(FROZEN) < set(want)
    for n, w in want.items():
        assert torch.equal(got[n], w) and torch.equal(exported[n], w), n
