"""The plan against a built runtime: the estimator's RuntimePlan is the engine's, and the engine's objects are it.

Each case builds a real engine (infinity.initialize, in this process) and
checks, through the runtime's own objects — its stores' pools, keys, homes and
swap files, its optimizer's sub-groups, its cache, its scheduler's budgets —
that it allocated what the estimate's RuntimePlan says, and that the
estimate's items add up to what those objects hold.
"""

import dataclasses

import pytest
import torch

import infinity
from infinity.config import load_config
from infinity.estimate import ZeroSetting, estimate_memory, plan_runtime, rules
from infinity.estimate.runtime_plan import cut_units, param_homes
from infinity.memory import format_nbytes
from infinity.models import GPT, GPTConfig

MODEL = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=64)


def _config(stage, p="none", o="none", *, dtype="fp32", nvme=None, grads_in_host=False, **zero):
    z = {"stage": stage, **zero}
    if p == "auto":
        z["offload_param"] = {"device": p, "nvme_path": str(nvme)}
    elif p != "none":
        z["offload_param"] = {
            "device": p,
            "nvme_path": str(nvme),
            "buffer_count": 4,
            "buffer_size": 1 << 16,
            "max_in_cpu": 0,
        }
    if o != "none":
        z["offload_optimizer"] = {
            "device": o,
            "nvme_path": str(nvme),
            "grads_in_host": grads_in_host,
        }
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": z,
    }
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    return cfg


CASES = {
    "stage0-fp32": dict(stage=0),
    "stage1-cpu": dict(stage=1, o="cpu"),
    "stage2-bf16-nvme": dict(stage=2, o="nvme", dtype="bf16", sub_group_size=20_000),
    "stage3-bf16-nvme-nvme": dict(
        stage=3,
        p="nvme",
        o="nvme",
        dtype="bf16",
        sub_group_size=20_000,
        stage3_param_persistence_threshold=200,
    ),
    "stage3-fp32-cpu-nvme": dict(stage=3, p="cpu", o="nvme", sub_group_size=20_000),
    "stage3-fp32-cpu-cpu": dict(stage=3, p="cpu", o="cpu"),
    "stage3-fp32-nvme-nvme-grads-in-host": dict(
        stage=3, p="nvme", o="nvme", sub_group_size=20_000, grads_in_host=True
    ),
    "stage1-bf16-nvme-grads-in-host": dict(
        stage=1, o="nvme", dtype="bf16", sub_group_size=20_000, grads_in_host=True
    ),
    "stage3-fp16-nvme-cpu": dict(stage=3, p="nvme", o="cpu", dtype="fp16", sub_group_size=20_000),
    # The placement planner's choice within a budget that holds part of the state (see _config).
    "stage3-fp32-auto-auto": dict(stage=3, p="auto", o="auto", budget=True),
    "stage3-bf16-auto-auto": dict(stage=3, p="auto", o="auto", dtype="bf16", budget=True),
    "stage3-fp32-nvme-auto": dict(stage=3, p="nvme", o="auto", sub_group_size=20_000, budget=True),
    "stage2-fp32-auto": dict(stage=2, o="auto", budget=True),
}


def _partial_budget(model, raw) -> int:
    """Halfway between what the run needs with every "auto" array on NVMe and with all in host memory:
    the planner then keeps some and spills the rest."""
    from infinity.estimate.activations import gpt_activations
    from infinity.estimate.context import RunContext
    from infinity.estimate.model import describe_model
    from infinity.estimate.placement import place_in_budget

    cfg = load_config(raw)
    spec = describe_model(model)
    acts = gpt_activations(
        spec.gpt, micro_batch=1, seq=MODEL.seq_len, itemsize=2 if cfg.bf16.enabled else 4
    )
    ctx = RunContext(spec, spec.built_nbytes, False, acts, "cpu", 1, 1)
    lo, hi = (
        place_in_budget(model, cfg, ctx, budget_nbytes=b, budget_source="").chosen.need_nbytes
        for b in (0, 1 << 50)
    )
    assert lo < hi
    return (lo + hi) // 2


