#!/usr/bin/env python3
"""Training step time and NVMe bytes: plain PyTorch in RAM vs infinity with its state placed several ways.

The same GPT (~150M parameters by default), data and seed, trained by each
kind below in a fresh subprocess (its peak memory is its own: VmHWM plus
hugetlb pages); the kinds are interleaved, their order rotating each repeat,
and each headline is the median over repeats of the ratio of a kind's median
step time (after warm-up) to plain PyTorch's in the same repeat.

  plain          torch AdamW (fused), fp32, everything in RAM: the reference
  infinity       ZeRO-3, params and optimizer on NVMe as DeepSpeed places them
  grads-in-host  the same with offload_optimizer.grads_in_host
  planner-100    "device": "auto": the placement planner within a host budget of what the run needs
  planner-50     with everything on NVMe, plus 100%, 50% or 10% of the training state; the process
  planner-10     runs in a memory cgroup whose limit is that budget plus what it held at initialize,
                 plus 32 MiB + 1% (memory.max on cgroup v2, memory.limit_in_bytes on v1), so the page
                 cache cannot hold what the planner spilled
  no-integrity   "infinity" with the swap-file checksums off ("integrity": false in both offload
                 sections): its step-time ratio to "infinity" is the cost of integrity
  traced         "infinity" with every timed step recorded on the timeline (the "trace" section,
                 docs/tracing.md): its step-time ratio to "infinity" is the cost of tracing
  plain-bf16     mixed precision by hand: a bf16 model for forward/backward, fp32 masters (torch AdamW)
  bf16           infinity in bf16 (16-bit parameter shards, fp32 masters) with the planner at 10%
  layer-major    "planner-10" driven by engine.train_batch: the --gas micro-batches of a step
                 layer-major in blocks (zero_optimization.layer_major.block: --layer-major-block,
                 default "auto": the planner picks the block with the least NVMe bytes whose
                 activations fit the same budget and cgroup as planner-10's), each unit read once
                 per block (docs/layer-major.md); the other infinity kinds run the micro-batch loop
  deepspeed      DeepSpeed ZeRO-3, params and optimizer on NVMe, where `deepspeed` is importable
                 (with stage3_max_reuse_distance 0 and the initial weights copied in after its
                 zero.Init, which drops the model's own initialisation)

Reported per kind: step-time ratio, bytes read and written per parameter per
step next to the least the placement needs (infinity.estimate.traffic:
``expected`` — each array on NVMe read and written the times the schedule
needs it, less what the parameter pool keeps at each turn), the GB/s those
bytes imply, the time steps waited for I/O, peak RSS, and whether the losses
equal plain PyTorch's (bf16: plain-bf16's, within bf16's rounding).

  python bench/train_step.py                      # ~150M, seq 256, 3 repeats, every kind
  python bench/train_step.py --kinds plain,planner-50
  python bench/train_step.py --kinds plain,infinity,no-integrity --repeat 5   # integrity's cost
  python bench/train_step.py --kinds plain,infinity,traced --repeat 5         # tracing's cost
  python bench/train_step.py --capacity 2e9       # the largest model trained 3 steps, every block
                                                  # checkpointed (and a check against plain at 300M)
  python bench/train_step.py --kinds plain,planner-10,layer-major --gas 8 --seq 32   # disk-bound
  python bench/train_step.py --kinds plain,planner-10,layer-major --gas 8             # compute-bound
  python bench/train_step.py --quick              # seconds: proves it still runs

--gas G: every kind's optimizer step takes G micro-batches (plain PyTorch accumulates their
gradients, loss / G each); step times and bytes are per optimizer step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _cgroup  # bench/ is on sys.path: this file runs as a script
import _deepspeed_env

ROOT = Path(__file__).resolve().parent.parent

KINDS = [
    "plain",
    "infinity",
    "grads-in-host",
    "no-integrity",
    "traced",
    "planner-100",
    "planner-50",
    "planner-10",
    "plain-bf16",
    "bf16",
    "layer-major",
    "deepspeed",
]
QUICK_KINDS = ["plain", "infinity", "planner-10", "layer-major"]
BUDGETS = {
    "planner-100": 1.0,
    "planner-50": 0.5,
    "planner-10": 0.1,
    "bf16": 0.1,
    "layer-major": 0.1,
    "planner-0": 0.0,
}
"""Share of the training state the planner may keep in host memory, on top of what the run needs with
every array on NVMe (planner-0: the capacity runs)."""


def cgroup_slack_nbytes(budget: int) -> int:
    """The cgroup holds what the process has now, the budget and this: what it allocates between the limit
    being set and initialize's pre-flight check, which judges the plan against the room left in the cgroup."""
    return (32 << 20) + budget // 100


