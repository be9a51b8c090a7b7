"""infinity.initialize's pre-flight check: refuses before allocating, with the plan and the fix; can be skipped."""

import dataclasses
import importlib
import logging

import pytest
import torch

import infinity
from infinity.config import load_config
from infinity.estimate import MachineView, PreflightError, machine_view, preflight
from infinity.memory import format_nbytes
from infinity.models import GPT, GPTConfig
from tests.distributed import run_distributed

GiB = 1 << 30
# The module (the package exports its function under the same name).
preflight_mod = importlib.import_module("infinity.estimate.preflight")
MODEL = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=64)


def _config(nvme=None, *, stage=3, p="nvme", o="nvme", **zero):
    z = {
        "stage": stage,
        "stage3_param_persistence_threshold": 100,
        "sub_group_size": 20_000,
        **zero,
    }
    if p != "none":
        z["offload_param"] = {
            "device": p,
            "nvme_path": str(nvme),
            "max_in_cpu": 0,
            "buffer_count": 4,
            "buffer_size": 1 << 16,
        }
    if o != "none":
        z["offload_optimizer"] = {"device": o, "nvme_path": str(nvme)}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": z,
    }


def _machine(paths=(), *, ram=None, disk=None) -> MachineView:
    """This machine, with its available RAM and/or free disk replaced."""
    v = machine_view(paths)
    if ram is not None:
        v = dataclasses.replace(v, mem_available_nbytes=ram, hugetlb_free_nbytes=0)
    if disk is not None:
        v = dataclasses.replace(
            v, disks=tuple(dataclasses.replace(d, free_nbytes=disk) for d in v.disks)
        )
    return v


@pytest.fixture
def small_machine(monkeypatch):
    """Makes the pre-flight check see a machine with the given RAM / free disk."""

    def use(**kw):
        monkeypatch.setattr(
            preflight_mod, "machine_view", lambda paths=(): _machine(list(paths), **kw)
        )

    return use


def test_too_little_host_memory_is_refused_before_anything_is_allocated(nvme_dir, small_machine):
    small_machine(ram=1 << 20)
    torch.manual_seed(0)
    model = GPT(MODEL)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PreflightError) as e:
        infinity.initialize(model, _config(nvme_dir))
    msg = str(e.value)
    assert "does not fit" in msg and "nothing has been allocated" in msg
    assert "host memory" in msg and "1.0 MiB available" in msg
    assert "Adam moments m, v" in msg and "parameter pool" in msg  # the plan, itemised
    assert '"preflight": false' in msg
    assert e.value.breakdown.setting.stage == 3 and e.value.reasons
    # Nothing allocated: no swap directory made, the model untouched.
    assert not (nvme_dir / "rank0").exists()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _fix_when_short(model, cfg, small_machine, short_nbytes: int) -> str:
    """The refusal's fix on a machine with ``short_nbytes`` less RAM than the run needs."""
    est = infinity.estimate_memory(model, config=cfg, device="cpu", machine=False)
    small_machine(ram=est.focus.breakdown.ram_nbytes - est.baseline_nbytes - short_nbytes)
    with pytest.raises(PreflightError) as e:
        infinity.initialize(model, cfg)
    return str(e.value).split("Fix:")[1]


def test_the_fix_names_a_setting_that_fits(nvme_dir, small_machine):
    """Optimizer state in host memory does not fit 16 MiB less than it needs; on NVMe it does."""
    cfg = _config(nvme_dir, stage=3, p="cpu", o="cpu")
    torch.manual_seed(0)
    model = GPT(
        dataclasses.replace(MODEL, n_layer=4, d_model=256, n_head=4)
    )  # 3.2M parameters: 51 MB of state
    fix = _fix_when_short(model, cfg, small_machine, 16 << 20)
    assert "offload_optimizer.device=nvme" in fix or "offload_param.device=nvme" in fix
    assert "fits" in fix


def test_ranks_sharing_a_drive_too_small_for_all_of_them_are_refused(
    nvme_dir, small_machine, monkeypatch
):
    """Four ranks on this node need four times this rank's swap files: a drive with room for
    two is refused, naming the path and the bytes (the engine sees only its own rank's need)."""
    cfg = load_config(_config(nvme_dir))
    model = GPT(MODEL)
    need = preflight(model, cfg).breakdown.nvme_nbytes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    small_machine(disk=2 * need)
    with pytest.raises(PreflightError) as e:
        preflight(model, cfg)
    msg = str(e.value)
    assert f"NVMe space at {nvme_dir}" in msg and "4 ranks on this node" in msg
    assert not (nvme_dir / "rank0").exists()


