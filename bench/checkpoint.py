#!/usr/bin/env python3
"""Checkpoint save and load vs fio on the same disk, interleaved, and peak RSS while saving a model
whose state is far larger than the memory the config gives the engine.

A GPT (``--params``) trains one step under ZeRO stage 3 with fp32 parameters and Adam state placed
two ways, one engine after the other:

  nvme   params and optimizer state on NVMe (the real case): a save reads every shard back from
         the swap files while it writes the checkpoint on the same disk, and a load reads the
         checkpoint while it writes the swap files. Its disk limit is fio copying (a read job and a
         write job at once, same size); fio write / read alone are shown too.
  cpu    the same state in host memory (offload "cpu"): a save is then writes only, a load reads
         only, so these rows measure the checkpoint writer and reader against fio write and read.

Each repetition runs fio write, fio read, fio copy (1 MiB blocks, queue depth 32, io_uring,
O_DIRECT, huge-page buffers; plus fio write with its default 4 KiB-page buffers) and the engine's
save, load and load(verify=False), in an order rotated every repetition. A save's figure is the
checkpoint's bytes over the save_checkpoint call (fsyncs and publishing included); a load's the
same bytes over load_checkpoint (which, verifying, reads them twice). Ratios are per repetition
against the fio run of that repetition; reported as median (min-max). The page cache is bypassed
(O_DIRECT) throughout.

Peak RSS (VmHWM, reset through /proc/self/clear_refs before each call; memory from the hugetlb pool,
which VmHWM leaves out, is reported beside it) is taken around the nvme engine's save, load and
export, next to the state bytes on NVMe and the engine's pool budget.

    python bench/checkpoint.py            # ~200M parameters (2.4 GB checkpoint), 3 repetitions
    python bench/checkpoint.py --quick    # smoke run in seconds

Results go to $INFINITY_BENCH_RESULTS or bench/results/ as JSON (checkpoint[-quick].json).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import infinity
from infinity.engine.checkpoint import export_checkpoint
from infinity.host import hugetlb_nbytes, peak_rss_nbytes, reset_peak_rss, rss_nbytes
from infinity.measure import FioError, FioJob, fio_path, machine_info, shmhuge_fits
from infinity.models import GPT, GPTConfig, TextCorpus

ROOT = Path(__file__).resolve().parent
BLOCK, DEPTH = 1 << 20, 32


def engine_config(placement: str, swap: Path, sub_group: int) -> dict:
    off = {"device": placement, "nvme_path": str(swap)}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": sub_group,
            "offload_param": {**off, "buffer_count": 4, "buffer_size": sub_group, "max_in_cpu": 0},
            "offload_optimizer": off,
        },
        "aio": {"block_size": BLOCK, "queue_depth": DEPTH},
    }


def build(placement: str, gpt: GPTConfig, swap: Path, sub_group: int):
    cfg = engine_config(placement, swap, sub_group)
    torch.manual_seed(0)
    with infinity.zero.Init(cfg):
        model = GPT(gpt)
    engine = infinity.initialize(model, cfg)
    x, y = TextCorpus(1 << 14).batch(0, 1, gpt.seq_len)
    loss = engine(x, y)  # one step: the moments are not all zero
    engine.backward(loss)
    engine.step()
    return engine


def dir_nbytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def fio_copy(src: Path, dst: Path, nbytes: int) -> float:
    """GB/s of fio reading ``src`` while writing ``dst`` (two jobs at once): nbytes over the longer job."""
    argv = [
        fio_path(),
        "--ioengine=io_uring",
        "--direct=1",
        f"--bs={BLOCK}",
        f"--iodepth={DEPTH}",
        f"--iomem={'shmhuge' if shmhuge_fits(BLOCK, DEPTH, 2) else 'malloc'}",
        "--output-format=json",
        "--name=read",
        f"--filename={src}",
        "--rw=read",
        f"--size={nbytes}",
        "--name=write",
        f"--filename={dst}",
        "--rw=write",
        f"--size={nbytes}",
    ]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise FioError(f"fio copy failed: {(r.stderr or r.stdout).strip()[-300:]}")
    jobs = json.loads(r.stdout[r.stdout.index("{") :])["jobs"]
    return nbytes / max(j["job_runtime"] for j in jobs) * 1e3 / 1e9


class Contenders:
    """The engine's save/load runs and the fio runs of one placement, each returning GB/s."""

    def __init__(self, engine, placement: str, work: Path, nbytes_hint: int):
        self.engine = engine
        self.placement = placement
        self.work = work
        self.ckpt = work / f"ckpt-{placement}"
        self.nbytes = nbytes_hint  # checkpoint bytes, known after the first save
        self.peak: dict[str, dict[str, float]] = {}
        self.rep = 0

    def _timed(self, name: str, fn) -> float:
        gc.collect()
        before = rss_nbytes()
        reset_peak_rss()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        # Pool memory from the hugetlb pool is not in VmRSS/VmHWM: it is counted beside them.
        self.peak[name] = {
            "rss_before_gib": before / 2**30,
            "peak_rss_gib": peak_rss_nbytes() / 2**30,
            "hugetlb_gib": hugetlb_nbytes() / 2**30,
        }
        return dt

    def save(self) -> float:
        shutil.rmtree(self.ckpt, ignore_errors=True)
        self.rep += 1
        dt = self._timed(
            "save", lambda: self.engine.save_checkpoint(self.ckpt, tag="bench", progress=False)
        )
        self.nbytes = dir_nbytes(self.ckpt / "bench")
        return self.nbytes / dt / 1e9

    def load(self, verify: bool) -> float:
        name = "load" if verify else "load (verify=False)"
        dt = self._timed(
            name, lambda: self.engine.load_checkpoint(self.ckpt, verify=verify, progress=False)
        )
        return self.nbytes / dt / 1e9

    def export(self) -> float:
        out = self.work / "export.safetensors"
        dt = self._timed("export", lambda: export_checkpoint(self.ckpt, out, progress=False))
        n = out.stat().st_size
        out.unlink()
        return n / dt / 1e9

    def fio(self, op: str, iomem: str = "shmhuge") -> float:
        job = FioJob(
            self.work / "fio.dat",
            self.nbytes,
            op,
            BLOCK,
            DEPTH,  # type: ignore[arg-type]
            iomem=iomem if iomem == "malloc" or shmhuge_fits(BLOCK, DEPTH, 1) else "malloc",
        )
        return job.run()

    def runs(self, with_fio: bool) -> dict:
        out = {
            "save": self.save,
            "load": lambda: self.load(True),
            "load (verify=False)": lambda: self.load(False),
        }
        if with_fio:
            out["fio write"] = lambda: self.fio("write")
            out["fio write, default buffers"] = lambda: self.fio("write", "malloc")
            out["fio read"] = lambda: self.fio("read")
            out["fio copy"] = lambda: fio_copy(
                self.work / "fio.dat", self.work / "fio-copy.dat", self.nbytes
            )
        return out


