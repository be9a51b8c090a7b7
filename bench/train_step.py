#!/usr/bin/env python3
"""Training step time: plain PyTorch in RAM vs ZeRO-3 with params and optimizer on NVMe.

The same GPT (~150M parameters by default), data and seed, trained by plain
PyTorch (torch AdamW, everything in RAM) and by infinity (stage 3, offload_param
and offload_optimizer on NVMe, O_DIRECT), once as DeepSpeed would place the
state and once with offload_optimizer.grads_in_host. Each run is a fresh
subprocess (so its peak memory is its own: VmHWM plus hugetlb pages); the kinds
are interleaved, their order rotating each repeat, and the headline is the
median ratio of their median step times after warm-up. Also reported: bytes
read and written per step and the GB/s they imply, the time steps spent
waiting for I/O, and peak RSS. DeepSpeed itself is not run (not installed here).

  python bench/train_step.py                 # ~150M, seq 256, 3 repeats
  python bench/train_step.py --capacity      # the largest model trained 3 steps
  python bench/train_step.py --quick         # seconds: proves it still runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, sys, time, torch
import infinity
from infinity.models import GPT, GPTConfig, TextCorpus
from infinity.cli.demo import demo_config

kind, params, seq, micro, steps, warmup, nvme = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
gpt = GPTConfig.for_params(params, seq_len=seq)
corpus = TextCorpus()
torch.manual_seed(0)
times, io = [], []
if kind == "plain":
    model = GPT(gpt)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    def step(i):
        x, y = corpus.batch(i, micro, seq)
        loss = model(x, y); loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad(set_to_none=True)
        return loss.item()
    stats = lambda: {"read_nbytes": 0, "write_nbytes": 0, "wait_s": 0.0}
else:
    largest = max(gpt.vocab_size, 4 * gpt.d_model) * gpt.d_model + 4 * gpt.d_model
    cfg = demo_config(nvme, lr=3e-4, steps=steps + warmup, micro_batch=micro, bf16=False, largest_unit=largest)
    del cfg["scheduler"]
    cfg["zero_optimization"]["offload_optimizer"]["grads_in_host"] = kind == "grads-in-host"
    with infinity.zero.Init(cfg):
        model = GPT(gpt)
    engine = infinity.initialize(model, cfg)
    def step(i):
        x, y = corpus.batch(i, micro, seq)
        loss = engine(x, y); engine.backward(loss); engine.step()
        return loss.item()
    stats = engine.io_stats
losses = []
for i in range(warmup + steps):
    before = stats()
    t = time.perf_counter()
    losses.append(step(i))
    dt = time.perf_counter() - t
    after = stats()
    if i >= warmup:
        times.append(dt)
        io.append({k: after[k] - before[k] for k in after})
if kind != "plain":
    engine.synchronize()
from infinity.memory import peak_host_nbytes
hwm = peak_host_nbytes()  # VmHWM + hugetlb pages (pools may live there)
print(json.dumps({"times": times, "io": io, "hwm": hwm, "params": gpt.num_params, "losses": losses}))
"""


