"""LoRA fine-tuning with the frozen base streamed read-only from NVMe (issue 24): capacity, speed, kernel.

Contenders, each in a fresh subprocess (a memory cgroup where this process may make one, caches
dropped before it starts where it may), interleaved round by round:
- ``peft``: plain PEFT in RAM, the reference: the base loaded whole with ``from_pretrained``, torch's
  AdamW over the adapters;
- ``peft-fp32mm`` (--speed): the same with its 16-bit layers multiplied as infinity multiplies them
  on a CPU without 16-bit matrix hardware ([Note: 16-bit Linear on the CPU]), so that its
  ratio to infinity is the cost of streaming the base, not of torch's reference bf16 loops;
- ``infinity-bf16`` / ``infinity-nf4``: the base built under ``zero.Init`` and read with
  ``load_pretrained`` (never whole), stage 3 with parameters and optimizer state on NVMe, the frozen
  base at rest in bf16 or NF4 (``zero_quantized_nontrainable_weights`` + ``weight_quantization``);
- ``deepspeed``: DeepSpeed ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on NVMe and PEFT's
  LoRA, set up as its docs set up a Hugging Face model (``HfDeepSpeedConfig``, so that
  ``from_pretrained`` builds under ``deepspeed.zero.Init``, then ``peft.get_peft_model`` and
  ``deepspeed.initialize``), where ``deepspeed`` is importable (the environment
  bench/deepspeed_venv.sh makes; skipped with the reason printed otherwise). ZeRO-3 with PEFT is
  brittle (DeepSpeed issues #5124, #3000): where it fails, the exception and the phase it failed in
  are the contender's result, not a crash of the bench.
Each reports its losses, step times, NVMe bytes read and written per step (the engine's counters)
against the base's bytes at rest (the least a step can read: the base once for the forward and once
for the backward), the peak RSS and the cgroup's peak. The base is a random Llama written once by the
bench as a sharded safetensors directory (tensor by tensor: never a whole model in memory).

    python bench/lora.py --quick      # a tiny Llama, 2 steps, every contender: seconds (CI)
    python bench/lora.py --capacity   # 7B-shaped Llama (hidden 4096, 32 layers, MLP 11008), LoRA r 16
                                      #   on the attention projections, seq 128, 3 steps, NF4 and bf16,
                                      #   each inside a 4 GiB memory cgroup
    python bench/lora.py --speed      # ~1B Llama, bf16, seq 256, 3 steps: infinity with the base on NVMe
                                      #   in a cgroup of a quarter of the base, against PEFT in RAM,
                                      #   both with activation checkpointing, interleaved rounds
    python bench/lora.py --kernel     # NF4 dequantisation GB/s (plain and double quant) against a
                                      #   copy of the same bytes (bench/dequant.py's measurement)
    python bench/lora.py --quality    # NF4, NF4 + double quant and int8 against bf16 on a Llama with
                                      #   real-shaped weights: |Δlogit|, greedy agreement
                                      #   (bench/nf4_quality.py's measurement)

``--kinds infinity-nf4`` runs only the contenders named. Each infinity contender reports each phase
(built, loaded, initialized, each step: the peak RSS and the cgroup's peak so far) as it reaches
it, so a run cut short by ``--timeout`` or the OOM killer records how far it got.

Writes a JSON into bench/results/ (INFINITY_BENCH_RESULTS overrides the folder).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import _cgroup
import _deepspeed_env

ROOT = Path(__file__).resolve().parent.parent

SHAPES = {
    # hidden, layers, MLP, heads, kv heads, vocabulary
    "tiny": (64, 2, 128, 4, 4, 256),
    "1b": (2048, 22, 5632, 32, 4, 32000),
    "7b": (4096, 32, 11008, 32, 32, 32000),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
SHARD_NBYTES = 2 << 30
PROGRESS = "lora-progress: "


def llama_config(shape: str):
    from transformers import LlamaConfig

    h, n, mlp, heads, kv, vocab = SHAPES[shape]
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=mlp,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2048,
        torch_dtype="bfloat16",
    )


def write_base(path: Path, shape: str) -> int:
    """A random bf16 Llama of ``shape`` as save_pretrained lays it out (shards and their index), written
    one tensor at a time from the meta-device model's names and shapes; returns its bytes."""
    import safetensors.torch
    import torch
    from transformers import LlamaForCausalLM

    index = path / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["metadata"]["total_size"]
    path.mkdir(parents=True, exist_ok=True)
    config = llama_config(shape)
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for name, p in meta.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        t = (
            torch.ones(p.shape, dtype=torch.bfloat16)
            if p.dim() == 1
            else (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)
        )
        if sizes[-1] and sizes[-1] + t.nbytes > SHARD_NBYTES:
            _flush(path, shards, len(shards))
            shards.append({})
            sizes.append(0)
        shards[-1][name] = t
        sizes[-1] += t.nbytes
    _flush(path, shards, len(shards))
    weight_map = {}
    total = sum(sizes)
    n = len(shards)
    for i in range(n):
        old = path / f"part-{i + 1}.safetensors"
        new = path / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        old.rename(new)
        with safetensors.safe_open(new, "pt") as f:
            weight_map.update({k: new.name for k in f.keys()})
    config.save_pretrained(path)
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def _flush(path: Path, shards: list, i: int) -> None:
    import safetensors.torch

    if shards[-1]:
        safetensors.torch.save_file(shards[-1], str(path / f"part-{i}.safetensors"))
        shards[-1].clear()  # its tensors' memory goes back before the next shard


