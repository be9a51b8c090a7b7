"""The placement planner against brute force: no placement within the budget moves fewer bytes.

Oracle: every assignment of the "auto" sections' arrays to host memory or NVMe
is enumerated; each is made into a RuntimePlan and itemised by the estimator
(what the pre-flight check holds the budget to), and its NVMe bytes per step
are counted here from the traffic table in words (parameter shards read by the
forward and backward of each micro-batch but the first forward, and by the step
when fp32; written once; master, m, v read and written once; g once each way
per micro-batch) — not by infinity.estimate.traffic. The cheapest assignment
that fits must cost what the planner's plan costs, and the planner's plan must
fit. The knapsack underneath is checked the same way on bare numbers.
"""

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from infinity.config import ConfigError, load_config
from infinity.estimate.budget import check_budget, default_budget, resolve_budget
from infinity.estimate.context import RunContext
from infinity.estimate.knapsack import Candidate, choose, total_value
from infinity.estimate.machine import MachineView
from infinity.estimate.model import describe_model
from infinity.estimate.placement import PARAM, auto_sizes, candidates, place_in_budget
from infinity.estimate.runtime_plan import Placement, cut_units, plan_runtime
from infinity.models import GPT, GPTConfig

GiB = 1 << 30


# -- the knapsack on bare numbers --------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    items=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 5)), max_size=10),
    capacity=st.integers(0, 60),
)
def test_knapsack_equals_brute_force(items, capacity):
    cands = [Candidate(4096 * w, 4096 * w * r, (i,)) for i, (w, r) in enumerate(items)]
    cap = 4096 * capacity
    kept = choose(cands, cap)
    assert sum(cands[i].weight for i in kept) <= cap
    best = 0
    for mask in itertools.product((0, 1), repeat=len(cands)):
        if sum(c.weight for c, m in zip(cands, mask, strict=True) if m) <= cap:
            best = max(best, sum(c.value for c, m in zip(cands, mask, strict=True) if m))
    assert total_value(cands, kept) == best


@settings(max_examples=100, deadline=None)
@given(
    items=st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 9)), min_size=1, max_size=10),
    capacity=st.integers(0, 20000),
)
def test_knapsack_values_need_not_follow_weights(items, capacity):
    """Arbitrary values and weights (not multiples of 4 KiB): still exact."""
    cands = [Candidate(w, v, ()) for w, v in items]
    kept = choose(cands, capacity)
    assert sum(cands[i].weight for i in kept) <= capacity
    best = max(
        sum(c.value for c, m in zip(cands, mask, strict=True) if m)
        for mask in itertools.product((0, 1), repeat=len(cands))
        if sum(c.weight for c, m in zip(cands, mask, strict=True) if m) <= capacity
    )
    assert total_value(cands, kept) == best


def test_knapsack_ties_keep_the_lower_priority_first():
    cands = [
        Candidate(4096, 8192, (1, 0)),
        Candidate(4096, 8192, (0, 5)),
        Candidate(4096, 8192, (0, 2)),
    ]
    assert choose(cands, 8192) == {1, 2}


def test_knapsack_on_a_coarse_grid_still_fits_and_nearly_optimal():
    """Thousands of distinct sizes force a coarser grid: weights round up, so the choice fits, and it
    stays within 0.5% of the fractional (LP) bound, which no choice can beat."""
    import random

    rng = random.Random(0)
    cands = [Candidate(4096 * rng.randint(100, 5000), 0, (i,)) for i in range(3000)]
    cands = [Candidate(c.weight, c.weight * rng.choice([2, 3, 4]), c.priority) for c in cands]
    cap = sum(c.weight for c in cands) // 3
    kept = choose(cands, cap)
    assert sum(cands[i].weight for i in kept) <= cap
    lp, room = 0.0, cap
    for c in sorted(cands, key=lambda c: -c.value / c.weight):
        take = min(1.0, room / c.weight)
        lp += take * c.value
        room -= take * c.weight
        if room <= 0:
            break
    assert total_value(cands, kept) >= 0.995 * lp