REFS = {
    "save": ("fio write", "fio copy", "fio write, default buffers"),
    "load": ("fio read", "fio copy"),
    "load (verify=False)": ("fio read", "fio copy"),
}


def measure(c: Contenders, repeat: int, with_fio: bool) -> list[dict]:
    runs = c.runs(with_fio)
    names = list(runs)
    got: dict[str, list[float]] = {n: [] for n in names}
    runs["save"]()  # warm-up; also sizes the fio files
    if with_fio:
        runs["fio write"]()
    for rep in range(repeat):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        # A load needs the checkpoint of this repetition: saves go first among the engine's runs.
        order = sorted(order, key=lambda n: 0 if n == "save" else 1) if rep == 0 else order
        for name in order:
            if name.startswith("load") and not (c.ckpt / "bench").exists():
                runs["save"]()
            got[name].append(runs[name]())
    rows = []
    for name, xs in got.items():
        row = {"placement": c.placement, "op": name, "gbps": _stats(xs)}
        for ref in REFS.get(name, ()):
            if ref in got:
                row[f"vs {ref}"] = _stats([a / b for a, b in zip(xs, got[ref], strict=True)])
        rows.append(row)
    return rows


def _stats(xs: list[float]) -> dict:
    return {
        "median": round(statistics.median(xs), 3),
        "min": round(min(xs), 3),
        "max": round(max(xs), 3),
        "runs": [round(x, 3) for x in xs],
    }


def fmt(s: dict | None) -> str:
    return "" if s is None else f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def format_rows(rows: list[dict]) -> str:
    cols = ["vs fio write", "vs fio read", "vs fio copy", "vs fio write, default buffers"]
    lines = [f"{'placement':<9} {'op':<28} {'GB/s':>18}  " + "  ".join(f"{c:>20}" for c in cols)]
    for r in rows:
        lines.append(
            f"{r['placement']:<9} {r['op']:<28} {fmt(r['gbps']):>18}  "
            + "  ".join(f"{fmt(r.get(c)):>20}" for c in cols)
        )
    return "\n".join(lines)


