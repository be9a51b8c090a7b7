"""`infinity demo`: its learning-rate warm-up, its two-panel picture and the files it writes."""

from __future__ import annotations

import json

import pytest
import torch

from infinity.cli import main as cli_main
from infinity.cli.demo import demo_config, draw, warmup_steps
from infinity.config import load_config
from infinity.engine.tracing import summary as trace_summary
from infinity.optim.lr_schedules import build_scheduler
from infinity.timeline import read_trace


@pytest.mark.parametrize("steps", [20, 200])
def test_the_learning_rate_warms_up_linearly_over_a_quarter_of_the_run(steps):
    cfg = load_config(
        demo_config("/unused", lr=6e-4, steps=steps, micro_batch=1, bf16=False, largest_unit=1)
    )
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=6e-4)
    sched = build_scheduler(cfg.scheduler, opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    w = warmup_steps(steps)
    assert w == max(1, steps // 4)
    # DeepSpeed's WarmupCosineLR: the largest lr comes after the warm-up, never above the peak;
    # linear: equal increments on the way up (from warmup_min_ratio 0) until the cosine takes over
    peak = lrs.index(max(lrs))
    assert peak >= w and max(lrs) <= 6e-4 * (1 + 1e-9)
    rises = [b - a for a, b in zip(lrs[: peak - 1], lrs[1:peak], strict=True) if b > a]
    assert len(rises) >= w - 1 and max(rises) == pytest.approx(min(rises), rel=1e-6)
    assert all(b >= a for a, b in zip(lrs[:peak], lrs[1 : peak + 1], strict=True))
    assert lrs[1] <= 6e-4 / w  # the first updates are small, not at the peak
    if steps > 2 * w:
        assert lrs[-1] < max(lrs)  # then the cosine decays


def test_the_picture_has_a_loss_panel_and_a_time_panel_with_integer_step_ticks():
    fig = draw(
        [5.0, 4.5, 4.2, 4.0, 3.9], [1.0, 0.9, 1.1, 1.0, 1.0], [0.5, 0.1, 0.0, 0.2, 0.1], title="t"
    )
    loss_ax, time_ax = fig.axes[:2]
    assert loss_ax.get_ylabel() == "loss" and time_ax.get_ylabel() == "seconds per step"
    fig.canvas.draw()  # ticks are placed when drawn
    for ax in (loss_ax, time_ax):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)
    # the bars: compute, with the exposed I/O stacked on top of it
    compute, exposed = time_ax.containers
    assert [b.get_height() for b in compute] == [1.0, 0.9, 1.1, 1.0, 1.0]
    assert [b.get_y() for b in exposed] == [1.0, 0.9, 1.1, 1.0, 1.0]
    assert [b.get_height() for b in exposed] == pytest.approx([0.5, 0.1, 0.0, 0.2, 0.1])


def test_demo_writes_prefix_png_and_json_with_each_steps_times(nvme_dir, tmp_path, capsys):
    """A tiny run end to end (about 15 s on a busy 2-core machine: the model is built, offloaded
    to NVMe and trained for two steps)."""
    out = tmp_path / "infinity_demo"
    argv = ["demo", "--params", "300K", "--steps", "2", "--seq", "16"]
    assert cli_main.main([*argv, "--nvme-path", str(nvme_dir), "--out", str(out)]) == 0
    assert (tmp_path / "infinity_demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "infinity_demo.json").read_text())
    assert len(summary["losses"]) == len(summary["step_s"]) == len(summary["exposed_io_s"]) == 2
    assert all(0 <= e <= s for e, s in zip(summary["exposed_io_s"], summary["step_s"], strict=True))
    printed = capsys.readouterr().out
    assert f"{out}.png" in printed
    # The summary ends with the advice `infinity report` computes from the last step's trace.
    trace = tmp_path / "infinity_demo.trace.json"
    assert [s["step"] for s in read_trace(trace)["infinity"]["steps"]] == [1]
    assert trace_summary(trace) in printed
