"""CPU Adam step: infinity's kernel vs torch AdamW (fused, foreach) and the memory-bandwidth bound.

    python bench/adam.py            # 50M and 200M params, flat and 200 tensors, 2 threads, 5 rounds
    python bench/adam.py --quick    # seconds: small sizes, 3 rounds (the CI smoke run)

Every contender runs once per round, in turn (A B C ... A B C ...), on the
same parameters and gradients, so the ratios compare like with like on a
noisy machine: each ratio is taken inside a round and reported as the median
and min-max over the rounds.

The bound is a kernel that reads param, grad, exp_avg, exp_avg_sq and writes
the three in place with the same loads, stores and threads as ours, but no
Adam math (infinity.optim.stream_bound_step), run over CPUAdam's own buffers:
28 bytes per parameter, the traffic of every fp32 Adam step. (It adds the
gradient to CPUAdam's moments; they stay finite, and the timings do not
depend on the values.) Ours with bf16 gradients and the bf16 weight
copy moves 28 bytes too (2 fewer read, 2 more written); torch has to run its
step (28) and then convert the weights (4 read + 2 written).

Writes a JSON with the configuration, versions and machine into bench/results/
(--quick: bench/out/), and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import infinity
from infinity import _adam
from infinity.host import cpu_model, memory_total_nbytes
from infinity.optim import (
    AdamHyper,
    CPUAdam,
    foreach_adam_step,
    get_isa,
    has_overflow,
    stream_bound_step,
)

ROOT = Path(__file__).resolve().parent.parent
BYTES_PER_PARAM = 28  # read p, g, m, v; write p, m, v (fp32)
HYPER = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
ADAM_HYPER = AdamHyper(
    lr=HYPER["lr"], beta1=HYPER["betas"][0], beta2=HYPER["betas"][1], eps=HYPER["eps"],
    weight_decay=HYPER["weight_decay"], adamw=True,
)  # fmt: skip


def _deepspeed_adam() -> type | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]
    except Exception:  # not installed, or its JIT build failed: there is nothing to compare with
        return None
    return DeepSpeedCPUAdam


class Case:
    """One model size and layout: shared params and grads, each contender with its own optimizer state."""

    def __init__(self, numel: int, tensors: int, threads: int, with_deepspeed: bool):
        self.numel, self.tensors, self.threads = numel, tensors, threads
        sizes = [numel // tensors + (1 if i < numel % tensors else 0) for i in range(tensors)]
        self.flat = torch.randn(numel) * 0.02
        self.grad_flat = torch.randn(numel) * 1e-3
        self.grad16_flat = self.grad_flat.to(torch.bfloat16)
        self.half_flat = torch.empty(numel, dtype=torch.bfloat16)
        self.params = [torch.nn.Parameter(t) for t in self.flat.split(sizes)]
        for p, g in zip(self.params, self.grad_flat.split(sizes), strict=True):
            p.grad = g
        self.grad16 = list(self.grad16_flat.split(sizes))
        self.halves = list(self.half_flat.split(sizes))
        self.ours = CPUAdam(self.params, **HYPER, num_threads=threads)
        self.fused = torch.optim.AdamW(self.params, **HYPER, fused=True)
        self.foreach = torch.optim.AdamW(self.params, **HYPER, foreach=True)
        ds = _deepspeed_adam() if with_deepspeed else None
        self.deepspeed = ds(self.params, **HYPER, adamw_mode=True) if ds is not None else None
        # Moments of the bf16 runs (CPUAdam keeps its own, laid out as torch's).
        self.m16 = list(torch.zeros(numel).split(sizes))
        self.v16 = list(torch.zeros(numel).split(sizes))
        self.step16 = 0

    def contenders(self) -> dict[str, Callable[[], None]]:
        c: dict[str, Callable[[], None]] = {
            "bound (4 read, 3 write)": self._bound,
            "ours fp32 (CPUAdam)": self.ours.step,
            "torch fused": self.fused.step,
            "torch foreach": self.foreach.step,
        }
        if self.deepspeed is not None:
            c["DeepSpeedCPUAdam"] = self.deepspeed.step
        c["ours bf16 grad + bf16 copy"] = self._ours_bf16
        c["torch fused + copy_ to bf16"] = self._fused_copy
        c["torch fused + .to(bf16)"] = self._fused_to
        return c

    def _bound(self) -> None:
        """Over the very buffers CPUAdam steps (its own exp_avg/exp_avg_sq): the same memory layout."""
        if not self.ours.state:
            self.ours.step()  # creates the state
        states = [self.ours.state[p] for p in self.params]
        stream_bound_step(
            self.params,
            [p.grad for p in self.params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            num_threads=self.threads,
        )

    def _ours_bf16(self) -> None:
        self.step16 += 1
        foreach_adam_step(
            self.params,
            self.grad16,
            self.m16,
            self.v16,
            ADAM_HYPER,
            step=self.step16,
            out_halves=self.halves,
            num_threads=self.threads,
        )

    def _fused_copy(self) -> None:
        self.fused.step()
        for h, p in zip(self.halves, self.params, strict=True):
            h.copy_(p.detach())

    def _fused_to(self) -> None:
        self.fused.step()
        self.copies = [p.detach().to(torch.bfloat16) for p in self.params]


def _ratio_stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _load() -> float:
    """The 1-minute load average: other processes on a shared machine show up here (and in min-max)."""
    return os.getloadavg()[0]


def run_case(numel: int, tensors: int, threads: int, rounds: int, with_deepspeed: bool) -> dict:
    case = Case(numel, tensors, threads, with_deepspeed)
    load_before = _load()
    fns = case.contenders()
    for fn in fns.values():  # warm-up: allocates optimizer state, touches every page
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    bound = "bound (4 read, 3 write)"
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {
            "ms": {"median": med * 1e3, "min": min(ts) * 1e3, "max": max(ts) * 1e3},
            "params_per_s": numel / med,
            "GBps_at_28_bytes_per_param": BYTES_PER_PARAM * numel / med / 1e9,
            "fraction_of_bound": _ratio_stats(
                [b / t for b, t in zip(times[bound], ts, strict=True)]
            ),
        }

    def speedup(slow: str, fast: str) -> dict[str, float]:
        return _ratio_stats([s / f for s, f in zip(times[slow], times[fast], strict=True)])

    ratios = {
        "ours fp32 vs torch fused (speedup)": speedup("torch fused", "ours fp32 (CPUAdam)"),
        "ours fp32 vs torch foreach (speedup)": speedup("torch foreach", "ours fp32 (CPUAdam)"),
        "ours bf16+copy vs torch fused + copy_ (speedup)": speedup(
            "torch fused + copy_ to bf16", "ours bf16 grad + bf16 copy"
        ),
        "ours bf16+copy vs torch fused + .to (speedup)": speedup(
            "torch fused + .to(bf16)", "ours bf16 grad + bf16 copy"
        ),
        "ours bf16+copy vs torch fused (speedup)": speedup(
            "torch fused", "ours bf16 grad + bf16 copy"
        ),
    }
    ratios = {"ours fp32 / bound (speed)": speedup(bound, "ours fp32 (CPUAdam)"), **ratios}
    if "DeepSpeedCPUAdam" in times:
        ratios["ours fp32 vs DeepSpeedCPUAdam (speedup)"] = speedup(
            "DeepSpeedCPUAdam", "ours fp32 (CPUAdam)"
        )
    del case, fns
    gc.collect()
    return {
        "numel": numel,
        "tensors": tensors,
        "threads": threads,
        "rounds": rounds,
        "loadavg_1min": [load_before, _load()],
        "rows": rows,
        "ratios": ratios,
    }


def run_pieces(threads: int, rounds: int, piece: int) -> dict:
    """The offload pipeline's granularity: adam_step on one flat piece, vs torch fused on the same piece."""
    from infinity.optim import adam_step

    p, g = torch.randn(piece), torch.randn(piece) * 1e-3
    m, v = torch.zeros(piece), torch.zeros(piece)
    tp = torch.nn.Parameter(p.clone())
    tp.grad = g
    fused = torch.optim.AdamW([tp], **HYPER, fused=True)
    tiny = [torch.randn(16), torch.randn(16), torch.zeros(16), torch.zeros(16)]
    step = [0]

    def ours() -> None:
        step[0] += 1
        adam_step(p, g, m, v, ADAM_HYPER, step=step[0], num_threads=threads)

    def call_overhead() -> None:
        adam_step(*tiny, ADAM_HYPER, step=1, num_threads=threads)

    fns = {
        "ours adam_step": ours,
        "torch fused": fused.step,
        "adam_step call, 16 elements": call_overhead,
    }
    for fn in fns.values():
        fn()
    reps = 20
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times[name].append((time.perf_counter() - t0) / reps)
    return {
        "numel": piece,
        "threads": threads,
        "us": {
            name: {
                "median": statistics.median(ts) * 1e6,
                "min": min(ts) * 1e6,
                "max": max(ts) * 1e6,
            }
            for name, ts in times.items()
        },
        "ours vs torch fused (speedup)": _ratio_stats(
            [f / o for f, o in zip(times["torch fused"], times["ours adam_step"], strict=True)]
        ),
    }


