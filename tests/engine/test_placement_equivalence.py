"""Every placement the planner can choose trains like plain PyTorch: where state rests is never a change of math.

Placements are forced per state class (one class on NVMe, the rest in host
memory, and the reverse), per unit (alternate units on NVMe) and per
(unit, class) at random, through sections whose device is "auto"; the
planner's own choices are taken at budgets from nothing to everything. The
oracles are those of test_equivalence.py (fp32: torch AdamW, 1e-5) and
test_precision.py (bf16: mixed precision by hand, within bf16's rounding).
"""

import random

import pytest
import torch

from infinity.estimate.runtime_plan import PARAM, STATE_KEYS, Placement
from tests.engine.reference import engine_config, engine_run, reference_mixed_run, reference_run
from tests.engine.test_equivalence import assert_equivalent

STEPS, GAS = 6, 2


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = reference_run(model, steps=STEPS, gas=GAS, world_size=1)
        return cache[model]

    return get


def only(*on_nvme):
    """The classes named on NVMe, every other class in host memory, for every unit."""

    def placement(units):
        return Placement(
            {
                (u.index, c): "nvme" if c in on_nvme else "cpu"
                for u in units
                for c in (PARAM, *STATE_KEYS)
            }
        )

    return placement


def alternate(units):
    """Every class of even units on NVMe, of odd units in host memory."""
    return Placement(
        {
            (u.index, c): "nvme" if u.index % 2 == 0 else "cpu"
            for u in units
            for c in (PARAM, *STATE_KEYS)
        }
    )


def scattered(seed):
    def placement(units):
        rng = random.Random(seed)
        return Placement(
            {(u.index, c): rng.choice(("cpu", "nvme")) for u in units for c in (PARAM, *STATE_KEYS)}
        )

    return placement


FORCED = {
    "param": only(PARAM),
    "m": only("m"),
    "v": only("v"),
    "g": only("g"),
    "all-but-param": only("m", "v", "g"),
    "alternate-units": alternate,
    "scattered-1": scattered(1),
    "scattered-2": scattered(2),
}


def _homes(engine):
    """(unit, class) -> home of what the engine registered: the stores' own records."""
    rt = engine.runtime
    out = {(k[0], k[1]): rt.state_store.spec(k).home for k in rt.state_store.keys()}
    if rt.param_store is not None:
        out.update({(u.index, PARAM): rt.param_store.spec(u.key).home for u in rt.unit_map.units})
    return out


@pytest.mark.parametrize("model", ["gpt", "twice", "alternating"])
@pytest.mark.parametrize("forced", list(FORCED))
def test_forced_placements_fp32_stage3(model, forced, nvme_dir, reference):
    cfg = engine_config(3, "auto", "auto", nvme_dir, gas=GAS)
    losses, weights = engine_run(model, cfg, steps=STEPS, gas=GAS, placement=FORCED[forced])
    assert_equivalent(losses, weights, *reference(model))


@pytest.mark.parametrize("forced", ["param", "m", "g", "scattered-1"])
@pytest.mark.parametrize("stage", [1, 2])
def test_forced_placements_optimizer_only(stage, forced, nvme_dir, reference):
    """Stages 1-2: the fp32 master is an array of its own, placed like m, v and g."""
    cfg = engine_config(stage, "none", "auto", nvme_dir, gas=GAS)
    placement = FORCED[forced] if forced != "param" else only("master")
    losses, weights = engine_run("gpt", cfg, steps=STEPS, gas=GAS, placement=placement)
    assert_equivalent(losses, weights, *reference("gpt"))


@pytest.mark.parametrize("forced", ["param", "master", "g", "alternate-units", "scattered-2"])
def test_forced_placements_bf16(forced, nvme_dir):
    """bf16 stage 3: the 16-bit shard and its fp32 master are placed apart."""
    cfg = engine_config(3, "auto", "auto", nvme_dir, gas=GAS)
    cfg["bf16"] = {"enabled": True}
    ref_losses, ref_masters = reference_mixed_run("gpt", torch.bfloat16, steps=STEPS, gas=GAS)
    placement = FORCED[forced] if forced != "master" else only("master")
    losses, weights = engine_run("gpt", cfg, steps=STEPS, gas=GAS, placement=placement)
    for k, ref in ref_losses.items():
        assert losses[k] == pytest.approx(ref, rel=1e-4), k
    for name, master in ref_masters.items():
        torch.testing.assert_close(weights[name], master.to(torch.bfloat16), msg=name)


def test_the_engine_registers_the_forced_homes(nvme_dir):
    from tests.engine.models import MODELS
    from tests.engine.reference import _forced

    cfg = engine_config(3, "auto", "auto", nvme_dir, gas=1)
    torch.manual_seed(0)
    engine = _forced(MODELS["gpt"](), cfg, scattered(3))
    try:
        plan = engine.runtime.plan
        want = {(sp.index, k): h for sp in plan.shards for k, h in sp.state_homes}
        want.update({(sp.index, PARAM): sp.param_home for sp in plan.shards})
        got = _homes(engine)
        assert got == want
        persistent = {u.index for u in plan.units if u.persistent}
        chosen = scattered(3)(plan.units)
        # the forced homes, but for persistent units' parameters, which stay in host memory
        assert {k: h for k, h in got.items() if not (k[1] == PARAM and k[0] in persistent)} == {
            k: chosen.home(*k) for k in got if not (k[1] == PARAM and k[0] in persistent)
        }
        assert {"cpu", "nvme"} <= set(got.values())
    finally:
        engine.close()


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.7, 1.5])
def test_the_planners_choices_at_several_budgets(fraction, nvme_dir, reference):
    """The planner's own placement (through initialize) at budgets from what everything on NVMe needs
    (fraction 0) to more than what everything in host memory needs (fraction 1): same losses and
    weights every time."""
    from infinity.config import load_config
    from infinity.estimate.context import run_context
    from infinity.estimate.placement import place_in_budget
    from tests.engine.models import MODELS

    cfg = engine_config(3, "auto", "auto", nvme_dir, gas=GAS)
    torch.manual_seed(0)
    probe = MODELS["gpt"]()
    ctx = run_context(probe, load_config(cfg), device="cpu", world_size=1)
    low = place_in_budget(probe, load_config(cfg), ctx, budget_nbytes=0, budget_source="probe")
    high = place_in_budget(
        probe, load_config(cfg), ctx, budget_nbytes=1 << 40, budget_source="probe"
    )
    lo, hi = low.chosen.need_nbytes, high.chosen.need_nbytes
    cfg["host_memory_budget"] = int(lo + fraction * (hi - lo)) + 1
    seen = {}
    losses, weights = engine_run(
        "gpt", cfg, steps=STEPS, gas=GAS, inspect=lambda e: seen.update(_homes(e))
    )
    assert_equivalent(losses, weights, *reference("gpt"))
    spilled = {k for k, h in seen.items() if h == "nvme"}
    if fraction >= 1:
        assert not spilled  # everything fits in host memory
    elif fraction > 0:
        assert spilled and len(spilled) < len(seen)  # a mix
    else:
        assert {k for k in seen if k[1] != PARAM} <= spilled  # all the optimizer's arrays on NVMe
