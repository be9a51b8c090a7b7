"""Sizes and lists as the measuring commands and benches read and print them: '128K', '1M,8M'.

Binary units (K = 1024); ``*_arg`` wrap the parsers as argparse types, which show the parser's own
words for a bad value.
"""

from __future__ import annotations

import argparse
from typing import Any

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'128K', '1M', '2G', '1.5G', '4096' -> bytes (binary units; a trailing 'B' or 'iB' is
    allowed)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    number = t[: len(t) - len(unit)]
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 128K, 1M, 2G)") from None
    if value <= 0 or value != int(value):
        raise ValueError(f"not a positive whole number of bytes: {text!r}")
    return int(value)


def parse_list(text: str, parse=int) -> list[Any]:
    try:
        return [parse(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"not a comma-separated list: {text!r} ({e})") from None


def _arg(parse):
    """Wraps a parser for argparse, which shows an ArgumentTypeError's own words."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


size_arg = _arg(parse_size)
sizes_arg = _arg(lambda t: parse_list(t, parse_size))
ints_arg = _arg(parse_list)
names_arg = _arg(lambda t: parse_list(t, str))


def format_size(n: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)
