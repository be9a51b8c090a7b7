import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.aio import crc32c


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """Bitwise CRC32C straight from the definition (independent of the C++ table/SSE paths)."""
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_known_vector():
    # RFC 3720 (iSCSI) check value for "123456789".
    assert crc32c(b"123456789") == 0xE3069283


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=300), st.integers(0, 299))
def test_matches_reference_and_chains(data, cut):
    cut = min(cut, len(data))
    assert crc32c(data) == crc32c_reference(data)
    assert crc32c(data[cut:], crc32c(data[:cut])) == crc32c(data)


def test_tensor_and_numpy_agree():
    t = torch.arange(10_000, dtype=torch.int32)
    assert crc32c(t) == crc32c(t.numpy()) == crc32c(t.numpy().tobytes())
    assert crc32c(np.zeros(0, np.uint8)) == 0


def _table_reference(data: bytes, crc: int = 0) -> int:
    """Byte-at-a-time table CRC32C (the table built from the bitwise definition above)."""
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


@pytest.mark.parametrize("offset", [0, 1, 3, 7, 8])
@pytest.mark.parametrize(
    "nbytes",
    [
        767,
        768,
        769,
        3 * 256 * 2 + 13,
        3 * 8192 - 1,
        3 * 8192,
        3 * 8192 + 771,
        7 * 8192 + 5,
        100_003,
    ],
)
def test_the_three_stream_path_matches_byte_at_a_time(offset, nbytes):
    """Sizes around the 3 x 8 KiB and 3 x 256 B blocks of [Note: three crc32 streams], at every
    alignment, and continued from a previous value."""
    data = np.random.default_rng(nbytes + offset).integers(0, 256, offset + nbytes, dtype=np.uint8)
    part = data[offset:]
    want = _table_reference(part.tobytes())
    assert crc32c(part) == want
    assert crc32c(part[nbytes // 3 :], crc32c(part[: nbytes // 3])) == want
