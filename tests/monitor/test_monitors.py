"""DeepSpeed's monitor sections acted on: the files hold what the engine returned and counted.

Oracles: the losses ``engine(x, y)`` returned, and the engine's own counters
(``io_stats``, ``prefetch_stats``) read by a second step listener at the
instant each step's record is made; the files are read back with each
writer's own reader (TensorBoard's EventAccumulator, the csv module, wandb's
record protobuf).
"""

from __future__ import annotations

import csv
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import infinity
from infinity.config import ConfigError
from tests.engine.models import batch, tiny_gpt
from tests.monitor.wandb_records import history

GAS = 2
STEPS = 3
MICRO = 2


def config(nvme: Path, **sections) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4},
        },
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 3000,
            "stage3_param_persistence_threshold": 100,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(nvme),
                "buffer_count": 4,
                "buffer_size": 1 << 16,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8},
        **sections,
    }


class Counted:
    """The engine's cumulative counters as the engine itself read them for each step's record:
    ``io_stats`` and ``prefetch_stats`` (public, reading the stores' and the scheduler's own
    counters) are watched, and each record is paired with the values they last returned."""

    def __init__(self, engine):
        self.io: list[dict] = []
        self.prefetch: list = []
        io_stats, prefetch_stats = engine.io_stats, engine.prefetch_stats
        engine.io_stats = lambda: self._seen(self.io, io_stats())
        engine.prefetch_stats = lambda: self._seen(self.prefetch, prefetch_stats())
        self.rows: list[dict] = []
        self.lrs: list[float] = []
        self.records: list = []

    @staticmethod
    def _seen(into: list, value):
        into.append(value)
        return value

    def __call__(self, record) -> None:
        io, stats = self.io[-1], self.prefetch[-1]
        t = stats.total if stats is not None else None
        self.rows.append(
            {
                "read": io["read_nbytes"],
                "write": io["write_nbytes"],
                "hits": t.prefetch_hits if t else 0,
                "late": t.late_prefetches if t else 0,
                "demand": t.on_demand if t else 0,
            }
        )
        self.records.append(record)

    def delta(self, step: int, key: str) -> int:
        """Step ``step``'s (1-based, from 2: step 1's window opened before the watch) difference."""
        assert step >= 2
        return self.rows[step - 1][key] - self.rows[step - 2][key]


def train(cfg: dict):
    """STEPS optimizer steps; the per-step mean of the losses the engine returned, and the
    counters."""
    torch.manual_seed(0)
    engine = infinity.initialize(tiny_gpt(), cfg)
    counted = Counted(engine)
    engine.add_step_listener(counted)
    means, lrs = [], []
    try:
        for step in range(STEPS):
            losses = []
            for micro in range(GAS):
                x, y = batch(step, micro, 0)
                loss = engine(x, y)
                engine.backward(loss)
                if micro == GAS - 1:
                    lrs.append(engine.get_lr()[0])  # what this update applies
                engine.step()
                losses.append(loss.item())
            means.append(sum(losses) / GAS)
    finally:
        engine.close()
    counted.lrs = lrs
    return means, counted


def samples(step: int) -> int:
    return step * MICRO * GAS


