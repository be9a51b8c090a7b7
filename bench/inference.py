#!/usr/bin/env python3
"""Batch generation with the weights larger than memory: infinity from NVMe against its peers, interleaved.

One Hugging Face Llama-style model (built from a config with random weights, saved with save_pretrained
in bf16; no downloads) generates greedily from the same random prompts with each contender below, each in
a fresh subprocess, caches dropped before it starts (``echo 3 > /proc/sys/vm/drop_caches``, root), the
contenders' order rotating each repeat:

  ram          plain transformers, the whole model in RAM: the compute bound (its cgroup has no limit)
  infinity     infinity.inference.from_pretrained + infinity.initialize, weights on NVMe (the generate
               CLI's default config: nothing kept in host memory), every decode step replaying the trace
  accelerate   Accelerate's big-model inference: a meta model with accelerate.disk_offload (weights in an
               offload folder written once, read back by memmap per module, no read-ahead)
  deepspeed    DeepSpeed ZeRO-Inference (stage 3, offload_param nvme) where `deepspeed` is importable

The streaming contenders run in a memory cgroup whose limit (memory.max on v2, memory.limit_in_bytes on
v1; page cache included) is below the weights' size, so no pass can be served from the page cache. The
limit is set once the model is loaded (loading is untimed; infinity's zero.Init construction heap peaks
above it before initialize trims it), and VmHWM and the cgroup's peak restart there: the peaks
reported are generation's, the load's beside them. infinity's pool is --buffer-count x --buffer-size
elements (4 x 7e7 bf16: 560 MB, under the limit; the config's default 5 x 1e8 would not fit).

Reported per contender and batch (median, min-max over repeats): prefill tokens/s (batch x prompt over
the first forward), decode tokens/s (batch x (new - 1) over the rest, timed by a logits processor at
every step), peak RSS (VmHWM + hugetlb pages), the cgroup's peak charge, bytes read from the block
device (/proc/self/io read_bytes) per decode step, and whether the greedy tokens equal the ram run's.
Bounds: the disk bound (weight bytes per pass / fio sequential read GB/s, fio io_uring direct=1 1 MiB
qd32 on the same file system with buffers in 2 MiB pages, measured each repeat; as root the bench reserves
those pages in the hugetlb pool for fio's run alone and gives them back) and the compute bound (the ram
run). Decode should reach 0.9 x min(bounds) at the largest batch that fits.

``--batches`` takes ``max``: the largest batch whose generation fits the cgroup limit by infinity's own
estimate (``estimate_inference`` for this model and pool; the limit is set after loading, so the
generation phase alone must fit it), up to ``--max-batch``.

    python bench/inference.py                      # ~1.0B Llama, prompt 128, 16 new, batches 1 and 8
    python bench/inference.py --batches 1,8,max --repeat 3
    python bench/inference.py --capacity           # weights >= 3x the cgroup limit: tokens equal plain's
    python bench/inference.py --quick              # seconds: a tiny model, batch max (capped at 2)

Results go to $INFINITY_BENCH_RESULTS or bench/results/ (inference[-quick].json and .png).
"""

from __future__ import annotations

import argparse
import functools
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
KINDS = ["ram", "infinity", "accelerate", "deepspeed"]
STREAMING = ("infinity", "accelerate", "deepspeed")
SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocab) -- TinyLlama's shape, fewer layers
    "1b": (2048, 5632, 20, 32, 4, 32000),
    "2b": (2048, 5632, 48, 32, 4, 32000),
    "tiny": (128, 256, 2, 4, 2, 512),
}

# -- the child: one contender, one batch, one process --------------------------------------------------


