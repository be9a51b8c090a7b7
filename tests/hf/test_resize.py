"""resize_token_embeddings and tied weights on a model built under zero.Init.

transformers 5.23 takes its ZeRO-3 path only where ``is_deepspeed_zero3_enabled()`` (DeepSpeed
installed and configured), so here it runs its plain path: it builds a new ``nn.Embedding``, copies
the old rows into it and assigns the result to the old parameter's ``.data`` — reading and changing
the parameter whole. The recipe: call it inside ``GatheredParameters([input and output embedding
weights], modifier_rank=0)`` before ``initialize``; zero.Init's store then lays the larger parameter
out anew. After ``initialize`` the units' layout is fixed and the change is refused, naming the fix.
"""

from __future__ import annotations

import pytest
import torch

import infinity
from infinity.zero.gathered import GatheredParameters
from tests.hf.models import ARCHS, VOCAB, batch, build, config, ds_config

NEW_VOCAB = VOCAB + 12


def _embeddings(model):
    return [
        m.weight
        for m in (model.get_input_embeddings(), model.get_output_embeddings())
        if m is not None
    ]


@pytest.mark.parametrize("arch", ["gpt2", "llama", "t5"])  # tied, untied, tied three ways
def test_resize_token_embeddings_under_gathered_parameters_before_initialize(arch, nvme_dir):
    cfg = ds_config(nvme_dir)
    plain = build(arch)
    plain.resize_token_embeddings(
        NEW_VOCAB
    )  # mean resizing samples from the RNG: same state in both runs
    torch.manual_seed(0)
    with infinity.zero.Init(cfg):
        model = ARCHS[arch][0](config(arch))
    with GatheredParameters(_embeddings(model), modifier_rank=0):
        model.resize_token_embeddings(NEW_VOCAB)
    assert model.config.vocab_size == NEW_VOCAB
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (arch != "llama")
    with GatheredParameters(model.get_input_embeddings().weight):
        assert model.get_input_embeddings().weight.shape == (
            NEW_VOCAB,
            model.config.get_text_config().hidden_size,
        )
    engine = infinity.initialize(model, cfg)
    try:
        with GatheredParameters(engine):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        for n, p in plain.named_parameters():
            assert torch.equal(weights[n], p.detach()), n
        b = batch(arch, 0)
        b["input_ids"][:, -1] = NEW_VOCAB - 1  # a token that only exists after the resize
        torch.manual_seed(1)  # dropout draws the same masks in both
        loss = engine(**b).loss
        engine.backward(loss)
        engine.step()
        torch.manual_seed(1)
        assert loss.item() == plain(**b).loss.item()
        if tied:
            with GatheredParameters(engine):
                assert torch.equal(
                    model.get_input_embeddings().weight, model.get_output_embeddings().weight
                )
    finally:
        engine.close()


def test_resize_after_initialize_is_refused_naming_the_recipe(nvme_dir):
    cfg = ds_config(nvme_dir)
    torch.manual_seed(0)
    with infinity.zero.Init(cfg):
        model = ARCHS["gpt2"][0](config("gpt2"))
    engine = infinity.initialize(model, cfg)
    try:
        with (
            pytest.raises(RuntimeError, match=r"after infinity\.initialize.*before initialize"),
            GatheredParameters(_embeddings(model), modifier_rank=0),
        ):
            model.resize_token_embeddings(NEW_VOCAB)
        with GatheredParameters(engine):  # the units are as they were
            assert model.get_input_embeddings().weight.shape == (VOCAB, 32)
    finally:
        engine.close()


def test_a_new_shape_without_modifier_rank_is_refused(nvme_dir):
    cfg = ds_config(nvme_dir)
    with infinity.zero.Init(cfg):
        model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8))
    weight = model[0].weight
    with pytest.raises(RuntimeError, match="pass modifier_rank=0"), GatheredParameters(weight):
        weight.data = torch.zeros(VOCAB + 1, 8)
    with GatheredParameters(weight):
        assert weight.shape == (VOCAB, 8)  # dropped, as the message says
