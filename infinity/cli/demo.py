"""``infinity demo``: the main job — train a GPT with parameters and optimizer state on NVMe.

Builds a GPT-style model (pure torch, tied embeddings) under zero.Init, so it
never exists whole in host memory, with ZeRO stage 3 and both offloads on
NVMe at a local path; trains it on the built-in corpus with a progress bar
(loss, step time, GB/s read and written, peak RSS), then prints a summary and
draws two panels in one PNG (``infinity_demo.png`` by default): the loss, and
each step's time split into compute and exposed I/O (the training thread's
wait for parameter reads), read from the engine's step records
(infinity/engine/step_record.py). It records its last step on the timeline
(``infinity_demo.trace.json``, docs/tracing.md) and ends its summary with
where that step went and the advice ``infinity report`` gives for it.

The learning rate warms up linearly over the first quarter of the steps to a
peak of 3e-4, then decays on a cosine. A 150M GPT trained with batch 1 jumps
out of its first descent when it reaches a higher peak early: the loss went
from 4.9 to 8.3 at step 5 with DeepSpeed's default log-shaped warm-up over a
tenth of the steps to 6e-4, and from 4.6 to 6.2 with this warm-up to 6e-4;
to 3e-4 it goes 4.5 -> 5.1 there (batch to batch, the losses differ by as
much) and ends where the 6e-4 run ends (3.0 after 20 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

NAME = "demo"
HELP = "train a GPT with parameters and optimizer state on NVMe (the main job)"

DEFAULT_NVME = "./infinity_nvme"


def parse_count(text: str) -> int:
    """'150M', '1.3B', '27e6' -> an integer count."""
    t = text.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if scale != 1 else t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a count: {text!r} (try 150M, 1.3B or 27e6)"
        ) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nvme-path",
        default=DEFAULT_NVME,
        help=f"swap directory (default {DEFAULT_NVME}, created)",
    )
    p.add_argument(
        "--params", type=parse_count, default=parse_count("150M"), help="model size (default 150M)"
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--seq", type=int, default=256, help="sequence length (default 256)")
    p.add_argument(
        "--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)"
    )
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    p.add_argument("--bf16", action="store_true", help="train in bf16 (fp32 master weights)")
    p.add_argument(
        "--out",
        default="infinity_demo",
        help="prefix of the files written: PREFIX.png, PREFIX.json, PREFIX.trace.json (default "
        "infinity_demo)",
    )
    p.add_argument("--config", help="a DeepSpeed-style config to use instead of the demo's own")


def demo_config(
    nvme_path: str, *, lr: float, steps: int, micro_batch: int, bf16: bool, largest_unit: int
) -> dict:
    """The demo's config: DeepSpeed's schema, everything on NVMe, buffers sized to the model."""
    buffer = max(largest_unit, 1 << 20)
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.1},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": steps,
                "warmup_num_steps": warmup_steps(steps),
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme_path,
                "buffer_count": 16,
                "buffer_size": buffer,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path},
            "sub_group_size": 2 * buffer,
            "stage3_param_persistence_threshold": 1e5,
        },
    }


def warmup_steps(steps: int) -> int:
    """The demo's linear warm-up: a quarter of the run, at least one step."""
    return max(1, steps // 4)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    import infinity
    from infinity.config import read_config_file
    from infinity.engine.tracing import summary as summary_of_trace
    from infinity.host import peak_resident_host_nbytes
    from infinity.models import GPT, GPTConfig, TextCorpus

    os.makedirs(args.nvme_path, exist_ok=True)
    gpt = GPTConfig.for_params(args.params, seq_len=args.seq)
    largest_unit = max(gpt.vocab_size, 4 * gpt.d_model) * gpt.d_model + 4 * gpt.d_model
    if args.config:
        config = read_config_file(args.config)
    else:
        config = demo_config(
            args.nvme_path,
            lr=args.lr,
            steps=args.steps,
            micro_batch=args.micro_batch,
            bf16=args.bf16,
            largest_unit=largest_unit,
        )
    trace_path = _record_last_step(config, args)
    print(
        f"infinity demo: GPT with {gpt.num_params / 1e6:.1f}M parameters ({gpt.n_layer} layers, "
        f"d_model {gpt.d_model}), seq {args.seq}, {args.steps} steps, swap files under {args.nvme_path}"
    )
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with infinity.zero.Init(config):
        model = GPT(gpt)
    engine = infinity.initialize(model, config)
    setup_s = time.perf_counter() - t0
    state_nbytes = engine.num_parameters * 16  # fp32 params, grads, two moments
    corpus = TextCorpus()
    records = []  # each step's figures: time, exposed I/O ([Note: step records])
    engine.add_step_listener(records.append)
    losses, times = [], []
    last = engine.io_stats()
    bar = tqdm(range(args.steps), desc="training", unit="step", dynamic_ncols=True)
    try:
        for step in bar:
            t = time.perf_counter()
            x, y = corpus.batch(step, args.micro_batch, args.seq)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            dt = time.perf_counter() - t
            io = engine.io_stats()
            rd, wr = (
                io["read_nbytes"] - last["read_nbytes"],
                io["write_nbytes"] - last["write_nbytes"],
            )
            last = io
            losses.append(loss.item())
            times.append(dt)
            bar.set_postfix_str(
                f"loss {losses[-1]:.3f} | {dt:.2f} s/step | read {rd / dt / 1e9:.2f} GB/s "
                f"| write {wr / dt / 1e9:.2f} GB/s | peak RSS {_gib(peak_resident_host_nbytes())}"
            )
    finally:
        bar.close()
        engine.synchronize()
        io = engine.io_stats()
        prefetch = engine.prefetch_stats()
        engine.close()
    rss = peak_resident_host_nbytes()
    median = sorted(times)[len(times) // 2] if times else 0.0
    summary = {
        "params": gpt.num_params,
        "steps": len(losses),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "median_step_s": median,
        "setup_s": setup_s,
        "read_nbytes": io["read_nbytes"],
        "write_nbytes": io["write_nbytes"],
        "io_wait_s": io["wait_s"],
        "prefetch_hits": prefetch.total.prefetch_hits if prefetch else None,
        "on_demand_fetches": prefetch.total.on_demand if prefetch else None,
        "fetch_stall_s": prefetch.total.stall_s if prefetch else None,
        "duplicate_reads": prefetch.total.duplicate_reads if prefetch else None,
        "training_state_nbytes": state_nbytes,
        "peak_rss_nbytes": rss,
        "losses": losses,
        "step_s": [r.step_time_s for r in records],
        "exposed_io_s": [r.fetch_stall_s for r in records],
    }
    print(
        f"\nloss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f} in {len(losses)} steps; "
        f"median {median:.2f} s/step (setup {setup_s:.1f} s)"
    )
    print(
        f"read {io['read_nbytes'] / 1e9:.1f} GB, wrote {io['write_nbytes'] / 1e9:.1f} GB "
        f"({io['read_nbytes'] / max(1, len(losses)) / 1e9:.2f} / {io['write_nbytes'] / max(1, len(losses)) / 1e9:.2f} GB per step)"
    )
    if prefetch:
        t = prefetch.total
        print(
            f"prefetch: {t.prefetch_hits} fetches served ahead, {t.on_demand} on demand, {t.stall_s:.1f} s "
            f"waiting for parameters, {t.duplicate_reads} duplicate reads"
        )
    print(
        f"training state {_gib(state_nbytes)} on NVMe, peak RSS {_gib(rss)} "
        f"(the state is {state_nbytes / max(rss, 1):.1f}x the memory used)"
    )
    if trace_path is not None and trace_path.is_file():
        # The advice `infinity report` gives, from the same figures ([Note: advice from the figures]).
        print(f"the last step, recorded in {trace_path} (infinity report {trace_path}):")
        print("  " + summary_of_trace(trace_path))
    png = Path(f"{args.out}.png")
    fig = draw(
        losses,
        [r.compute_s for r in records],
        [r.fetch_stall_s for r in records],
        title=f"GPT {gpt.num_params / 1e6:.0f}M, params + optimizer on NVMe",
    )
    fig.savefig(png)
    Path(f"{args.out}.json").write_text(json.dumps(summary, indent=2))
    print(f"loss and step time: {png}; summary: {args.out}.json")
    return 0


def _record_last_step(config: dict, args: argparse.Namespace) -> Path | None:
    """Records the run's last step on the timeline into PREFIX.trace.json, for the summary's
    advice; None (and nothing recorded by the demo) where INFINITY_TRACE or the config's own
    ``trace`` section chooses the steps: the engine then logs that file's advice itself."""
    from infinity.config.trace import ENV

    if os.environ.get(ENV) or "trace" in config or args.steps < 1:
        return None
    path = Path(f"{args.out}.trace.json")
    config["trace"] = {
        "enabled": True,
        "output_path": str(path),
        "first_step": args.steps - 1,
        "steps": 1,
    }
    return path


def draw(losses: list[float], compute_s: list[float], exposed_io_s: list[float], *, title: str):
    """The demo's picture: the loss per step above, each step's seconds below as compute with the
    exposed I/O stacked on it; steps are integers on both axes' ticks. Returns the Figure."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 5), dpi=120)
    loss_ax, time_ax = fig.subplots(2, 1, sharex=True)
    steps = list(range(1, len(losses) + 1))
    loss_ax.plot(steps, losses, marker="o", markersize=3)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title(title)
    bars = list(range(1, len(compute_s) + 1))
    time_ax.bar(bars, compute_s, label="compute", color="tab:blue")
    time_ax.bar(bars, exposed_io_s, bottom=compute_s, label="exposed I/O", color="tab:orange")
    time_ax.set_ylabel("seconds per step")
    time_ax.set_xlabel("step")
    time_ax.legend(loc="upper right", fontsize="small")
    for ax in (loss_ax, time_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
