"""The merged export at world size 2 (gloo, ranks as under torchrun): the live ``engine.save_merged``
([Note: merged export] in infinity/engine/checkpoint/merged.py), ``infinity export --merge-adapters`` run
by every rank (rank 0 writes, the others serve their part of the checkpoint), and the same command in
one process over the checkpoint the two ranks saved ([Note: merging from a checkpoint] in
merged_checkpoint.py). PEFT LoRA on a tiny Llama built under zero.Init, stage 3, base on NVMe.

Oracles: PEFT's own ``merge_and_unload()`` on the plain model holding the adapters the ranks trained,
and transformers' ``from_pretrained`` for each directory written (weights and logits, exactly).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from infinity.cli import main as cli_main
from tests.distributed import run_distributed
from tests.hf.lora import assert_loads_as
from tests.hf.test_lora_merge import plain_merged
from tests.hf.test_lora_quantised_checkpoint import make_engine, train

pytestmark = pytest.mark.distributed


def _train_save_and_merge(rank: int, nvme: str, out: str) -> dict:
    root = Path(out)
    engine = make_engine(Path(nvme), None)  # each rank swaps under nvme/rank<N>
    try:
        train(engine, 0, 1)  # B is zero at the start: after a step the merge changes the weights
        engine.save_merged(root / "live")
        engine.save_checkpoint(root / "ckpt")
        adapters = {n: t for n, t in engine.gathered_state_dict().items() if ".lora_" in n}
    finally:
        engine.close()
    args = ["export", "--merge-adapters", str(root / "ckpt"), str(root / "ranks"), "--no-progress"]
    return {"adapters": adapters, "exit": cli_main.main(args)}


def _same_files(got: Path, want: Path) -> None:
    written = safetensors.torch.load_file(got / "model.safetensors")
    same = safetensors.torch.load_file(want / "model.safetensors")
    assert written.keys() == same.keys()
    for n, w in same.items():
        assert torch.equal(written[n], w), n
    assert json.loads((got / "config.json").read_text()) == json.loads(
        (want / "config.json").read_text()
    )


def test_the_merged_export_at_world_size_2_is_peft_merge_and_unload(nvme_dir, tmp_path):
    results = run_distributed(_train_save_and_merge, str(nvme_dir), str(tmp_path), world_size=2)
    assert [r["exit"] for r in results] == [0, 0]
    adapters = {n: torch.from_numpy(t) for n, t in results[0]["adapters"].items()}
    for n, t in results[1]["adapters"].items():
        assert torch.equal(torch.from_numpy(t), adapters[n]), n  # gathered whole on every rank
    assert any(t.abs().max() > 0 for n, t in adapters.items() if ".lora_B." in n)

    live = tmp_path / "live"
    written = safetensors.torch.load_file(live / "model.safetensors")
    assert not any("lora_" in n or "base_layer" in n for n in written)
    assert_loads_as(live, plain_merged(adapters, None))
    _same_files(tmp_path / "ranks", live)  # the command under torchrun

    one = tmp_path / "one"  # the checkpoint of two ranks, merged by one process
    args = ["export", "--merge-adapters", str(tmp_path / "ckpt"), str(one), "--no-progress"]
    assert cli_main.main(args) == 0
    _same_files(one, live)
    assert_loads_as(one, plain_merged(adapters, None))
