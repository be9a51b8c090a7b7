"""docs/huggingface.md's example runs as written (the page marks it no-run: it needs these inputs).

Its inputs (named in its first comment) are given here: a tiny Llama saved with save_pretrained, the
tests' DeepSpeed config, two batches and a prompt. What it leaves behind is checked against
transformers: ``out`` is what from_pretrained loads, with the resized vocabulary.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tests.hf.models import VOCAB, batch, build, ds_config

PAGE = Path(__file__).resolve().parents[2] / "docs" / "huggingface.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 1, "the page has one example"
    return blocks[0]


def test_the_hugging_face_example_runs(nvme_dir, tmp_path, monkeypatch):
    build("llama").save_pretrained(tmp_path / "llama")
    monkeypatch.chdir(tmp_path)  # the example writes "out"
    cfg = ds_config(nvme_dir)
    cfg["optimizer"]["params"]["lr"] = (
        "auto"  # as HF's configs write it: the example's lr= fills it
    )
    scope = {
        "checkpoint_dir": str(tmp_path / "llama"),
        "ds_config": cfg,
        "batches": [batch("llama", i) for i in range(2)],
        "prompt": batch("llama", 0)["input_ids"],
    }
    try:
        exec(compile(_example(), str(PAGE), "exec"), scope)
    finally:
        if "engine" in scope:
            scope["engine"].close()
    assert scope["tokens"].shape[1] == scope["prompt"].shape[1] + 16
    import transformers as tf

    saved = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert saved.get_input_embeddings().weight.shape[0] == VOCAB + 8
    with torch.no_grad():
        assert torch.isfinite(saved(input_ids=scope["prompt"]).logits).all()
