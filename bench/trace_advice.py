#!/usr/bin/env python3
"""The trace's advice, followed: a run whose host-memory budget starves the optimizer, traced; the
budget ``infinity report`` advises; the same run with it. Prints both step times and the advice.

The first run plans with the least budget the run can have (every array the planner may place on
NVMe goes there: the optimizer's state is read and written every step); its trace is reported as
``infinity report`` does, and the second run takes the host_memory_budget the advice names (the
planner's prediction recorded in the trace). Step times are medians over the steps after the
recorded ones' warm-up; this is a measurement, not a test (tests never assert on timings).

  python bench/trace_advice.py                    # ~10M parameters, 6 steps each
  python bench/trace_advice.py --params 30e6 --steps 8
  python bench/trace_advice.py --quick            # ~2M parameters, 4 steps each (the CI smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def train(cfg: dict, gpt, steps: int) -> list[float]:
    import torch

    import infinity
    from infinity.models import GPT, TextCorpus

    torch.manual_seed(0)
    with infinity.zero.Init(cfg):
        model = GPT(gpt)
    engine = infinity.initialize(model, cfg)
    corpus = TextCorpus()
    times = []
    try:
        for i in range(steps):
            x, y = corpus.batch(i, cfg["train_micro_batch_size_per_gpu"], gpt.seq_len)
            t = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            loss.item()
            times.append(time.perf_counter() - t)
    finally:
        engine.close()
    return times


def least_budget(cfg: dict, gpt) -> int:
    """What the run needs with every array the planner may spill on NVMe."""
    import torch

    import infinity
    from infinity.config import load_config
    from infinity.estimate.context import run_context
    from infinity.estimate.placement import place_in_budget
    from infinity.models import GPT

    torch.manual_seed(0)
    with infinity.zero.Init(cfg):
        model = GPT(gpt)
    c = load_config(cfg)
    ctx = run_context(model, c, device="cpu", world_size=1)
    return place_in_budget(model, c, ctx, budget_nbytes=0, budget_source="bench").chosen.need_nbytes


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--params", type=float, default=10e6)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--keep", default=None, help="a folder to keep the two trace files in")
    ap.add_argument("--quick", action="store_true", help="~2M parameters, sequence 32, 4 steps")
    ap.add_argument("--out", default=None, help="JSON output (default below)")
    args = ap.parse_args()
    results = os.environ.get("INFINITY_BENCH_RESULTS")  # tests/test_benchmarks.py's smoke runs
    name = f"trace_advice{'-quick' if args.quick else ''}.json"
    out_path = Path(
        args.out
        or (
            Path(results) / name
            if results
            else ROOT / "bench" / ("out" if args.quick else "results") / name
        )
    )
    if args.quick:  # the least that still records steps 2-3 and has steps after them to time
        args.params, args.seq, args.steps = 2e6, 32, 4

    from infinity.cli.demo import demo_config
    from infinity.cli.report import describe
    from infinity.models import GPTConfig
    from infinity.timeline import read_trace
    from infinity.timeline.advice import optimizer_saving_s
    from infinity.timeline.breakdown import mean_breakdown, step_breakdowns

    gpt = GPTConfig.for_params(args.params, seq_len=args.seq)
    root = Path(args.nvme_path or Path.home() / ".cache")
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as nvme, tempfile.TemporaryDirectory() as tmp:
        out = args.keep or tmp
        largest = max(gpt.vocab_size, 4 * gpt.d_model) * gpt.d_model + 4 * gpt.d_model
        cfg = demo_config(
            nvme, lr=3e-4, steps=args.steps, micro_batch=1, bf16=False, largest_unit=largest
        )
        del cfg["scheduler"]
        for section in ("offload_param", "offload_optimizer"):
            cfg["zero_optimization"][section] = {"device": "auto", "nvme_path": nvme}
        del cfg["zero_optimization"]["sub_group_size"]
        cfg["host_memory_budget"] = least_budget(cfg, gpt)
        trace = Path(out) / "starved.json"
        cfg["trace"] = {"enabled": True, "output_path": str(trace), "first_step": 2, "steps": 2}
        starved = train(cfg, gpt, args.steps)
        doc = read_trace(trace)
        plan = doc["infinity"]["plan"]
        print(f"starved run: host_memory_budget {cfg['host_memory_budget'] / 2**30:.3f} GiB")
        print("\n".join(describe(step_breakdowns(doc), plan)))
        prediction = plan.get("prediction") or {}
        if "budget_nbytes" not in prediction:
            print(f"no budget advised (prediction: {json.dumps(prediction)}); nothing to follow")
            return 1
        starved_budget = cfg["host_memory_budget"]
        advice = describe(step_breakdowns(doc), plan)[-1]
        starved_mean = mean_breakdown(step_breakdowns(doc))
        predicted = optimizer_saving_s(starved_mean, plan)
        cfg["host_memory_budget"] = prediction["budget_nbytes"]
        cfg["trace"] = {
            "enabled": True,
            "output_path": str(Path(out) / "fed.json"),
            "first_step": 2,
            "steps": 2,
        }
        fed = train(cfg, gpt, args.steps)
        fed_doc = read_trace(Path(out) / "fed.json")
        fed_mean = mean_breakdown(step_breakdowns(fed_doc))
        fed_plan = fed_doc["infinity"]["plan"]
        # The structure the prediction assumed: the followed run keeps on NVMe what it said.
        fed_nvme = sum(fed_plan["state"][c]["nvme_nbytes"] for c in fed_plan["optimizer_classes"])
        if fed_nvme != prediction["optimizer_nvme_nbytes"]:
            raise SystemExit(
                f"the advised run keeps {fed_nvme} bytes of optimizer state on NVMe, the "
                f"prediction said {prediction['optimizer_nvme_nbytes']}"
            )
        print(f"\nfollowed: host_memory_budget {cfg['host_memory_budget'] / 2**30:.3f} GiB")
        print("\n".join(describe(step_breakdowns(fed_doc), fed_doc["infinity"]["plan"])))
    a, b = statistics.median(starved[2:]), statistics.median(fed[2:])
    print(
        f"\nmedian step (steps 2..{args.steps - 1}): starved {a:.3f} s, advised budget {b:.3f} s "
        f"({(b - a) / a:+.0%}; predicted "
        f"{'none' if predicted is None else f'-{predicted:.3f} s'}); machine shared with other "
        "work: figures vary run to run"
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "params": args.params,
        "seq": args.seq,
        "steps": args.steps,
        "starved_budget_nbytes": starved_budget,
        "advised_budget_nbytes": prediction["budget_nbytes"],
        "advice": advice,
        "starved_step_s": starved,
        "advised_step_s": fed,
        "starved_median_s": a,
        "advised_median_s": b,
        "predicted_saving_s": predicted,
        "measured_saving_s": a - b,
        "starved_optimizer_io_s": starved_mean.optimizer_io_s,
        "advised_optimizer_io_s": fed_mean.optimizer_io_s,
        "starved_optimizer_wait_s": starved_mean.parts["optimizer"],
        "advised_optimizer_wait_s": fed_mean.parts["optimizer"],
    }
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