def _items(breakdown, name_prefix, resource=None):
    return sum(
        i.nbytes
        for i in breakdown.items
        if i.name.startswith(name_prefix) and (resource is None or i.resource == resource)
    )


DECISIONS = (
    "shards",
    "param_store",
    "state_store",
    "optimizer",
    "swap_reserves",
    "tensor_cache_cap_nbytes",
    "staging_numel",
    "schedule",
    "param_pool_refusal",
    "warnings",
    "gradient_accumulation_steps",
    "chosen",
    "zero",
)
"""Every RuntimePlan field but the units themselves (another model's) and the device (meta for an estimate)."""


def _estimate(model, cfg, stage):
    z = cfg["zero_optimization"]
    setting = ZeroSetting(
        stage,
        z.get("offload_param", {}).get("device", "none"),
        z.get("offload_optimizer", {}).get("device", "none"),
    )
    # activations as initialize counts them (they take from an "auto" placement's budget)
    est = estimate_memory(
        model,
        config=cfg,
        device="cpu",
        machine=False,
        baseline_nbytes=0,
        settings=[setting],
        micro_batch=cfg["train_micro_batch_size_per_gpu"],
    )
    return est.settings[0].breakdown


def _check_pool(store, pool_plan, plan, item):
    """A store's pool is the plan's, and maps what the estimate's item says."""
    pool = store.pool
    assert (pool.name, pool.count, pool.capacity) == (
        pool_plan.name,
        pool_plan.count,
        pool_plan.capacity_nbytes,
    )
    assert rules.mapped_nbytes(pool.capacity, huge_pages=True) == _items(plan, item)


@pytest.mark.parametrize("case", list(CASES))
def test_plan_matches_a_built_runtime(case, nvme_dir):
    kw = dict(CASES[case])
    stage = kw.pop("stage")
    partial = kw.pop("budget", False)
    cfg = _config(
        stage,
        kw.pop("p", "none"),
        kw.pop("o", "none"),
        dtype=kw.pop("dtype", "fp32"),
        nvme=nvme_dir,
        **kw,
    )
    torch.manual_seed(0)
    model = GPT(MODEL)
    if partial:
        cfg["host_memory_budget"] = _partial_budget(model, cfg)
    plan = _estimate(model, cfg, stage)
    est = plan.runtime
    engine = infinity.initialize(model, cfg)
    try:
        rt = engine.runtime
        units = rt.unit_map.units
        # The engine allocated from the same decisions the estimate itemised.
        assert {f: getattr(rt.plan, f) for f in DECISIONS} == {
            f: getattr(est, f) for f in DECISIONS
        }
        assert [(u.module_name, u.layout.shard_numel, u.persistent) for u in est.units] == [
            (u.module_name, u.layout.shard_numel, u.persistent) for u in units
        ]
        # Optimizer state: the plan's keys per shard, at the plan's homes; host tensors or reserved swap.
        state = rt.state_store
        opt = est.optimizer
        assert sorted(state.keys()) == sorted((u.index, k) for u in units for k in opt.state_keys)
        assert all(state.spec(k).home == est.shards[k[0]].state_home(k[1]) for k in state.keys())
        specs = [state.spec(k) for k in state.keys()]
        opt_names = ("fp32 master weights", "Adam moments m, v", "gradient partitions (fp32)")
        assert sum(s.nbytes for s in specs if s.home == "cpu") == sum(
            _items(plan, n, "host") for n in opt_names
        )
        assert sum(s.nbytes for s in specs if s.home == "nvme") == sum(
            _items(plan, n, "nvme") for n in opt_names
        )
        assert state.stats().swap_capacity == (
            _items(plan, "", "nvme")
            - _items(plan, "parameter swap")
            - _items(plan, "optimizer swap directory")
        )
        _check_pool(state, est.state_store.pool, plan, "optimizer pool")
        assert [[s.index for s in g] for g in rt.optimizer.sub_groups] == [
            list(g) for g in opt.sub_groups
        ]
        if partial:  # a mix, as the planner chose it within the budget
            homes = {h for sp in est.shards for _, h in sp.state_homes}
            homes |= {
                sp.param_home
                for sp in est.shards
                if sp.param_home and not units[sp.index].persistent
            }
            assert homes == {"cpu", "nvme"} and est.chosen.need_nbytes <= cfg["host_memory_budget"]
        # Parameters: stage 3 shards at the plan's homes in the parameter store; else resident in the module.
        if stage == 3:
            ps = rt.param_store
            assert {u.key: est.shards[u.index].param_home for u in units} == {
                k: ps.spec(k).home for k in ps.keys()
            }
            pspecs = [ps.spec(k) for k in ps.keys()]
            assert sum(s.nbytes for s in pspecs if s.home == "cpu") == _items(
                plan, "parameter shards in host memory"
            )
            assert ps.stats().swap_capacity == _items(plan, "parameter swap files")
            _check_pool(ps, est.param_store.pool, plan, "parameter pool")
            assert rt.shard_source.budget == est.schedule.budget
        else:
            resident = sum(p.numel() * p.element_size() for p in model.parameters())
            assert resident == _items(plan, "parameters in the module")
        assert rt.cache.cap_nbytes == est.tensor_cache_cap_nbytes
    finally:
        engine.close()