def _lora(model, r: int):
    import warnings

    import peft

    config = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=TARGETS)
    with warnings.catch_warnings():  # peft 0.21 reads transformers 5's deprecated attribute
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        return peft.get_peft_model(model, config)


def _recomputes(model, a: dict) -> bool:
    """Whether the contender's layers will recompute in its backward: asked for, and the model in
    training mode (transformers checkpoints only there)."""
    if not a.get("checkpointing"):
        return False
    if not model.training:
        raise RuntimeError(f"{a['kind']}: the model is in eval mode, so it would not recompute")
    return True


def _batch(step: int, seq: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, vocab, (1, seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def _progress(a: dict, t0: float, phase: str, **figures) -> None:
    """One line on stderr per phase of a contender's run: what a run cut short (a timeout, the OOM
    killer) reached, which run_child records."""
    from infinity.host import peak_rss_nbytes

    line = {
        "phase": phase,
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "peak_rss_nbytes": peak_rss_nbytes(),
        "cgroup_peak_nbytes": _cgroup.peak(a.get("cgroup")),
        **figures,
    }
    print(PROGRESS + json.dumps(line), file=sys.stderr, flush=True)


def _progress_of(stderr: str | bytes | None) -> list[dict]:
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    return [
        json.loads(line[len(PROGRESS) :])
        for line in (stderr or "").splitlines()
        if line.startswith(PROGRESS)
    ]


def child(a: dict) -> dict:
    """One contender's run (in its own process, in the parent's cgroup where there is one)."""
    if a["kind"] == "runtime":  # what a contender holds before any of the model: the imports
        import peft  # noqa: F401
        import transformers  # noqa: F401

        import infinity  # noqa: F401

        return {"kind": "runtime", "cgroup_peak_nbytes": _cgroup.peak(a.get("cgroup"))}
    import torch

    from infinity.host import peak_rss_nbytes

    torch.manual_seed(0)
    base = Path(a["base"])
    config = llama_config(a["shape"])
    steps, seq = a["steps"], a["seq"]
    losses, times, reads, writes, base_reads, base_writes = [], [], [], [], [], []
    records: list = []  # infinity's step records: where each step's time went
    t_load = time.perf_counter()
    if a["kind"] == "deepspeed":
        return _deepspeed(a, config)
    if a["kind"] in ("peft", "peft-fp32mm"):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        # from_pretrained returns the model in eval mode, where transformers skips the layers'
        # checkpointing: a training loop's train() is what makes PEFT recompute as infinity does.
        model.train()
        if a.get("checkpointing"):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        model = _lora(model, a["r"])
        if a["kind"] == "peft-fp32mm":  # the 16-bit layers' matmuls as infinity's on this CPU
            from infinity.zero.cpu_linear import Fp32Linears

            Fp32Linears(model).install()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        recomputes = _recomputes(model, a)
        load_s = time.perf_counter() - t_load
        for step in range(steps):
            t0 = time.perf_counter()
            loss = model(**_batch(step, seq, config.vocab_size)).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        at_rest = None
    else:
        from transformers import LlamaForCausalLM

        import infinity

        nvme = str(Path(a["nvme"]))
        os.makedirs(nvme, exist_ok=True)
        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "bf16": {"enabled": True},
            "max_seq_length": seq,
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": nvme},
                "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
            },
        }
        if a.get("small_box"):
            # --capacity: what the pre-flight check's fixes name for a 4 GiB box (no parameter
            # shards kept in host memory, a pool holding the units a checkpointed layer holds at
            # once, the adapters' small sub-groups), and activation checkpointing (below).
            cfg["zero_optimization"]["offload_param"].update(
                max_in_cpu=0, buffer_count=4, buffer_size=116_129_792
            )
            cfg["zero_optimization"]["sub_group_size"] = 1_000_000
        elif a.get("limited"):
            # --speed: what the pre-flight check's fixes name for its cgroup (no parameter shards
            # kept in host memory, a pool holding the units the model holds at once, the
            # adapters' small sub-groups).
            cfg["zero_optimization"]["offload_param"].update(
                max_in_cpu=0, buffer_count=3, buffer_size=65_536_000
            )
            cfg["zero_optimization"]["sub_group_size"] = 1_000_000
        if a["kind"] == "infinity-nf4":
            cfg["zero_optimization"]["zero_quantized_nontrainable_weights"] = True
            cfg["weight_quantization"] = {
                "quantized_initialization": {"num_bits": 4, "group_size": 64, "quant_type": "nf4"}
            }
        # Built in bf16: load_pretrained overwrites every value, and an fp32 build would make
        # zero.Init write twice the base's bytes (28 GB for the 7B shape) before the first read.
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with infinity.zero.Init(cfg):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(default_dtype)
        _progress(a, t_load, "built under zero.Init")
        infinity.zero.load_pretrained(model, base)
        _progress(a, t_load, "loaded")
        if a.get("checkpointing"):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        engine = infinity.initialize(_lora(model, a["r"]), cfg)
        recomputes = _recomputes(engine.module, a)
        load_s = time.perf_counter() - t_load
        _progress(a, t_load, "initialized")
        rt = engine.runtime
        engine.add_step_listener(records.append)
        frozen = {u.key for u in rt.unit_map.units if not u.trainable}
        at_rest = sum(rt.plan.at_rest_nbytes(u) for u in rt.unit_map.units if not u.trainable)
        for step in range(steps):
            before = engine.io_stats()
            keys_before = rt.param_store.key_traffic()
            t0 = time.perf_counter()
            loss = engine(**_batch(step, seq, config.vocab_size)).loss
            engine.backward(loss)
            engine.step()
            engine.synchronize()
            times.append(time.perf_counter() - t0)
            after = engine.io_stats()
            reads.append(after["read_nbytes"] - before["read_nbytes"])
            writes.append(after["write_nbytes"] - before["write_nbytes"])
            moved = rt.param_store.key_traffic().since(keys_before)
            base_reads.append(sum(n for k, n in moved.read.items() if k in frozen))
            base_writes.append(sum(n for k, n in moved.written.items() if k in frozen))
            losses.append(loss.item())
            _progress(
                a,
                t_load,
                f"step {step}",
                loss=losses[-1],
                step_s=times[-1],
                read_nbytes=reads[-1],
                write_nbytes=writes[-1],
                base_read_nbytes=base_reads[-1],
            )
        engine.close()
    breakdown = {
        k: [round(getattr(r, k), 3) for r in records]
        for k in ("forward_s", "backward_s", "optimizer_s", "fetch_stall_s", "io_wait_s")
    }
    return {
        "kind": a["kind"],
        "recomputes": recomputes,
        "time_breakdown": breakdown,
        "losses": losses,
        "step_s": times,
        "load_s": load_s,
        "read_nbytes_per_step": reads,
        "write_nbytes_per_step": writes,
        "base_read_nbytes_per_step": base_reads,
        "base_write_nbytes_per_step": base_writes,
        "base_at_rest_nbytes": at_rest,
        "peak_rss_nbytes": peak_rss_nbytes(),
        "cgroup_peak_nbytes": _cgroup.peak(a.get("cgroup")),
    }


