"""Property: for any stack of layers built under zero.Init, each parameter's ds_shape / ds_numel are
its true shape and element count (a dict of the shapes built without Init is the oracle), ds_ids
are distinct, and ds_status is AVAILABLE exactly for the parameters a GatheredParameters context
holds under zero.Init; after initialize, for those and the rest of their units (an engine gathers
a module's parameters together), and NOT_AVAILABLE for all outside the context."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import infinity.compat.deepspeed as deepspeed
from infinity.compat.deepspeed.zero import ZeroParamStatus

AVAILABLE, NOT_AVAILABLE = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE


def _build(widths, bias):
    return nn.Sequential(
        *[nn.Linear(a, b, bias=bias) for a, b in zip(widths, widths[1:], strict=False)]
    )


@settings(max_examples=12, deadline=None)
@given(
    widths=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    bias=st.booleans(),
    held=st.data(),
)
def test_ds_attributes_follow_the_parameters(widths, bias, held):
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    oracle = {n: tuple(p.shape) for n, p in _build(widths, bias).named_parameters()}
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = _build(widths, bias)
    named = dict(model.named_parameters())
    assert {n: tuple(p.ds_shape) for n, p in named.items()} == oracle
    assert {n: p.ds_numel for n, p in named.items()} == {
        n: int(torch.Size(s).numel()) for n, s in oracle.items()
    }
    assert len({p.ds_id for p in named.values()}) == len(named)
    pick = held.draw(st.lists(st.sampled_from(sorted(named)), unique=True))

    def statuses():
        return {n: p.ds_status for n, p in named.items()}

    assert set(statuses().values()) == {NOT_AVAILABLE}
    with deepspeed.zero.GatheredParameters([named[n] for n in pick]):
        assert statuses() == {n: AVAILABLE if n in pick else NOT_AVAILABLE for n in named}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    try:
        assert {n: tuple(p.ds_shape) for n, p in named.items()} == oracle
        assert set(statuses().values()) == {NOT_AVAILABLE}
        with deepspeed.zero.GatheredParameters([named[n] for n in pick]):
            got = statuses()
        assert {n for n, s in got.items() if s is AVAILABLE} >= set(pick)
    finally:
        engine.destroy()
