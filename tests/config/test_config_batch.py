"""train_batch_size = micro x accumulation x world size: any two determine the third."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.config import ConfigError, load_config

T, M, A = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def _sizes(cfg):
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


@pytest.mark.parametrize(
    ("given_keys", "world", "expected"),
    [
        ({}, 1, (1, 1, 1)),
        ({}, 4, (4, 1, 1)),
        ({T: 32}, 4, (32, 8, 1)),
        ({M: 3}, 2, (6, 3, 1)),
        ({A: 5}, 2, (10, 1, 5)),
        ({T: 48, M: 4}, 3, (48, 4, 4)),
        ({T: 48, A: 2}, 3, (48, 8, 2)),
        ({M: 4, A: 2}, 3, (24, 4, 2)),
        ({T: 24, M: 4, A: 2}, 3, (24, 4, 2)),
        ({T: 1e2, M: 5.0}, 2, (100, 5, 10)),
    ],
)
def test_batch_arithmetic(given_keys, world, expected):
    assert _sizes(load_config(given_keys, world_size=world)) == expected


@pytest.mark.parametrize(
    ("given_keys", "world", "message"),
    [
        (
            {T: 30, M: 4, A: 2},
            2,
            r"^train_batch_size \(30\) must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
            r"world_size = 4 x 2 x 2 = 16$",
        ),
        (
            {T: 30, M: 4},
            2,
            r"^train_batch_size \(30\) is not divisible by train_micro_batch_size_per_gpu x world_size = 4 x 2 = 8, "
            r"so gradient_accumulation_steps would not be a whole number; fix one of the batch sizes$",
        ),
        (
            {T: 30, A: 4},
            2,
            r"^train_batch_size \(30\) is not divisible by gradient_accumulation_steps x world_size = 4 x 2 = 8, "
            r"so train_micro_batch_size_per_gpu would not be a whole number",
        ),
        (
            {T: 7},
            2,
            r"^train_batch_size \(7\) is not divisible by world_size \(2\) = 2, so train_micro_batch_size_per_gpu",
        ),
        ({M: 0}, 1, r"^train_micro_batch_size_per_gpu must be an integer >= 1; got 0$"),
        ({A: 2.5}, 1, r"^gradient_accumulation_steps must be an integer >= 1; got 2\.5$"),
        ({T: "16"}, 1, r"^train_batch_size must be an integer >= 1; got '16'$"),
    ],
)
def test_batch_errors_show_the_arithmetic(given_keys, world, message):
    with pytest.raises(ConfigError, match=message):
        load_config(given_keys, world_size=world)


SUBSETS = [frozenset(c) for r in range(4) for c in itertools.combinations((T, M, A), r)]


@settings(max_examples=300, deadline=None)
@given(
    micro=st.integers(1, 64),
    accumulation=st.integers(1, 32),
    world=st.integers(1, 16),
    keys=st.sampled_from(SUBSETS),
    auto=st.booleans(),
)
def test_any_consistent_subset_completes_to_the_product(micro, accumulation, world, keys, auto):
    truth = {T: micro * accumulation * world, M: micro, A: accumulation}
    if auto:
        # the same values arriving as arguments for "auto" keys
        raw = {k: "auto" for k in keys}
        cfg = load_config(raw, world_size=world, **{k: truth[k] for k in keys})
    else:
        cfg = load_config({k: truth[k] for k in keys}, world_size=world)
    t, m, a = _sizes(cfg)
    assert t == m * a * world
    if len(keys) >= 2:
        assert (t, m, a) == (truth[T], micro, accumulation)
    elif keys == {T}:
        assert (m, a) == (micro * accumulation, 1)
    elif keys == {M}:
        assert (m, a) == (micro, 1)
    elif keys == {A}:
        assert (m, a) == (1, accumulation)
    else:
        assert (m, a) == (1, 1)


@settings(max_examples=200, deadline=None)
@given(
    micro=st.integers(1, 64),
    accumulation=st.integers(1, 32),
    world=st.integers(1, 16),
    off=st.integers(1, 1000),
)
def test_an_inconsistent_triple_is_always_refused(micro, accumulation, world, off):
    t = micro * accumulation * world + off
    with pytest.raises(
        ConfigError,
        match=rf"= {micro} x {accumulation} x {world} = {micro * accumulation * world}$",
    ):
        load_config({T: t, M: micro, A: accumulation}, world_size=world)
