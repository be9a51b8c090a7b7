"""A sweep's samples shown to a person: the text table the commands print and the PNG chart.

One row (or group of bars) per setting, and per target where several paths were measured; read and
write GB/s, with fio's figure and the ratio where fio ran beside.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from infinity.measure.throughput import Sample, Setting


def format_table(samples: Sequence[Sample]) -> str:
    """One row per setting (and target, where several paths were measured): read and write GB/s
    (median, with min-max when repeated), fio and ratio."""
    rows: dict[tuple[str, Setting], dict[str, Sample]] = {}
    for sample in samples:
        rows.setdefault((sample.target, sample.setting), {})[sample.op] = sample
    ops = [op for op in ("read", "write") if any(op in r for r in rows.values())]
    with_fio = any(sm.fio for sm in samples)
    width = max(len(t) for t, _ in rows)
    header = (["target".ljust(width)] if width else []) + ["setting".ljust(18)]
    for op in ops:
        header.append(f"{op} GB/s".rjust(18))
        if with_fio:
            header += [f"fio {op}".rjust(9), "ratio".rjust(6)]
    lines = ["  ".join(header)]
    for (target, setting), by_op in rows.items():
        cells = ([target.ljust(width)] if width else []) + [setting.label.ljust(18)]
        for op in ops:
            sm = by_op.get(op)
            if sm is None:
                cells.append("-".rjust(18))
                if with_fio:
                    cells += ["-".rjust(9), "-".rjust(6)]
                continue
            spread = f" ({min(sm.ours):.2f}-{max(sm.ours):.2f})" if len(sm.ours) > 1 else ""
            cells.append(f"{sm.median:.2f}{spread}".rjust(18))
            if with_fio:
                cells += [f"{sm.fio_median:.2f}".rjust(9), f"{sm.ratio:.2f}".rjust(6)]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def plot(samples: Sequence[Sample], out: Path, title: str) -> None:
    """Grouped bars, GB/s per setting: ours (and fio) for each direction. PNG via matplotlib's
    Agg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(sm: Sample) -> str:
        return f"{sm.target} {sm.setting.label}" if sm.target else sm.setting.label

    labels = list(dict.fromkeys(label(sm) for sm in samples))
    series: dict[str, list[float]] = {}
    for op in ("read", "write"):
        mine = {label(sm): sm for sm in samples if sm.op == op}
        if not mine:
            continue
        series[f"{op} (infinity)"] = [mine[k].median if k in mine else 0.0 for k in labels]
        if any(sm.fio for sm in mine.values()):
            series[f"{op} (fio)"] = [mine[k].fio_median if k in mine else 0.0 for k in labels]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 4.5))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks(
        [x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=45, ha="right"
    )
    ax.set_ylabel("GB/s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
