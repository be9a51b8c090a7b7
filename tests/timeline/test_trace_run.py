"""A recorded step obeys the schedule: read spans and compute spans, bytes and waits, checked against
the store's and the scheduler's own counters (not against the trace's)."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch
from trace_run import config, train

from infinity.config import ConfigError
from infinity.timeline import Timeline, read_trace


def _spans(doc, cat=None):
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and (cat is None or e["cat"] == cat)]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    import os
    from pathlib import Path

    root = Path(os.environ.get("INFINITY_TEST_NVME", Path.home() / ".cache" / "infinity-tests"))
    root.mkdir(parents=True, exist_ok=True)
    nvme = tmp_path_factory.mktemp("trace-nvme")
    nvme = root / f"{os.getpid()}-trace-{nvme.name}"
    nvme.mkdir()
    out = tmp_path_factory.mktemp("trace") / "run.json"
    trace = {"enabled": True, "output_path": str(out), "first_step": 1, "steps": 2}
    engine, losses = train(config(str(nvme), trace), 4, keep_open=True)
    history = {s.step: s for s in engine.prefetch_stats().history}
    engine.close()
    import shutil

    shutil.rmtree(nvme, ignore_errors=True)
    assert Timeline.active is None, "the recording was not switched off"
    return read_trace(out), history


def test_every_recorded_step_and_span_kind_is_there(recorded):
    doc, _ = recorded
    steps = doc["infinity"]["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    cats = {e["cat"] for e in _spans(doc)}
    assert {"compute", "read", "write", "wait", "optimizer", "phase"} <= cats
    phases = {e["name"] for e in _spans(doc, "phase")}
    assert {"forward", "backward", "step"} <= phases
    for e in _spans(doc, "read") + _spans(doc, "write"):
        assert e["args"]["bytes"] > 0 and e["args"]["tier"] == "nvme" and e["args"]["keys"]


def test_a_units_compute_starts_after_its_read_completes(recorded):
    doc, _ = recorded
    reads = defaultdict(list)  # key -> [(start, end)] of the param store's reads
    for e in _spans(doc, "read"):
        if e["args"]["store"] == "params":
            for k in e["args"]["keys"]:
                reads[k].append((e["ts"], e["ts"] + e["dur"]))
    computes = _spans(doc, "compute")
    assert computes and reads, "the run must read units from NVMe and compute with them"
    checked = 0
    for c in computes:
        for unit in c["args"]["units"]:
            for start, end in reads[repr(unit)]:
                if start <= c["ts"]:  # a read submitted before the compute began...
                    assert end <= c["ts"], (
                        f"{c['name']} began at {c['ts']} us while the read of {unit} "
                        f"({start}-{end} us) was in flight"
                    )
                    checked += 1
    assert checked > 0, "no compute span followed a read of its unit"


def test_bytes_in_the_trace_equal_the_stores_counters(recorded):
    doc, _ = recorded
    counters = doc["infinity"]["counters"]
    for store in counters["start"]:
        for cat in ("read", "write"):
            spans = sum(e["args"]["bytes"] for e in _spans(doc, cat) if e["args"]["store"] == store)
            key = f"{cat}_nbytes"
            assert spans == counters["end"][store][key] - counters["start"][store][key], (
                store,
                cat,
            )
    total_read = sum(e["args"]["bytes"] for e in _spans(doc, "read"))
    assert total_read > 0


def test_exposed_waits_equal_the_schedulers_stall(recorded):
    doc, history = recorded
    by_step = defaultdict(float)
    for e in _spans(doc, "wait"):
        if e["args"].get("source") == "scheduler":
            by_step[e["args"]["step"]] += e["dur"] / 1e6
    seen = [s["step"] for rec in doc["infinity"]["steps"] for s in rec["scheduler"]]
    assert seen, "the recorded steps name no scheduler step"
    for step in seen:
        stall = history[step].stall_s  # the scheduler's own figure, read from the engine
        assert stall > 0
        assert by_step[step] == pytest.approx(stall, rel=0.01)


def test_the_file_is_plain_trace_event_json(recorded):
    doc, _ = recorded
    json.dumps(doc, allow_nan=False)  # strict JSON, as Perfetto's importer reads it
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert "MainThread" in names.values()
    for e in _spans(doc):
        assert e["pid"] == 1 and e["tid"] in names


def test_the_environment_variable_overrides_the_config(nvme_dir, tmp_path, monkeypatch):
    out = tmp_path / "env.json"
    monkeypatch.setenv("INFINITY_TRACE", f"{out}:0")
    train(config(str(nvme_dir), {"enabled": False}), 2)
    doc = read_trace(out)
    assert [s["step"] for s in doc["infinity"]["steps"]] == [0]


def test_an_unwritable_output_path_is_refused_at_initialize(nvme_dir, tmp_path):
    bad = tmp_path / "missing" / "t.json"
    with pytest.raises(ConfigError, match=r"trace\.output_path.*does not exist"):
        train(config(str(nvme_dir), {"enabled": True, "output_path": str(bad)}), 1)


def test_spans_are_ranges_inside_a_running_torch_profiler(nvme_dir):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train(config(str(nvme_dir), None), 2)
    names = {e.name for e in prof.events()}
    assert any(n.startswith("infinity/compute: forward") for n in names)
    assert any(n.startswith("infinity/phase: backward") for n in names)
    assert any(n.startswith("infinity/phase: step") for n in names)
    assert Timeline.active is None
