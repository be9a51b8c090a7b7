"""The store's reads and writes on a timeline recording ([Note: recording costs no lock] in
infinity/timeline/recorder.py): a completing request formats nothing while it holds the store's
lock (where it holds up every other thread's store call): it hands the request to the recording,
which formats it once the spans are read, as a span with its keys and bytes."""

from __future__ import annotations

import torch

from infinity.store import store as store_module
from infinity.timeline import Timeline


def test_a_completing_request_is_formatted_only_when_the_spans_are_read(make_store, monkeypatch):
    store = make_store(name="params")
    formatted = []
    format_op = store_module._op_span

    def counting(*payload):
        formatted.append(payload[1].kind)
        return format_op(*payload)

    monkeypatch.setattr(store_module, "_op_span", counting)
    keys = [f"w{i}" for i in range(3)]
    for k in keys:
        store.register(k, (1024,), torch.float32)
    tl = Timeline().start()
    try:
        for i, k in enumerate(keys):
            store.write(k, torch.full((1024,), float(i))).result(10)
            store.evict(k).result(10)
            assert torch.equal(store.fetch(k).result(10), torch.full((1024,), float(i)))
            store.release(k)
    finally:
        tl.stop()
    assert formatted == []  # nothing formatted while the requests completed
    spans = [s for s in tl.spans() if s.cat in ("read", "write")]
    assert sorted(formatted) == sorted(s.cat for s in spans)
    assert sorted((s.cat, s.args["keys"][0]) for s in spans) == sorted(
        (cat, repr(k)) for k in keys for cat in ("read", "write")
    )
    assert all(s.args["bytes"] == 4096 and s.args["store"] == "params" for s in spans)
    assert all(s.end >= s.start and s.track == f"params {s.cat}" for s in spans)
