#!/usr/bin/env python3
"""Training step time: plain PyTorch in RAM vs ZeRO-3 with params and optimizer on NVMe.

The same GPT (~150M parameters by default), data and seed, trained by plain
PyTorch (torch AdamW, everything in RAM) and by infinity (stage 3, offload_param
and offload_optimizer on NVMe, O_DIRECT), once as DeepSpeed would place the
state, once with offload_optimizer.grads_in_host, and once with the swap-file
checksums off (``"integrity": false`` in both offload sections): the step-time
ratio of "infinity" to "no-integrity" is the cost of integrity. Each run is a fresh
subprocess (so its peak memory is its own: VmHWM plus hugetlb pages); the kinds
are interleaved, their order rotating each repeat, and the headline is the
median ratio of their median step times after warm-up. Also reported: bytes
read and written per step and the GB/s they imply, the time steps spent
waiting for I/O, and peak RSS. DeepSpeed itself is not run (not installed here).

  python bench/train_step.py                 # ~150M, seq 256, 3 repeats
  python bench/train_step.py --kinds infinity,no-integrity --repeat 5   # integrity's cost only
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
KINDS = ("plain", "infinity", "grads-in-host", "no-integrity")

CHILD = r"""
import json, os, sys, time, torch
import infinity
from infinity.models import GPT, GPTConfig, TextCorpus
from infinity.cli.demo import demo_config

kind, params, seq, micro, steps, warmup, nvme = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
gpt = GPTConfig.for_params(params, seq_len=seq)
corpus = TextCorpus()
torch.manual_seed(0)
times, cpus, io = [], [], []
if kind == "plain":
    model = GPT(gpt)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    def step(i):
        x, y = corpus.batch(i, micro, seq)
        loss = model(x, y); loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad(set_to_none=True)
        return loss.item()
    stats = lambda: {"read_nbytes": 0, "write_nbytes": 0, "wait_s": 0.0, "checksum_s": 0.0, "checksum_caller_s": 0.0}
else:
    largest = max(gpt.vocab_size, 4 * gpt.d_model) * gpt.d_model + 4 * gpt.d_model
    cfg = demo_config(nvme, lr=3e-4, steps=steps + warmup, micro_batch=micro, bf16=False, largest_unit=largest)
    del cfg["scheduler"]
    cfg["zero_optimization"]["offload_optimizer"]["grads_in_host"] = kind == "grads-in-host"
    for section in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][section]["integrity"] = kind != "no-integrity"
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
    t, c = time.perf_counter(), time.process_time()
    losses.append(step(i))
    dt, dc = time.perf_counter() - t, time.process_time() - c
    after = stats()
    if i >= warmup:
        times.append(dt)
        cpus.append(dc)
        io.append({k: after[k] - before[k] for k in after})
if kind != "plain":
    engine.synchronize()
from infinity.memory import peak_host_nbytes
hwm = peak_host_nbytes()  # VmHWM + hugetlb pages (pools may live there)
print(json.dumps({"times": times, "cpus": cpus, "io": io, "hwm": hwm, "params": gpt.num_params,
                  "losses": losses}))
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
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"comma-separated runs to compare, interleaved (default: all of {', '.join(KINDS)})")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.params, args.seq, args.steps, args.warmup, args.repeat = 2e6, 64, 2, 1, 1
    base = args.nvme_path or os.path.join(Path.home(), ".cache", "infinity-bench")
    os.makedirs(base, exist_ok=True)
    if args.capacity:
        return capacity(args, base)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        raise SystemExit(f"--kinds takes a comma-separated subset of {', '.join(KINDS)}; got {args.kinds!r}")
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for rep in range(args.repeat):
        for kind in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:
            with tempfile.TemporaryDirectory(dir=base) as nvme:
                t = time.perf_counter()
                res = run_child(kind, args, nvme)
                print(f"  repeat {rep + 1}/{args.repeat} {kind:13s}: median step "
                      f"{statistics.median(res['times']):.2f} s, peak RSS {res['hwm'] / 2**30:.2f} GiB "
                      f"({time.perf_counter() - t:.0f} s)", flush=True)
                runs[kind].append(res)
    med = {k: [statistics.median(r["times"]) for r in v] for k, v in runs.items()}
    result = {
        "params": runs[kinds[0]][0]["params"],
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "kinds": kinds,
        "repeat": args.repeat,
        "step_s": {k: statistics.median(v) for k, v in med.items()},
        "peak_rss": {k: max(r["hwm"] for r in v) for k, v in runs.items()},
    }
    print(f"\nGPT {result['params'] / 1e6:.0f}M, seq {args.seq} x {args.micro_batch}")
    if "plain" in runs:
        print(f"plain PyTorch {result['step_s']['plain']:.2f} s/step, peak RSS "
              f"{result['peak_rss']['plain'] / 2**30:.2f} GiB")
        for kind in kinds:
            if kind != "plain":
                result[kind] = _offload_summary(kind, runs, med)
    if "infinity" in runs and "no-integrity" in runs:
        result["integrity_overhead"] = _integrity_summary(runs, med)
    results = Path(os.environ.get("INFINITY_BENCH_RESULTS", ROOT / "bench" / "results"))
    results.mkdir(parents=True, exist_ok=True)
    out = args.out or results / f"train_step{'-quick' if args.quick else ''}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