def test_tensorboard_csv_and_wandb_hold_the_losses_and_the_counters(
    nvme_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config(
        nvme_dir,
        tensorboard={"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "run"},
        csv_monitor={"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run"},
        wandb={"enabled": True, "project": "infinity-test", "group": "g"},
    )
    means, counted = train(cfg)
    xs = [samples(s) for s in range(1, STEPS + 1)]

    counts = {
        "Infinity/prefetch_hits": "hits",
        "Infinity/prefetch_late": "late",
        "Infinity/prefetch_on_demand": "demand",
        "Infinity/nvme_read_bytes": "read",
        "Infinity/nvme_write_bytes": "write",
    }
    assert sum(counted.delta(s, "hits") for s in range(2, STEPS + 1)) > 0  # replayed: read ahead
    records = counted.records

    def check(series: dict[str, list[tuple[int, float]]], rel: float) -> None:
        assert [x for x, _ in series["Train/Samples/train_loss"]] == xs
        for (_, got), want in zip(series["Train/Samples/train_loss"], means, strict=True):
            assert got == pytest.approx(want, rel=rel)
        assert series["Train/Samples/lr"] == [
            (x, pytest.approx(lr, rel=rel)) for x, lr in zip(xs, counted.lrs, strict=True)
        ]
        assert len(set(counted.lrs)) > 1  # the warm-up moves it
        for name, key in counts.items():
            # step 1's window opened at initialize, before the watch
            want = [(x, counted.delta(step, key)) for step, x in enumerate(xs, start=1) if step > 1]
            assert series[name][1:] == want, name
        for name, field in (
            ("Infinity/nvme_read_bytes", "read_nbytes"),
            ("Infinity/io_wait_s", "io_wait_s"),
            ("Infinity/fetch_stall_s", "fetch_stall_s"),
        ):
            assert series[name] == [
                (r.samples, pytest.approx(getattr(r, field), rel=rel)) for r in records
            ]
        assert series["Infinity/nvme_read_bytes"][0][1] > 0
        for _, v in series["Infinity/step_time_s"]:
            assert v > 0
        for _, v in series["Infinity/peak_host_bytes"]:
            assert v > 0
        for _, v in series["Infinity/pool_occupancy"]:
            assert 0 < v <= 1
        assert "Train/Samples/loss_scale" not in series  # fp16 only, as in DeepSpeed
        assert "Train/Samples/elapsed_time_ms_forward" not in series  # wall_clock_breakdown off

    # TensorBoard's own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "run"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    check({t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags}, rel=1e-6)  # float32

    # DeepSpeed's CSV layout: one file per event, headed step,<last part of the name>
    csv_series = {}
    for path in sorted((tmp_path / "csv" / "run").glob("*.csv")):
        with open(path, newline="") as f:
            header, *rows = list(csv.reader(f))
        name = next(n for n in tags if n.replace("/", "_") + ".csv" == path.name)
        assert header == ["step", name.rsplit("/", 1)[-1]]
        csv_series[name] = [(int(s), float(v)) for s, v in rows]
    assert sorted(csv_series) == sorted(tags)
    assert (tmp_path / "csv" / "run" / "Train_Samples_train_loss.csv").exists()
    check(csv_series, rel=1e-12)

    # the wandb offline run
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    rows = history(run_file)
    assert [r["_step"] for r in rows] == xs
    check({t: [(r["_step"], r[t]) for r in rows if t in r] for t in tags}, rel=1e-12)


def test_monitors_off_write_nothing_and_build_no_records(nvme_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    torch.manual_seed(0)
    engine = infinity.initialize(tiny_gpt(), config(nvme_dir))
    with engine:
        for micro in range(GAS):
            x, y = batch(0, micro, 0)
            engine.backward(engine(x, y))
            engine.step()
        assert engine.global_steps == 1
        assert engine.last_step_record is None  # [Note: step records]: nobody reads one
    assert list(tmp_path.iterdir()) == []


def test_the_optional_packages_are_imported_only_for_an_enabled_section(tmp_path):
    """In a fresh interpreter: a run with the csv monitor on imports neither wandb nor
    tensorboard."""
    code = (
        "import sys, torch, infinity\n"
        "from tests.engine.models import tiny_gpt, batch\n"
        f"cfg = {{'optimizer': {{'type': 'AdamW', 'params': {{'lr': 1e-3}}}},"
        f" 'csv_monitor': {{'enabled': True, 'output_path': {str(tmp_path)!r}}}}}\n"
        "engine = infinity.initialize(tiny_gpt(), cfg)\n"
        "x, y = batch(0, 0, 0)\n"
        "engine.backward(engine(x, y)); engine.step(); engine.close()\n"
        "print(sorted(m for m in ('wandb', 'tensorboard', 'torch.utils.tensorboard')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "DeepSpeedJobName" / "Train_Samples_train_loss.csv").exists()


def test_csv_monitor_defaults_write_under_the_job_name_here(nvme_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    means, _ = train(config(nvme_dir, csv_monitor={"enabled": True}))
    with open(tmp_path / "DeepSpeedJobName" / "Train_Samples_train_loss.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"]
    assert [int(s) for s, _ in rows[1:]] == [samples(s) for s in range(1, STEPS + 1)]
    assert [float(v) for _, v in rows[1:]] == pytest.approx(means, rel=1e-12)


def test_wall_clock_breakdown_logs_and_writes_the_times(nvme_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO, "infinity.engine")
    cfg = config(
        nvme_dir,
        wall_clock_breakdown=True,
        steps_per_print=2,
        csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"},
    )
    train(cfg)
    lines = [r.getMessage() for r in caplog.records if r.name == "infinity.engine"]
    times = [line for line in lines if "time (ms)" in line]
    assert len(times) == 1 and times[0].startswith("step=2 time (ms) | forward: ")
    for part in ("backward: ", "step: ", "io_wait: ", "total: "):
        assert part in times[0]
    assert any(line.startswith("step=2, skipped=0, lr=") for line in lines)
    for name in ("forward", "backward", "step"):
        with open(tmp_path / "j" / f"Train_Samples_elapsed_time_ms_{name}.csv", newline="") as f:
            header, *rows = list(csv.reader(f))
        assert header == ["step", f"elapsed_time_ms_{name}"]
        assert len(rows) == STEPS and all(float(v) > 0 for _, v in rows)


@pytest.mark.parametrize("section", ["tensorboard", "csv_monitor"])
def test_an_unwritable_output_path_is_refused_at_initialize_naming_the_key(
    section, nvme_dir, tmp_path
):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cfg = config(nvme_dir, **{section: {"enabled": True, "output_path": str(blocker / "runs")}})
    with pytest.raises(
        ConfigError, match=rf"^{section}\.output_path: cannot write .* set {section}"
    ):
        infinity.initialize(tiny_gpt(), cfg)
    assert list(nvme_dir.iterdir()) == []  # refused before anything was allocated


@pytest.mark.parametrize(
    ("section", "module"), [("wandb", "wandb"), ("tensorboard", "tensorboard")]
)
def test_an_enabled_section_without_its_package_names_the_extra(
    section, module, nvme_dir, tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    cfg = config(nvme_dir, **{section: {"enabled": True, "output_path": str(tmp_path)}})
    if section == "wandb":
        cfg[section].pop("output_path")
    with pytest.raises(
        ConfigError,
        match=rf"^{section}\.enabled is true but the {module} package cannot be "
        rf"imported .*pip install 'infinity\[{module}\]'",
    ):
        infinity.initialize(tiny_gpt(), cfg)


def test_loss_scale_is_an_event_under_fp16_only():
    from infinity.engine import StepRecord
    from infinity.monitor import step_events

    record = StepRecord(
        step=2,
        samples=8,
        loss=1.5,
        lr=None,
        loss_scale=1024.0,
        grad_norm=None,
        skipped=False,
        step_time_s=2.0,
        forward_s=0.5,
        backward_s=1.0,
        optimizer_s=0.25,
        io_wait_s=0.7,
        fetch_stall_s=0.5,
        read_nbytes=4_000_000_000,
        write_nbytes=1_000_000_000,
        prefetch_hits=3,
        late_prefetches=1,
        on_demand=2,
        pool_in_use_nbytes=10,
        pool_peak_nbytes=50,
        pool_capacity_nbytes=100,
        peak_host_nbytes=7,
    )
    on = {n: (v, x) for n, v, x in step_events(record, fp16=True, wall_clock_breakdown=True)}
    assert on["Train/Samples/loss_scale"] == (1024.0, 8)
    assert "Train/Samples/lr" not in on  # nothing trains: no lr, not a made-up 0
    assert on["Train/Samples/elapsed_time_ms_step"] == (250.0, 8)
    assert on["Infinity/nvme_read_GBps"] == (2.0, 8) and on["Infinity/compute_s"] == (1.5, 8)
    assert on["Infinity/pool_occupancy"] == (0.5, 8)
    off = {n for n, _, _ in step_events(record, fp16=False, wall_clock_breakdown=False)}
    assert "Train/Samples/loss_scale" not in off and "Train/Samples/train_loss" in off


def test_the_bytes_of_each_step_are_the_stores_counters(nvme_dir, tmp_path):
    """Stage 2 with the optimizer state on NVMe: each step's bytes are the differences of the
    stores' counters as the engine read them for the record."""
    cfg = config(
        nvme_dir,
        csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"},
    )
    cfg["zero_optimization"] = {
        "stage": 2,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme_dir)},
    }
    _, counted = train(cfg)
    for name, key in (("nvme_read_bytes", "read"), ("nvme_write_bytes", "write")):
        with open(tmp_path / "j" / f"Infinity_{name}.csv", newline="") as f:
            _, *rows = list(csv.reader(f))
        got = [(int(s), float(v)) for s, v in rows]
        want = [(samples(s), counted.delta(s, key)) for s in range(2, STEPS + 1)]
        assert got[1:] == want, name
        assert all(v > 0 for _, v in got), name
