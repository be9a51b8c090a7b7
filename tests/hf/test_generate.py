"""``model.generate()`` on a model trained under stage 3: greedy decoding gives plain PyTorch's tokens.

generate() calls the module itself (many forwards, a KV cache, encoder outputs reused by T5's
decoder); the partitioner fetches each unit as the module runs, and the engine's own eval forwards
keep working beside it.
"""

from __future__ import annotations

import pytest
import torch

import infinity
from tests.hf.models import CAUSAL, batch, build, build_under_init, ds_config


@pytest.mark.parametrize("arch", [*CAUSAL, "t5"])
def test_greedy_generate_gives_plain_pytorchs_tokens(arch, nvme_dir):
    cfg = ds_config(nvme_dir)
    plain = build(arch).eval()
    engine = infinity.initialize(build_under_init(arch, cfg), cfg)
    try:
        engine.eval()
        prompt = batch(arch, 0)["input_ids"]
        kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=1)
        with torch.no_grad():
            want = plain.generate(prompt, **kw)
            got = engine.module.generate(prompt, **kw)
        assert torch.equal(got, want)
        assert got.shape[1] == 8 + (
            1 if arch == "t5" else prompt.shape[1]
        )  # T5 starts from its decoder start
        # an eval forward through the engine after generate(): the same logits as plain
        inputs = {"input_ids": prompt, **({"decoder_input_ids": want} if arch == "t5" else {})}
        with torch.no_grad():
            assert torch.equal(engine(**inputs).logits, plain(**inputs).logits)
    finally:
        engine.close()
