"""The one safetensors reader and writer (infinity.weights) against the safetensors package as oracle.

Files infinity writes (``tensors_to_bytes``, ``build_header`` at any alignment)
load with ``safetensors.torch`` bit for bit, metadata included; files
``safetensors.torch.save_file`` writes are read back bit for bit by the
header parser, ``tensors_from_bytes`` and ``TensorFiles`` (the preadv reader
load_pretrained uses), and converted reads equal torch's own conversion.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infinity.weights.header import DTYPE_CODES, build_header, parse_header, read_header
from infinity.weights.in_memory import tensors_from_bytes, tensors_to_bytes
from infinity.weights.reader import TensorFiles, file_tensors

DTYPES = sorted(DTYPE_CODES, key=str)
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes, as torch holds them (NaN payloads, -0.0 and all)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(
        draw(st.lists(st.integers(0, 5), max_size=3))
    )  # () is a scalar; a 0 makes it empty
    numel = 1
    for d in shape:
        numel *= d
    data = bytearray(
        draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    )
    if dtype == torch.bool:
        data = bytearray(b & 1 for b in data)  # a bool byte other than 0 or 1 is no value torch has
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape).clone()


names = st.text(min_size=1, max_size=12).filter(lambda n: n != "__metadata__")
state_dicts = st.dictionaries(names, tensors(), max_size=6)
metadatas = st.one_of(
    st.none(), st.dictionaries(st.text(max_size=8), st.text(max_size=16), max_size=4)
)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert (a[k].dtype, tuple(a[k].shape), raw(a[k])) == (
            b[k].dtype,
            tuple(b[k].shape),
            raw(b[k]),
        ), k


@SETTINGS
@given(sd=state_dicts, metadata=metadatas)
def test_what_infinity_writes_loads_with_safetensors(tmp_path: Path, sd, metadata):
    path = tmp_path / "ours.safetensors"
    path.write_bytes(tensors_to_bytes(sd, metadata))
    same(safetensors.torch.load_file(path), sd)
    with safetensors.safe_open(path, "pt") as f:
        assert (f.metadata() or {}) == (metadata or {})
        assert list(f.keys()) == sorted(sd)


@SETTINGS
@given(sd=state_dicts, metadata=metadatas, align=st.sampled_from([8, 64, 4096]))
def test_aligned_headers_load_with_safetensors(tmp_path: Path, sd, metadata, align):
    """Checkpoint part files pad the header so the data starts at 4 KiB: still safetensors."""
    header, layout = build_header(
        [(k, t.dtype, t.shape) for k, t in sd.items()], metadata, align=align
    )
    path = tmp_path / "aligned.safetensors"
    path.write_bytes(header + b"".join(raw(t) for t in sd.values()))
    assert layout.data_start % align == 0 and layout.file_nbytes == path.stat().st_size
    same(safetensors.torch.load_file(path), sd)
    parsed = read_header(path)
    assert parsed == layout  # what the writer planned is what the parser reads


@SETTINGS
@given(sd=state_dicts, metadata=metadatas)
def test_what_safetensors_writes_reads_back_with_infinity(tmp_path: Path, sd, metadata):
    path = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(sd, path, metadata=metadata)
    blob = path.read_bytes()
    try:
        safetensors.torch.load_file(path)
    except safetensors.SafetensorError:
        # safetensors 0.8 writes '{},"__metadata__":{}}' for no tensors and empty metadata, which its
        # own reader refuses: so must ours.
        with pytest.raises(ValueError, match=f"'{path}' has a corrupt safetensors header"):
            read_header(path)
        return
    header = parse_header(blob, file_nbytes=len(blob), path=str(path))
    assert header.metadata == (metadata or {})
    assert header.file_nbytes == len(blob)
    same(tensors_from_bytes(blob, header), sd)
    read = {}
    with TensorFiles() as files:
        for name, t in file_tensors(path).items():
            read[name] = torch.empty(t.shape, dtype=t.dtype)
            files.read_whole(t, read[name])
    same(read, sd)


def converted(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal values, NaN where NaN: a conversion's NaN payload is torch's choice, and its vectorised and
    scalar paths (a staging buffer of 2 bytes takes the scalar one) choose differently."""
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@SETTINGS
@given(
    sd=st.dictionaries(
        names, tensors().filter(lambda t: t.dtype.is_floating_point), min_size=1, max_size=4
    ),
    to=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    stage=st.sampled_from([2, 7, 8 << 20]),
)
def test_converting_reads_are_torchs_conversion(tmp_path: Path, sd, to, stage, monkeypatch):
    """A checkpoint in one dtype into a model in another, through a staging buffer of any size."""
    monkeypatch.setattr("infinity.weights.reader.STAGE_NBYTES", stage)
    path = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(sd, path)
    with TensorFiles() as files:
        for name, t in file_tensors(path).items():
            out = torch.empty(t.shape, dtype=to)
            files.read_whole(t, out)
            converted(out, sd[name].to(to))
            part = torch.empty(max(0, t.numel - 1), dtype=to)  # a slice, as a rank reads its own
            files.read(t, min(1, t.numel), t.numel, part)
            converted(part, sd[name].reshape(-1)[1:].to(to))


def test_every_dtype_the_safetensors_package_reads_is_in_the_table():
    """The table is the package's, less nothing torch can hold (the oracle's own list)."""
    from safetensors.torch import _TYPES  # the package's code -> torch dtype table

    assert {DTYPE_CODES[dt]: dt for dt in DTYPE_CODES} == _TYPES


def test_a_dtype_safetensors_cannot_hold_is_named():
    with pytest.raises(
        ValueError, match=r"torch.complex128 cannot be stored in a safetensors file"
    ):
        tensors_to_bytes({"z": torch.zeros(2, dtype=torch.complex128)})
