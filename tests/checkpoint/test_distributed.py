"""World size 2 (gloo): resume equals continue, and re-partitioning 2 -> 1 -> 2.

Two ranks train N steps (each on its own batches) and save; they train M more. Then, in fresh
processes: (a) two ranks load that checkpoint and train M steps: same losses, weights and buffers on
each rank, bit for bit; (b) one process loads it (re-partitioned to world size 1), checks the full
weights, saves it again, and two fresh ranks load that one (re-partitioned back to 2) and train M
steps: again the same losses and weights, so nothing of the optimizer state was lost either way.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infinity.cli import main as cli_main
from infinity.engine.checkpoint import CheckpointCorruptError, CheckpointPeerError
from infinity.weights.header import read_header
from tests.checkpoint.helpers import (
    M_STEPS,
    N_STEPS,
    assert_same,
    config,
    eval_logits,
    flip_byte,
    make_engine,
    snapshot,
    train,
    weights,
)
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed

# name: (stage, offload_param, offload_optimizer, model)
CASES = {
    "stage3-params-and-optimizer-on-nvme": (3, "nvme", "nvme", "gpt"),
    "stage1-optimizer-on-nvme": (1, "none", "nvme", "tied"),
}


def _state(engine, losses):
    return {
        "losses": losses,
        "weights": weights(engine),
        "buffers": {n: b.clone() for n, b in engine.module.named_buffers()},
    }


def _continue(rank, roots):
    out = {}
    for case, root in roots.items():
        stage, param, optim, model = CASES[case]
        engine, _ = make_engine(model, config(stage, param, optim, Path(root) / "swap"), seed=0)
        try:
            train(engine, 0, N_STEPS, rank=rank)
            engine.save_checkpoint(Path(root) / "ckpt", client_state={"rank": rank})
            at_save = weights(engine)
            logits = eval_logits(engine.eval())
            engine.train()
            out[case] = {
                **_state(engine, train(engine, N_STEPS, M_STEPS, rank=rank)),
                "at_save": at_save,
                "logits": logits,
            }
        finally:
            engine.close()
    return out


def _resume(rank, roots, ckpt_name, corrupt_name=None):
    out = {}
    for case, root in roots.items():
        stage, param, optim, model = CASES[case]
        engine, _ = make_engine(model, config(stage, param, optim, Path(root) / "swap"), seed=1)
        try:
            if corrupt_name is not None:
                # Rank 1's shard is corrupt: both ranks refuse, and neither changes anything.
                before = snapshot(engine)
                with pytest.raises(
                    CheckpointCorruptError if rank == 1 else CheckpointPeerError,
                    match="part-00001-of-00002" if rank == 1 else "rank.s. 1",
                ):
                    engine.load_checkpoint(Path(root) / corrupt_name)
                assert_same(before, snapshot(engine), f"rank {rank} after a failed load")
            client = engine.load_checkpoint(Path(root) / ckpt_name)
            out[case] = {
                **_state(engine, train(engine, N_STEPS, M_STEPS, rank=rank)),
                "client": client,
            }
        finally:
            engine.close()
    return out


@pytest.fixture(scope="module")
def saved():
    base = Path(os.environ.get("INFINITY_TEST_NVME", Path.home() / ".cache" / "infinity-tests"))
    root = base / f"{os.getpid()}-distributed"
    shutil.rmtree(root, ignore_errors=True)
    roots = {case: str(root / case) for case in CASES}
    for r in roots.values():
        (Path(r) / "swap").mkdir(parents=True)
    try:
        yield roots, run_distributed(_continue, roots, world_size=2)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _assert_equal_runs(a, b, *, buffers=True):
    assert a["losses"] == b["losses"]
    for name, w in a["weights"].items():
        assert torch.equal(torch.as_tensor(w), torch.as_tensor(b["weights"][name])), name
    if buffers:
        for name, buf in a["buffers"].items():
            assert torch.equal(torch.as_tensor(buf), torch.as_tensor(b["buffers"][name])), name


def test_resume_equals_continue_world_size_2(saved):
    roots, cont = saved
    for root in roots.values():
        good = next((Path(root) / "ckpt").glob("global_step*"))
        bad = Path(root) / "corrupt" / good.name
        shutil.copytree(good, bad)
        part = bad / "part-00001-of-00002.safetensors"
        flip_byte(part, read_header(str(part)).entries["u0.exp_avg"].begin + 8)
    resumed = run_distributed(
        _resume, roots, "ckpt", str(Path("corrupt") / good.name), world_size=2
    )
    for case in CASES:
        for rank in range(2):
            _assert_equal_runs(cont[rank][case], resumed[rank][case])
            assert resumed[rank][case]["client"] == {"rank": rank}


def test_repartition_2_to_1_and_back(saved, tmp_path):
    roots, cont = saved
    for case, root in roots.items():
        stage, param, optim, model = CASES[case]
        (tmp_path / case).mkdir()
        engine, _ = make_engine(model, config(stage, param, optim, tmp_path / case), seed=1)
        try:
            engine.load_checkpoint(Path(root) / "ckpt")  # saved by 2 ranks, loaded by 1
            assert engine.global_steps == N_STEPS
            for name, w in weights(engine).items():
                assert torch.equal(w, torch.as_tensor(cont[0][case]["at_save"][name])), (case, name)
            engine.save_checkpoint(Path(root) / "ckpt-w1")  # one partition
        finally:
            engine.close()
    resumed = run_distributed(_resume, roots, "ckpt-w1", world_size=2)  # 1 -> 2
    assert (
        resumed[0]["stage1-optimizer-on-nvme"]["losses"][0]
        == cont[0]["stage1-optimizer-on-nvme"]["losses"][0]
    )
    # Without dropout the whole run matches: weights, Adam moments and step counts all survived 2 -> 1 -> 2.
    # (TiedNet's dropout on rank 1 draws from an RNG state that world size 1 never had, and its BatchNorm
    # buffers come back as rank 0's; both are exact in test_resume_equals_continue_world_size_2.)
    case = "stage3-params-and-optimizer-on-nvme"
    for rank in range(2):
        _assert_equal_runs(cont[rank][case], resumed[rank][case], buffers=False)


def test_export_of_a_two_partition_checkpoint(saved, tmp_path):
    roots, cont = saved
    root = Path(roots["stage3-params-and-optimizer-on-nvme"])
    out = tmp_path / "gpt.safetensors"
    assert cli_main.main(["export", str(root / "ckpt"), str(out), "--no-progress"]) == 0
    state = load_file(str(out))
    at_save = cont[0]["stage3-params-and-optimizer-on-nvme"]["at_save"]
    assert state.keys() == at_save.keys()
    for name, w in at_save.items():
        assert torch.equal(state[name], torch.as_tensor(w)), name
    from tests.checkpoint.helpers import MODELS

    model = MODELS["gpt"]()
    model.load_state_dict(state, strict=True)
    torch.testing.assert_close(
        eval_logits(model.eval()),
        torch.as_tensor(cont[0]["stage3-params-and-optimizer-on-nvme"]["logits"]),
        rtol=0,
        atol=0,
    )