# -- the planner on small models --------------------------------------------------------------


def _config(stage, param, optimizer, *, dtype="fp32", gas=1, budget=None, nvme="/nonexistent/nvme"):
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if param != "none":
        zero["offload_param"] = {"device": param, "nvme_path": nvme}
    if optimizer != "none":
        zero["offload_optimizer"] = {"device": optimizer, "nvme_path": nvme}
    raw = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "zero_optimization": zero,
    }
    if dtype != "fp32":
        raw[dtype] = {"enabled": True}
    if budget is not None:
        raw["host_memory_budget"] = budget
    return load_config(raw)


def _traffic(plan, gas):
    """NVMe bytes per step, from the table in the module docstring (the oracle's own count)."""
    fp32_params = plan.dtype == torch.float32 and plan.stage == 3
    total = 0
    for sp, u in zip(plan.shards, plan.units, strict=True):
        if sp.param_home == "nvme":
            reads = 2 * gas if fp32_params else 2 * gas - 1
            total += (reads + 1) * u.layout.shard_nbytes
        for key, home in sp.state_homes:
            if home == "nvme":
                total += (2 * gas if key == "g" else 2) * 4 * sp.numel
    return total


def _ctx(model, world_size=1):
    return RunContext(
        spec=describe_model(model),
        held_nbytes=0,
        zero_init=False,
        activations=None,
        device_type="cpu",
        world_size=world_size,
        ranks_per_node=1,
    )


def _enumerate(model, cfg, ctx):
    """(host need, traffic) of every assignment of the "auto" arrays to host memory or NVMe."""
    unit_map = cut_units(model, cfg, world_size=1, device=torch.device("meta"))
    sized, _ = auto_sizes(model, cfg, unit_map, 1)
    base = plan_runtime(model, sized, world_size=1, unit_map=unit_map)
    arrays = [(c.index, c.cls) for c in candidates(base, sized)]
    out = []
    for homes in itertools.product(("cpu", "nvme"), repeat=len(arrays)):
        plan = plan_runtime(
            model,
            sized,
            world_size=1,
            unit_map=unit_map,
            placement=Placement(dict(zip(arrays, homes, strict=True))),
        )
        out.append(
            (
                ctx.host_need(ctx.itemise(sized, plan)),
                _traffic(plan, cfg.gradient_accumulation_steps),
            )
        )
    return out


class Stack(nn.Module):
    """A chain of Linear layers of the given widths (one unit each, with its bias)."""

    def __init__(self, widths):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False)
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


SECTIONS = [  # (stage, offload_param, offload_optimizer): which sections the planner decides
    (3, "auto", "auto"),
    (3, "auto", "cpu"),
    (3, "nvme", "auto"),
    (3, "none", "auto"),
    (2, "none", "auto"),
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    widths=st.lists(st.sampled_from([16, 48, 96, 160]), min_size=2, max_size=3),
    sections=st.sampled_from(SECTIONS),
    dtype=st.sampled_from(["fp32", "bf16"]),
    gas=st.sampled_from([1, 2]),
    where=st.floats(-0.1, 1.1),
)
def test_planner_equals_brute_force(widths, sections, dtype, gas, where):
    """Budgets from below what everything on NVMe needs to above what everything in host memory
    needs: the planner's traffic is the least any fitting assignment has."""
    stage, param, optimizer = sections
    torch.manual_seed(0)
    model = Stack(widths)
    cfg = _config(stage, param, optimizer, dtype=dtype, gas=gas)
    ctx = _ctx(model)
    every = _enumerate(model, cfg, ctx)
    needs = [n for n, _ in every]
    budget = int(min(needs) + where * (max(needs) - min(needs)))
    plan = place_in_budget(model, cfg, ctx, budget_nbytes=budget, budget_source="test")
    assert plan.chosen.need_nbytes == ctx.host_need(ctx.itemise(cfg, plan))
    fitting = [t for n, t in every if n <= budget]
    if (
        not fitting
    ):  # nothing fits: the planner's plan needs the least there is (the refusal says so)
        assert plan.chosen.need_nbytes == min(needs) > budget
        return
    assert plan.chosen.need_nbytes <= budget
    assert _traffic(plan, gas) == min(fitting)