def test_a_refusal_over_several_drives_names_each_ones_bytes(nvme_dir, small_machine, monkeypatch):
    """Four ranks striped over two folders: each folder is checked for its share, and the refusal
    itemises what each folder would hold."""
    a, b = nvme_dir / "a", nvme_dir / "b"
    a.mkdir()
    b.mkdir()
    raw = _config(nvme_dir)
    for section in ("offload_param", "offload_optimizer"):
        raw["zero_optimization"][section]["nvme_path"] = [str(a), str(b)]
    cfg = load_config(raw)
    model = GPT(MODEL)
    by_path = dict(preflight(model, cfg).breakdown.nvme_by_path)
    assert list(by_path) == [str(a), str(b)] and by_path[str(a)] == by_path[str(b)]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    small_machine(
        disk=2 * by_path[str(a)]
    )  # each file system has room for two ranks' share, not four
    with pytest.raises(PreflightError) as e:
        preflight(model, cfg)
    msg = str(e.value)
    assert f"NVMe space at {a}, {b}: needs " in msg  # one file system here: the shares add up
    assert f"NVMe by folder (striped): {a} {format_nbytes(by_path[str(a)])}, {b} " in msg
    assert not (a / "rank0").exists() and not (b / "rank0").exists()


def test_one_ranks_swap_space_is_left_to_the_engines_own_check(nvme_dir, small_machine):
    """With one rank per node the engine's nvme_path.check_space refuses exactly this, before writing."""
    small_machine(disk=1 << 20)
    assert preflight(GPT(MODEL), load_config(_config(nvme_dir))) is not None


def test_a_parameter_pool_the_optimizer_step_would_stall_on_is_refused(nvme_dir):
    """Two sub-groups of shards do not fit the pool: the step would wait until its 300 s timeout."""
    cfg = _config(nvme_dir, sub_group_size=1_000_000)
    cfg["zero_optimization"]["offload_param"].update(buffer_count=2, buffer_size=32_768)
    with pytest.raises(PreflightError) as e:
        infinity.initialize(GPT(MODEL), cfg)
    msg = str(e.value)
    assert "optimizer step holds" in msg
    assert "offload_param.buffer_size" in msg and "sub_group_size" in msg