def test_flat_buffer_peak_matches_the_cache_after_training(nvme_dir):
    """Stage 1 accumulates every unit's grads in fp32 buffers from the cache and puts them back
    (with the shard buffers of the reduce) at the window's end."""
    torch.manual_seed(0)
    model = GPT(MODEL)
    cfg = _config(1, o="cpu")
    est = estimate_memory(
        model,
        config=cfg,
        device="cpu",
        machine=False,
        baseline_nbytes=0,
        settings=[ZeroSetting(1, "none", "cpu")],
    )
    engine = infinity.initialize(model, cfg)
    try:
        x = torch.randint(0, MODEL.vocab_size, (1, 16))
        for _ in range(2):
            engine.backward(engine(x, x))
            engine.step()
        cache = engine.runtime.cache
        cached = sum(t.numel() * t.element_size() for b in cache._free.values() for t in b)
        plan = est.settings[0].breakdown
        assert 0 < cached <= _items(plan, "flat buffers") + _items(plan, "gradient accumulators")
        assert _items(plan, "gradient accumulators") == 4 * sum(
            u.layout.padded_numel for u in engine.runtime.unit_map.units
        )
    finally:
        engine.close()


def test_sub_groups_are_the_optimizers_and_their_pool_need_its_keys(nvme_dir):
    """The plan's sub-groups are the ones the optimizer steps through, and the parameter-pool bytes
    planned per sub-group are those of its NVMe keys in the parameter store (the step fetches a whole
    sub-group before it updates any of it)."""
    torch.manual_seed(0)
    cfg = _config(
        3,
        "nvme",
        "nvme",
        nvme=nvme_dir,
        sub_group_size=5000,
        stage3_param_persistence_threshold=200,
    )
    engine = infinity.initialize(GPT(MODEL), cfg)
    try:
        rt = engine.runtime
        groups = [[s.index for s in g] for g in rt.optimizer.sub_groups]
        assert groups == [list(g) for g in rt.plan.optimizer.sub_groups] and len(groups) > 2
        ps, units = rt.param_store, rt.unit_map.units
        # (shards are 4 KiB-padded: a key's pool region is its size)
        held = [
            sum(ps.spec(units[i].key).nbytes for i in g if ps.spec(units[i].key).home == "nvme")
            for g in groups
        ]
        assert rt.plan.sub_group_param_nbytes() == held
        assert rt.plan.param_store.pool.need_nbytes >= max(held)
        # A group never splits a shard: each shard larger than the limit is a group of its own.
        assert len(rt.plan.sub_group_param_nbytes(1)) == len(units)
    finally:
        engine.close()


