"""zero.Init: a model built inside it has the same weights as one built without it (same seed),
and trains the same; its parameters never exist whole in memory outside one module at a time."""

import pytest
import torch

import infinity
from infinity.zero.gathered import GatheredParameters
from tests.distributed import run_distributed
from tests.engine.models import MODELS, batch
from tests.engine.reference import engine_config, engine_run, reference_run


def _change(model, rank):
    """What Hugging Face does between zero.Init and initialize() (loading and initialising weights):
    a change under GatheredParameters(modifier_rank=0); rank 1's own writes must not survive."""
    fc, ln_f = model.blocks[0].mlp.fc.weight, model.ln_f.weight
    with GatheredParameters([fc, ln_f], modifier_rank=0), torch.no_grad():
        fc[0].fill_(0.5 if rank == 0 else 7.0)
        fc[-1].fill_(-1.5 if rank == 0 else 7.0)
        ln_f.fill_(2.0 if rank == 0 else 7.0)


def _changed(weights):
    weights = {n: w.clone() for n, w in weights.items()}
    weights["blocks.0.mlp.fc.weight"][0] = 0.5
    weights["blocks.0.mlp.fc.weight"][-1] = -1.5
    weights["ln_f.weight"][:] = 2.0
    return weights


def _build_and_gather(rank, name, offload_param, nvme_dir, change=False):
    cfg = engine_config(3, offload_param, "cpu", nvme_dir, gas=1)
    torch.manual_seed(0)
    with infinity.zero.Init(cfg):
        model = MODELS[name]()
    placeholders = all(p.numel() == 0 for p in model.parameters())
    if change:
        _change(model, rank)
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
    """... with rank 0's change made before initialize() (rank 1's writes overwritten)."""
    results = run_distributed(_build_and_gather, "gpt", "nvme", str(nvme_dir), True, world_size=2)
    for placeholders, weights in results:
        assert placeholders
        for n, ref in _changed(_plain("gpt")).items():
            assert (weights[n] == ref.numpy()).all(), n


def test_gathered_parameters_before_initialize(nvme_dir):
    """After the context and before initialize(), GatheredParameters reads parameters whole (and
    leaves them at rest again), and a change made with modifier_rank is what initialize() starts from."""
    cfg = engine_config(3, "nvme", "cpu", nvme_dir, gas=1)
    torch.manual_seed(0)
    with infinity.zero.Init(cfg):
        model = MODELS["gpt"]()
    fc = model.blocks[0].mlp.fc.weight
    with GatheredParameters(model.blocks[0].mlp), GatheredParameters(fc):  # nested: held twice
        assert torch.equal(fc, _plain("gpt")["blocks.0.mlp.fc.weight"])
    assert fc.numel() == 0
    placeholders, weights = _build_and_gather(0, "gpt", "nvme", str(nvme_dir), change=True)
    assert placeholders
    for n, ref in _changed(_plain("gpt")).items():
        assert torch.equal(weights[n], ref), n


def test_model_built_under_init_refuses_to_run_before_initialize(nvme_dir):
    cfg = engine_config(3, "cpu", "cpu", nvme_dir, gas=1)
    with infinity.zero.Init(cfg):
        model = MODELS["gpt"]()
    x, y = batch(0, 0, 0)
    with pytest.raises(
        RuntimeError,
        match=r"built under infinity\.zero\.Init .* pass the model to infinity\.initialize",
    ):
        model(x, y)
    with GatheredParameters(model):  # whole: it runs
        model(x, y)
    with (
        pytest.raises(RuntimeError, match="still being built under infinity.zero.Init"),
        infinity.zero.Init(cfg),
    ):
        inner = torch.nn.Linear(4, 4)
        torch.nn.Sequential(inner)  # registers inner: its parameters are partitioned
        with GatheredParameters(inner.weight):
            pass


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


class _InitThroughViews(torch.nn.Module):
    """A parent that initialises its children's parameters through views, as Hugging Face's
    ``_init_weights`` does (``init.zeros_(emb.weight[padding_idx])``, ``module.weight.data.normal_()``),
    and keeps one view while other parameters are initialised."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        with torch.no_grad():
            torch.nn.init.zeros_(self.emb.weight[1])
            self.a.weight.data.normal_(0.0, 3.0)
            row = self.b.weight[0]
            self.a.bias.data.uniform_(
                -5.0, 5.0
            )  # another parameter between the view's making and its use
            row.fill_(2.0)
            self.b.weight.t()[1].mul_(10.0)  # a view of a view


def test_writes_through_views_of_parameters_are_kept(nvme_dir):
    cfg = engine_config(3, "nvme", "cpu", nvme_dir, gas=1)
    torch.manual_seed(0)
    plain = dict(_InitThroughViews().named_parameters())
    torch.manual_seed(0)
    with infinity.zero.Init(cfg):
        model = _InitThroughViews()
    assert all(p.numel() == 0 for p in model.parameters())
    with GatheredParameters(model):
        for n, p in model.named_parameters():
            assert torch.equal(p, plain[n]), n
        assert (model.emb.weight[1] == 0).all() and (model.b.weight[0, 0] == 2.0)


def test_a_config_with_autos_init_does_not_read_needs_no_arguments(nvme_dir, tmp_path):
    """HF writes lr, batch sizes and bucket sizes as "auto"; zero.Init reads only zero_optimization and
    aio, so it builds with no arguments (as deepspeed.zero.Init does) and initialize fills the rest."""
    import json

    cfg = engine_config(3, "nvme", "nvme", nvme_dir, gas=1)
    cfg["optimizer"]["params"]["lr"] = "auto"
    cfg["train_micro_batch_size_per_gpu"] = "auto"
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = "auto"
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    for config in (cfg, path):
        torch.manual_seed(0)
        with infinity.zero.Init(config):
            model = MODELS["gpt"]()
        engine = infinity.initialize(model, config, lr=1e-3, train_micro_batch_size_per_gpu=2)
        try:
            assert engine.get_lr() == [1e-3]
            loss = engine(*batch(0, 0, 0))
            engine.backward(loss)
            engine.step()
        finally:
            engine.close()
    with pytest.raises(
        TypeError, match="learning_rat"
    ):  # a name that is no argument is still refused
        with infinity.zero.Init(cfg, learning_rat=1e-3):
            pass


def test_initialize_frees_the_init_store_and_its_pool_at_once(nvme_dir):
    """Once initialize() has moved every parameter home, zero.Init's store (its pool's slab, 64 MiB
    touched while building) is freed there and then, not whenever the cyclic garbage collector
    next runs: kept through training, it was +62 MiB on tests/hf/test_memory.py's training peak."""
    import gc
    import weakref

    from infinity.zero.init import init_store_of

    cfg = engine_config(3, "nvme", "cpu", str(nvme_dir), gas=1)
    gc.collect()
    gc.disable()  # only reference counting frees anything from here
    try:
        torch.manual_seed(0)
        with infinity.zero.Init(cfg):
            model = MODELS["gpt"]()
        store = init_store_of(model.parameters())
        assert store is not None
        pool = weakref.ref(store.store.pool)
        store = weakref.ref(store)
        engine = infinity.initialize(model, cfg)
        try:
            assert store() is None, gc.get_referrers(store())
            assert pool() is None
        finally:
            engine.close()
    finally:
        gc.enable()
