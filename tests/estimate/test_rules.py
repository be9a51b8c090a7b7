"""The estimator's rules against a built runtime, byte for byte: units, homes, host tensors, pools, swap, cache.

Each case builds a real engine (infinity.initialize, in this process) and
compares what its stores and caches hold with the plan's items. When the
engine's allocation code changes, these fail and name the item that drifted;
rules.py is then the one place to follow it.
"""

import dataclasses

import pytest
import torch

import infinity
from infinity.estimate import estimate_memory, rules
from infinity.estimate.plan import Setting
from infinity.memory import round_up
from infinity.models import GPT, GPTConfig

MODEL = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=64)


def _config(stage, p="none", o="none", *, dtype="fp32", nvme=None, grads_in_host=False, **zero):
    z = {"stage": stage, **zero}
    if p != "none":
        z["offload_param"] = {"device": p, "nvme_path": str(nvme), "buffer_count": 4, "buffer_size": 1 << 16,
                              "max_in_cpu": 0}
    if o != "none":
        z["offload_optimizer"] = {"device": o, "nvme_path": str(nvme), "grads_in_host": grads_in_host}
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": z}
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    return cfg


CASES = {
    "stage0-fp32": dict(stage=0),
    "stage1-cpu": dict(stage=1, o="cpu"),
    "stage2-bf16-nvme": dict(stage=2, o="nvme", dtype="bf16", sub_group_size=20_000),
    "stage3-bf16-nvme-nvme": dict(stage=3, p="nvme", o="nvme", dtype="bf16", sub_group_size=20_000,
                                  stage3_param_persistence_threshold=200),
    "stage3-fp32-cpu-nvme": dict(stage=3, p="cpu", o="nvme", sub_group_size=20_000),
    "stage3-fp32-cpu-cpu": dict(stage=3, p="cpu", o="cpu"),
    "stage3-fp32-nvme-nvme-grads-in-host": dict(stage=3, p="nvme", o="nvme", sub_group_size=20_000,
                                                grads_in_host=True),
    "stage1-bf16-nvme-grads-in-host": dict(stage=1, o="nvme", dtype="bf16", sub_group_size=20_000,
                                           grads_in_host=True),
    "stage3-fp16-nvme-cpu": dict(stage=3, p="nvme", o="cpu", dtype="fp16", sub_group_size=20_000),
}


def _items(plan, name_prefix, tier=None):
    return sum(i.nbytes for i in plan.items if i.name.startswith(name_prefix) and (tier is None or i.tier == tier))


@pytest.mark.parametrize("case", list(CASES))
def test_plan_matches_a_built_runtime(case, nvme_dir):
    kw = dict(CASES[case])
    stage = kw.pop("stage")
    cfg = _config(stage, kw.pop("p", "none"), kw.pop("o", "none"), dtype=kw.pop("dtype", "fp32"), nvme=nvme_dir, **kw)
    torch.manual_seed(0)
    model = GPT(MODEL)
    est = estimate_memory(model, config=cfg, device="cpu", machine=False, baseline_nbytes=0,
                          settings=[Setting(stage, cfg["zero_optimization"].get("offload_param", {}).get("device", "none"),
                                            cfg["zero_optimization"].get("offload_optimizer", {}).get("device", "none"))])
    plan = est.settings[0].plan
    engine = infinity.initialize(model, cfg)
    try:
        rt = engine.runtime
        units = rt.unit_map.units
        # Units: the estimator cuts the model as the engine does.
        est_units = rules.units_for(GPT(MODEL), engine.config, 1)
        assert [(u.module_name, u.layout.shard_numel, u.persistent) for u in est_units] == [
            (u.module_name, u.layout.shard_numel, u.persistent) for u in units
        ]
        # Optimizer state: home "cpu" tensors in host memory, or reserved swap space.
        state = rt.state_store
        specs = [state.spec(k) for k in state.keys()]
        in_host = sum(s.nbytes for s in specs if s.home == "cpu")
        opt_names = ("fp32 master weights", "Adam moments m, v", "gradient partitions (fp32)")
        assert in_host == sum(_items(plan, n, "host") for n in opt_names)
        on_disk = sum(s.nbytes for s in specs if s.home == "nvme")
        assert on_disk == sum(_items(plan, n, "nvme") for n in opt_names)
        assert state.stats().swap_capacity == (
            _items(plan, "", "nvme") - _items(plan, "parameter swap") - _items(plan, "optimizer swap directory"))
        assert rules.mapped_nbytes(state.pool.capacity, huge_pages=True) == _items(plan, "optimizer pool")
        # Parameters: stage 3 shards in the parameter store; else resident in the module.
        if stage == 3:
            ps = rt.param_store
            pspecs = [ps.spec(k) for k in ps.keys()]
            assert sum(s.nbytes for s in pspecs if s.home == "cpu") == _items(plan, "parameter shards in host memory")
            homes = rules.param_homes(units, engine.config.zero_optimization)
            assert {u.key: homes[u.index] for u in units} == {k: ps.spec(k).home for k in ps.keys()}
            assert ps.stats().swap_capacity == _items(plan, "parameter swap files")
            assert rules.mapped_nbytes(ps.pool.capacity, huge_pages=True) == _items(plan, "parameter pool")
        else:
            resident = sum(p.numel() * p.element_size() for p in model.parameters())
            assert resident == _items(plan, "parameters in the module")
        assert rt.cache.cap_nbytes == rules.tensor_cache_cap(units)
    finally:
        engine.close()


