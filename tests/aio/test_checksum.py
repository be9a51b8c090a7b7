import numpy as np
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
