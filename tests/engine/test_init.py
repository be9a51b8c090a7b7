"""zero.Init: a model built inside it has the same weights as one built without it (same seed),
and trains the same; its parameters never exist whole in memory outside one module at a time."""

import pytest
import torch

import infinity
from infinity.zero.gathered import GatheredParameters
from tests.distributed import run_distributed
from tests.engine.models import MODELS
from tests.engine.reference import engine_config, engine_run, reference_run


def _build_and_gather(rank, name, offload_param, nvme_dir):
    cfg = engine_config(3, offload_param, "cpu", nvme_dir, gas=1)
    torch.manual_seed(0)
    with infinity.zero.Init(cfg):
        model = MODELS[name]()
    placeholders = all(p.numel() == 0 for p in model.parameters())
    engine = infinity.initialize(model, cfg)
    try:
        with GatheredParameters(engine):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        engine.close()
    return placeholders, weights


def _plain(name):
    torch.manual_seed(0)
    return {n: p.detach() for n, p in MODELS[name]().named_parameters()}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("offload_param", ["none", "cpu", "nvme"])
def test_same_weights_as_without_init(name, offload_param, nvme_dir):
    placeholders, weights = _build_and_gather(0, name, offload_param, str(nvme_dir))
    assert placeholders, "parameters were left whole after zero.Init"
    for n, ref in _plain(name).items():
        assert torch.equal(weights[n], ref), n


def test_shards_larger_than_the_init_pool_are_stored_in_pieces(monkeypatch, nvme_dir):
    # 4 KiB pieces: every MLP layer of the models spans several keys (a 2B model's do at 32 MiB)
    monkeypatch.setattr(infinity.zero.init, "_INIT_CHUNK_NBYTES", 4096)
    placeholders, weights = _build_and_gather(0, "gpt", "nvme", str(nvme_dir))
    assert placeholders
    for n, ref in _plain("gpt").items():
        assert torch.equal(weights[n], ref), n


def test_init_with_stage_below_3_does_nothing(caplog):
    with infinity.zero.Init({"zero_optimization": {"stage": 2}}):
        model = MODELS["twice"]()
    assert all(p.numel() > 0 for p in model.parameters())
    assert "zero.Init does nothing with zero_optimization.stage=2" in caplog.text


@pytest.mark.distributed
def test_same_weights_world_size_2(nvme_dir):
    results = run_distributed(_build_and_gather, "gpt", "nvme", str(nvme_dir), world_size=2)
    for placeholders, weights in results:
        assert placeholders
        for n, ref in _plain("gpt").items():
            assert (weights[n] == ref.numpy()).all(), n


def test_model_built_under_init_trains_like_plain_pytorch(nvme_dir, monkeypatch):
    """engine_run builds the model itself; build it under Init instead (same seed)."""
    cfg = engine_config(3, "nvme", "nvme", nvme_dir, gas=2)
    factory = MODELS["gpt"]

    def built_under_init():
        with infinity.zero.Init(cfg):
            return factory()

    monkeypatch.setitem(MODELS, "gpt", built_under_init)
    losses, weights = engine_run("gpt", cfg, steps=4, gas=2)
    monkeypatch.setitem(MODELS, "gpt", factory)
    ref_losses, ref_weights = reference_run("gpt", steps=4, gas=2, world_size=1)
    for k, v in ref_losses.items():
        assert losses[k] == pytest.approx(v, rel=1e-5), k
    for n, ref in ref_weights.items():
        assert (weights[n] - ref).abs().max() <= 1e-5 * ref.abs().max(), n
