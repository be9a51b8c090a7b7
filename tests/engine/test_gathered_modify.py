"""GatheredParameters(..., modifier_rank=0) keeps its promise in every precision and at every stage:
a change made inside it on rank 0 becomes every rank's parameter (shard) and fp32 master, survives
optimizer steps (lr 0: nothing else moves, so it must survive them exactly), and is what
save_checkpoint keeps (the checkpoint's fp32 masters, read back by export_checkpoint). What rank 1
writes inside the context is overwritten by rank 0's values. Elements the change left alone keep
their fp32 masters, and Adam's moments are left as they are (as DeepSpeed leaves them).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import infinity
from infinity.engine.checkpoint import export_checkpoint
from infinity.zero.gathered import GatheredParameters
from tests.checkpoint.helpers import snapshot
from tests.distributed import run_distributed
from tests.engine.models import batch, tiny_gpt
from tests.engine.reference import engine_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (stage, offload_param, offload_optimizer); "passthrough": stage 0 with a torch optimizer of the user's
LAYOUTS = [
    (0, "none", "none"),
    (1, "none", "cpu"),
    (2, "none", "nvme"),
    (3, "cpu", "cpu"),
    (3, "nvme", "cpu"),
    (3, "cpu", "nvme"),
    (3, "nvme", "nvme"),
]
CASES = [(layout, precision) for layout in LAYOUTS for precision in DTYPES] + [
    ("passthrough", "fp32")
]

# Exact in fp32, bf16 and fp16: the 16-bit parameter and its fp32 master can agree bit for bit.
NEW = torch.tensor([0.5, -1.25, 2.0, 0.0])


def _case_id(layout, precision: str) -> str:
    return (
        layout if isinstance(layout, str) else "stage{}-param_{}-optim_{}".format(*layout)
    ) + f"-{precision}"


def _config(layout, precision: str, nvme) -> dict:
    stage, param, optim = (0, "none", "none") if layout == "passthrough" else layout
    cfg = engine_config(stage, param, optim, nvme, gas=1)
    cfg["zero_optimization"]["sub_group_size"] = (
        10**9
    )  # one sub-group (why: tests/checkpoint/helpers.py config)
    if layout == "passthrough":
        del cfg["optimizer"]
    else:
        cfg["optimizer"]["params"]["lr"] = 0.0
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def _train(engine, steps: int, rank: int) -> None:
    for step in range(steps):
        x, y = batch(step, 0, rank)
        engine.backward(engine(x, y))
        engine.step()


def _change(model, rank: int) -> None:
    """Rank 0's change (rank 1 writes something else, which must not survive): a partitioned
    parameter whose first and last rows lie in different ranks' shards, the tied embedding (read
    outside its module), and a LayerNorm weight small enough to stay resident under stage 3. Three
    nested contexts, given a bare parameter, a module and a list."""
    fc, wte, ln_f = model.blocks[0].mlp.fc.weight, model.wte.weight, model.ln_f.weight
    with (
        GatheredParameters(fc, modifier_rank=0),
        GatheredParameters(model.ln_f, modifier_rank=0),
        GatheredParameters([wte], modifier_rank=0),
        torch.no_grad(),
    ):
        if rank == 0:
            fc[0, :4] = NEW
            fc[-1, -4:] = NEW
            wte[3, :4] = NEW
            ln_f[0], ln_f[-1] = 3.0, -0.5
        else:
            fc[0, :4] = 7.0
            fc[-1, :] = 7.0
            ln_f.fill_(7.0)


def _expected_masters() -> dict[str, torch.Tensor]:
    """The fp32 masters after the change: the model as built (lr 0 moves nothing) with rank 0's change."""
    torch.manual_seed(0)
    model = tiny_gpt()
    _change(model, 0)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _mismatches(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str
) -> list[str]:
    return [f"{what} {n}" for n in want if not torch.equal(got[n], want[n])]


def _change_survives(rank: int, layout, precision: str, nvme, ckpt_dir) -> list[str]:
    """Mismatches (empty: all good) of the live parameters and of the checkpoint's masters."""
    cfg = _config(layout, precision, nvme)
    torch.manual_seed(0)
    model = tiny_gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0) if layout == "passthrough" else None
    engine = infinity.initialize(model, cfg, optimizer=optimizer)
    want = _expected_masters()
    try:
        _train(engine, 1, rank)  # under stage 3 the step then runs behind: the change waits for it
        _change(model, rank)
        _train(engine, 2, rank)
        with GatheredParameters(engine):
            live = {n: p.detach().clone() for n, p in model.named_parameters()}
        bad = _mismatches(live, {n: w.to(DTYPES[precision]) for n, w in want.items()}, "live")
        ckpt = engine.save_checkpoint(ckpt_dir)
    finally:
        engine.close()
    if rank == 0:
        out = export_checkpoint(ckpt, ckpt_dir / "model.safetensors", progress=False)
        bad += _mismatches(load_file(str(out)), want, "checkpoint master")
    return bad


