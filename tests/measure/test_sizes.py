"""Sizes as the measuring commands read and print them: binary units; every whole size
round-trips."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infinity.measure import format_size, parse_list, parse_size, size_arg


@given(st.integers(min_value=1, max_value=1 << 50))
def test_a_printed_size_reads_back_as_the_same_bytes(n):
    assert parse_size(format_size(n)) == n


@given(st.integers(min_value=1, max_value=1 << 20), st.sampled_from(["", "K", "M", "G", "T"]))
def test_units_are_binary(count, unit):
    factor = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    for suffix in ("", "B", "iB") if unit else ("",):
        assert parse_size(f"{count}{unit}{suffix}") == count * factor


@pytest.mark.parametrize("text", ["", "K", "1.3", "-1M", "0", "one"])
def test_a_bad_size_is_refused_with_examples(text):
    with pytest.raises(ValueError, match=r"size|bytes"):
        parse_size(text)
    with pytest.raises(argparse.ArgumentTypeError, match=repr(text).replace(".", r"\.")):
        size_arg(text)


def test_lists_are_comma_separated():
    assert parse_list("4,32, 64,") == [4, 32, 64]
    assert parse_list("1M,8M", parse_size) == [1 << 20, 8 << 20]
    with pytest.raises(ValueError, match="comma-separated"):
        parse_list("4,x")