def test_a_parameter_pool_too_big_for_memory_names_both_of_its_keys(nvme_dir):
    """A 4 × 2^26-element ask is capped at every shard that may rest on NVMe (test_pool_sizing.py), still
    more than the run holds at once: when host memory is short by less than the pool could give back, the
    fix names buffer_count as well as buffer_size (and by more than that, it does not blame the pool)."""
    from infinity.estimate import rules
    from infinity.estimate.preflight import _pool_fixes

    cfg = _config(nvme_dir)
    cfg["zero_optimization"]["offload_param"].update(buffer_count=4, buffer_size=1 << 26)
    model = GPT(
        dataclasses.replace(MODEL, n_layer=16, d_model=256, n_head=4)
    )  # 13M parameters: 51 MB of shards
    plan = infinity.estimate_memory(model, config=cfg, device="cpu", machine=False).focus.breakdown
    pool = plan.runtime.param_store.pool
    assert pool.capacity_nbytes < 4 * (1 << 26) * 4
    spare = rules.mapped_nbytes(pool.capacity_nbytes, huge_pages=True) - rules.mapped_nbytes(
        pool.need_nbytes, huge_pages=True
    )
    assert spare > 32 << 20
    (fix,) = _pool_fixes(plan, spare // 2, ranks=1)
    assert "the parameter pool is what does not fit" in fix
    assert (
        "zero_optimization.offload_param.buffer_count or zero_optimization.offload_param.buffer_size"
        in fix
    )
    assert _pool_fixes(plan, spare + 1, ranks=1) == []


def test_preflight_false_skips_the_check_with_a_warning(nvme_dir, small_machine, caplog):
    small_machine(ram=1 << 20, disk=1 << 20)
    cfg = _config(nvme_dir)
    cfg["preflight"] = False
    with caplog.at_level(logging.WARNING, logger="infinity.estimate"):
        engine = infinity.initialize(GPT(MODEL), cfg)
    engine.close()
    assert any("pre-flight check skipped" in r.getMessage() for r in caplog.records)


def test_preflight_argument_skips_it_too(nvme_dir, small_machine, caplog):
    small_machine(ram=1 << 20)
    with caplog.at_level(logging.WARNING, logger="infinity.estimate"):
        engine = infinity.initialize(GPT(MODEL), _config(nvme_dir), preflight=False)
    engine.close()
    assert any("pre-flight check skipped" in r.getMessage() for r in caplog.records)


def test_a_run_that_fits_passes_and_reports_its_plan(nvme_dir):
    cfg = load_config(_config(nvme_dir))
    model = GPT(MODEL)
    r = preflight(model, cfg)
    assert r is not None and r.breakdown.setting.offload_param == "nvme"
    assert r.held_nbytes > 100 << 20  # torch and infinity are in this process
    assert r.breakdown.nvme_nbytes > 0 and not (nvme_dir / "rank0").exists()


def _rank_refuses(rank, nvme):
    import infinity

    pm = importlib.import_module("infinity.estimate.preflight")

    if rank == 1:  # only rank 1's machine is too small
        real = pm.machine_view
        pm.machine_view = lambda paths=(): dataclasses.replace(
            real(list(paths)), mem_available_nbytes=1 << 20, hugetlb_free_nbytes=0
        )
    try:
        infinity.initialize(GPT(MODEL), _config(nvme))
    except PreflightError as e:
        return str(e).splitlines()[0]
    return "built"


@pytest.mark.distributed
def test_every_rank_refuses_when_one_does(nvme_dir):
    first = run_distributed(_rank_refuses, str(nvme_dir), world_size=2)
    assert "another rank's pre-flight check failed" in first[0]
    assert "does not fit" in first[1]


def test_an_auto_placement_that_cannot_fit_is_refused_with_where_the_planner_put_it(
    nvme_dir, small_machine, monkeypatch
):
    """With no host_memory_budget the planner plans within the available memory less a margin; when
    even everything on NVMe does not fit, the pre-flight refusal shows the placement it checked."""
    placement_mod = importlib.import_module("infinity.estimate.rank_plan")
    monkeypatch.setattr(
        placement_mod, "machine_view", lambda paths=(): _machine(list(paths), ram=1 << 20)
    )
    small_machine(ram=1 << 20)
    torch.manual_seed(0)
    cfg = _config(nvme_dir, p="auto", o="auto")
    with pytest.raises(PreflightError) as e:
        infinity.initialize(GPT(MODEL), cfg)
    msg = str(e.value)
    assert "Where the placement planner put the state" in msg and "NVMe per step: read" in msg
    assert (
        "budget 0 B (the available host memory, 1.0 MiB, less a safety margin of 512.0 MiB)" in msg
    )
    assert not (nvme_dir / "rank0").exists()


def test_the_engine_logs_where_the_state_rests_once(nvme_dir, caplog):
    torch.manual_seed(0)
    cfg = _config(nvme_dir, p="auto", o="auto")
    with caplog.at_level(logging.INFO, logger="infinity.engine"):
        engine = infinity.initialize(GPT(MODEL), cfg)
    try:
        lines = [
            r.getMessage()
            for r in caplog.records
            if "where the training state rests" in r.getMessage()
        ]
        assert len(lines) == 1
        assert "placement planner: budget" in lines[0] and "NVMe per step: read" in lines[0]
        assert "parameters (float32)" in lines[0] and "Adam m" in lines[0]
    finally:
        engine.close()


def test_the_refusal_counts_any_models_activations_as_it_checkpoints(nvme_dir, small_machine):
    """A transformers LM's activations are traced (with its checkpointing); a model whose inputs are not
    known is refused without them, and the message says so."""
    transformers = pytest.importorskip("transformers")
    small_machine(ram=1 << 20)
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=6,
            n_embd=64,
            n_head=2,
            vocab_size=64,
            n_positions=32,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    lm.train()
    with pytest.raises(PreflightError) as e:
        infinity.initialize(lm, _config(nvme_dir))
    msg = str(e.value)
    assert "activations not included" not in msg and "activations saved for backward" in msg
    plain = next(
        i.nbytes for i in e.value.breakdown.items if i.name == "activations saved for backward"
    )
    with pytest.warns(FutureWarning):
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(PreflightError) as e:
        infinity.initialize(lm, _config(nvme_dir))
    checkpointed = next(
        i.nbytes for i in e.value.breakdown.items if i.name == "activations saved for backward"
    )
    assert checkpointed < plain
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    with pytest.raises(PreflightError) as e:
        infinity.initialize(mlp, _config(nvme_dir))
    assert "activations not included: its inputs or context length are not known" in str(e.value)


def test_max_seq_length_sizes_the_activations_and_the_refusal_names_it(nvme_dir, small_machine):
    """Activations are sized for the model's context unless max_seq_length says how long the
    micro-batches are; a refusal made on the guess names the key, one made on the stated length
    does not."""
    transformers = pytest.importorskip("transformers")
    small_machine(ram=1 << 20)
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=64,
            n_positions=256,
            bos_token_id=0,
            eos_token_id=0,
        )
    )

    def activations(cfg):
        with pytest.raises(PreflightError) as e:
            infinity.initialize(lm, cfg)
        item = next(
            i for i in e.value.breakdown.items if i.name == "activations saved for backward"
        )
        return item, str(e.value)

    guessed, msg = activations(_config(nvme_dir))
    assert "seq 256" in guessed.detail and "set max_seq_length" in msg
    stated, msg = activations({**_config(nvme_dir), "max_seq_length": 16})
    assert "seq 16" in stated.detail and "max_seq_length" not in msg
    assert stated.nbytes * 8 < guessed.nbytes