@pytest.mark.parametrize(("layout", "precision"), CASES, ids=[_case_id(*c) for c in CASES])
def test_change_reaches_parameters_masters_and_checkpoint(layout, precision, nvme_dir, tmp_path):
    assert _change_survives(0, layout, precision, nvme_dir, tmp_path) == []


def _all_cases(rank: int, nvme, root) -> dict[str, list[str]]:
    from pathlib import Path

    return {
        _case_id(layout, precision): _change_survives(
            rank, layout, precision, nvme, Path(root) / _case_id(layout, precision)
        )
        for layout, precision in CASES
    }


@pytest.mark.distributed
def test_change_reaches_every_rank_world_size_2(nvme_dir, tmp_path):
    """Every case in one process group (start-up once): rank 1's parameters, shards and masters follow
    rank 0's change, and rank 1's own writes are overwritten."""
    results = run_distributed(_all_cases, str(nvme_dir), str(tmp_path), world_size=2)
    for rank, bad in enumerate(results):
        assert {case: b for case, b in bad.items() if b} == {}, f"rank {rank}"


@pytest.mark.parametrize("stage", [2, 3])
def test_untouched_elements_and_moments_keep_their_state(stage, nvme_dir):
    """bf16: a change to a few elements replaces exactly their fp32 masters (upcast); the other masters
    keep their fp32 bits (not rounded to bf16) and exp_avg / exp_avg_sq do not move."""
    cfg = _config((stage, "nvme" if stage == 3 else "none", "nvme"), "bf16", nvme_dir)
    cfg["optimizer"]["params"]["lr"] = 1e-3  # masters that bf16 cannot represent
    torch.manual_seed(0)
    model = tiny_gpt()
    engine = infinity.initialize(model, cfg)
    try:
        _train(engine, 2, 0)
        before = snapshot(engine)["shards"]
        _change(model, 0)
        after = snapshot(engine)["shards"]
        unit_of = engine.runtime.unit_map.unit_of
        fc_unit = unit_of[model.blocks[0].mlp.fc.weight][0].index
        changed_units = {
            unit_of[p][0].index
            for p in (model.blocks[0].mlp.fc.weight, model.wte.weight, model.ln_f.weight)
        }
    finally:
        engine.close()
    for (unit, role), t in before.items():
        if role != "master" or unit not in changed_units:
            assert torch.equal(after[(unit, role)], t), (unit, role)
    master_before, master_after = before[(fc_unit, "master")], after[(fc_unit, "master")]
    changed = master_after != master_before
    assert int(changed.sum()) == 8  # row 0's first four elements and the last row's last four
    assert torch.equal(master_after[changed], torch.cat([NEW, NEW]))
    assert torch.equal(master_after[~changed], master_before[~changed])
    assert not torch.equal(
        master_before, master_before.bfloat16().float()
    )  # fp32 bits worth keeping


def test_one_context_over_an_engine_and_a_model_built_under_init(nvme_dir, monkeypatch):
    """Hugging Face's resize_token_embeddings under ZeRO-3: the old embedding (an engine's) is copied
    into a new one built under zero.Init, in one context over both owners. An owner whose write-back
    fails does not leave the other's parameters gathered."""
    cfg = _config((3, "nvme", "nvme"), "bf16", nvme_dir)
    torch.manual_seed(0)
    model = tiny_gpt()
    engine = infinity.initialize(model, cfg)
    try:
        with infinity.zero.Init(cfg):
            new = torch.nn.Embedding(80, 32)
        old = model.wte.weight
        with GatheredParameters(old):
            want = old.detach().float().clone()
        with GatheredParameters([old, new.weight], modifier_rank=0), torch.no_grad():
            new.weight[:64] = old
        with GatheredParameters(new):
            assert torch.equal(new.weight[:64], want)

        def fail(*args, **kwargs):
            raise OSError("disk gone")

        monkeypatch.setattr(engine.runtime.optimizer, "overwrite_master", fail)
        with (
            pytest.raises(OSError, match="disk gone"),
            GatheredParameters([old, new.weight], modifier_rank=0),
        ):
            with torch.no_grad():
                old[0] = 1.0
        assert engine.runtime.partitioner.gathered_units() == []
        assert new.weight.numel() == 0  # released although the engine's write-back failed first
    finally:
        engine.close()
