"""The pieces a throughput run submits: a Stripe covers every byte of every file once, block-sized
pieces going round the files as a store striped over those drives lays out its swap space."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infinity.measure import Stripe, testfiles  # not TestFile: pytest would collect it

MiB = 1 << 20


@pytest.mark.parametrize(
    "nfiles,size,block,ring",
    [(2, 8 * MiB, MiB, 4 * MiB), (3, 5 * MiB + 4096, MiB, 2 * MiB), (2, 3 * 4096, 8192, 8192)],
)
def test_stripe_pieces_cover_each_file_once_going_round_the_files(nfiles, size, block, ring):
    files = [testfiles.TestFile(Path(f"/d{i}"), size) for i in range(nfiles)]
    buf = torch.empty(ring, dtype=torch.uint8)
    items = Stripe(files).items(buf, block, files)
    covered = {id(f): [] for f in files}
    for k, (piece, f, off) in enumerate(items):
        assert f is files[k % nfiles], "piece k lies in file k % N"
        assert off == (k // nfiles) * block and 0 < piece.numel() <= block
        start = piece.data_ptr() - buf.data_ptr()
        assert start == (k * block) % ring and start + piece.numel() <= ring, (
            "each piece in its ring slot"
        )
        covered[id(f)].append((off, off + piece.numel()))
    for spans in covered.values():
        assert spans[0][0] == 0 and spans[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)), (
            "no gap, no overlap"
        )


def test_a_stripe_needs_files_of_one_size():
    with pytest.raises(ValueError, match="two or more test files of one size"):
        Stripe([testfiles.TestFile(Path("/a"), MiB), testfiles.TestFile(Path("/b"), 2 * MiB)])
    with pytest.raises(ValueError, match="two or more test files of one size"):
        Stripe([testfiles.TestFile(Path("/a"), MiB)])