def test_swap_growth_follows_the_swap_space(nvme_dir):
    """zero.Init's store grows its files on demand; rules.swap_growth_nbytes mirrors SwapSpace.alloc."""
    from infinity.memory import BufferPool
    from infinity.store import TieredStore

    sizes = [5000, 70_000, 1 << 20, 3 << 20, 4096, 9 << 20]
    with TieredStore(nvme_dir, pool=BufferPool(1, 1 << 20), name="growth") as store:
        for i, n in enumerate(sizes):
            store.register(("k", i), (n,), torch.uint8)
        assert store.stats().swap_capacity == rules.swap_growth_nbytes(
            sizes, store._rio.config.block_size
        )


def test_swap_growth_over_several_drives_follows_the_swap_space(nvme_dir):
    """Striped over two drives, the files grow in whole stripes: one block on each drive."""
    from infinity.memory import BufferPool
    from infinity.store import TieredStore

    drives = [nvme_dir / "d0", nvme_dir / "d1"]
    for d in drives:
        d.mkdir()
    sizes = [5000, 70_000, 1 << 20, 3 << 20, 4096, 9 << 20]
    with TieredStore(drives, pool=BufferPool(1, 1 << 20), name="growth") as store:
        for i, n in enumerate(sizes):
            store.register(("k", i), (n,), torch.uint8)
        assert store.stats().swap_capacity == rules.swap_growth_nbytes(
            sizes, store._rio.config.block_size, 2
        )
        assert [_file_nbytes(d) for d in store.directories] == [
            store.stats().swap_capacity // 2
        ] * 2


