"""TensorCache: buffers reused by size, the free lists bounded by the cap, none handed out while a
tensor still views it."""

import hypothesis
import hypothesis.strategies as st
import torch

from infinity.zero.buffers import TensorCache


def test_taking_the_last_buffer_of_a_size_then_overflowing_the_cap_evicts_others():
    """A bucket emptied by get() must not stay behind for put()'s eviction to pop from
    (stage 0/1 take every unit's accumulator before putting any back)."""
    cache = TensorCache(torch.device("cpu"), cap_nbytes=3 * 1024 * 4)
    a, b = torch.empty(1024), torch.empty(2048)
    cache.put(a)
    cache.put(b)
    assert cache.get(1024, torch.float32) is a  # the oldest bucket is now empty
    c = torch.empty(2048)
    cache.put(c)  # over the cap: the oldest buffer goes
    assert cache._free_nbytes <= cache.cap_nbytes
    assert cache.get(2048, torch.float32) is c


def test_a_buffer_put_back_while_a_view_of_it_lives_is_reused_only_once_the_view_is_gone():
    """The stage-3 partitioner puts a frozen unit's buffer back while autograd's saved tensors still
    view it ([Note: frozen units in backward]): handing it out then would overwrite what backward reads."""
    cache = TensorCache(torch.device("cpu"), cap_nbytes=1 << 20)
    a = cache.get(1024, torch.float32)
    a.fill_(7)
    saved = a.view(32, 32).t()  # as autograd keeps it
    cache.put(a)
    b = cache.get(1024, torch.float32)
    assert b.data_ptr() != a.data_ptr()
    b.fill_(1)
    assert torch.all(saved == 7)
    del saved
    assert cache.get(1024, torch.float32) is a


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    st.lists(
        st.tuples(
            st.sampled_from(["get", "put", "view", "drop"]), st.integers(0, 2), st.integers()
        ),
        max_size=40,
    )
)
def test_no_buffer_is_handed_out_while_a_view_of_it_lives_and_the_cap_holds(ops):
    """Oracle: the buffers the test holds and the views it keeps of them, by hand."""
    cap = 3 * 256 * 4
    cache = TensorCache(torch.device("cpu"), cap_nbytes=cap)
    held: list[torch.Tensor] = []  # handed out, not put back
    views: list[torch.Tensor] = []  # of any buffer, put back or not
    for op, size, pick in ops:
        numel = (1, 128, 256)[size]
        if op == "get":
            t = cache.get(numel, torch.float32)
            viewed = {v.untyped_storage().data_ptr() for v in views}
            assert t.untyped_storage().data_ptr() not in viewed
            assert all(t is not h for h in held)
            held.append(t)
        elif op == "put" and held:
            cache.put(held.pop(pick % len(held)))
        elif op == "view" and held:
            views.append(held[pick % len(held)][: numel // 2 + 1])
        elif op == "drop" and views:
            views.pop(pick % len(views))
        assert cache._free_nbytes <= cap