LOSS_RTOL = {"bf16": 2e-2}
"""Loss agreement with the reference kind (plain, or plain-bf16 for bf16): 1e-4 relative unless named."""
REFERENCE = {"bf16": "plain-bf16"}

# -- the child: one kind, one process ----------------------------------------------------------


def child(a: dict) -> dict:
    import torch

    from infinity.host import peak_resident_host_nbytes
    from infinity.models import GPTConfig, TextCorpus

    kind = a["kind"]
    gpt = GPTConfig.for_params(a["params"], seq_len=a["seq"])
    corpus = TextCorpus()
    torch.manual_seed(0)
    out: dict = {"params": gpt.num_params}
    if kind in ("plain", "plain-bf16"):
        step, stats = _plain(gpt, corpus, a, bf16=kind == "plain-bf16")
    elif kind == "deepspeed":
        step, stats = _deepspeed(gpt, corpus, a)
    else:
        step, stats, engine = _infinity(gpt, corpus, a, out)
    times, cpus, io, losses = [], [], [], []
    for i in range(a["warmup"] + a["steps"]):
        before = stats()
        t, c = time.perf_counter(), time.process_time()
        losses.append(step(i))
        dt, dc = time.perf_counter() - t, time.process_time() - c
        after = stats()
        if i >= a["warmup"]:
            times.append(dt)
            cpus.append(dc)
            io.append({k: after[k] - before[k] for k in after})
    if kind not in ("plain", "plain-bf16", "deepspeed"):
        engine.synchronize()
        pf = engine.prefetch_stats()
        if pf is not None and pf.last is not None:
            out["prefetch_last_step"] = {
                k: getattr(pf.last, k)
                for k in (
                    "prefetch_hits",
                    "late_prefetches",
                    "reuse_hits",
                    "on_demand",
                    "reads",
                    "read_nbytes",
                    "duplicate_reads",
                    "stall_s",
                )
            }
        engine.close()
    out.update(
        times=times, cpus=cpus, io=io, hwm=peak_resident_host_nbytes(), losses=losses
    )  # VmHWM + hugetlb pages
    out["cgroup_peak"] = _cgroup.peak(a.get("cgroup"))
    return out