def child(a: dict) -> dict:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from infinity.host import block_io_nbytes, peak_resident_host_nbytes

    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    model, engine, close = _load(a)
    load_s = time.perf_counter() - t0
    hwm_load, cgroup_load = peak_resident_host_nbytes(), _cgroup.peak(a.get("cgroup"))
    # [the limit after loading] zero.Init's construction heap (infinity) and the loaders' transients peak
    # before generation; the limit that keeps the weights out of the page cache is set once the model is
    # loaded (loading is not timed), and the peaks are restarted so they describe generation alone.
    limit = _limit_after_load(a.get("cgroup"), a.get("limit"))

    class Clock(LogitsProcessor):
        """Stamps the end of every forward: generate calls it once per new token."""

        def __init__(self):
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, a["vocab"], (a["batch"], a["prompt"]), generator=g)
    clock = Clock()
    read0 = block_io_nbytes()[0]
    start = time.perf_counter()
    with torch.no_grad():
        out = (engine or model).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=a["new"],
            min_new_tokens=a["new"],
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock]),
        )
    read_nbytes = block_io_nbytes()[0] - read0
    prefill_s = clock.stamps[0] - start
    decode_s = clock.stamps[-1] - clock.stamps[0]
    res = {
        "kind": a["kind"],
        "batch": a["batch"],
        "load_s": load_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "steps": len(clock.stamps),
        "tokens": out[:, ids.shape[1] :].tolist(),
        "read_nbytes": read_nbytes,
        "hwm": peak_resident_host_nbytes(),
        "hwm_load": hwm_load,
        "cgroup_peak": _cgroup.peak(a.get("cgroup")),
        "cgroup_peak_load": cgroup_load,
        "cgroup_limit": limit,
    }
    if engine is not None:
        res["engine"] = engine.last_generation.as_dict()
    close()
    return res


def _limit_after_load(cgroup: str | None, limit_nbytes: int | None) -> int | None:
    """Sets the cgroup's limit (the kernel reclaims page cache to get under it), then restarts VmHWM
    (clear_refs 5) and the cgroup's peak where the kernel lets it (v1: max_usage_in_bytes; v2: memory.peak)."""
    if not cgroup or not limit_nbytes:
        return None
    try:
        _cgroup.limit(cgroup, limit_nbytes)
    except OSError as e:  # EBUSY: the kernel could not reclaim enough to get under it
        from infinity.host import resident_host_nbytes

        raise SystemExit(
            f"could not limit the cgroup to {limit_nbytes / 2**30:.2f} GiB after loading ({e}): "
            f"the contender holds {resident_host_nbytes() / 2**30:.2f} GiB resident, its cgroup "
            f"{_cgroup.usage(cgroup) / 2**30:.2f} GiB"
        ) from None
    for path in (
        Path("/proc/self/clear_refs"),
        Path(cgroup) / "memory.max_usage_in_bytes",
        Path(cgroup) / "memory.peak",
    ):
        try:
            path.write_text("5\n" if path.name == "clear_refs" else "0\n")
        except OSError:
            pass
    return limit_nbytes


def _load(a: dict):
    """(model, engine or None, close) for the contender ``a["kind"]``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, model_dir = a["kind"], a["model_dir"]
    if kind == "ram":
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, local_files_only=True
        ).eval()
        for p in (
            model.parameters()
        ):  # from_pretrained may leave tensors mmapped: make them resident, unshared
            p.data = p.data.clone()
        return model, None, lambda: None
    if kind == "infinity":
        import infinity
        from infinity.inference import from_pretrained

        cfg = infinity_config(a["nvme"], a["buffer_count"], a["buffer_size"])
        model = from_pretrained(model_dir, cfg)
        engine = infinity.initialize(model, cfg)
        return model, engine, engine.close
    if kind == "accelerate":
        from accelerate import disk_offload, init_empty_weights

        hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
        model.eval()
        disk_offload(model, a["offload_dir"], execution_device=torch.device("cpu"))
        return model, None, lambda: None
    if kind == "deepspeed":
        return _load_deepspeed(a)
    raise ValueError(f"unknown contender {kind!r}")


def _load_deepspeed(a: dict):
    """DeepSpeed ZeRO-Inference as its docs set it up for Hugging Face models: HfDeepSpeedConfig so that
    from_pretrained builds under deepspeed.zero.Init, then deepspeed.initialize with no optimizer; the
    weights on NVMe with the pool infinity gets (buffer_count x buffer_size), nothing kept in host memory."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    _deepspeed_env.single_process_env()
    ds_cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {
                "device": "nvme",
                "nvme_path": a["nvme"],
                "buffer_count": a["buffer_count"],
                "buffer_size": a["buffer_size"],
                "max_in_cpu": 0,
            },
        },
    }
    keep = HfDeepSpeedConfig(ds_cfg)  # noqa: F841 -- must outlive from_pretrained: it routes it through zero.Init
    model = AutoModelForCausalLM.from_pretrained(
        a["model_dir"], dtype=torch.bfloat16, local_files_only=True
    )
    engine = deepspeed.initialize(model=model, config=ds_cfg)[0]
    engine.module.eval()
    return engine.module, None, lambda: None


