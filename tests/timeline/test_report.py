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


def _starved(opt_wait: float, io_wait: float = 0.25):
    """A 1 s step: 0.2 s forward compute, a wait of ``opt_wait`` s for the optimizer, a read of
    1 GB over 0.5 s on the reads' own track, the rest backward (with a 0.05 s wait for a parameter
    read). The optimizer's thread waits ``io_wait`` s for its state's reads, then runs Adam."""
    m, o = "MainThread", "infinity-optimizer-step"
    spans = [
        Span("forward", "phase", 0.0, 0.2 + opt_wait, m, None),
        Span("forward GPT p0", "compute", 0.0, 0.2, m, {"units": ["p0"]}),
        Span(
            "optimizer step to update unit 1", "wait", 0.2, 0.2 + opt_wait, m, {"kind": "optimizer"}
        ),
        Span("backward", "phase", 0.2 + opt_wait, 1.0, m, None),
        Span("unit 'p1'", "wait", 0.9, 0.95, m, {"kind": "read"}),
        Span("read 3 keys", "read", 0.1, 0.6, "optimizer read", {"bytes": 10**9}),
        Span("the reads of optimizer sub-group 0 of 1", "wait", 0.0, io_wait, o, {"kind": "read"}),
        Span("Adam sub-group 0 of 1", "optimizer", io_wait, io_wait + 0.05, o, None),
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
    assert s.parts["compute"] == pytest.approx(0.65)  # 0.2 forward + 0.45 backward
    assert s.parts["exposed read"] == pytest.approx(0.05)
    assert s.read_nbytes == 10**9 and s.read_busy_s == pytest.approx(0.5)
    # The optimizer thread's wait for its state; not the driving thread's wait for a parameter.
    assert s.optimizer_io_s == pytest.approx(0.25)


def test_a_starved_optimizer_gets_the_budget_that_keeps_its_state_in_memory(tmp_path, capsys):
    spans, steps = _starved(0.3)
    assert main(["report", str(_trace(tmp_path, spans, steps, PLAN))]) == 0
    out = capsys.readouterr().out
    assert "30% of the step waits for the optimizer" in out
    assert "host_memory_budget of 6.00 GiB" in out
    # All of the state comes into memory: the optimizer's 0.25 s of waits for it go.
    assert "waited 0.25 s/step for its state's reads and writes, 100% of which" in out
    assert "-0.25 s/step" in out and "8.00 GiB fewer NVMe bytes per step" in out


@pytest.mark.parametrize(
    ("io_wait", "left_on_nvme", "saving"),
    [(0.2, 2 * GIB, "-0.10"), (0.5, 0, "-0.30"), (0.2, 3 * GIB, "-0.05")],
)
def test_the_saving_is_the_share_of_the_optimizers_io_waits_the_change_removes(
    tmp_path, io_wait, left_on_nvme, saving
):
    """What the bigger budget removes: the optimizer's measured waits for its state, in the share
    of the state it keeps in memory, never more than the step's wait for the optimizer (0.3 s)."""
    spans, steps = _starved(0.3, io_wait)
    plan = PLAN | {"prediction": PLAN["prediction"] | {"optimizer_nvme_nbytes": left_on_nvme}}
    [s] = step_breakdowns(_read(_trace(tmp_path, spans, steps, plan)))
    assert f"{saving} s/step" in advise(s, plan)


def test_no_saving_is_quoted_when_the_optimizer_never_waited_for_its_state(tmp_path):
    spans, steps = _starved(0.3, 0.0)
    spans = [s for s in spans if s.cat != "wait" or s.track != "infinity-optimizer-step"]
    [s] = step_breakdowns(_read(_trace(tmp_path, spans, steps, PLAN)))
    text = advise(s, PLAN)
    assert "never waiting for its state's I/O" in text and "s/step" not in text


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


def test_the_backwards_own_time_outside_every_units_backward_is_autograd(tmp_path):
    """The backward phase's self time splits by what the units' backward spans (on their own
    track) cover: covered is compute, the rest autograd; a wait inside stays exposed read."""
    m = "MainThread"
    spans = [
        Span("forward", "phase", 0.0, 0.5, m, None),
        Span("backward", "phase", 0.5, 1.0, m, None),
        Span("unit 'p1'", "wait", 0.7, 0.75, m, {"kind": "read"}),
        Span("backward p1", "compute", 0.6, 0.8, "backward units", {"phase": "backward"}),
        Span("backward p0", "compute", 0.65, 0.7, "backward units", {"phase": "backward"}),
    ]
    steps = [{"step": 0, "begin": 0.0, "end": 1e6}]
    [s] = step_breakdowns(_read(_trace(tmp_path, spans, steps, PLAN)))
    assert s.parts["autograd"] == pytest.approx(0.30)  # [0.5, 0.6) and [0.8, 1.0)
    assert s.parts["compute"] == pytest.approx(0.5 + 0.15)  # the forward, [0.6, 0.7), [0.75, 0.8)
    assert s.parts["exposed read"] == pytest.approx(0.05)
    assert sum(s.parts[p] for p in PARTS) == pytest.approx(1.0)
    # Without any unit's backward span the trace cannot split it: the backward is compute.
    [s] = step_breakdowns(_read(_trace(tmp_path, spans[:3], steps, PLAN)))
    assert s.parts["autograd"] == 0.0 and s.parts["compute"] == pytest.approx(0.95)
