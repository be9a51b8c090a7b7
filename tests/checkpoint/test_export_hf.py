"""A checkpoint saved during training carries what an export needs (config.json as the model is at the
save, PEFT's adapter config): ``infinity export CKPT OUT`` with no flag writes a folder that
transformers' ``from_pretrained`` (or peft's ``PeftModel.from_pretrained``) loads with the engine's
weights, bit for bit (fp32 training: the masters are the weights), also after
``resize_token_embeddings``; a ``--config`` that does not fit the weights is refused naming the tensor
and both shapes."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers as tf

import infinity
from infinity.cli import main as cli_main
from tests.checkpoint.helpers import config as engine_cfg
from tests.checkpoint.helpers import weights
from tests.hf import models as hf

RESIZED = hf.VOCAB + 16


def _train(engine, steps: int = 2) -> None:
    for step in range(steps):
        loss = engine(**hf.batch("llama", step)).loss
        engine.backward(loss)
        engine.step()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two Llamas trained under stage 3 on NVMe and checkpointed: as built, and resized before training."""
    import os
    import shutil
    from pathlib import Path

    base = Path(os.environ.get("INFINITY_TEST_NVME", Path.home() / ".cache" / "infinity-tests"))
    root = base / f"{os.getpid()}-export-hf"
    shutil.rmtree(root, ignore_errors=True)
    out = {}
    try:
        for name in ("plain", "resized"):
            (root / name / "swap").mkdir(parents=True)
            model = hf.build("llama", seed=0)
            if name == "resized":
                model.resize_token_embeddings(RESIZED)
            engine = infinity.initialize(
                model, engine_cfg(3, "nvme", "nvme", root / name / "swap", gas=1)
            )
            try:
                _train(engine)
                ckpt = engine.save_checkpoint(root / name / "ckpt")
                out[name] = (ckpt, weights(engine))
            finally:
                engine.close()
        yield root, out
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("name", ["plain", "resized"])
def test_export_without_flags_loads_with_from_pretrained(saved, name, tmp_path):
    root, runs = saved
    ckpt, engine_weights = runs[name]
    assert json.loads((ckpt / "config.json").read_text())["vocab_size"] == (
        RESIZED if name == "resized" else hf.VOCAB
    )
    assert (
        cli_main.main(["export", str(root / name / "ckpt"), str(tmp_path / "out"), "--no-progress"])
        == 0
    )
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert isinstance(model, tf.LlamaForCausalLM)
    loaded = dict(model.named_parameters())
    assert loaded.keys() == engine_weights.keys()
    for n, w in engine_weights.items():
        assert loaded[n].dtype == w.dtype and torch.equal(loaded[n].detach(), w), n


def test_a_config_that_does_not_fit_the_weights_is_refused(saved, tmp_path, capsys):
    root, _ = saved
    hf.config("llama").save_pretrained(
        tmp_path / "cfg"
    )  # the vocabulary before resize_token_embeddings
    args = [
        "export",
        str(root / "resized" / "ckpt"),
        str(tmp_path / "out"),
        "--config",
        str(tmp_path / "cfg"),
        "--no-progress",
    ]
    assert cli_main.main(args) == 1
    err = capsys.readouterr().err
    assert (
        "'model.embed_tokens.weight'" in err
        and f"[{RESIZED}, 32]" in err
        and f"[{hf.VOCAB}, 32]" in err
    )
    assert not (tmp_path / "out" / "model.safetensors").exists()
    # The matching config passes the check.
    assert (
        cli_main.main(
            [
                "export",
                str(root / "plain" / "ckpt"),
                str(tmp_path / "ok"),
                "--config",
                str(tmp_path / "cfg" / "config.json"),
                "--no-progress",
            ]
        )
        == 0
    )


def test_a_lora_checkpoint_exports_the_adapter_peft_loads(tmp_path, nvme_dir):
    import peft

    from tests.checkpoint.test_frozen import lora_engine, lora_train, make_base

    engine = lora_engine(tmp_path, nvme_dir, seed=0)
    try:
        lora_train(engine, 0, 2)
        engine.save_checkpoint(tmp_path / "ckpt")
        lora = {n: w for n, w in weights(engine).items() if "lora_" in n}
    finally:
        engine.close()
    ckpt = next((tmp_path / "ckpt").glob("global_step*"))
    assert {"config.json", "adapter_config.json"} <= {f.name for f in ckpt.iterdir()}
    assert (
        cli_main.main(
            ["export", str(tmp_path / "ckpt"), str(tmp_path / "adapter"), "--no-progress"]
        )
        == 0
    )
    base = tf.AutoModelForCausalLM.from_pretrained(make_base(tmp_path))
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
        )
        model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert loaded.keys() == lora.keys() and len(lora) == 8  # q_proj, v_proj x A, B x 2 layers
    for n, w in lora.items():
        assert torch.equal(loaded[n].detach(), w), n