def run_child(kind: str, args: argparse.Namespace, nvme: str) -> dict:
    cmd = [sys.executable, "-c", CHILD, kind, str(args.params), str(args.seq), str(args.micro_batch),
           str(args.steps), str(args.warmup), nvme]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=150e6)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--nvme-path", default=None, help="swap directory (default: a temporary one under ~/.cache)")
    ap.add_argument("--quick", action="store_true", help="a tiny model, one repeat: proves the bench runs")
    ap.add_argument("--capacity", type=float, default=None, metavar="PARAMS",
                    help="instead: train a model of PARAMS parameters for 3 steps under infinity only and report "
                         "training-state bytes / peak RSS")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.params, args.seq, args.steps, args.warmup, args.repeat = 2e6, 64, 2, 1, 1
    base = args.nvme_path or os.path.join(Path.home(), ".cache", "infinity-bench")
    os.makedirs(base, exist_ok=True)
    if args.capacity:
        return capacity(args, base)
    kinds = ["plain", "infinity", "grads-in-host"]
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for rep in range(args.repeat):
        for kind in kinds[rep % 3:] + kinds[:rep % 3]:
            with tempfile.TemporaryDirectory(dir=base) as nvme:
                t = time.perf_counter()
                res = run_child(kind, args, nvme)
                print(f"  repeat {rep + 1}/{args.repeat} {kind:13s}: median step "
                      f"{statistics.median(res['times']):.2f} s, peak RSS {res['hwm'] / 2**30:.2f} GiB "
                      f"({time.perf_counter() - t:.0f} s)", flush=True)
                runs[kind].append(res)
    med = {k: [statistics.median(r["times"]) for r in v] for k, v in runs.items()}
    result = {
        "params": runs["plain"][0]["params"],
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "step_s": {k: statistics.median(v) for k, v in med.items()},
        "peak_rss": {k: max(r["hwm"] for r in v) for k, v in runs.items()},
    }
    print(f"\nGPT {result['params'] / 1e6:.0f}M, seq {args.seq} x {args.micro_batch}: plain PyTorch "
          f"{result['step_s']['plain']:.2f} s/step, peak RSS {result['peak_rss']['plain'] / 2**30:.2f} GiB")
    for kind in kinds[1:]:
        result[kind] = _offload_summary(kind, runs, med)
    results = Path(os.environ.get("INFINITY_BENCH_RESULTS", ROOT / "bench" / "results"))
    results.mkdir(parents=True, exist_ok=True)
    out = args.out or results / f"train_step{'-quick' if args.quick else ''}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


def _offload_summary(kind: str, runs: dict[str, list[dict]], med: dict[str, list[float]]) -> dict:
    """One infinity kind against plain PyTorch: step-time ratio per repeat, I/O per step, memory."""
    ratios = [i / p for i, p in zip(med[kind], med["plain"], strict=True)]
    io = [s for r in runs[kind] for s in r["io"]]
    step_s = statistics.median(med[kind])
    read = statistics.median(s["read_nbytes"] for s in io)
    write = statistics.median(s["write_nbytes"] for s in io)
    wait = statistics.median(s["wait_s"] for s in io)
    r = {
        "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "read_nbytes_per_step": read,
        "write_nbytes_per_step": write,
        "read_gbps": read / step_s / 1e9,
        "write_gbps": write / step_s / 1e9,
        "io_wait_s_per_step": wait,
        "losses_equal_plain": all(abs(a - b) <= 1e-4 * abs(b) for a, b in
                                  zip(runs[kind][0]["losses"], runs["plain"][0]["losses"], strict=True)),
    }
    print(f"{kind:13s}: {step_s:.2f} s/step -> ratio {r['ratio']['median']:.2f} ({r['ratio']['min']:.2f}-"
          f"{r['ratio']['max']:.2f}); per step read {read / 1e9:.2f} GB, wrote {write / 1e9:.2f} GB "
          f"({r['read_gbps']:.2f} / {r['write_gbps']:.2f} GB/s), waited {wait:.2f} s for I/O; peak RSS "
          f"{max(x['hwm'] for x in runs[kind]) / 2**30:.2f} GiB; losses equal plain's: {r['losses_equal_plain']}")
    return r


def capacity(args: argparse.Namespace, base: str) -> int:
    args.params, args.steps, args.warmup = args.capacity, 3, 0
    with tempfile.TemporaryDirectory(dir=base) as nvme:
        t = time.perf_counter()
        res = run_child("infinity", args, nvme)
        wall = time.perf_counter() - t
    state = res["params"] * 16
    result = {"params": res["params"], "seq": args.seq, "training_state_nbytes": state, "peak_rss": res["hwm"],
              "state_over_rss": state / res["hwm"], "step_s": res["times"], "losses": res["losses"], "wall_s": wall}
    print(f"capacity: GPT {res['params'] / 1e9:.2f}B trained {len(res['times'])} steps; training state "
          f"{state / 2**30:.1f} GiB on NVMe, peak RSS {res['hwm'] / 2**30:.2f} GiB -> "
          f"{state / res['hwm']:.1f}x; steps {', '.join(f'{x:.0f} s' for x in res['times'])}")
    results = Path(os.environ.get("INFINITY_BENCH_RESULTS", ROOT / "bench" / "results"))
    results.mkdir(parents=True, exist_ok=True)
    out = args.out or results / "train_capacity.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