def _integrity_summary(runs: dict[str, list[dict]], med: dict[str, list[float]]) -> dict:
    """The cost of the swap-file checksums: step time with integrity on over off, per repeat (the two
    runs of a repeat are neighbours in time, so load on the machine affects both alike)."""
    ratios = [on / off for on, off in zip(med["infinity"], med["no-integrity"], strict=True)]
    cpu = {k: [statistics.median(r["cpus"]) for r in runs[k]] for k in ("infinity", "no-integrity")}
    cpu_ratios = [on / off for on, off in zip(cpu["infinity"], cpu["no-integrity"], strict=True)]
    r = {"ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
         "cpu_ratio": {"median": statistics.median(cpu_ratios), "min": min(cpu_ratios), "max": max(cpu_ratios)},
         "step_s_on": statistics.median(med["infinity"]), "step_s_off": statistics.median(med["no-integrity"]),
         "cpu_s_on": statistics.median(cpu["infinity"]), "cpu_s_off": statistics.median(cpu["no-integrity"]),
         "same_losses": runs["infinity"][0]["losses"] == runs["no-integrity"][0]["losses"]}
    io = [s for run in runs["infinity"] for s in run["io"]]
    # Bounds that load on the machine hardly moves: the CRC32C CPU time per step, all of it and the
    # part in threads that waited for it (the rest ran in the store's reaper), over the step time
    # without integrity.
    r["checksum_s_per_step"] = statistics.median(s["checksum_s"] for s in io)
    r["checksum_caller_s_per_step"] = statistics.median(s["checksum_caller_s"] for s in io)
    r["checksum_nbytes_per_step"] = statistics.median(s["read_nbytes"] + s["write_nbytes"] for s in io)
    r["checksum_share_of_step"] = r["checksum_s_per_step"] / r["step_s_off"]
    r["checksum_caller_share_of_step"] = r["checksum_caller_s_per_step"] / r["step_s_off"]
    pct = lambda xs: ", ".join(f"{(x - 1) * 100:+.1f}%" for x in xs)  # noqa: E731
    print(f"integrity: {r['step_s_on']:.3f} s/step on vs {r['step_s_off']:.3f} off -> overhead "
          f"{(r['ratio']['median'] - 1) * 100:+.1f}% of the step (per repeat {pct(ratios)}); CPU time "
          f"{r['cpu_s_on']:.3f} vs {r['cpu_s_off']:.3f} s/step -> {(r['cpu_ratio']['median'] - 1) * 100:+.1f}% "
          f"(per repeat {pct(cpu_ratios)}); same losses: {r['same_losses']}\n"
          f"  CRC32C per step: {r['checksum_s_per_step'] * 1e3:.0f} ms of CPU for "
          f"{r['checksum_nbytes_per_step'] / 1e9:.2f} GB ({r['checksum_nbytes_per_step'] / 1e9 / max(r['checksum_s_per_step'], 1e-9):.1f} GB/s) = "
          f"{r['checksum_share_of_step'] * 100:.1f}% of this run's step without integrity, of which "
          f"{r['checksum_caller_s_per_step'] * 1e3:.0f} ms ({r['checksum_caller_share_of_step'] * 100:.1f}%) in threads "
          "that waited for it; the rest ran in the stores' reaper threads, beside the I/O")
    return r


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
