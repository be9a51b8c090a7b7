"""The store's reads and writes on a timeline recording ([Note: recording costs no lock] in
infinity/timeline/recorder.py): a recording adds no formatting to the I/O path, and each request is
a span with its keys and bytes once the recording is read."""

from __future__ import annotations

import torch

from infinity.timeline import Timeline


class Key:
    """A store key that counts how often it is formatted (``repr``)."""

    def __init__(self, name: str, formatted: list[str]):
        self.name = name
        self.formatted = formatted

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and other.name == self.name

    def __repr__(self) -> str:
        self.formatted.append(self.name)
        return f"Key({self.name})"


def _round_trips(store, keys) -> None:
    for i, k in enumerate(keys):
        store.write(k, torch.full((1024,), float(i))).result(10)
        store.evict(k).result(10)
        assert torch.equal(store.fetch(k).result(10), torch.full((1024,), float(i)))
        store.release(k)


def test_a_recording_adds_no_formatting_to_reads_and_writes(make_store):
    store = make_store(name="params")
    formatted: list[str] = []
    plain = [Key(f"a{i}", formatted) for i in range(3)]
    traced = [Key(f"b{i}", formatted) for i in range(3)]
    for k in plain + traced:
        store.register(k, (1024,), torch.float32)
    _round_trips(store, plain)
    untraced_formats = len(formatted)
    formatted.clear()
    tl = Timeline().start()
    try:
        _round_trips(store, traced)
    finally:
        tl.stop()
    assert len(formatted) == untraced_formats  # the same requests, no more formatting
    formatted.clear()
    spans = [s for s in tl.spans() if s.cat in ("read", "write")]
    assert sorted((s.cat, s.args["keys"][0]) for s in spans) == sorted(
        (cat, repr(k)) for k in traced for cat in ("read", "write")
    )
    assert all(s.args["bytes"] == 4096 and s.args["store"] == "params" for s in spans)
    assert all(s.end >= s.start for s in spans)
