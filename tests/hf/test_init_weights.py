"""zero.Init gives the weights plain construction gives, for transformers' own models.

Their ``_init_weights`` writes through views of parameters (``init.zeros_(weight[padding_idx])`` for
OPT's and BERT's padding rows, ``.data`` elsewhere), and ties embeddings; the state dict after
``with zero.Init(): model = Cls(config)`` and ``initialize``, read with GatheredParameters, must be
plain construction's bit for bit (same seed), and so must the first loss.
"""

from __future__ import annotations

import pytest
import torch

import infinity
from infinity.zero.gathered import GatheredParameters
from tests.hf.models import ARCHS, batch, build, build_under_init, ds_config


@pytest.mark.parametrize("arch", list(ARCHS))
def test_zero_init_gives_the_weights_of_plain_construction(arch, nvme_dir):
    cfg = ds_config(nvme_dir)
    plain = build(arch)
    model = build_under_init(arch, cfg)
    assert all(p.numel() == 0 for p in model.parameters()), "zero.Init left parameters whole"
    engine = infinity.initialize(model, cfg)
    try:
        with GatheredParameters(engine):
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assert state.keys() == plain.state_dict().keys()
        for k, v in plain.state_dict().items():
            assert torch.equal(state[k], v), k
        if arch in ("opt", "bert"):  # the padding row _init_weights zeroes through a view
            pad = model.config.pad_token_id
            assert (
                state[
                    next(
                        k
                        for k in state
                        if k.endswith("word_embeddings.weight") or k.endswith("embed_tokens.weight")
                    )
                ][pad]
                == 0
            ).all()
        torch.manual_seed(1)
        first = engine(**batch(arch, 0)).loss.item()
        torch.manual_seed(1)
        assert first == plain(**batch(arch, 0)).loss.item()
    finally:
        engine.close()