def _deepspeed(a: dict, config) -> dict:
    """DeepSpeed ZeRO-3, parameters and optimizer state on NVMe, PEFT's LoRA over the base built under
    its zero.Init; its failure (with the phase: load, initialize or step) is the result."""
    import traceback

    import torch

    from infinity.host import peak_rss_nbytes

    _deepspeed_env.single_process_env()
    nvme = str(Path(a["nvme"]) / "deepspeed")
    os.makedirs(nvme, exist_ok=True)
    ds_cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
    }
    row: dict = {"kind": "deepspeed", "losses": [], "step_s": []}
    phase = "import"
    t_load = time.perf_counter()
    try:
        import deepspeed
        from transformers import LlamaForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        row["deepspeed_version"] = deepspeed.__version__
        phase = "load"
        keep = HfDeepSpeedConfig(ds_cfg)  # noqa: F841 -- routes from_pretrained through zero.Init
        model = _lora(LlamaForCausalLM.from_pretrained(a["base"], dtype=torch.bfloat16), a["r"])
        model.train()  # from_pretrained's eval mode; DeepSpeed's own train() follows in its engine
        phase = "initialize"
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_cfg)[0]
        row["load_s"] = time.perf_counter() - t_load
        phase = "step"
        io = []
        for step in range(a["steps"]):
            before = _deepspeed_env.block_io_nbytes()
            t0 = time.perf_counter()
            loss = engine(**_batch(step, a["seq"], config.vocab_size)).loss
            engine.backward(loss)
            engine.step()
            row["step_s"].append(time.perf_counter() - t0)
            row["losses"].append(loss.item())
            after = _deepspeed_env.block_io_nbytes()
            io.append({k: after[k] - before[k] for k in after})
        row["read_nbytes_per_step"] = [d["read_nbytes"] for d in io]
        row["write_nbytes_per_step"] = [d["write_nbytes"] for d in io]
        row["io_counted_by"] = "the block layer (/proc/self/io): DeepSpeed counts none of its own"
    except Exception as e:  # the outcome of this contender, recorded: see the module's docstring
        row["error"] = {
            "phase": phase,
            "exception": f"{type(e).__name__}: {e}"[:2000],
            "traceback_tail": traceback.format_exc()[-3000:],
        }
        row.pop("step_s")  # an incomplete run has no step figures for the summary
    row["peak_rss_nbytes"] = peak_rss_nbytes()
    row["cgroup_peak_nbytes"] = _cgroup.peak(a.get("cgroup"))
    return row