def run_overflow(numel: int, threads: int, rounds: int) -> dict:
    """has_overflow (one read-only pass) vs torch's check, over finite fp32 and fp16 gradients (the worst case)."""
    grads = {"fp32": torch.randn(numel), "fp16": torch.randn(numel).half()}
    fns: dict[str, Callable[[], bool]] = {}
    for name, g in grads.items():
        fns[f"ours has_overflow {name}"] = lambda g=g: has_overflow(g, num_threads=threads)
        fns[f"torch not isfinite().all() {name}"] = lambda g=g: not bool(torch.isfinite(g).all())
    for fn in fns.values():
        assert fn() is False
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    out = {"numel": numel, "threads": threads, "ms": {}, "speedup": {}}
    for name, ts in times.items():
        out["ms"][name] = {
            "median": statistics.median(ts) * 1e3,
            "min": min(ts) * 1e3,
            "max": max(ts) * 1e3,
        }
    for name in grads:
        ours, theirs = (
            times[f"ours has_overflow {name}"],
            times[f"torch not isfinite().all() {name}"],
        )
        out["speedup"][name] = _ratio_stats([t / o for t, o in zip(theirs, ours, strict=True)])
    return out


def machine() -> dict:
    cpu = cpu_model() or platform.processor()
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_GiB": round(memory_total_nbytes() / 2**30, 1),
        "isa": get_isa(),
        "threading": _adam.threading_backend(),
        "stream_min_bytes": _adam.stream_min_bytes(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "infinity": infinity.__version__,
        "deepspeed": "importable" if _deepspeed_adam() is not None else "not importable",
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def print_case(r: dict) -> None:
    load = "-".join(f"{x:.1f}" for x in r["loadavg_1min"])
    print(
        f"\n{r['numel'] / 1e6:g}M params in {r['tensors']} tensor(s), {r['threads']} threads, "
        f"{r['rounds']} rounds (load average {load})"
    )
    print(f"  {'':30s} {'ms median':>10s} {'(min-max)':>17s} {'Mparams/s':>10s} {'of bound':>9s}")
    for name, row in r["rows"].items():
        ms = row["ms"]
        print(
            f"  {name:30s} {ms['median']:10.2f} ({ms['min']:7.2f}-{ms['max']:7.2f}) "
            f"{row['params_per_s'] / 1e6:10.0f} {row['fraction_of_bound']['median']:9.2f}"
        )
    for name, s in r["ratios"].items():
        print(f"  {name:50s} {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})")


def markdown(result: dict) -> str:
    """docs/benchmarks.md's table: medians (min-max) over the rounds, ratios taken inside each round."""

    def cell(d: dict, fmt: str = "{:.1f}") -> str:
        return f"{fmt.format(d['median'])} ({fmt.format(d['min'])}-{fmt.format(d['max'])})"

    lines = [
        "| params | tensors | bound ms | ours fp32 ms | torch fused ms | torch foreach ms "
        "| ours / bound | ours vs fused | ours bf16+copy ms | fused + copy_ ms | bf16+copy vs fused+copy_ |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cases"]:
        r, q = c["rows"], c["ratios"]
        lines.append(
            f"| {c['numel'] / 1e6:g}M | {c['tensors']} "
            f"| {cell(r['bound (4 read, 3 write)']['ms'])} | {cell(r['ours fp32 (CPUAdam)']['ms'])} "
            f"| {cell(r['torch fused']['ms'])} | {cell(r['torch foreach']['ms'])} "
            f"| {cell(q['ours fp32 / bound (speed)'], '{:.2f}')} | {cell(q['ours fp32 vs torch fused (speedup)'], '{:.2f}')}x "
            f"| {cell(r['ours bf16 grad + bf16 copy']['ms'])} | {cell(r['torch fused + copy_ to bf16']['ms'])} "
            f"| {cell(q['ours bf16+copy vs torch fused + copy_ (speedup)'], '{:.2f}')}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, 3 rounds: seconds (CI)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick 3)"
    )
    ap.add_argument(
        "--sizes",
        type=float,
        nargs="+",
        default=None,
        help="params per case in millions (default 50 200)",
    )
    ap.add_argument(
        "--tensors",
        type=int,
        nargs="+",
        default=[1, 200],
        help="tensor counts per size (default 1 200)",
    )
    ap.add_argument(
        "--no-deepspeed", action="store_true", help="leave DeepSpeedCPUAdam out even if importable"
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default bench/results/adam.json; --quick bench/out/)",
    )
    args = ap.parse_args(argv)
    sizes = args.sizes or ([0.5, 2] if args.quick else [50, 200])
    rounds = args.rounds or (3 if args.quick else 5)
    results = os.environ.get(
        "INFINITY_BENCH_RESULTS"
    )  # tests/test_benchmarks.py: smoke runs write there
    out = args.out or (
        Path(results) / f"adam{'-quick' if args.quick else ''}.json"
        if results
        else ROOT / "bench" / ("out/adam-quick.json" if args.quick else "results/adam.json")
    )
    torch.set_num_threads(args.threads)

    result = {
        "benchmark": "cpu adam step",
        "command": "python bench/adam.py" + (" --quick" if args.quick else ""),
        "machine": machine(),
        "hyper": HYPER,
        "cases": [],
    }
    print(
        f"machine: {result['machine']['cpu']}, {result['machine']['cores']} cores, kernels: {result['machine']['isa']}"
    )
    for size in sizes:
        for tensors in args.tensors:
            r = run_case(int(size * 1e6), tensors, args.threads, rounds, not args.no_deepspeed)
            print_case(r)
            result["cases"].append(r)
    pieces = run_pieces(args.threads, rounds, piece=1 << 20)
    result["pieces"] = pieces
    print(f"\n1M-element piece (adam_step, the NVMe swapper's call), {args.threads} threads:")
    for name, us in pieces["us"].items():
        print(f"  {name:30s} {us['median']:9.1f} us ({us['min']:.1f}-{us['max']:.1f})")
    s = pieces["ours vs torch fused (speedup)"]
    print(f"  ours vs torch fused (speedup)  {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})")
    overflow = run_overflow(
        int(max(sizes) * 1e6) if args.quick else 50_000_000, args.threads, rounds
    )
    result["overflow"] = overflow
    print(
        f"\nOverflow check over {overflow['numel'] / 1e6:g}M finite gradients, {args.threads} threads:"
    )
    for name, ms in overflow["ms"].items():
        print(f"  {name:36s} {ms['median']:8.2f} ms ({ms['min']:.2f}-{ms['max']:.2f})")
    for name, sp in overflow["speedup"].items():
        print(
            f"  ours vs torch, {name} (speedup)     {sp['median']:.2f} ({sp['min']:.2f}-{sp['max']:.2f})"
        )
    print("\n" + markdown(result))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
