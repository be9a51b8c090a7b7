"""estimate_memory: the settings it covers, how settings compare, fits and recommendations, activations, tuning."""

import dataclasses

import pytest
import torch

from infinity.estimate import (
    MachineView,
    ZeroSetting,
    all_settings,
    estimate_memory,
    gpt_activations,
    machine_view,
)
from infinity.estimate.activations import SAVED_PER_BLOCK
from infinity.estimate.machine import describe_machine
from infinity.memory import format_nbytes
from infinity.models import GPT, GPTConfig

GiB = 1 << 30
SMALL = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=256)


def _machine(tmp_path, *, ram, disk=1 << 50, huge=0) -> MachineView:
    v = machine_view([str(tmp_path)])
    return dataclasses.replace(
        v,
        mem_available_nbytes=ram,
        hugetlb_free_nbytes=huge,
        gpus=(),
        disks=tuple(dataclasses.replace(d, free_nbytes=disk) for d in v.disks),
    )


def _est(model=SMALL, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("baseline_nbytes", 300 << 20)
    kw.setdefault("machine", False)
    return estimate_memory(model, **kw)


def test_every_valid_setting_is_estimated_and_no_invalid_one():
    est = _est()
    got = {e.setting for e in est.settings if not e.setting.tuned}
    assert got == set(all_settings())
    # Without a machine, NVMe settings also come tuned (their sizes derived from the model).
    assert all(
        "nvme" in (s.offload_param, s.offload_optimizer)
        for s in (e.setting for e in est.settings)
        if s.tuned
    )
    assert len(got) == 16  # 1 (stage 0) + 2 × 3 (stages 1, 2) + 3 × 3 (stage 3)
    assert all(s.offload_param == "none" for s in got if s.stage < 3)
    assert all(s.offload_optimizer == "none" for s in got if s.stage == 0)


def test_offloading_moves_bytes_from_memory_to_nvme():
    est = _est(1e9, precision="bf16", zero_init=True)
    s0 = est.setting(0).breakdown
    nn = est.setting(3, "nvme", "nvme").breakdown
    assert s0.nvme_nbytes == 0
    # 16 B per parameter of optimizer state and 2 B of bf16 parameters land on NVMe (plus zero.Init's files).
    assert nn.nvme_nbytes >= 18 * est.num_params
    opt = est.setting(2, "none", "nvme").breakdown
    assert opt.nvme_nbytes >= 16 * est.num_params
    assert est.setting(2, "none", "cpu").breakdown.nvme_nbytes == 0


def test_world_size_divides_the_partitioned_state():
    one = _est(1e9, zero_init=True).setting(3, "cpu", "cpu").breakdown
    eight = _est(1e9, zero_init=True, nodes=2, gpus_per_node=4).setting(3, "cpu", "cpu").breakdown
    per_rank = {i.name: i.nbytes for i in eight.items}
    whole = {i.name: i.nbytes for i in one.items}
    assert per_rank["Adam moments m, v"] == pytest.approx(whole["Adam moments m, v"] / 8, rel=0.01)
    # Stage 0 does not partition: every rank holds it all.
    s0 = _est(1e9, world_size=8).setting(0).breakdown
    assert {i.name: i.nbytes for i in s0.items}["Adam moments m, v"] == pytest.approx(
        whole["Adam moments m, v"], rel=0.01
    )


def test_the_settings_come_fastest_first():
    est = _est(1e9, zero_init=True)
    order = [e.setting for e in est.settings if not e.setting.tuned]
    assert order[0] == ZeroSetting(0, "none", "none")
    assert order[-1] == ZeroSetting(3, "nvme", "nvme")
    traffic = [e.breakdown.nvme_traffic_nbytes for e in est.settings]
    assert traffic == sorted(traffic)


def test_fits_and_recommends_the_fastest_setting_that_fits(tmp_path):
    big = _est(
        1e9, zero_init=True, nvme_path=str(tmp_path), machine=_machine(tmp_path, ram=1 << 50)
    )
    assert big.recommended.setting == ZeroSetting(0, "none", "none")
    assert big.recommendation.startswith("fits with stage 0")
    # Little RAM, a big disk: only state on NVMe fits, and the sentence says what it needs where.
    small = _est(
        1e9, zero_init=True, nvme_path=str(tmp_path), machine=_machine(tmp_path, ram=6 * GiB)
    )
    rec = small.recommended
    assert rec is not None and rec.setting.offload_optimizer == "nvme"
    assert all(not e.fit.ok for e in small.settings if e.breakdown.ram_nbytes > 6 * GiB)
    assert (
        "on NVMe" in small.recommendation and f"at nvme_path ({tmp_path})" in small.recommendation
    )
    assert "of RAM" in small.recommendation


def test_too_little_disk_is_reported_per_path(tmp_path):
    est = _est(
        1e9,
        zero_init=True,
        nvme_path=str(tmp_path),
        machine=_machine(tmp_path, ram=8 * GiB, disk=GiB),
    )
    e = est.setting(3, "nvme", "nvme")
    assert not e.fit.nvme_ok
    assert any(f"NVMe space at {tmp_path}" in r for r in e.fit.reasons)
    assert est.recommended is None and est.recommendation.startswith("nothing fits")


def test_several_nvme_paths_split_the_bytes_and_their_space_is_checked_per_file_system(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    est = _est(1e9, zero_init=True, nvme_path=[a, b], settings=[ZeroSetting(3, "nvme", "nvme")])
    p = est.settings[0].breakdown
    by_path = dict(p.nvme_by_path)
    assert list(by_path) == [str(a), str(b)] and by_path[str(a)] == by_path[str(b)]
    assert sum(by_path.values()) == p.nvme_nbytes
    from infinity.estimate import check_fit

    view = machine_view([str(a), str(b)])
    half = by_path[str(a)]

    def disks(free, same_fs):
        return dataclasses.replace(
            view,
            mem_available_nbytes=1 << 50,
            disks=tuple(
                dataclasses.replace(d, free_nbytes=free, device=0 if same_fs else i)
                for i, d in enumerate(view.disks)
            ),
        )

    # each folder's share fits on its own file system; on one file system the two shares add up
    assert check_fit(p, disks(half, same_fs=False), ranks_per_node=1).ok
    f = check_fit(p, disks(half, same_fs=True), ranks_per_node=1)
    assert not f.nvme_ok and f.reasons == (
        f"NVMe space at {a}, {b}: needs {format_nbytes(2 * half)}, {format_nbytes(half)} free",
    )
    assert check_fit(p, disks(2 * half, same_fs=True), ranks_per_node=1).ok
    lines = describe_machine(disks(half, same_fs=True))
    assert lines[-1].endswith(f" — the file system of {a}: free space and bandwidth shared")


def test_huge_pages_count_for_pinned_pools_only(tmp_path):
    cfg = {
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 50_000_000,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        }
    }
    est = _est(1e9, config=cfg, zero_init=True, settings=[ZeroSetting(3, "none", "nvme")])
    p = est.settings[0].breakdown
    pool = p.pinned_pool_nbytes
    assert pool >= 3 * 50_000_000 * 12  # fp32 stage 3: m, v, g (the parameter shard is the master)
    need = p.ram_nbytes
    from infinity.estimate import check_fit

    assert not check_fit(p, _machine(tmp_path, ram=need - pool // 2), ranks_per_node=1).ok
    assert check_fit(p, _machine(tmp_path, ram=need - pool // 2, huge=pool), ranks_per_node=1).ok


def test_ranks_per_node_multiply_host_and_disk(tmp_path):
    est = _est(1e9, zero_init=True, nvme_path=str(tmp_path), gpus_per_node=4)
    p = est.setting(3, "nvme", "nvme").breakdown
    from infinity.estimate import check_fit

    assert check_fit(
        p, _machine(tmp_path, ram=4 * p.ram_nbytes, disk=4 * p.nvme_nbytes), ranks_per_node=4
    ).ok
    f = check_fit(
        p, _machine(tmp_path, ram=4 * p.ram_nbytes, disk=3 * p.nvme_nbytes), ranks_per_node=4
    )
    assert not f.ok and not f.nvme_ok and f.host_ok


def test_deepspeed_defaults_are_flagged_and_tuned():
    """Defaults (sub_group_size 1e9, max_in_cpu 1e9, buffer_size 1e8) for a 13B model: a 45 GiB
    optimizer pool and a parameter pool the step stalls on; the tuned row fixes both."""
    est = _est(13e9, zero_init=True, nvme_path="/nvme")
    default = est.setting(3, "nvme", "nvme").breakdown
    pools = {i.name: i.nbytes for i in default.items}
    assert pools["optimizer pool"] >= 3 * 10**9 * 16
    assert any("optimizer step holds" in p.message for p in default.problems)
    tuned = est.setting(3, "nvme", "nvme", tuned=True).breakdown
    keys = {k for k, _old, _new in tuned.changes}
    assert keys == {
        "zero_optimization.sub_group_size",
        "zero_optimization.offload_param.max_in_cpu",
        "zero_optimization.offload_param.buffer_size",
    }
    assert not tuned.problems
    assert tuned.ram_nbytes < default.ram_nbytes / 4
    assert "sub_group_size=" in tuned.keys()


def test_activation_count_matches_what_autograd_saves():
    """The exact part of the activation rule: bytes autograd saves for infinity.models.GPT."""
    cfg = GPTConfig(vocab_size=128, seq_len=32, n_layer=3, n_head=4, d_model=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    B, T = 2, 32
    x = torch.randint(0, cfg.vocab_size, (B, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    bt = B * T
    per_block = SAVED_PER_BLOCK * bt * cfg.d_model * 4 + (2 * 2 * 4 + 4 * cfg.n_head) * bt
    top = 2 * bt * cfg.d_model * 4 + 4 * bt * cfg.vocab_size
    indices = 3 * bt * 8
    assert sum(seen.values()) == pytest.approx(cfg.n_layer * per_block + top + indices, rel=0.01)
    a = gpt_activations(cfg, micro_batch=B, seq=T, itemsize=4)
    assert a.saved >= sum(seen.values())


def test_checkpointing_keeps_block_inputs_only():
    cfg = GPTConfig(vocab_size=256, seq_len=2048, n_layer=24, n_head=16, d_model=1024)
    a = gpt_activations(cfg, micro_batch=1, seq=2048, itemsize=2)
    assert a.saved_checkpointed < a.saved / 5
    assert a.peak(checkpointing=True) < a.peak(checkpointing=False)
    est = _est(
        cfg,
        micro_batch=1,
        seq=2048,
        activation_checkpointing=True,
        settings=[ZeroSetting(0, "none", "none")],
    )
    item = next(
        i for i in est.settings[0].breakdown.items if i.name == "activations saved for backward"
    )
    assert item.nbytes == a.saved_checkpointed and "without checkpointing" in item.detail


def test_a_module_and_its_config_estimate_alike():
    torch.manual_seed(0)
    live = _est(
        GPT(SMALL),
        config={"zero_optimization": {"stage": 1}},
        settings=[ZeroSetting(1, "none", "none")],
    )
    meta = _est(
        SMALL, config={"zero_optimization": {"stage": 1}}, settings=[ZeroSetting(1, "none", "none")]
    )
    a, b = live.settings[0].breakdown, meta.settings[0].breakdown
    assert [(i.name, i.nbytes) for i in a.items] == [(i.name, i.nbytes) for i in b.items]
    assert live.num_params == meta.num_params == SMALL.num_params


def test_a_count_stands_for_a_gpt_of_that_size():
    est = _est(13e9)
    assert abs(est.num_params - 13e9) / 13e9 < 0.05
    assert "stand-in" in est.model
    # A config's sizes and precision are kept; without one, bf16.
    assert est.dtype == "bfloat16"
    assert _est(13e9, config={}).dtype == "float32"


def test_the_table_and_the_dict_carry_the_same_numbers(tmp_path):
    est = _est(
        350e6,
        micro_batch=2,
        seq=512,
        nvme_path=str(tmp_path),
        machine=_machine(tmp_path, ram=8 * GiB),
    )
    text = est.table()
    assert "stage 3, params nvme, optimizer nvme" in text and "this machine:" in text
    assert est.recommendation in text
    d = est.to_dict()
    assert len(d["settings"]) == len(est.settings)
    assert d["settings"][0]["ram_nbytes"] == est.settings[0].breakdown.ram_nbytes
    assert d["recommendation"] == est.recommendation
    assert d["activations"]["micro_batch"] == 2


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(nodes=0), "nodes must be >= 1"),
        (dict(world_size=6, nodes=4), "not a multiple of nodes"),
        (dict(world_size=4, nodes=1, gpus_per_node=2), "world_size 4 != nodes 1 × gpus_per_node 2"),
        (dict(device="tpu"), "device must be"),
        (dict(precision="fp8"), "precision must be fp32, bf16 or fp16"),
    ],
)
def test_bad_arguments_say_what_is_wrong(kw, message):
    with pytest.raises(ValueError, match=message):
        _est(1e9, **kw)


def test_a_bad_model_argument_is_refused():
    with pytest.raises(ValueError, match="parameter count >= 1"):
        _est(0)


def test_a_cuda_plan_splits_device_and_host_and_checks_the_gpu(tmp_path):
    """Planned for CUDA (no GPU needed): parameters, grads and activations on the device, optimizer state
    on the host (this runtime's optimizer always steps on the CPU), the GPU's free memory checked."""
    from infinity.estimate import GPUInfo, check_fit

    est = _est(1e9, device="cuda", micro_batch=1, seq=1024, zero_init=True)
    s0 = est.setting(0).breakdown
    dev = {i.name for i in s0.items if i.resource == "device"}
    assert {
        "parameters in the module (bfloat16)",
        "gradient accumulators (fp32)",
        "activations saved for backward",
    } <= dev
    assert "Adam moments m, v" in {i.name for i in s0.items if i.resource == "host"}
    assert s0.device_nbytes >= 6 * est.num_params  # bf16 params + fp32 grad accumulators
    assert s0.host_nbytes >= 16 * est.num_params
    # Stage 3 keeps only persistent and gathered units (and activations) on the device.
    s3 = est.setting(3, "nvme", "nvme").breakdown
    assert s3.device_nbytes < s0.device_nbytes - 3 * est.num_params  # no resident params or grads
    view = dataclasses.replace(
        _machine(tmp_path, ram=1 << 50),
        gpus=(GPUInfo(0, "test GPU", 80 * GiB, s3.device_nbytes + 1),),
    )
    assert check_fit(s3, view, ranks_per_node=1).device_ok
    f = check_fit(s0, view, ranks_per_node=1)
    assert not f.device_ok and any("per GPU" in r for r in f.reasons)
    no_gpu = check_fit(s3, _machine(tmp_path, ram=1 << 50), ranks_per_node=1)
    assert not no_gpu.device_ok and any("no GPU is visible" in r for r in no_gpu.reasons)


def _meta_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def _as_built(breakdown) -> int:
    return sum(i.nbytes for i in breakdown.items if i.name == "model as built (fp32)")


def test_a_model_on_the_meta_device_is_not_counted_as_fp32_weights_in_memory():
    """[Note: a model on the meta device]: at stage 3 it is taken as built under zero.Init (its weights
    exist only as zero.Init's shards), exactly as when zero_init=True is said; at stages 0-2, and when
    zero_init=False is said, the weights would be materialised, and their fp32 bytes are counted."""
    model = _meta_llama()
    n = sum(p.numel() for p in model.parameters())
    s3, s1 = ZeroSetting(3, "nvme", "nvme"), ZeroSetting(1, "none", "none")
    default = _est(model, settings=[s3, s1])
    said = _est(model, settings=[s3, s1], zero_init=True)
    plain = _est(model, settings=[s3], zero_init=False)
    assert "on the meta device" in default.model
    stage3 = default.setting(3, "nvme", "nvme").breakdown
    assert _as_built(stage3) == 0 and any(i.name.startswith("zero.Init") for i in stage3.items)
    assert stage3.items == said.setting(3, "nvme", "nvme").breakdown.items
    assert _as_built(plain.settings[0].breakdown) == n * 4
    assert _as_built(default.setting(1).breakdown) == n * 4


def test_a_materialised_module_is_counted_as_it_is_built():
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_config(_meta_llama().config)
    est = _est(model, settings=[ZeroSetting(3, "nvme", "nvme")])
    assert "on the meta device" not in est.model
    assert _as_built(est.settings[0].breakdown) == sum(p.numel() * 4 for p in model.parameters())