def format_markdown(rows: list[dict]) -> str:
    lines = [
        "| state in | operation | GB/s | ÷ fio write | ÷ fio read | ÷ fio copy |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["op"].startswith("fio"):
            continue
        lines.append(
            f"| {r['placement']} | {r['op']} | {fmt(r['gbps'])} | {fmt(r.get('vs fio write'))} | "
            f"{fmt(r.get('vs fio read'))} | {fmt(r.get('vs fio copy'))} |"
        )
    fio = {r["op"]: r for r in rows if r["op"].startswith("fio") and r["placement"] == "nvme"}
    if fio:
        lines.append("")
        lines.append(
            "fio on the same disk (nvme run): "
            + ", ".join(f"{k} {fmt(v['gbps'])}" for k, v in fio.items())
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--path",
        type=Path,
        default=Path("infinity_nvme"),
        help="directory on the drive for swap files, checkpoints and fio files (default ./infinity_nvme)",
    )
    p.add_argument(
        "--params",
        type=float,
        default=None,
        help="model parameters (default 2e8; 4e6 with --quick)",
    )
    p.add_argument(
        "--repeat", type=int, default=None, help="repetitions (default 3; 1 with --quick)"
    )
    p.add_argument(
        "--placements",
        default="nvme,cpu",
        help="where the state lives: nvme, cpu or both (default)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run in seconds")
    p.add_argument("--markdown", action="store_true", help="also print docs/benchmarks.md's table")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON output (default $INFINITY_BENCH_RESULTS or bench/results)",
    )
    args = p.parse_args(argv)
    n_params = args.params or (4e6 if args.quick else 2e8)
    repeat = args.repeat or (1 if args.quick else 3)
    results = Path(os.environ.get("INFINITY_BENCH_RESULTS", ROOT / "results"))
    out = args.out or results / f"checkpoint{'-quick' if args.quick else ''}.json"
    gpt = GPTConfig.for_params(n_params, seq_len=64)
    sub_group = int(2e6 if args.quick else 8e6)
    with_fio = fio_path() is not None
    if not with_fio:
        print("fio is not installed: no ratios (apt-get install fio)")
    work = args.path / f"bench-checkpoint-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"checkpoint bench: GPT {gpt.num_params / 1e6:.0f}M params, {repeat} repetition(s), under {work}"
    )
    rows: list[dict] = []
    memory: dict = {}
    try:
        for placement in args.placements.split(","):
            swap = work / f"swap-{placement}"
            swap.mkdir()
            t0 = time.perf_counter()
            engine = build(placement, gpt, swap, sub_group)
            print(f"  {placement}: engine built and stepped in {time.perf_counter() - t0:.0f} s")
            try:
                c = Contenders(engine, placement, work, 0)
                rows += measure(c, repeat, with_fio)
                if placement == "nvme":
                    export_gbps = c.export()
                    rt = engine.runtime
                    memory = {
                        "state_on_nvme_gib": dir_nbytes(swap) / 2**30,
                        "checkpoint_gib": c.nbytes / 2**30,
                        "pool_budget_gib": (
                            rt.param_store.pool.capacity + rt.state_store.pool.capacity
                        )
                        / 2**30,
                        "export_gbps": round(export_gbps, 3),
                        **{
                            k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in c.peak.items()
                        },
                    }
            finally:
                engine.close()
                shutil.rmtree(swap, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(format_rows(rows))
    if memory:
        print(
            f"nvme: {memory['state_on_nvme_gib']:.2f} GiB of training state on NVMe, a "
            f"{memory['checkpoint_gib']:.2f} GiB checkpoint, engine pools {memory['pool_budget_gib']:.2f} GiB; "
            + "; ".join(
                f"{k}: peak RSS {v['peak_rss_gib']:.2f} GiB (before {v['rss_before_gib']:.2f}) "
                f"+ {v['hugetlb_gib']:.2f} GiB hugetlb"
                for k, v in memory.items()
                if isinstance(v, dict)
            )
            + f"; export {memory['export_gbps']:.2f} GB/s"
        )
    if args.markdown:
        print(format_markdown(rows))
    record = {
        "bench": "checkpoint",
        "mode": "quick" if args.quick else "full",
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": machine_info(args.path),
        "params": gpt.num_params,
        "gpt": gpt.__dict__,
        "repeat": repeat,
        "aio": {"block_size": BLOCK, "queue_depth": DEPTH},
        "page_cache": "bypassed (O_DIRECT) for checkpoint shards, swap files and fio",
        "rows": rows,
        "memory": memory,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
