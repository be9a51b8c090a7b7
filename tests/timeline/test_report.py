"""``infinity report``: the step split from constructed traces, and advice only where figures support it."""

from __future__ import annotations

import pytest

from infinity.cli.main import main
from infinity.timeline import Span, write_trace
from infinity.timeline.advice import advise
from infinity.timeline.breakdown import PARTS, step_breakdowns

GIB = 2**30


def _trace(tmp_path, spans, steps, plan):
    return write_trace(tmp_path / "t.json", spans, 0.0, {"steps": steps, "plan": plan})


def _starved(opt_wait: float):
    """A 1 s step: 0.2 s forward compute, a wait of ``opt_wait`` s for the optimizer, a read of
    1 GB over 0.5 s on the reads' own track, the rest backward."""
    m = "MainThread"
    spans = [
        Span("forward", "phase", 0.0, 0.2 + opt_wait, m, None),
        Span("forward GPT p0", "compute", 0.0, 0.2, m, {"units": ["p0"]}),
        Span(
            "optimizer step to update unit 1", "wait", 0.2, 0.2 + opt_wait, m, {"kind": "optimizer"}
        ),
        Span("backward", "phase", 0.2 + opt_wait, 1.0, m, None),
        Span("read 3 keys", "read", 0.1, 0.6, "optimizer read", {"bytes": 10**9}),
    ]
    return spans, [{"step": 4, "begin": 0.0, "end": 1e6}]


PLAN = {
    "planned": True,
    "optimizer_classes": ["m", "v"],
    "state": {"m": {"nvme_nbytes": 2 * GIB}, "v": {"nvme_nbytes": 2 * GIB}},
    "budget_nbytes": 2 * GIB,
    "expected_read_nbytes": 4 * GIB,
    "expected_write_nbytes": 4 * GIB,
    "prediction": {
        "budget_nbytes": 6 * GIB,
        "optimizer_nvme_nbytes": 0,
        "expected_read_nbytes": 0,
        "expected_write_nbytes": 0,
    },
}


def test_the_parts_of_a_step_sum_to_its_wall_time(tmp_path):
    spans, steps = _starved(0.3)
    [s] = step_breakdowns(_read(_trace(tmp_path, spans, steps, PLAN)))
    assert s.wall_s == pytest.approx(1.0)
    assert sum(s.parts[p] for p in PARTS) == pytest.approx(1.0)
    assert s.parts["optimizer"] == pytest.approx(0.3)
    assert s.parts["compute"] == pytest.approx(0.7)  # 0.2 forward + 0.5 backward
    assert s.read_nbytes == 10**9 and s.read_busy_s == pytest.approx(0.5)


def test_a_starved_optimizer_gets_the_budget_that_keeps_its_state_in_memory(tmp_path, capsys):
    spans, steps = _starved(0.3)
    assert main(["report", str(_trace(tmp_path, spans, steps, PLAN))]) == 0
    out = capsys.readouterr().out
    assert "30% of the step waits for the optimizer" in out
    assert "host_memory_budget of 6.00 GiB" in out
    # 8 GiB fewer at 2 GB/s would be 4.3 s: never more than the 0.3 s the step waited.
    assert "-0.30 s/step" in out


def test_a_compute_bound_step_gets_no_change_to_make(tmp_path):
    spans, steps = _starved(0.05)
    [s] = step_breakdowns(_read(_trace(tmp_path, spans, steps, PLAN)))
    text = advise(s, PLAN)
    assert "no offload setting would shorten the step" in text
    assert "host_memory_budget" not in text


def test_without_a_planned_placement_no_saving_is_quoted(tmp_path):
    spans, steps = _starved(0.4)
    plan = {k: v for k, v in PLAN.items() if k != "prediction"} | {"planned": False}
    [s] = step_breakdowns(_read(_trace(tmp_path, spans, steps, plan)))
    text = advise(s, plan)
    assert "No prediction was made" in text and "s/step" not in text


def test_a_file_that_is_not_a_trace_is_refused(tmp_path, capsys):
    (tmp_path / "x.json").write_text('{"traceEvents": []}')
    assert main(["report", str(tmp_path / "x.json")]) == 2
    assert "not an infinity trace file" in capsys.readouterr().err


def _read(path):
    from infinity.timeline import read_trace

    return read_trace(path)