def test_flat_buffer_peak_matches_the_cache_after_training(nvme_dir):
    """Stage 1 accumulates every unit's grads in fp32 buffers from the cache and puts them back
    (with the shard buffers of the reduce) at the window's end."""
    torch.manual_seed(0)
    model = GPT(MODEL)
    cfg = _config(1, o="cpu")
    est = estimate_memory(model, config=cfg, device="cpu", machine=False, baseline_nbytes=0,
                          settings=[Setting(1, "none", "cpu")])
    engine = infinity.initialize(model, cfg)
    try:
        x = torch.randint(0, MODEL.vocab_size, (1, 16))
        for _ in range(2):
            engine.backward(engine(x, x))
            engine.step()
        cache = engine.runtime.cache
        cached = sum(t.numel() * t.element_size() for b in cache._free.values() for t in b)
        plan = est.settings[0].plan
        assert 0 < cached <= _items(plan, "flat buffers") + _items(plan, "gradient accumulators")
        assert _items(plan, "gradient accumulators") == 4 * sum(u.layout.padded_numel
                                                                 for u in engine.runtime.unit_map.units)
    finally:
        engine.close()


def test_step_pool_need_is_what_the_optimizer_step_holds():
    """rules.step_param_pool_need mirrors PartitionedAdam.step: a whole sub-group is fetched before
    it is used (and with room for two, the next one's read overlaps the update)."""
    units = rules.units_for(GPT(MODEL), _loaded(_config(3, "nvme", "nvme", nvme="/x", sub_group_size=5000)), 1)
    homes = {u.index: ("cpu" if u.persistent else "nvme") for u in units}
    groups = rules.sub_groups(units, 5000)
    per = [sum(round_up(u.layout.shard_nbytes, 4096) for u in g if homes[u.index] == "nvme") for g in groups]
    assert rules.step_param_pool_need(units, homes, 5000) == max(per)
    assert rules.step_param_pool_overlap(units, homes, 5000) == max(a + b for a, b in zip(per, per[1:], strict=False))
    # A group never splits a shard: each shard larger than the limit is a group of its own.
    assert all(len(g) == 1 for g in rules.sub_groups(units, 1))


def test_swap_growth_follows_the_swap_space(nvme_dir):
    """zero.Init's store grows its files on demand; rules.swap_growth_nbytes mirrors SwapSpace.alloc."""
    from infinity.memory import BufferPool
    from infinity.store import TieredStore

    sizes = [5000, 70_000, 1 << 20, 3 << 20, 4096, 9 << 20]
    with TieredStore(nvme_dir, pool=BufferPool(1, 1 << 20), name="growth") as store:
        for i, n in enumerate(sizes):
            store.register(("k", i), (n,), torch.uint8)
        assert store.stats().swap_capacity == rules.swap_growth_nbytes(sizes, store._rio.config.block_size)


def _loaded(cfg):
    from infinity.config import load_config

    return load_config(cfg)


def test_param_homes_keep_max_in_cpu_elements_in_host_memory():
    cfg = _loaded(_config(3, "nvme", "nvme", nvme="/x", stage3_param_persistence_threshold=100))
    zero = cfg.zero_optimization
    units = rules.units_for(GPT(MODEL), cfg, 1)
    big = [u for u in units if not u.persistent]
    budget = big[0].layout.shard_numel + big[1].layout.shard_numel
    zero = dataclasses.replace(zero, offload_param=dataclasses.replace(zero.offload_param, max_in_cpu=budget))
    homes = rules.param_homes(units, zero)
    kept = sum(u.layout.shard_numel for u in big if homes[u.index] == "cpu")
    assert kept == budget  # greedy: the first two fit exactly
    assert any(homes[u.index] == "nvme" for u in big)
    assert all(homes[u.index] == "cpu" for u in units if u.persistent)


@pytest.mark.parametrize("what", ["live budget", "pool"])
def test_the_schedulers_refusals_are_foreseen_exactly(nvme_dir, what):
    """ScheduleBudget.check_serves refuses (after initialize moved the model home) a live budget or a
    parameter pool below the partitioner's working set: the plan flags exactly those configs."""
    torch.manual_seed(0)
    cfg = _loaded(_config(3, "nvme", "nvme", nvme=nvme_dir, stage3_param_persistence_threshold=200))
    model = GPT(MODEL)
    unit_map = rules.unit_map_for(model, cfg, 1)
    homes = rules.param_homes(unit_map.units, cfg.zero_optimization)
    everything = rules.partitioner_working_set(model, unit_map, lambda u: True)
    on_nvme = rules.partitioner_working_set(model, unit_map, lambda u: homes[u.index] == "nvme")
    assert everything > max(u.layout.shard_nbytes for u in unit_map.units)  # a chain, not one unit
    for delta, refused in ((-1024, True), (0, False)):  # 4 KiB of fp32: pool buffers are 4 KiB-granular
        raw = _config(3, "nvme", "nvme", nvme=nvme_dir, stage3_param_persistence_threshold=200, sub_group_size=20_000)
        if what == "live budget":
            raw["zero_optimization"]["stage3_max_live_parameters"] = everything // 4 + delta
        else:
            raw["zero_optimization"]["offload_param"].update(buffer_count=1, buffer_size=on_nvme // 4 + delta)
        raw["preflight"] = False
        est = estimate_memory(GPT(MODEL), config=raw, device="cpu", machine=False, baseline_nbytes=0,
                              settings=[Setting(3, "nvme", "nvme")])
        flagged = any("prefetch scheduler refuses" in p.message for p in est.settings[0].plan.problems)
        assert flagged == refused, (what, delta, est.settings[0].plan.problems)
        if refused:
            with pytest.raises(ValueError, match="stage3_max_live_parameters" if what == "live budget" else "pool"):
                infinity.initialize(GPT(MODEL), raw)
        else:
            infinity.initialize(GPT(MODEL), raw).close()
