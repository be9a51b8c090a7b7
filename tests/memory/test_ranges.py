"""RangeAllocator against a byte-map model: no overlap, exact free accounting, coalescing."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.memory import RangeAllocator

G = 4096  # any granule; the pools and swap space use infinity.aio.DIRECT_ALIGNMENT


def test_best_fit_takes_the_smallest_run_that_fits():
    a = RangeAllocator(16 * G, granule=G)
    offs = [a.alloc(G) for _ in range(16)]
    assert offs == [i * G for i in range(16)]
    a.free(1 * G, 3 * G)  # a 3-granule hole
    a.free(8 * G, G)  # a 1-granule hole
    assert a.alloc(G) == 8 * G  # best fit: the 1-granule hole, not the first hole
    assert a.alloc(2 * G) == 1 * G
    a.check()


def test_free_coalesces_both_neighbours():
    a = RangeAllocator(3 * G, granule=G)
    x, y, z = a.alloc(G), a.alloc(G), a.alloc(G)
    a.free(x, G)
    a.free(z, G)
    assert a.free_runs() == [(0, G), (2 * G, G)]
    a.free(y, G)
    assert a.free_runs() == [(0, 3 * G)]
    assert a.largest_free() == 3 * G


def test_double_free_and_out_of_range_are_refused():
    a = RangeAllocator(4 * G, granule=G)
    x = a.alloc(2 * G)
    a.free(x, 2 * G)
    with pytest.raises(ValueError, match="double free"):
        a.free(x, G)
    with pytest.raises(ValueError, match="inside"):
        a.free(4 * G, G)


def test_grow_merges_with_a_free_tail():
    a = RangeAllocator(2 * G, granule=G)
    a.alloc(G)
    a.grow(4 * G)
    assert a.free_runs() == [(G, 3 * G)]
    assert a.tail_free() == 3 * G
    assert a.alloc(3 * G) == G
    assert a.alloc(G) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * G), st.integers(0, 1000)), max_size=60))
def test_matches_a_byte_map_model(steps):
    a = RangeAllocator(32 * G, granule=G)
    owned: list[tuple[int, int]] = []
    used = [False] * 32
    for is_alloc, nbytes, pick in steps:
        if is_alloc or not owned:
            n = -(-nbytes // G)
            off = a.alloc(nbytes)
            fits = any(all(not used[i + j] for j in range(n)) for i in range(32 - n + 1))
            if off is None:
                # best fit may fail only when no run of n free granules exists
                assert not fits
                continue
            assert off % G == 0
            for j in range(off // G, off // G + n):
                assert not used[j], "allocated an in-use granule"
                used[j] = True
            owned.append((off, n * G))
        else:
            off, n = owned.pop(pick % len(owned))
            a.free(off, n)
            for j in range(off // G, (off + n) // G):
                used[j] = False
        a.check()
        assert a.free_nbytes == used.count(False) * G
