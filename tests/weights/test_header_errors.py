"""Corrupt safetensors headers are refused before a byte of data is read, naming the file and the fault.

Each case is also refused by the safetensors package (the oracle): nothing
it would reject is read here, and nothing here is refused that it reads.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infinity.weights.header import HeaderError, read_header
from infinity.weights.hf_layout import checkpoint_tensors
from infinity.weights.in_memory import tensors_to_bytes


def with_header(doc: object, data: bytes = b"", *, length: int | None = None) -> bytes:
    text = json.dumps(doc).encode() if not isinstance(doc, bytes) else doc
    return struct.pack("<Q", len(text) if length is None else length) + text + data


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
CASES = {
    "empty file": (b"", "too short for a header"),
    "a length only": (struct.pack("<Q", 0)[:5], "too short for a header"),
    "a length past the file": (
        with_header({}, length=64),
        "its header claims 64 bytes of a 10-byte file",
    ),
    "not JSON": (with_header(b"{not json"), "not valid JSON"),
    "not UTF-8": (with_header(b'{"\xff": 1}'), "not valid JSON"),
    "a JSON list": (with_header([1, 2]), "not a JSON object"),
    "metadata not strings": (
        with_header({"__metadata__": {"a": 1}}),
        "__metadata__ must map strings to strings",
    ),
    "an entry without offsets": (
        with_header({"w": {"dtype": "F32", "shape": [2]}}, bytes(8)),
        "malformed",
    ),
    "a string shape": (with_header({"w": {**F32, "shape": "2"}}, bytes(8)), "malformed"),
    "an unknown dtype": (
        with_header({"w": {**F32, "dtype": "F7"}}, bytes(8)),
        "dtype 'F7', which is not read",
    ),
    "a negative dimension": (
        with_header({"w": {**F32, "shape": [-2], "data_offsets": [0, 8]}}, bytes(8)),
        "negative dimension",
    ),
    "offsets not the shape's size": (
        with_header({"w": {**F32, "data_offsets": [0, 4]}}, bytes(8)),
        r"at bytes \[0, 4\), not 2 x torch.float32",
    ),
    "offsets reversed": (with_header({"w": {**F32, "data_offsets": [8, 0]}}, bytes(8)), "not 2 x"),
    "data cut short": (
        with_header({"w": F32}, bytes(5)),
        "is truncated or corrupt: tensor 'w' \\(F32 \\[2\\]\\)",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_corrupt_header_is_refused_naming_the_file(tmp_path: Path, case):
    blob, what = CASES[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(safetensors.SafetensorError):
        safetensors.torch.load_file(path)
    with pytest.raises(HeaderError, match=what) as err:
        read_header(path)
    assert str(err.value).startswith(f"'{path}' ") and err.value.path == str(path)


def test_a_corrupt_shard_is_named_when_loading_a_checkpoint(tmp_path: Path):
    (tmp_path / "model.safetensors").write_bytes(with_header({"w": F32}, bytes(5)))
    with pytest.raises(
        ValueError, match=f"'{tmp_path / 'model.safetensors'}' is truncated or corrupt"
    ):
        checkpoint_tensors(tmp_path)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shapes=st.lists(st.lists(st.integers(0, 4), max_size=2), min_size=1, max_size=4),
    cut=st.floats(0, 1, exclude_max=True),
)
def test_every_truncation_is_refused(tmp_path: Path, shapes, cut):
    """A file cut anywhere (a header or data short) is refused, never read as another file."""
    sd = {f"t{i}": torch.ones(shape) for i, shape in enumerate(shapes)}
    blob = tensors_to_bytes(sd, {"k": "v"})
    path = tmp_path / "cut.safetensors"
    path.write_bytes(blob[: int(cut * len(blob))])
    with pytest.raises(HeaderError, match=f"^'{path}' "):
        read_header(path)
