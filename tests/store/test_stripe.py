"""A store striped over N drives round-trips every byte: hypothesis picks N, the stripe unit, the
swap-file size and a sequence of keys of any size written, dropped and read back at whatever offsets
the allocator gives them; a dict of what was written is the oracle.

Besides reading each key back through the store, an independent reader (plain os.pread on the swap
files, at the runs ``locate`` reports) must find the same bytes, so a key is where the store says it
is; and the layout keeps [Note: striping]'s promises: with N > 1 a run never leaves its stripe unit,
consecutive runs go round the drives in order, and every drive holds the same number of bytes.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infinity.aio import AioConfig
from infinity.memory import BufferPool
from infinity.store import TieredStore
from tests.store.conftest import ENGINES

BLOCK = 4096
MAX_KEY = 80_000

op = st.one_of(
    st.tuples(
        st.just("put"), st.integers(1, MAX_KEY)
    ),  # register a key of this many bytes, write it
    st.tuples(
        st.just("drop"), st.integers(0, 1 << 16)
    ),  # unregister one (leaves a hole to be reused)
    st.tuples(st.just("read"), st.integers(0, 1 << 16)),  # evict one and read it back
)


def _data(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def _read_back(store: TieredStore, key) -> torch.Tensor:
    store.evict(key).result(10)
    try:
        return store.fetch(key).result(10).clone()
    finally:
        store.release(key)


def _independent_read(store: TieredStore, key, nbytes: int) -> bytes:
    """The key's bytes as the files hold them, read without the store or the aio engine."""
    out = bytearray()
    for path, offset, n in store.locate(key):
        fd = os.open(path, os.O_RDONLY)
        try:
            out += os.pread(fd, n, offset)
        finally:
            os.close(fd)
    return bytes(out[:nbytes])


def _check_layout(store: TieredStore, key, drives: list[Path], unit: int) -> None:
    runs = store.locate(key)
    drive_of = [drives.index(Path(p).parent.parent) for p, _o, _n in runs]
    if len(drives) > 1:
        assert all(off % unit + n <= unit for _p, off, n in runs), (
            f"a run leaves its stripe unit: {runs}"
        )
        assert all(b == (a + 1) % len(drives) for a, b in itertools.pairwise(drive_of)), runs
    assert sum(n for _p, _o, n in runs) == -(-store.spec(key).nbytes // BLOCK) * BLOCK


@pytest.mark.parametrize("engine", ENGINES)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ndrives=st.integers(1, 3),
    unit_blocks=st.integers(1, 4),
    file_units=st.integers(1, 3),
    lead=st.integers(0, 3 * BLOCK),
    ops=st.lists(op, min_size=1, max_size=14),
)
def test_round_trip_over_n_drives(nvme_dir, engine, ndrives, unit_blocks, file_units, lead, ops):
    unit = unit_blocks * BLOCK
    with tempfile.TemporaryDirectory(dir=nvme_dir) as tmp:
        drives = [Path(tmp) / f"d{i}" for i in range(ndrives)]
        for d in drives:
            d.mkdir()
        store = TieredStore(
            drives, pool=BufferPool(4, 2 * MAX_KEY, name="stripe"), name="stripe",
            aio=AioConfig(block_size=BLOCK, queue_depth=4, engine=engine),
            stripe_nbytes=unit, file_nbytes=file_units * unit,
        )  # fmt: skip
        try:
            oracle: dict[str, torch.Tensor] = {}
            if lead:  # the first keys start anywhere in a stripe unit, not at its start
                store.register("lead", (lead,), torch.uint8)
                store.write("lead", oracle.setdefault("lead", _data(lead, 0))).result(10)
            for i, (kind, n) in enumerate(ops):
                if kind == "put":
                    key = f"k{i}"
                    store.register(key, (n,), torch.uint8)
                    store.write(key, oracle.setdefault(key, _data(n, i + 1))).result(10)
                elif oracle:
                    key = sorted(oracle)[n % len(oracle)]
                    if kind == "drop":
                        store.unregister(key)
                        del oracle[key]
                    else:
                        assert torch.equal(_read_back(store, key), oracle[key]), key
            store.flush_all().result(10)
            for key, value in oracle.items():
                assert torch.equal(_read_back(store, key), value), key
                assert _independent_read(store, key, value.numel()) == value.numpy().tobytes(), key
                _check_layout(store, key, drives, unit)
            sizes = {sum(f.stat().st_size for f in d.glob("swap.*")) for d in store.directories}
            assert len(sizes) == 1, f"drives hold different amounts: {sizes}"
            assert sizes.pop() * ndrives == store.stats().swap_capacity
        finally:
            store.close()
        assert [list(d.iterdir()) for d in drives] == [[] for _ in drives], (
            "close removes every file"
        )