# -- the parent: model files, fio, interleaved runs ----------------------------------------------------


def make_model(base: Path, shape: str) -> tuple[Path, Path, int, int]:
    """The save_pretrained directory of ``shape`` (made once, seed 0) and Accelerate's offload folder for it;
    their parameter count and weight bytes."""
    model_dir, offload_dir = base / f"llama-{shape}", base / f"llama-{shape}-offload"
    if not (model_dir / "config.json").exists() or not (offload_dir / "index.json").exists():
        code = (
            "import sys, torch; from transformers import LlamaConfig, LlamaForCausalLM;"
            "from accelerate.utils import offload_state_dict;"
            "h, i, n, q, kv, v = map(int, sys.argv[3:9]); torch.manual_seed(0);"
            "cfg = LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=q,"
            " num_key_value_heads=kv, vocab_size=v, max_position_embeddings=2048, bos_token_id=1,"
            " eos_token_id=2, pad_token_id=0);"
            "m = LlamaForCausalLM(cfg).to(torch.bfloat16).eval();"
            "m.save_pretrained(sys.argv[1]); offload_state_dict(sys.argv[2], m.state_dict())"
        )
        t = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-c",
                code,
                str(model_dir),
                str(offload_dir),
                *map(str, SHAPES[shape]),
            ],
            check=True,
        )
        print(
            f"made {model_dir} and {offload_dir.name} ({time.perf_counter() - t:.0f} s)", flush=True
        )
    from infinity.weights import checkpoint_tensors

    tensors = checkpoint_tensors(model_dir).values()
    return model_dir, offload_dir, sum(t.numel for t in tensors), sum(t.nbytes for t in tensors)


FIO_BLOCK, FIO_DEPTH = 1 << 20, 32


def fio_read_gbps(base: Path, nbytes: int) -> tuple[float, str] | None:
    """fio's sequential O_DIRECT read GB/s on ``base``'s file system (io_uring, 1 MiB, qd32) and the buffers
    it read into ("shmhuge": 2 MiB pages, reserved for this run where root may; else "malloc"); None
    without fio."""
    from infinity import measure

    if not measure.fio_path():
        return None
    f = measure.TestFile(str(base), nbytes, name="infinity-bench-inference-fio.dat")
    f.prepare()
    # fio's shmhuge segment: block x depth, plus room for its alignment
    with _cgroup.huge_pages(FIO_BLOCK * FIO_DEPTH + (4 << 20)):
        job = measure.fio_job(
            measure.Setting(FIO_BLOCK, FIO_DEPTH), f, "read", "shmhuge", direct=True
        )
        return job.run(), job.iomem


def infinity_config(nvme: str, buffer_count: int, buffer_size: int) -> dict:
    """The streaming config infinity runs (and is estimated) with: weights on NVMe, none kept in host memory."""
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme,
                "max_in_cpu": 0,
                "buffer_count": buffer_count,
                "buffer_size": buffer_size,
            },
        }
    }