def test_the_estimate_gives_each_drive_the_swap_files_the_runtime_puts_there(nvme_dir):
    drives = [nvme_dir / "d0", nvme_dir / "d1"]
    for d in drives:
        d.mkdir()
    cfg = _config(
        3,
        "nvme",
        "nvme",
        nvme=nvme_dir,
        sub_group_size=20_000,
        stage3_param_persistence_threshold=200,
    )
    for section in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][section]["nvme_path"] = [str(d) for d in drives]
    torch.manual_seed(0)
    model = GPT(MODEL)
    est = estimate_memory(
        model,
        config=cfg,
        device="cpu",
        machine=False,
        baseline_nbytes=0,
        settings=[ZeroSetting(3, "nvme", "nvme")],
    )
    by_path = dict(est.settings[0].breakdown.nvme_by_path)
    assert list(by_path) == [str(d) for d in drives]
    assert est.to_dict()["settings"][0]["nvme_by_path"] == by_path
    sizes = ", ".join(f"{d} {format_nbytes(by_path[str(d)])}" for d in drives)
    assert f"  NVMe by folder (striped): {sizes}" in est.table().splitlines()
    engine = infinity.initialize(model, cfg)
    try:
        rt = engine.runtime
        stores = (rt.param_store, rt.state_store)
        swap = [
            sum(_file_nbytes(d) for s in stores for d in s.directories if d.parent.parent == drive)
            for drive in drives
        ]
        assert swap[0] == swap[1] > 0  # whole stripes: each drive holds the same share
        assert sum(swap) == sum(s.stats().swap_capacity for s in stores)
        meta = sum(rules.swap_dir_overhead_nbytes(s.stats().swap_capacity // 2) for s in stores)
        assert [by_path[str(d)] for d in drives] == [n + meta for n in swap]
    finally:
        engine.close()


def _file_nbytes(directory) -> int:
    return sum(f.stat().st_size for f in directory.glob("swap.*"))


def test_param_homes_keep_max_in_cpu_elements_in_host_memory():
    cfg = load_config(_config(3, "nvme", "nvme", nvme="/x", stage3_param_persistence_threshold=100))
    zero = cfg.zero_optimization
    units = cut_units(GPT(MODEL), cfg, world_size=1, device=torch.device("meta")).units
    big = [u for u in units if not u.persistent]
    budget = big[0].layout.shard_numel + big[1].layout.shard_numel
    zero = dataclasses.replace(
        zero, offload_param=dataclasses.replace(zero.offload_param, max_in_cpu=budget)
    )
    homes = param_homes(units, zero)
    kept = sum(u.layout.shard_numel for u in big if homes[u.index] == "cpu")
    assert kept == budget  # greedy: the first two fit exactly
    assert any(homes[u.index] == "nvme" for u in big)
    assert all(homes[u.index] == "cpu" for u in units if u.persistent)


@pytest.mark.parametrize("what", ["live budget", "pool"])
def test_the_schedulers_refusals_are_foreseen_exactly(nvme_dir, what):
    """ScheduleBudget.check_serves refuses (after initialize moved the model home) a live budget or a
    parameter pool below the partitioner's working set: the plan flags exactly those configs."""
    torch.manual_seed(0)
    cfg = load_config(
        _config(3, "nvme", "nvme", nvme=nvme_dir, stage3_param_persistence_threshold=200)
    )
    schedule = plan_runtime(GPT(MODEL), cfg, world_size=1).schedule
    everything, on_nvme = schedule.working_set_nbytes, schedule.pool_working_set_nbytes
    assert everything > schedule.largest_unit_nbytes  # a chain, not one unit
    for delta, refused in (
        (-1024, True),
        (0, False),
    ):  # 4 KiB of fp32: pool buffers are 4 KiB-granular
        raw = _config(
            3,
            "nvme",
            "nvme",
            nvme=nvme_dir,
            stage3_param_persistence_threshold=200,
            sub_group_size=20_000,
        )
        if what == "live budget":
            raw["zero_optimization"]["stage3_max_live_parameters"] = everything // 4 + delta
        else:
            raw["zero_optimization"]["offload_param"].update(
                buffer_count=1, buffer_size=on_nvme // 4 + delta
            )
        raw["preflight"] = False
        est = estimate_memory(
            GPT(MODEL),
            config=raw,
            device="cpu",
            machine=False,
            baseline_nbytes=0,
            settings=[ZeroSetting(3, "nvme", "nvme")],
        )
        flagged = any(
            "prefetch scheduler refuses" in p.message for p in est.settings[0].breakdown.problems
        )
        assert flagged == refused, (what, delta, est.settings[0].breakdown.problems)
        if refused:
            with pytest.raises(
                ValueError, match="stage3_max_live_parameters" if what == "live budget" else "pool"
            ):
                infinity.initialize(GPT(MODEL), raw)
        else:
            infinity.initialize(GPT(MODEL), raw).close()


def test_a_checkpointing_model_holds_a_whole_layer_in_backward():
    """With gradient_checkpointing_enable() the recomputation hands each unit of a block to backward
    until its grads are reduced: the working set is the heaviest block plus two largest units (the tied
    weight held through backward, and room for the free bytes to be split); without, one chain."""
    cfg = load_config(_config(3, "nvme", "nvme", nvme="/x", stage3_param_persistence_threshold=100))
    model = GPT(MODEL)
    plain = plan_runtime(model, cfg, world_size=1).schedule
    model.gradient_checkpointing_enable()
    ckpt = plan_runtime(model, cfg, world_size=1).schedule
    units = cut_units(model, cfg, world_size=1, device=torch.device("meta"))
    block = max(
        sum(
            u.layout.shard_nbytes
            for m in b.modules()
            for u in units.uses.get(m, ())
            if not u.persistent
        )
        for b in model.blocks
    )
    largest = max(u.layout.shard_nbytes for u in units.units if not u.persistent)
    assert ckpt.working_set_nbytes == block + 2 * largest
    assert plain.working_set_nbytes < ckpt.working_set_nbytes
    assert plain.working_set_nbytes < block + largest
