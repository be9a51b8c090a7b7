"""Checkpoints of a LoRA run whose frozen base rests quantised ([Note: a quantised base in a checkpoint]
in infinity/engine/checkpoint/quantised.py): PEFT on a tiny Llama, stage 3 on NVMe, the base in NF4
(with double quantisation too).

Oracles: the uninterrupted run (a new process that loads the checkpoint continues with its losses),
bitsandbytes' own ``quantize_4bit`` / ``dequantize_4bit`` for the weights an export writes (what the
adapters were trained against), the checkpoint's own files for what it holds (a reference to the
pretrained files and no base bytes, or the packed base once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch

import infinity
from infinity.engine.checkpoint import CheckpointMismatchError, export_checkpoint
from tests.hf.lora import lora
from tests.hf.models import batch, build, build_under_init
from tests.hf.test_lora_quantised import config, dequantised

ROOT = Path(__file__).resolve().parents[2]
SEED = {"files": 3, "saved": 0}  # the base's weights: a pretrained directory's, or built in place


def make_engine(nvme_dir, kind: str | None, pretrained: str | os.PathLike | None = None):
    """The LoRA engine over the tiny Llama built under zero.Init (read from ``pretrained`` when given),
    its frozen base at rest as ``kind`` says (None: in its dtype)."""
    Path(nvme_dir).mkdir(exist_ok=True)
    cfg = config(nvme_dir, kind, nontrainable=kind is not None)
    model = build_under_init("llama", cfg, seed=SEED["saved"])
    if pretrained is not None:
        infinity.zero.load_pretrained(model, pretrained)
    return infinity.initialize(lora(model), cfg)


def train(engine, first: int, last: int) -> list[float]:
    losses = []
    for step in range(first, last):
        loss = engine(**batch("llama", step)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


CHILD = textwrap.dedent("""
    import json, sys
    from tests.hf.test_lora_quantised_checkpoint import make_engine, train
    nvme, kind, pretrained, ckpt = sys.argv[1:5]
    engine = make_engine(nvme, kind, pretrained or None)
    engine.load_checkpoint(ckpt)
    print(json.dumps({"losses": train(engine, 2, 4), "step": engine.global_steps}))
    engine.close()
""")


def frozen_matrices_are_the_dequantised_base(
    weights: dict, base: torch.nn.Module, kind: str = "nf4"
) -> None:
    """The frozen matrices of an exported state dict hold the base's NF4-dequantised values (bitsandbytes'
    oracle; ``kind`` "nf4-dq": double-quantised); the rest of the base (norms) its values."""
    for name, w in base.state_dict().items():
        key = f"base_model.model.{name}".replace(".weight", ".base_layer.weight")
        got = weights.get(key, weights.get(f"base_model.model.{name}"))
        assert got is not None, name
        want = dequantised(w, kind) if w.dim() >= 2 else w
        assert torch.equal(got, want), name


@pytest.mark.parametrize(("source", "kind"), [("files", "nf4"), ("saved", "nf4-dq")])
def test_a_quantised_base_checkpoints_and_resumes_in_a_new_process_with_the_same_losses(
    source, kind, nvme_dir, tmp_path
):
    """A base from files in NF4; one built in place in NF4 with double quantisation (its packed bytes,
    nested scales included, saved once and loaded as they are)."""
    pretrained = None
    if source == "files":
        pretrained = tmp_path / "base"
        build("llama", seed=SEED["files"]).save_pretrained(pretrained)
    ckpt = tmp_path / "ckpt"
    engine = make_engine(nvme_dir / "a", kind, pretrained)
    try:
        losses = train(engine, 0, 2)
        saved_at = engine.save_checkpoint(ckpt)
        live = engine.save_16bit_model(tmp_path / "live", layout="state_dict")
        losses += train(engine, 2, 4)
        formats = {u.index: engine.runtime.plan.format_of(u) for u in engine.runtime.unit_map.units}
    finally:
        engine.close()

    manifest = json.loads((Path(saved_at) / "manifest.json").read_text())
    quantised = [u for u in manifest["units"] if u["quant"] is not None]
    assert quantised and all(u["quant"]["quant_type"] == "nf4" for u in quantised)
    assert all(u["quant"]["double_quant"] == (kind == "nf4-dq") for u in quantised)
    assert not any(u["trainable"] for u in quantised)
    (part,) = sorted(Path(saved_at).glob("part*.safetensors"))
    with safetensors.safe_open(part, "pt") as f:
        held = set(f.keys())
        for i, u in enumerate(manifest["units"]):
            if u["quant"] is None:
                continue
            if source == "files":  # the base is a reference to its files, none of its bytes
                assert u["source"] is not None and f"u{i}.param" not in held
            else:  # the base's packed bytes, once
                t = f.get_tensor(f"u{i}.param")
                assert t.dtype == torch.uint8 and t.numel() == formats[i].nbytes
    # save_16bit_model and export write what training saw: the dequantised base, and the adapters
    written = safetensors.torch.load_file(live)
    frozen_matrices_are_the_dequantised_base(written, build("llama", seed=SEED[source]), kind)
    exported = safetensors.torch.load_file(
        export_checkpoint(saved_at, tmp_path / "out.safetensors")
    )
    assert exported.keys() == written.keys()
    for name, w in written.items():
        assert torch.equal(exported[name], w), name

    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(nvme_dir / "b"), kind, str(pretrained or ""), str(ckpt)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    resumed = json.loads(child.stdout.strip().splitlines()[-1])
    assert resumed["step"] == 4
    assert resumed["losses"] == pytest.approx(losses[2:], rel=1e-6)


def test_a_checkpoint_of_a_16bit_base_loads_under_a_quantised_one(nvme_dir, tmp_path):
    """The base's values are read from the checkpoint and quantised as this engine's format says."""
    engine = make_engine(nvme_dir / "a", None)
    try:
        train(engine, 0, 1)
        saved_at = engine.save_checkpoint(tmp_path / "ckpt")
        adapters = {n: t for n, t in engine.gathered_state_dict().items() if ".lora_" in n}
    finally:
        engine.close()
    engine = make_engine(nvme_dir / "b", "nf4")
    try:
        engine.load_checkpoint(saved_at)
        written = safetensors.torch.load_file(
            engine.save_16bit_model(tmp_path / "live", layout="state_dict")
        )
    finally:
        engine.close()
    frozen_matrices_are_the_dequantised_base(written, build("llama", seed=SEED["saved"]))
    for n, t in adapters.items():
        assert torch.equal(written[n], t), n


@pytest.mark.parametrize(
    ("saved", "live", "names"),
    [("nf4", "int8", ("NF4", "int8")), ("nf4-dq", "nf4", (r"NF4\+DQ", "NF4"))],
)
def test_packed_base_bytes_are_refused_under_another_format_naming_the_unit_and_the_fix(
    saved, live, names, nvme_dir, tmp_path
):
    engine = make_engine(nvme_dir / "a", saved)
    try:
        saved_at = engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()
    engine = make_engine(nvme_dir / "b", live)
    try:
        with pytest.raises(
            CheckpointMismatchError,
            match=rf"frozen weights of '.*' were saved quantised \({names[0]}, groups of 32\) as their "
            rf"packed bytes, and this engine keeps it quantised \({names[1]}, groups of 32\); load "
            r"the checkpoint with the weight_quantization and world size it was saved with",
        ):
            engine.load_checkpoint(saved_at)
    finally:
        engine.close()