def test_planner_on_a_gpt_spends_the_budget_on_parameters_first():
    """fp32 stage 3: a parameter shard saves 16 B per 4 B kept (forward, backward and step reads, the
    write), any optimizer array 8 B: with room for the parameters and a little more, all parameters
    are kept and the rest goes to optimizer arrays; more budget never costs more traffic."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=64))
    cfg = _config(3, "auto", "auto")
    ctx = _ctx(model)
    low = place_in_budget(model, cfg, ctx, budget_nbytes=0, budget_source="test")
    floor = low.chosen.need_nbytes
    params = low.state_nbytes(PARAM)
    traffic = []
    for extra in (0, params // 2, params + 300_000, params + 10**9):
        plan = place_in_budget(model, cfg, ctx, budget_nbytes=floor + extra, budget_source="test")
        assert plan.chosen.need_nbytes <= floor + extra
        traffic.append(_traffic(plan, 1))
        if extra == params + 300_000:
            assert plan.state_nbytes(PARAM, "nvme") == 0
            # the rest, and the parameter pool no longer needed, holds optimizer arrays
            pool = low.param_store.pool.capacity_nbytes
            kept = sum(plan.state_nbytes(k, "cpu") for k in ("m", "v", "g"))
            assert 300_000 - 4 * 4096 * 16 < kept <= 300_000 + pool
    assert traffic == sorted(traffic, reverse=True) and traffic[-1] == 0 < traffic[0]


# -- the budget -------------------------------------------------------------------------------


def _machine(avail):
    return MachineView(
        mem_total_nbytes=2 * avail,
        mem_available_nbytes=avail,
        hugetlb_free_nbytes=0,
        cpu_count=2,
        gpus=(),
        disks=(),
        self_rss_nbytes=0,
    )


def test_the_budget_from_the_config_or_the_machine():
    m = _machine(20 * GiB)
    assert default_budget(m, 1)[0] == 18 * GiB  # less 10%
    assert default_budget(_machine(3 * GiB), 1)[0] == 3 * GiB - (
        512 << 20
    )  # at least 512 MiB kept free
    assert default_budget(m, 4)[0] == 5 * GiB - (512 << 20)  # per rank, the margin is per rank too
    assert resolve_budget(_config(3, "auto", "auto", budget="50%"), m, 1)[0] == 10 * GiB
    assert resolve_budget(_config(3, "auto", "auto", budget=0.25), m, 2)[0] == int(0.25 * 10 * GiB)
    nbytes, source = resolve_budget(_config(3, "auto", "auto", budget="3GiB"), m, 1)
    assert nbytes == 3 * GiB and "host_memory_budget='3GiB'" in source
    assert resolve_budget(_config(3, "auto", "auto", budget=5e9), m, 1)[0] == 5 * 10**9


def test_a_budget_below_what_everything_on_nvme_needs_is_refused_naming_the_key():
    torch.manual_seed(0)
    model = Stack([64, 64])
    cfg = _config(3, "auto", "auto", budget="1MiB")
    ctx = _ctx(model)
    plan = place_in_budget(model, cfg, ctx, budget_nbytes=1 << 20, budget_source="test")
    with pytest.raises(
        ConfigError,
        match=r"host_memory_budget='1MiB' gives 1\.0 MiB .* raise host_memory_budget to at "
        r"least",
    ):
        check_budget(plan, cfg)
    # the default budget is judged by the pre-flight check instead: not refused here
    check_budget(plan, _config(3, "auto", "auto"))