def largest_batch(model_dir: Path, common: dict, limit_nbytes: int, cap: int) -> tuple[int, dict]:
    """The largest batch (up to ``cap``) whose generation phase fits ``limit_nbytes`` by infinity's estimate
    for this model and pool, and the estimate's generation-phase bytes at that batch and the next.

    Only the generation phase is held to the limit because the bench sets the limit once the model is
    loaded (see [the limit after loading] in child)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from infinity.estimate.machine import runtime_baseline_nbytes
    from infinity.inference import estimate_inference

    hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    cfg = infinity_config(common["base"], common["buffer_count"], common["buffer_size"])
    baseline = (
        runtime_baseline_nbytes()
    )  # once: measured per estimate, it would move the bisection's target

    @functools.cache  # each is a whole estimate; the bisection and the report ask for some twice
    def generation_nbytes(b: int) -> int:
        breakdown = estimate_inference(
            meta,
            config=cfg,
            batch=b,
            prompt=common["prompt"],
            gen=common["new"],
            zero_init=True,
            machine=False,
            baseline_nbytes=baseline,
        ).breakdown
        return breakdown.resource_nbytes("host", "train") + breakdown.resource_nbytes(
            "device", "train"
        )

    lo, hi = 0, cap + 1  # generation_nbytes grows with the batch: bisect for the last b that fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if generation_nbytes(mid) <= limit_nbytes else (lo, mid)
    if lo == 0:
        raise SystemExit(
            f"--batches max: not even batch 1 fits the {limit_nbytes / 2**30:.2f} GiB limit by the "
            f"estimate ({generation_nbytes(1) / 2**30:.2f} GiB); raise --limit-gib or shrink the pool"
        )
    return lo, {
        "batch": lo,
        "generation_nbytes": generation_nbytes(lo),
        "limit_nbytes": limit_nbytes,
        "next_batch_nbytes": generation_nbytes(lo + 1),
        "capped": lo == cap,
    }


def run_child(a: dict, limit_nbytes: int | None, timeout_s: float | None = None) -> dict:
    cgroup = _cgroup.make(
        f"infinity-bench-inference-{os.getpid()}-{a['kind']}-{time.monotonic_ns()}"
    )
    a = {**a, "cgroup": cgroup, "limit": limit_nbytes if cgroup else None}
    try:
        with tempfile.TemporaryDirectory(dir=a["base"]) as nvme:
            try:
                r = subprocess.run(
                    [sys.executable, __file__, "--child", json.dumps({**a, "nvme": nvme})],
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                    timeout=timeout_s,
                )
            except subprocess.TimeoutExpired:
                # a contender whose working set exceeds the limit faults its own pages back in forever
                faults = _cgroup.major_faults(cgroup)
                return {
                    "kind": a["kind"],
                    "batch": a["batch"],
                    "failed": (
                        f"timed out after {timeout_s:.0f} s"
                        + (
                            f" with {faults:,} major page faults in its cgroup "
                            "(thrashing under the limit)"
                            if faults
                            else ""
                        )
                    ),
                }
    finally:
        _cgroup.remove(cgroup)
    if r.returncode != 0:
        return {
            "kind": a["kind"],
            "batch": a["batch"],
            "failed": f"exit {r.returncode}: {r.stderr[-1500:]}",
        }
    return json.loads(r.stdout.strip().splitlines()[-1])


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def interleaved(args, kinds: list[str], common: dict, weight_nbytes: int, notes: list[str]) -> dict:
    runs: dict[str, list[dict]] = {f"{k}/{b}": [] for k in kinds for b in args.batches}
    fio: list[float] = []
    fio_iomem: set[str] = set()
    dropped = True
    for rep in range(args.repeat):
        measured = fio_read_gbps(Path(common["base"]), args.fio_nbytes)
        if measured is not None:
            g, iomem = measured
            fio.append(g)
            fio_iomem.add(iomem)
            print(
                f"repeat {rep + 1}/{args.repeat}: fio seq read {g:.2f} GB/s ({iomem} buffers)",
                flush=True,
            )
        for batch in args.batches:
            shift = rep % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                dropped &= _cgroup.drop_caches()
                limit = args.limit_nbytes if kind in STREAMING else None
                t = time.perf_counter()
                r = run_child({**common, "kind": kind, "batch": batch}, limit, args.timeout)
                r["load1"] = os.getloadavg()[0]
                runs[f"{kind}/{batch}"].append(r)
                if "failed" in r:
                    print(f"  {kind:10s} b{batch}: FAILED {r['failed'][-300:]}", flush=True)
                    continue
                print(
                    f"  {kind:10s} b{batch}: prefill {batch * args.prompt / r['prefill_s']:7.1f} tok/s, decode "
                    f"{batch * (r['steps'] - 1) / r['decode_s']:6.2f} tok/s, read {r['read_nbytes'] / 1e9:5.2f} GB, "
                    f"peak RSS {r['hwm'] / 2**30:.2f} GiB (load {r['hwm_load'] / 2**30:.2f}), cgroup peak "
                    f"{(r['cgroup_peak'] or 0) / 2**30:.2f} GiB ({time.perf_counter() - t:.0f} s; "
                    f"load {r['load1']:.1f})",
                    flush=True,
                )
    if not dropped:
        notes.append(
            "drop_caches was not permitted (not root): caches were not dropped between runs"
        )
    if "malloc" in fio_iomem:
        notes.append(
            "fio read into malloc'd buffers in some repeats (no 2 MiB pages could be reserved): "
            "its disk bound is below what the disk gives huge-page buffers"
        )
    return {"runs": runs, "fio_read_gbps": fio, "fio_iomem": sorted(fio_iomem)}


def summarise(args, kinds: list[str], raw: dict, weight_nbytes: int) -> dict:
    fio = raw["fio_read_gbps"]
    fio_med = statistics.median(fio) if fio else None
    table: dict[str, dict] = {}
    for batch in args.batches:
        ref = [r for r in raw["runs"].get(f"ram/{batch}", []) if "failed" not in r]
        for kind in kinds:
            rs = [r for r in raw["runs"][f"{kind}/{batch}"] if "failed" not in r]
            row: dict = {
                "failed": [r["failed"] for r in raw["runs"][f"{kind}/{batch}"] if "failed" in r]
            }
            if rs:
                row.update(
                    {
                        "prefill_tok_s": _stats([batch * args.prompt / r["prefill_s"] for r in rs]),
                        "decode_tok_s": _stats(
                            [batch * (r["steps"] - 1) / r["decode_s"] for r in rs]
                        ),
                        "decode_step_s": _stats([r["decode_s"] / (r["steps"] - 1) for r in rs]),
                        "peak_rss": max(r["hwm"] for r in rs),
                        "peak_rss_load": max(r["hwm_load"] for r in rs),
                        "cgroup_peak": max((r["cgroup_peak"] or 0) for r in rs) or None,
                        "cgroup_limit": rs[0]["cgroup_limit"],
                        "read_nbytes": statistics.median(r["read_nbytes"] for r in rs),
                        "read_nbytes_per_forward": statistics.median(
                            r["read_nbytes"] / r["steps"] for r in rs
                        ),
                        "load_s": statistics.median(r["load_s"] for r in rs),
                    }
                )
                if ref:
                    same = [
                        sum(
                            x == y for x, y in zip(r["tokens"][i], ref[0]["tokens"][i], strict=True)
                        )
                        for r in rs
                        for i in range(batch)
                    ]
                    total = len(rs) * batch * len(ref[0]["tokens"][0])
                    row["tokens_equal_ram"] = sum(same) / total
                    row["sequences_equal_ram"] = sum(
                        r["tokens"] == ref[0]["tokens"] for r in rs
                    ) / len(rs)
                if "engine" in rs[0]:
                    row["engine"] = rs[0]["engine"]
            table[f"{kind}/{batch}"] = row
        bound = {
            "disk_decode_tok_s": batch / (weight_nbytes / (fio_med * 1e9)) if fio_med else None,
            "compute_decode_tok_s": table.get(f"ram/{batch}", {})
            .get("decode_tok_s", {})
            .get("median"),
        }
        known = [x for x in bound.values() if x]
        bound["min"] = min(known) if known else None
        table[f"bounds/{batch}"] = bound
        inf, acc = table.get(f"infinity/{batch}", {}), table.get(f"accelerate/{batch}", {})
        if "decode_tok_s" in inf:
            d = inf["decode_tok_s"]["median"]
            bound["infinity_over_min_bound"] = d / bound["min"] if bound["min"] else None
            # per repeat: each infinity run against the bounds of its own repeat (fio and ram of that round)
            per = []
            for i, r in enumerate(raw["runs"][f"infinity/{batch}"]):
                ram = raw["runs"].get(f"ram/{batch}", [])
                ram_r = ram[i] if i < len(ram) else None
                bounds_i = [batch / (weight_nbytes / (fio[i] * 1e9))] if i < len(fio) else []
                if ram_r is not None and "failed" not in ram_r:
                    bounds_i.append(batch * (ram_r["steps"] - 1) / ram_r["decode_s"])
                if "failed" not in r and bounds_i:
                    per.append(batch * (r["steps"] - 1) / r["decode_s"] / min(bounds_i))
            bound["infinity_over_min_bound_per_repeat"] = per
            if "decode_tok_s" in acc:
                bound["infinity_over_accelerate_decode"] = d / acc["decode_tok_s"]["median"]
                bound["infinity_over_accelerate_prefill"] = (
                    inf["prefill_tok_s"]["median"] / acc["prefill_tok_s"]["median"]
                )
    return {
        "fio_read_gbps": _stats(fio) if fio else None,
        "fio_iomem": raw["fio_iomem"],
        "table": table,
    }


def print_table(args, kinds, s: dict, weight_nbytes: int) -> None:
    print(
        f"\n{'contender':<11}{'batch':>6}{'prefill tok/s':>15}{'decode tok/s':>22}{'peak RSS':>10}"
        f"{'cgroup peak/limit':>20}{'GB read/step':>14}{'tokens = ram':>14}"
    )
    for batch in args.batches:
        for kind in kinds:
            r = s["table"][f"{kind}/{batch}"]
            if "decode_tok_s" not in r:
                print(f"{kind:<11}{batch:>6}  failed")
                continue
            d = r["decode_tok_s"]
            lim = (
                f"{(r['cgroup_peak'] or 0) / 2**30:.2f}/{r['cgroup_limit'] / 2**30:.2f}"
                if r["cgroup_limit"]
                else (f"{(r['cgroup_peak'] or 0) / 2**30:.2f}/-")
            )
            print(
                f"{kind:<11}{batch:>6}{r['prefill_tok_s']['median']:>15.1f}"
                f"{d['median']:>9.2f} ({d['min']:.2f}-{d['max']:.2f})"
                f"{r['peak_rss'] / 2**30:>9.2f}G{lim:>20}{r['read_nbytes_per_forward'] / 1e9:>14.2f}"
                f"{r.get('tokens_equal_ram', float('nan')) * 100:>13.0f}%"
            )
        b = s["table"][f"bounds/{batch}"]
        print(
            f"{'bounds':<11}{batch:>6}  disk {b['disk_decode_tok_s'] or 0:.2f} tok/s "
            f"({weight_nbytes / 1e9:.2f} GB per pass), compute {b['compute_decode_tok_s'] or 0:.2f} tok/s; "
            f"infinity / min bound {b.get('infinity_over_min_bound') or 0:.2f} (per repeat "
            f"{', '.join(f'{x:.2f}' for x in b.get('infinity_over_min_bound_per_repeat', [])) or '-'}; "
            f"target >= 0.9), / accelerate {b.get('infinity_over_accelerate_decode') or 0:.2f} (decode)"
        )


def plot(args, kinds, s: dict, path: Path, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(kinds)
    for ax, metric in zip(axes, ("prefill_tok_s", "decode_tok_s"), strict=True):
        for i, kind in enumerate(kinds):
            ys = [s["table"][f"{kind}/{b}"].get(metric, {}).get("median", 0) for b in args.batches]
            ax.bar([j + i * width for j in range(len(args.batches))], ys, width, label=kind)
        if metric == "decode_tok_s":
            for j, b in enumerate(args.batches):
                d = s["table"][f"bounds/{b}"]["disk_decode_tok_s"]
                if d:
                    ax.hlines(
                        d,
                        j - width / 2,
                        j + width * (len(kinds) - 0.5),
                        colors="k",
                        linestyles="dashed",
                        label="disk bound (fio)" if j == 0 else None,
                    )
        ax.set_xticks(
            [j + width * (len(kinds) - 1) / 2 for j in range(len(args.batches))],
            [f"batch {b}" for b in args.batches],
        )
        ax.set_yscale("log")
        low = ax.get_ylim()[0]
        for i, kind in enumerate(
            kinds
        ):  # a contender with no run that finished: say so where its bar would be
            for j, b in enumerate(args.batches):
                if metric not in s["table"][f"{kind}/{b}"]:
                    ax.text(
                        j + i * width,
                        low * 1.05,
                        "failed",
                        rotation=90,
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        color=f"C{i}",
                    )
        ax.set_ylabel(metric.replace("_tok_s", " tokens/s"))
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def capacity(args, base: Path, common: dict) -> dict:
    """A model whose bf16 weights are >= 3x the cgroup limit: infinity in the cgroup vs plain in RAM."""
    model_dir, offload_dir, numel, nbytes = make_model(base, args.capacity_shape)
    c = {
        **common,
        "model_dir": str(model_dir),
        "offload_dir": str(offload_dir),
        "vocab": SHAPES[args.capacity_shape][5],
    }
    out = {
        "params": numel,
        "weight_nbytes": nbytes,
        "cgroup_limit": args.limit_nbytes,
        "weights_over_limit": nbytes / args.limit_nbytes,
        "batch": 1,
        "prompt": args.prompt,
        "new": args.new,
    }
    for kind in ("ram", "infinity"):
        _cgroup.drop_caches()
        r = run_child(
            {**c, "kind": kind, "batch": 1}, args.limit_nbytes if kind == "infinity" else None
        )
        if "failed" in r:
            raise SystemExit(f"capacity {kind}: {r['failed']}")
        out[kind] = {
            k: r[k]
            for k in (
                "prefill_s",
                "decode_s",
                "steps",
                "hwm",
                "hwm_load",
                "cgroup_peak",
                "cgroup_peak_load",
                "cgroup_limit",
                "read_nbytes",
                "tokens",
                "load_s",
            )
        }
        print(
            f"capacity {kind}: {numel / 1e9:.2f}B, decode {(r['steps'] - 1) / r['decode_s']:.2f} tok/s, peak RSS "
            f"{r['hwm'] / 2**30:.2f} GiB, cgroup peak {(r['cgroup_peak'] or 0) / 2**30:.2f} GiB",
            flush=True,
        )
    out["tokens_equal"] = out["ram"]["tokens"] == out["infinity"]["tokens"]
    print(
        f"capacity: {nbytes / 2**30:.2f} GiB of bf16 weights, {out['weights_over_limit']:.1f}x the cgroup limit; "
        f"greedy tokens equal plain's: {out['tokens_equal']}"
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=16, help="new tokens per sequence")
    ap.add_argument(
        "--batches",
        default="1,8",
        help="comma-separated; 'max' is the largest batch whose generation fits --limit-gib by the estimate",
    )
    ap.add_argument("--max-batch", type=int, default=256, help="the most 'max' may resolve to")
    ap.add_argument(
        "--timeout",
        type=float,
        default=1800,
        help="seconds one contender's run may take before it is killed and reported as failed",
    )
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument(
        "--limit-gib",
        type=float,
        default=1.5,
        help="memory limit of the streaming contenders' cgroup once loaded (page cache included)",
    )
    ap.add_argument(
        "--buffer-count", type=int, default=4, help="infinity's offload_param.buffer_count"
    )
    ap.add_argument(
        "--buffer-size",
        type=float,
        default=7e7,
        help="infinity's offload_param.buffer_size in elements (>= the largest parameter)",
    )
    ap.add_argument(
        "--base",
        default=os.path.join(Path.home(), ".cache", "infinity-bench-inference"),
        help="model files, offload folder, swap files and fio's test file (one file system)",
    )
    ap.add_argument(
        "--capacity", action="store_true", help="instead: weights >= 3x the cgroup limit"
    )
    ap.add_argument("--capacity-shape", choices=sorted(SHAPES), default="2b")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny model, batch max (capped at 2: a batch of several), 4 new tokens: proves it runs",
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON path (the PNG beside it)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return _cgroup.serve_child(args.child, child)
    if args.quick:
        # One batch: each contender's run is a fresh interpreter (imports dominate); batch max
        # exercises the estimate's bisection too, and 2 a batch of several sequences.
        args.shape, args.prompt, args.new, args.batches, args.repeat = "tiny", 16, 4, "max", 1
        args.buffer_size, args.max_batch = 1 << 17, 2
        args.base = os.path.abspath("infinity_nvme_bench_inference")
    args.limit_nbytes = int(args.limit_gib * 2**30)
    args.fio_nbytes = (64 << 20) if args.quick else (1 << 30)
    base = Path(args.base)
    base.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    kinds = args.kinds.split(",")
    if "deepspeed" in kinds and importlib.util.find_spec("deepspeed") is None:
        kinds.remove("deepspeed")
        notes.append(
            "deepspeed: skipped, `deepspeed` is not importable here (it is never a dependency; "
            "bench/deepspeed_venv.sh makes an environment where it is)"
        )
    if _cgroup.root() is None:
        notes.append(
            "no memory cgroup could be made (needs root and a memory controller): nothing bounded the "
            "page cache, and no cgroup peak is reported"
        )
    common = {
        "prompt": args.prompt,
        "new": args.new,
        "base": str(base),
        "buffer_count": args.buffer_count,
        "buffer_size": int(args.buffer_size),
    }
    machine = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    results = Path(os.environ.get("INFINITY_BENCH_RESULTS", ROOT / "bench" / "results"))
    results.mkdir(parents=True, exist_ok=True)
    if args.capacity:
        out = {
            "bench": "inference-capacity",
            **capacity(args, base, common),
            "notes": notes,
            "machine": machine,
        }
        out["machine"]["loadavg_end"] = os.getloadavg()
        path = results / f"inference-capacity{'-quick' if args.quick else ''}.json"
        path.write_text(json.dumps(out, indent=2))
        print(f"wrote {path}")
        return 0
    model_dir, offload_dir, numel, weight_nbytes = make_model(base, args.shape)
    common.update(
        model_dir=str(model_dir), offload_dir=str(offload_dir), vocab=SHAPES[args.shape][5]
    )
    largest = None
    batches = []
    for b in args.batches.split(","):
        if b == "max":
            n, largest = largest_batch(model_dir, common, args.limit_nbytes, args.max_batch)
            print(
                f"largest batch that fits {args.limit_gib} GiB by the estimate: {n} (generation "
                f"{largest['generation_nbytes'] / 2**30:.2f} GiB; batch {n + 1}: "
                f"{largest['next_batch_nbytes'] / 2**30:.2f} GiB{'; capped by --max-batch' if largest['capped'] else ''})",
                flush=True,
            )
            b = n
        batches.append(int(b))
    args.batches = list(dict.fromkeys(batches))
    if weight_nbytes <= args.limit_nbytes:
        notes.append(
            f"the weights ({weight_nbytes / 2**30:.3f} GiB) fit under the cgroup limit "
            f"({args.limit_gib} GiB): the page cache may serve repeated passes (a smoke run)"
        )
    for n in notes:
        print("note:", n)
    print(
        f"Llama {numel / 1e9:.2f}B ({weight_nbytes / 1e9:.2f} GB bf16), prompt {args.prompt}, {args.new} new, "
        f"batches {args.batches}, {args.repeat} repeat(s), streaming contenders limited to {args.limit_gib} GiB; "
        f"load {machine['loadavg_start'][0]:.1f}",
        flush=True,
    )
    raw = interleaved(args, kinds, common, weight_nbytes, notes)
    s = summarise(args, kinds, raw, weight_nbytes)
    print_table(args, kinds, s, weight_nbytes)
    machine["loadavg_end"] = os.getloadavg()
    path = args.out or results / f"inference{'-quick' if args.quick else ''}.json"
    note = plot(
        args,
        kinds,
        s,
        path.with_suffix(".png"),
        f"Llama {numel / 1e6:.0f}M bf16, prompt {args.prompt}, {args.new} new, {platform.node()} "
        f"({os.cpu_count()} CPUs), caches dropped, streaming in a {args.limit_gib} GiB cgroup",
    )
    if note:
        notes.append(note)
    out = {
        "bench": "inference",
        "params": numel,
        "weight_nbytes": weight_nbytes,
        "prompt": args.prompt,
        "new": args.new,
        "batches": args.batches,
        "repeat": args.repeat,
        "kinds": kinds,
        "cgroup_limit": args.limit_nbytes,
        "largest_batch": largest,
        "notes": notes,
        "machine": machine,
        **s,
        "runs": {
            k: [{x: y for x, y in r.items() if x != "tokens"} for r in v]
            for k, v in raw["runs"].items()
        },
    }
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