def run_child(spec: dict, limit_nbytes: int | None, timeout_s: float, notes: list[str]) -> dict:
    cgroup = _cgroup.make(f"infinity-bench-lora-{os.getpid()}") if limit_nbytes else None
    try:
        if limit_nbytes:
            if cgroup is None:
                notes.append(f"{spec['kind']}: no memory cgroup could be made; ran unbounded")
            else:
                _cgroup.limit(cgroup, limit_nbytes)
        _cgroup.drop_caches()
        r = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps({**spec, "cgroup": cgroup})],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if r.returncode != 0:
            return {
                "kind": spec["kind"],
                "failed": r.stderr[-8000:],
                "rc": r.returncode,
                "progress": _progress_of(r.stderr),
                "cgroup_peak_nbytes": _cgroup.peak(cgroup),
            }
        return json.loads(r.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired as e:
        return {
            "kind": spec["kind"],
            "failed": f"timed out after {timeout_s:.0f} s",
            "progress": _progress_of(e.stderr),
            "cgroup_peak_nbytes": _cgroup.peak(cgroup),
        }
    finally:
        _cgroup.remove(cgroup)


def kernel(quick: bool, out: Path) -> dict:
    """bench/dequant.py's measurement: the NF4 kernel's GB/s over a copy of the same bytes."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import dequant

    argv = ["--out", str(out)] + (["--quick"] if quick else [])
    dequant.main(argv)
    return json.loads(out.read_text())


def quality(out: Path) -> dict:
    """bench/nf4_quality.py's measurement: each format's logits and greedy tokens against bf16."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import nf4_quality

    nf4_quality.main(["--out", str(out)])
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a tiny Llama, 2 steps: seconds (CI)")
    mode.add_argument("--capacity", action="store_true", help="7B-shaped, 4 GiB cgroup, 3 steps")
    mode.add_argument("--speed", action="store_true", help="~1B bf16 against PEFT in RAM")
    mode.add_argument("--kernel", action="store_true", help="NF4 dequantisation GB/s")
    mode.add_argument("--quality", action="store_true", help="NF4 / int8 accuracy against bf16")
    ap.add_argument("--rounds", type=int, default=2, help="--speed: interleaved rounds")
    ap.add_argument("--limit-gib", type=float, default=4.0, help="--capacity: the cgroup's limit")
    ap.add_argument(
        "--base-fraction",
        type=float,
        default=0.25,
        help="--speed: infinity's cgroup holds the imports and this fraction of the base",
    )
    ap.add_argument(
        "--base-dir",
        default=os.path.join(Path.home(), ".cache", "infinity-bench-lora"),
        help="the model files and the swap files (one file system, a local NVMe)",
    )
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per contender run")
    ap.add_argument(
        "--kinds", default=None, help="comma-separated: run only these of the mode's contenders"
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        return _cgroup.serve_child(args.child, child)
    results = Path(os.environ.get("INFINITY_BENCH_RESULTS", ROOT / "bench" / "results"))
    results.mkdir(parents=True, exist_ok=True)
    name = (
        "lora-quick"
        if args.quick
        else "lora-capacity"
        if args.capacity
        else "lora-kernel"
        if args.kernel
        else "lora-quality"
        if args.quality
        else "lora-speed"
    )
    out_path = results / f"{name}.json"
    machine = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    if args.kernel:
        kernel(False, out_path)
        print(out_path)
        return 0
    if args.quality:
        quality(out_path)
        return 0
    notes: list[str] = []
    if args.quick:
        base_dir = Path(os.path.abspath("infinity_nvme_bench_lora"))
        shape, steps, seq, r, rounds = "tiny", 2, 16, 4, 1
        kinds, limits = ["peft", "infinity-bf16", "infinity-nf4", "deepspeed"], {}
    elif args.capacity:
        base_dir = Path(args.base_dir)
        shape, steps, seq, r, rounds = "7b", 3, 128, 16, 1
        limit = int(args.limit_gib * 2**30)
        kinds, limits = (
            ["infinity-nf4", "infinity-bf16"],
            {"infinity-nf4": limit, "infinity-bf16": limit},
        )
    else:
        base_dir = Path(args.base_dir)
        shape, steps, seq, r, rounds = "1b", 3, 256, 16, args.rounds
        kinds, limits = ["peft", "peft-fp32mm", "infinity-bf16", "deepspeed"], {}
    if args.kinds:
        asked = args.kinds.split(",")
        unknown = sorted(set(asked) - set(kinds))
        if unknown:
            ap.error(f"--kinds: {', '.join(unknown)} not among this mode's {', '.join(kinds)}")
        kinds = [k for k in kinds if k in asked]
    if "deepspeed" in kinds and importlib.util.find_spec("deepspeed") is None:
        kinds.remove("deepspeed")
        notes.append(
            "deepspeed: skipped, `deepspeed` is not importable here (it is never a dependency; "
            "bench/deepspeed_venv.sh makes an environment where it is)"
        )
        print(notes[-1], flush=True)
    base = base_dir / f"llama-{shape}"
    base_nbytes = write_base(base, shape)
    if args.speed:
        # A share of the base (a quarter unless --base-fraction) above what the process holds
        # before it builds anything (torch, transformers, peft and infinity imported: ~0.55 GB
        # with their files' pages, a quarter of a 1B bf16 base by itself), measured here in a
        # cgroup of its own after the caches are dropped.
        runtime = run_child({"kind": "runtime", "shape": shape}, 1 << 40, args.timeout, notes)
        runtime_nbytes = runtime.get("cgroup_peak_nbytes")
        if runtime_nbytes is None:
            ap.error(f"could not measure the runtime's memory in a cgroup: {runtime}")
        share = int(args.base_fraction * base_nbytes)
        limits = {"infinity-bf16": runtime_nbytes + share}
        notes.append(
            f"infinity-bf16's cgroup: {runtime_nbytes / 2**20:.0f} MiB for the imports (measured) "
            f"+ {share / 2**20:.0f} MiB ({args.base_fraction:g} of the base)"
        )
        print(notes[-1], flush=True)
    if limits and _cgroup.root() is None:
        notes.append("no memory cgroup could be made (needs root and a memory controller)")
    runs = []
    for rnd in range(rounds):
        for kind in kinds:
            spec = {
                "kind": kind,
                "shape": shape,
                "steps": steps,
                "seq": seq,
                "r": r,
                "base": str(base),
                "nvme": str(base_dir / "swap"),
                "small_box": bool(args.capacity),
                "limited": kind in limits,
                # Activation checkpointing for every contender outside --quick: a quarter of a 1B
                # base (the speed cgroup) cannot hold its activations at sequence 256, and it is
                # how QLoRA runs (peft.prepare_model_for_kbit_training turns it on), so PEFT in
                # RAM recomputes as much as infinity does.
                "checkpointing": not args.quick,
            }
            row = run_child(spec, limits.get(kind), args.timeout, notes)
            row["round"] = rnd
            row["limit_nbytes"] = limits.get(kind)
            runs.append(row)
            shown = {k: v for k, v in row.items() if k != "failed"}
            if "error" in row:
                shown["error"] = {k: v for k, v in row["error"].items() if k != "traceback_tail"}
            print(json.dumps(shown), flush=True)
    summary = {}
    ref_kind = next(k for k in ("peft", "peft-fp32mm", None) if k is None or k in kinds)
    ref = next((r_["losses"] for r_ in runs if r_["kind"] == ref_kind and "losses" in r_), None)
    for kind in kinds:
        done = [r_ for r_ in runs if r_["kind"] == kind and "step_s" in r_]
        errors = [r_["error"] for r_ in runs if r_["kind"] == kind and "error" in r_]
        if errors:  # the contender failed as its runs recorded (DeepSpeed's, see the docstring)
            summary[kind] = {"error": f"{errors[0]['phase']}: {errors[0]['exception']}"}
        if not done:
            continue
        steady = [min(r_["step_s"][1:] or r_["step_s"]) for r_ in done]
        row = {"step_s": min(steady), "peak_rss_nbytes": max(r_["peak_rss_nbytes"] for r_ in done)}
        if ref is not None and kind != ref_kind:
            row[f"max_rel_loss_diff_vs_{ref_kind}"] = max(
                abs(a - b) / abs(b) for a, b in zip(done[0]["losses"], ref, strict=True)
            )
        if done[0].get("read_nbytes_per_step"):
            row["read_nbytes_per_step"] = done[0]["read_nbytes_per_step"][-1]
            row["write_nbytes_per_step"] = done[0]["write_nbytes_per_step"][-1]
        if done[0].get("base_at_rest_nbytes"):  # infinity's own per-key counters
            least = 2 * done[0]["base_at_rest_nbytes"]  # the base read for the forward and backward
            row["base_read_nbytes_per_step"] = done[0]["base_read_nbytes_per_step"][-1]
            row["base_read_over_least"] = row["base_read_nbytes_per_step"] / least
            row["base_write_nbytes_per_step"] = done[0]["base_write_nbytes_per_step"][-1]
        summary[kind] = row
    for ref_name in ("peft", "peft-fp32mm"):
        if "step_s" in summary.get(ref_name, {}) and "step_s" in summary.get("infinity-bf16", {}):
            summary[f"step_time_ratio_bf16_vs_{ref_name}"] = (
                summary["infinity-bf16"]["step_s"] / summary[ref_name]["step_s"]
            )
    out = {
        "bench": "lora",
        "mode": name,
        "shape": shape,
        "base_nbytes": base_nbytes,
        "steps": steps,
        "seq": seq,
        "r": r,
        "machine": machine,
        "notes": notes,
        "summary": summary,
        "runs": runs,
    }
    out_path.write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))
    print(out_path)
    return 0 if all("failed" not in r_ for r_ in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