def _plain(gpt, corpus, a, *, bf16: bool):
    import torch

    from infinity.models import GPT

    model = GPT(gpt)
    if a.get("checkpointing"):
        model.gradient_checkpointing_enable()
    params = list(model.parameters())
    if bf16:  # fp32 masters stepped by AdamW; a bf16 copy runs forward and backward
        masters = [p.detach().clone().requires_grad_(True) for p in params]
        model.to(torch.bfloat16)
        opt = torch.optim.AdamW(masters, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    else:
        masters = params
        opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    gas = a.get("gas", 1)

    def step(i):
        total = 0.0
        for j in range(gas):
            x, y = corpus.batch(i * gas + j, a["micro_batch"], a["seq"])
            loss = model(x, y)
            (loss / gas if gas > 1 else loss).backward()
            total += loss.item()
        if bf16:
            for m, p in zip(masters, params, strict=True):
                m.grad = p.grad.float()
                p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if bf16:
            with torch.no_grad():
                for m, p in zip(masters, params, strict=True):
                    p.copy_(m)
        return total / gas

    return step, lambda: {
        "read_nbytes": 0,
        "write_nbytes": 0,
        "wait_s": 0.0,
        "checksum_s": 0.0,
        "checksum_caller_s": 0.0,
    }


def _infinity(gpt, corpus, a, out):

    import infinity
    from infinity.cli.demo import demo_config
    from infinity.models import GPT

    kind = a["kind"]
    largest = max(gpt.vocab_size, 4 * gpt.d_model) * gpt.d_model + 4 * gpt.d_model
    cfg = demo_config(
        a["nvme"],
        lr=3e-4,
        steps=a["steps"] + a["warmup"],
        micro_batch=a["micro_batch"],
        bf16=kind == "bf16",
        largest_unit=largest,
    )
    del cfg["scheduler"]
    gas = a.get("gas", 1)
    cfg["gradient_accumulation_steps"] = gas
    zero = cfg["zero_optimization"]
    zero["offload_optimizer"]["grads_in_host"] = kind == "grads-in-host"
    if kind in BUDGETS:  # the planner decides; it sizes the pools and sub-groups itself
        for section in ("offload_param", "offload_optimizer"):
            zero[section] = {"device": "auto", "nvme_path": a["nvme"]}
        del zero["sub_group_size"]
    for section in ("offload_param", "offload_optimizer"):
        zero[section]["integrity"] = kind != "no-integrity"
    if kind == "traced":  # every timed step recorded; the file is written at close, untimed
        cfg["trace"] = {
            "enabled": True,
            "output_path": os.path.join(a["nvme"], f"trace-{os.getpid()}.json"),
            "first_step": a["warmup"],
            "steps": a["steps"],
        }
    if kind == "layer-major":  # initialize plans for train_batch: a block's activations counted
        block = a.get("layer_major_block") or "auto"
        zero["layer_major"] = {"block": block if block == "auto" else int(block)}
    with infinity.zero.Init(cfg):
        model = GPT(gpt)
    if a.get("checkpointing"):
        model.gradient_checkpointing_enable()
    if kind in BUDGETS:
        budget, floor, state = _planner_budget(model, cfg, BUDGETS[kind])
        cfg["host_memory_budget"] = budget
        out.update(
            budget_nbytes=budget,
            floor_nbytes=floor,
            state_nbytes=state,
            cgroup_limit=_cgroup.enforce(a.get("cgroup"), budget + cgroup_slack_nbytes(budget)),
        )
    engine = infinity.initialize(model, cfg)
    out.update(_plan_record(engine.runtime.plan))
    if out.get("layer_major_block") is not None:  # on stderr now: it is what a killed run leaves
        print(
            f"{kind}: blocks of {out['layer_major_block']}; " + "; ".join(out["plan"]),
            file=sys.stderr,
        )

    def batches(i):
        return [corpus.batch(i * gas + j, a["micro_batch"], a["seq"]) for j in range(gas)]

    def step(i):
        if kind == "layer-major":
            return engine.train_batch(batches(i)).item()
        total = 0.0
        for x, y in batches(i):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        return total / gas

    return step, engine.io_stats, engine


def _planner_budget(model, raw: dict, share: float) -> tuple[int, int, int]:
    """(host_memory_budget, what the run needs with every array on NVMe, the training state's bytes):
    the budget is the second plus ``share`` of the third."""
    from infinity.config import load_config
    from infinity.estimate.context import run_context
    from infinity.estimate.placement import place_in_budget
    from infinity.estimate.runtime_plan import STATE_CLASSES

    cfg = load_config(raw)
    ctx = run_context(model, cfg, device="cpu", world_size=1)
    low = place_in_budget(model, cfg, ctx, budget_nbytes=0, budget_source="bench")
    state = sum(
        low.state_nbytes(c) for c in STATE_CLASSES if c == "param" or c in low.optimizer.state_keys
    )
    floor = low.chosen.need_nbytes
    return floor + int(share * state), floor, state


def _plan_record(plan) -> dict:
    """Where the plan put each state class, and the bytes per step it should move (layer-major:
    each array read and written once per block, as with one micro-batch)."""
    from infinity.estimate.placement import describe_placement
    from infinity.estimate.runtime_plan import STATE_CLASSES
    from infinity.estimate.traffic import expected_traffic, worst_case_traffic

    gas, block = plan.gradient_accumulation_steps, plan.layer_major_block
    blocks = None if block is None else -(-gas // block)
    t = expected_traffic(plan, blocks=blocks)
    w = worst_case_traffic(plan, blocks=blocks)
    classes = [
        c
        for c in STATE_CLASSES
        if (c == "param" and plan.stage == 3) or c in plan.optimizer.state_keys
    ]
    return {
        "layer_major_block": block,
        "expected_read_nbytes": t.read_nbytes,
        "expected_write_nbytes": t.write_nbytes,
        "worst_read_nbytes": w.read_nbytes,
        "worst_write_nbytes": w.write_nbytes,
        "homes": {
            c: {"host": plan.state_nbytes(c, "cpu"), "nvme": plan.state_nbytes(c, "nvme")}
            for c in classes
        },
        "plan": describe_placement(plan),
    }


def _deepspeed(gpt, corpus, a):
    """DeepSpeed ZeRO-3 with parameters and optimizer on NVMe (only where `deepspeed` is importable)."""
    import deepspeed
    import torch

    from infinity.models import GPT

    _deepspeed_env.single_process_env()
    largest = max(gpt.vocab_size, 4 * gpt.d_model) * gpt.d_model + 4 * gpt.d_model
    buffer = max(largest, 1 << 20)
    ds_cfg = {
        "train_micro_batch_size_per_gpu": a["micro_batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
        },
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 2 * buffer,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_max_reuse_distance": 0,  # needed: its trace otherwise runs out of swap buffers
            "offload_param": {
                "device": "nvme",
                "nvme_path": a["nvme"],
                "buffer_count": 16,
                "buffer_size": buffer,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": a["nvme"]},
        },
    }
    torch.manual_seed(0)
    initial = GPT(gpt).state_dict()  # its zero.Init drops GPT's own initialisation: copied in below
    with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
        model = GPT(gpt)
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            p.data.copy_(initial[name])
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_cfg
    )

    def step(i):
        x, y = corpus.batch(i, a["micro_batch"], a["seq"])
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    # DeepSpeed counts none of its I/O: the block layer's bytes for this process (its aio threads included)
    return step, lambda: {
        **_deepspeed_env.block_io_nbytes(),
        "checksum_s": 0.0,
        "checksum_caller_s": 0.0,
    }


# -- the parent: interleaved runs ------------------------------------------------------------


def run_child(kind: str, args: argparse.Namespace, nvme: str) -> dict:
    cgroup = (
        _cgroup.make(f"infinity-bench-{os.getpid()}-{kind}-{time.monotonic_ns()}")
        if kind in BUDGETS
        else None
    )
    a = {
        "kind": kind,
        "params": args.params,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "nvme": nvme,
        "cgroup": cgroup,
        "checkpointing": args.checkpointing,
        "gas": args.gas,
        "layer_major_block": args.layer_major_block,
    }
    try:
        r = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(a)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
    finally:
        _cgroup.remove(cgroup)
    if r.returncode != 0:
        raise SystemExit(f"{kind} run failed (exit {r.returncode}):\n{r.stderr[-12000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--params", type=float, default=150e6)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument(
        "--gas",
        type=int,
        default=None,
        help="micro-batches per optimizer step (gradient accumulation; default 1, --quick 2)",
    )
    ap.add_argument(
        "--layer-major-block",
        default="auto",
        metavar="K",
        help="the layer-major kind's micro-batches per block (default \"auto\": the planner's)",
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--kinds", default=None, help=f"comma-separated, of {', '.join(KINDS)} (default: all)"
    )
    ap.add_argument(
        "--nvme-path", default=None, help="swap directory (default: a temporary one under ~/.cache)"
    )
    ap.add_argument(
        "--quick", action="store_true", help="a tiny model, one repeat, three kinds: proves it runs"
    )
    ap.add_argument(
        "--capacity",
        type=float,
        default=None,
        metavar="PARAMS",
        help="instead: train a model of PARAMS parameters for 3 steps with everything the planner "
        "can spill on NVMe, report training-state bytes / peak RSS, and check the losses "
        "against plain PyTorch at --capacity-check parameters",
    )
    ap.add_argument("--capacity-check", type=float, default=300e6, metavar="PARAMS")
    ap.add_argument(
        "--checkpointing",
        action="store_true",
        help="every block checkpointed (GPT.gradient_checkpointing_enable); --capacity sets it",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return _cgroup.serve_child(args.child, child)
    kinds = args.kinds.split(",") if args.kinds else list(KINDS)
    if args.quick:
        args.params, args.seq, args.steps, args.warmup, args.repeat = 2e6, 64, 2, 1, 1
        kinds = args.kinds.split(",") if args.kinds else QUICK_KINDS
        args.gas = args.gas or 2
    args.gas = args.gas or 1
    if args.gas < 1:
        ap.error("--gas must be at least 1")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or "plain" not in kinds:
        ap.error(
            f"--kinds: unknown {unknown}"
            if unknown
            else "--kinds must include plain (the reference)"
        )
    base = args.nvme_path or os.path.join(Path.home(), ".cache", "infinity-bench")
    os.makedirs(base, exist_ok=True)
    if args.capacity:
        return capacity(args, base)
    notes = []
    if "deepspeed" in kinds and importlib.util.find_spec("deepspeed") is None:
        kinds.remove("deepspeed")
        notes.append(
            "deepspeed: skipped, `deepspeed` is not importable here (it is never a dependency; "
            "bench/deepspeed_venv.sh makes an environment where it is); there, this row runs DeepSpeed "
            "ZeRO-3 with params and optimizer on NVMe, "
            "stage3_max_reuse_distance 0 and the initial weights copied in after its zero.Init"
        )
    if any(k in BUDGETS for k in kinds) and _cgroup.root() is None:
        notes.append(
            "no memory cgroup could be made (needs root and a memory controller): the planner's "
            "budgets are planned for but not enforced"
        )
    for n in notes:
        print("note: " + n)
    runs = _interleaved(kinds, args, base)
    result = _summary(runs, kinds, args, notes)
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
    r = {
        "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "cpu_ratio": {
            "median": statistics.median(cpu_ratios),
            "min": min(cpu_ratios),
            "max": max(cpu_ratios),
        },
        "step_s_on": statistics.median(med["infinity"]),
        "step_s_off": statistics.median(med["no-integrity"]),
        "cpu_s_on": statistics.median(cpu["infinity"]),
        "cpu_s_off": statistics.median(cpu["no-integrity"]),
        "same_losses": runs["infinity"][0]["losses"] == runs["no-integrity"][0]["losses"],
    }
    io = [s for run in runs["infinity"] for s in run["io"]]
    # Bounds that load on the machine hardly moves: the CRC32C CPU time per step, all of it and the
    # part in threads that waited for it (the rest ran in the store's reaper), over the step time
    # without integrity.
    r["checksum_s_per_step"] = statistics.median(s["checksum_s"] for s in io)
    r["checksum_caller_s_per_step"] = statistics.median(s["checksum_caller_s"] for s in io)
    r["checksum_nbytes_per_step"] = statistics.median(
        s["read_nbytes"] + s["write_nbytes"] for s in io
    )
    r["checksum_share_of_step"] = r["checksum_s_per_step"] / r["step_s_off"]
    r["checksum_caller_share_of_step"] = r["checksum_caller_s_per_step"] / r["step_s_off"]
    pct = lambda xs: ", ".join(f"{(x - 1) * 100:+.1f}%" for x in xs)  # noqa: E731
    print(
        f"integrity: {r['step_s_on']:.3f} s/step on vs {r['step_s_off']:.3f} off -> overhead "
        f"{(r['ratio']['median'] - 1) * 100:+.1f}% of the step (per repeat {pct(ratios)}); CPU time "
        f"{r['cpu_s_on']:.3f} vs {r['cpu_s_off']:.3f} s/step -> {(r['cpu_ratio']['median'] - 1) * 100:+.1f}% "
        f"(per repeat {pct(cpu_ratios)}); same losses: {r['same_losses']}\n"
        f"  CRC32C per step: {r['checksum_s_per_step'] * 1e3:.0f} ms of CPU for "
        f"{r['checksum_nbytes_per_step'] / 1e9:.2f} GB ({r['checksum_nbytes_per_step'] / 1e9 / max(r['checksum_s_per_step'], 1e-9):.1f} GB/s) = "
        f"{r['checksum_share_of_step'] * 100:.1f}% of this run's step without integrity, of which "
        f"{r['checksum_caller_s_per_step'] * 1e3:.0f} ms ({r['checksum_caller_share_of_step'] * 100:.1f}%) in threads "
        "that waited for it; the rest ran in the stores' reaper threads, beside the I/O"
    )
    return r


def _interleaved(kinds: list[str], args: argparse.Namespace, base: str) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for rep in range(args.repeat):
        shift = rep % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            with tempfile.TemporaryDirectory(dir=base) as nvme:
                t = time.perf_counter()
                res = run_child(kind, args, nvme)
                print(
                    f"  repeat {rep + 1}/{args.repeat} {kind:13s}: median step "
                    f"{statistics.median(res['times']):.2f} s, peak RSS {res['hwm'] / 2**30:.2f} GiB "
                    f"({time.perf_counter() - t:.0f} s; load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
                runs[kind].append(res)
    return runs


def _summary(
    runs: dict[str, list[dict]], kinds: list[str], args: argparse.Namespace, notes: list[str]
) -> dict:
    med = {k: [statistics.median(r["times"]) for r in v] for k, v in runs.items()}
    n = runs["plain"][0]["params"]
    result = {
        "params": n,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "gas": args.gas,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeat": args.repeat,
        "kinds": kinds,
        "notes": notes,
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_end": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
        },
        "step_s": {k: statistics.median(v) for k, v in med.items()},
        "peak_rss": {k: max(r["hwm"] for r in v) for k, v in runs.items()},
    }
    print(
        f"\nGPT {n / 1e6:.0f}M, seq {args.seq} x {args.micro_batch}, gas {args.gas}: plain PyTorch "
        f"{result['step_s']['plain']:.2f} s/step, peak RSS {result['peak_rss']['plain'] / 2**30:.2f} GiB"
    )
    for kind in kinds:
        if kind != "plain":
            result[kind] = _kind_summary(kind, runs, med, n)
    if "infinity" in runs and "no-integrity" in runs:
        result["integrity_overhead"] = _integrity_summary(runs, med)
    if "infinity" in runs and "traced" in runs:
        result["tracing_overhead"] = _tracing_summary(runs, med)
    return result


def _tracing_summary(runs: dict[str, list[dict]], med: dict[str, list[float]]) -> dict:
    """The cost of recording every timed step on the timeline: step time traced over untraced, per
    repeat (neighbours in time), and the same for CPU time, which load on the machine moves less."""
    ratios = [on / off for on, off in zip(med["traced"], med["infinity"], strict=True)]
    cpu = {k: [statistics.median(r["cpus"]) for r in runs[k]] for k in ("traced", "infinity")}
    cpu_ratios = [on / off for on, off in zip(cpu["traced"], cpu["infinity"], strict=True)]
    r = {
        "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "cpu_ratio": {"median": statistics.median(cpu_ratios)},
        "step_s_traced": statistics.median(med["traced"]),
        "step_s_untraced": statistics.median(med["infinity"]),
        "same_losses": runs["traced"][0]["losses"] == runs["infinity"][0]["losses"],
    }
    pct = ", ".join(f"{(x - 1) * 100:+.1f}%" for x in ratios)
    print(
        f"tracing: {r['step_s_traced']:.3f} s/step traced vs {r['step_s_untraced']:.3f} untraced -> "
        f"{(r['ratio']['median'] - 1) * 100:+.1f}% of the step (per repeat {pct}); CPU time "
        f"{(r['cpu_ratio']['median'] - 1) * 100:+.1f}%; same losses: {r['same_losses']}"
    )
    return r


def _kind_summary(
    kind: str, runs: dict[str, list[dict]], med: dict[str, list[float]], n: int
) -> dict:
    """One kind against plain PyTorch: step-time ratio per repeat, NVMe bytes per step and per
    parameter against the plan's least, GB/s, I/O waits, memory, losses."""
    ratios = [i / p for i, p in zip(med[kind], med["plain"], strict=True)]
    io = [s for r in runs[kind] for s in r["io"]]
    step_s = statistics.median(med[kind])
    read = statistics.median(s["read_nbytes"] for s in io)
    write = statistics.median(s["write_nbytes"] for s in io)
    wait = statistics.median(s["wait_s"] for s in io) if all("wait_s" in s for s in io) else None
    first = runs[kind][0]
    ref = REFERENCE.get(kind, "plain")
    rtol = LOSS_RTOL.get(kind, 1e-4)
    r = {
        "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "read_nbytes_per_step": read,
        "write_nbytes_per_step": write,
        "read_per_param": read / n,
        "write_per_param": write / n,
        "read_gbps": read / step_s / 1e9,
        "write_gbps": write / step_s / 1e9,
        "io_wait_s_per_step": wait,
        "peak_rss": max(x["hwm"] for x in runs[kind]),
    }
    if ref in runs:
        r["losses_equal_" + ref] = all(
            abs(x - y) <= rtol * abs(y)
            for x, y in zip(first["losses"], runs[ref][0]["losses"], strict=True)
        )
    for key in (
        "expected_read_nbytes",
        "expected_write_nbytes",
        "worst_read_nbytes",
        "worst_write_nbytes",
        "homes",
        "plan",
        "budget_nbytes",
        "floor_nbytes",
        "state_nbytes",
        "cgroup_limit",
        "cgroup_peak",
        "prefetch_last_step",
    ):
        if key in first:
            r[key] = first[key]
    line = (
        f"{kind:13s}: {step_s:.2f} s/step -> ratio {r['ratio']['median']:.2f} ({r['ratio']['min']:.2f}-"
        f"{r['ratio']['max']:.2f}); per step read {read / 1e9:.2f} GB, wrote {write / 1e9:.2f} GB "
        f"({r['read_gbps']:.2f} / {r['write_gbps']:.2f} GB/s), {read / n:.1f} / {write / n:.1f} B per param"
    )
    if "expected_read_nbytes" in r:
        er, ew = r["expected_read_nbytes"], r["expected_write_nbytes"]
        r["read_over_least"] = read / er if er else None
        r["write_over_least"] = write / ew if ew else None
        line += f" (least {er / n:.1f} / {ew / n:.1f})"
    line += f"; waited {wait:.2f} s for I/O" if wait is not None else "; I/O waits not measured"
    if first.get("layer_major_block") is not None:
        r["layer_major_block"] = first["layer_major_block"]
        line += f"; blocks of {first['layer_major_block']} micro-batches"
    line += f"; peak RSS {r['peak_rss'] / 2**30:.2f} GiB"
    if "budget_nbytes" in r:
        line += f" (budget {r['budget_nbytes'] / 2**30:.2f} GiB over {r['floor_nbytes'] / 2**30:.2f} needed anyway"
        line += (
            f", cgroup limit {r['cgroup_limit'] / 2**30:.2f} GiB)"
            if r.get("cgroup_limit")
            else ", not enforced)"
        )
    if ("losses_equal_" + ref) in r:
        line += f"; losses equal {ref}'s: {r['losses_equal_' + ref]}"
    print(line)
    return r


def capacity(args: argparse.Namespace, base: str) -> int:
    """A model far larger than memory, 3 steps with the planner at its least budget, in a cgroup, every
    block checkpointed (GPT.gradient_checkpointing_enable); then plain PyTorch and the same configuration
    at --capacity-check parameters, whose losses must agree."""
    out = {}
    for label, params in (("capacity", args.capacity), ("check", args.capacity_check)):
        # Every block checkpointed: activations are the one thing besides the pools that grows with the model.
        args.params, args.steps, args.warmup, args.checkpointing = params, 3, 0, True
        kinds = ["planner-0"] + (["plain"] if label == "check" else [])
        for kind in kinds:
            with tempfile.TemporaryDirectory(dir=base) as nvme:
                t = time.perf_counter()
                res = run_child(kind, args, nvme)
                res["wall_s"] = time.perf_counter() - t
            out[f"{label}/{kind}"] = res
            print(
                f"  {label} {kind}: {res['params'] / 1e9:.2f}B, steps {', '.join(f'{x:.0f} s' for x in res['times'])}"
                f", losses {', '.join(f'{x:.3f}' for x in res['losses'])}, peak RSS {res['hwm'] / 2**30:.2f} GiB",
                flush=True,
            )
    big = out["capacity/planner-0"]
    state = big["state_nbytes"]
    same = all(
        abs(x - y) <= 1e-4 * abs(y)
        for x, y in zip(out["check/planner-0"]["losses"], out["check/plain"]["losses"], strict=True)
    )
    result = {
        "params": big["params"],
        "seq": args.seq,
        "training_state_nbytes": state,
        "peak_rss": big["hwm"],
        "state_over_rss": state / big["hwm"],
        "step_s": big["times"],
        "losses": big["losses"],
        "losses_finite": all(x == x and abs(x) != float("inf") for x in big["losses"]),
        "cgroup_limit": big.get("cgroup_limit"),
        "plan": big.get("plan"),
        "wall_s": big["wall_s"],
        "check": {
            "params": out["check/plain"]["params"],
            "plain_losses": out["check/plain"]["losses"],
            "infinity_losses": out["check/planner-0"]["losses"],
            "losses_equal": same,
        },
    }
    print(
        f"capacity: GPT {big['params'] / 1e9:.2f}B trained {len(big['times'])} steps; training state "
        f"{state / 2**30:.1f} GiB, peak RSS {big['hwm'] / 2**30:.2f} GiB -> {state / big['hwm']:.1f}x; "
        f"losses finite: {result['losses_finite']}; at {result['check']['params'] / 1e6:.0f}M the losses equal "
        f"plain PyTorch's: {same}"
    )
    results = Path(os.environ.get("INFINITY_BENCH_RESULTS", ROOT / "bench" / "results"))
    results.mkdir(parents=True, exist_ok=True)
    path = args.out or results / "train_capacity.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
