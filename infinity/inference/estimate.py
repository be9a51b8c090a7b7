"""estimate_inference: what streamed inference allocates per rank — weights, KV cache, activations — and the largest batch that fits.

The weights' part is the RuntimePlan the inference engine allocates
(``plan_runtime(..., trains=False)``: no optimizer plan, [Note: frozen units]),
itemised by infinity.estimate's Itemiser as for training: the parameter store's pool,
shards kept in host memory, swap files (packed when quantised), what is
gathered or dequantised. What generation adds is counted here from the
decoder's shape (DecoderShape: an HF config, infinity's GPTConfig):
- the KV cache: 2 (keys, values) × layers × batch × (prompt + new tokens) ×
  KV heads × head dim × itemsize, in host memory (Hugging Face's cache on a
  CPU device; the offloaded cache on CUDA, see infinity/inference/engine.py),
  plus one layer's worth again while a step grows it (torch.cat makes the
  longer tensor before freeing the shorter);
- the prefill's working memory, the largest forward (see [Note: inference
  activations]).
``preflight_inference`` is the check infinity.initialize runs before it
builds an inference engine: the weights' part only (batch and lengths are
not known until generate).

[Note: inference activations]
Measured, not mirrored (CPU, torch 2.13, transformers 5.23, GPT-2 / Llama /
OPT shapes, bf16 and fp32, eager and sdpa attention; tests/inference/
test_estimate.py checks the KV cache item against the cache generate makes
and the swap files against the engine's, not yet the whole estimate against
a run's peak RSS): a forward over B × P tokens holds at most ~12 fp32 values per token per hidden
unit (the residual stream, the normed input, q/k/v, the attention output,
kernels' fp32 upcasts) plus 3 per token per MLP unit (gate, up and their
product), the attention scores of one layer (B × heads × P × P fp32, the
math path's), and the last position's logits twice (the model's and
generate's fp32 copy for the logits processors).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from infinity.config import ConfigError, InfinityConfig
from infinity.estimate import (
    Breakdown,
    Fit,
    Item,
    Itemiser,
    MachineView,
    ModelSpec,
    PreflightError,
    RuntimePlan,
    ZeroSetting,
    check_fit,
    describe_model,
    estimate_config,
    items_table,
    machine_view,
    nvme_path_value,
    partitioner_working_set,
    plan_runtime,
    ranks_on_this_node,
    runtime_baseline_nbytes,
    warn_preflight_skipped,
)
from infinity.memory import format_nbytes
from infinity.models import GPTConfig
from infinity.zero import init as zero_init_mod
from infinity.zero.collectives import DataParallelGroup

HIDDEN_FP32_PER_TOKEN = 12
MLP_FP32_PER_TOKEN = 3
LOGITS_COPIES = 2


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """What sizes a decoder's KV cache and activations."""

    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int

    def kv_nbytes(self, batch: int, seq: int, nbytes_per_value: int) -> int:
        """Keys and values of every layer for ``batch`` sequences of ``seq`` positions."""
        return 2 * self.n_layer * batch * seq * self.n_kv_head * self.head_dim * nbytes_per_value

    def prefill_nbytes(self, batch: int, prompt: int, logits_nbytes_per_value: int = 4) -> int:
        """The largest forward's working memory (see [Note: inference activations])."""
        bt = batch * prompt
        hidden = (
            4 * bt * (HIDDEN_FP32_PER_TOKEN * self.hidden + MLP_FP32_PER_TOKEN * self.intermediate)
        )
        scores = 4 * batch * self.n_head * prompt * prompt
        logits = LOGITS_COPIES * batch * self.vocab * max(4, logits_nbytes_per_value)
        return hidden + scores + logits


def decoder_shape(model: Any) -> DecoderShape | None:
    """The shape of a decoder from an HF model or config (GPT-2, Llama, OPT, ... names), infinity's GPT or
    GPTConfig; None when it cannot be read."""
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None) or model
    if isinstance(cfg, GPTConfig):
        return DecoderShape(
            cfg.n_layer,
            cfg.n_head,
            cfg.n_head,
            cfg.d_model // cfg.n_head,
            cfg.d_model,
            4 * cfg.d_model,
            cfg.vocab_size,
        )
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()

    def first(*names: str) -> Any:
        for n in names:
            v = getattr(cfg, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return None

    layers = first("num_hidden_layers", "n_layer", "num_layers")
    heads = first("num_attention_heads", "n_head")
    hidden = first("hidden_size", "n_embd", "d_model")
    vocab = first("vocab_size")
    if None in (layers, heads, hidden, vocab):
        return None
    kv = first("num_key_value_heads") or heads
    head_dim = first("head_dim") or hidden // heads
    inter = first("intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    return DecoderShape(layers, heads, kv, head_dim, hidden, inter, vocab)


@dataclasses.dataclass(frozen=True)
class InferenceEstimate:
    """What ``estimate_inference`` returns; ``table()`` renders it, ``to_dict()`` serialises it."""

    model: str
    num_params: int
    dtype: str
    device_type: str
    batch: int
    prompt: int
    gen: int
    shape: DecoderShape | None
    breakdown: Breakdown
    fit: Fit | None
    machine: MachineView | None
    largest_batch: int | None
    """The largest batch whose breakdown fits this machine (None: no machine view, or not even batch 1)."""

    def table(self) -> str:
        cpu = self.device_type == "cpu"
        p = self.breakdown
        q = p.runtime.formats[0].spec if p.runtime is not None and p.runtime.formats else None
        weights = (
            f"nf4 (groups of {q.group_size}, "
            + ("absmax double-quantised)" if q.double_quant else "fp32 absmax)")
            if q and q.quant_type == "nf4"
            else f"int{q.num_bits} (groups of {q.group_size}, {'symmetric' if q.symmetric else 'min/max'})"
            if q
            else self.dtype
        )
        lines = [
            f"model      {self.model}: {self.num_params:,} parameters, weights at rest in {weights}",
            f"generate   batch {self.batch} × (prompt {self.prompt} + {self.gen} new tokens); compute device "
            + ("cpu (shares host memory)" if cpu else "cuda"),
            "",
            f"{'stage 3, weights streamed from NVMe'}, per rank:",
        ]
        lines += ["  " + ln for ln in items_table(p)]
        mem = (
            f"RAM {format_nbytes(p.ram_nbytes)}"
            if cpu
            else (f"GPU {format_nbytes(p.device_nbytes)}, host {format_nbytes(p.host_nbytes)}")
        )
        lines.append(
            f"  peak: {mem}, NVMe {format_nbytes(p.nvme_nbytes)} (init: as built + stores; "
            "train: generation — weights streamed, KV cache, working memory)"
        )
        if self.fit is not None:
            lines.append("")
            lines.append("fits this machine" if self.fit.ok else "does not fit this machine:")
            lines += ["  " + r for r in self.fit.reasons]
        if self.machine is not None:
            if self.largest_batch is None:
                lines.append("largest batch that fits: none (not even batch 1)")
            else:
                lines.append(
                    f"largest batch that fits: {self.largest_batch} (prompt {self.prompt} + {self.gen})"
                )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        p = self.breakdown
        return {
            "model": self.model,
            "num_params": self.num_params,
            "dtype": self.dtype,
            "device_type": self.device_type,
            "batch": self.batch,
            "prompt": self.prompt,
            "gen": self.gen,
            "shape": dataclasses.asdict(self.shape) if self.shape else None,
            "ram_nbytes": p.ram_nbytes,
            "host_nbytes": p.host_nbytes,
            "device_nbytes": p.device_nbytes,
            "nvme_nbytes": p.nvme_nbytes,
            "nvme_by_path": dict(p.nvme_by_path),
            "items": [dataclasses.asdict(i) for i in p.items],
            "problems": [dataclasses.asdict(x) for x in p.problems],
            "fit": dataclasses.asdict(self.fit) if self.fit else None,
            "largest_batch": self.largest_batch,
        }


class _InferenceItemiser(Itemiser):
    """infinity.estimate's itemisation of the weights, plus what generation adds."""

    def gathered(self) -> None:
        """Quantised weights are dequantised into buffers of their dtype (the partitioner's working set
        at once, and the TensorCache keeps some for reuse); on a CPU device at world size 1 plain weights
        are computed on in the pool itself."""
        if self.rt.formats is None or self.cuda or self.world > 1:
            return  # on CUDA / several ranks _scheduler counts the gathered units
        working = partitioner_working_set(self.spec.module, self.unit_map, full=True)
        self.add(
            Item(
                f"dequantised weights ({self.dname})",
                "device",
                working + self.rt.tensor_cache_cap_nbytes,
                "train",
                "the units in use, dequantised after each read (infinity/weights/quant.py), and the "
                "buffers the TensorCache keeps for reuse",
                heap=True,
            )
        )
        largest = max((u.layout.padded_numel for u in self.units), default=0)
        self.add(
            Item(
                "quantisation transient",
                "host",
                largest * 9,
                "init",
                "build.py: one unit's values in fp32 while its codes are computed",
                heap=True,
            )
        )

    def generation(self, shape: DecoderShape | None, batch: int, prompt: int, gen: int) -> None:
        if shape is None or batch == 0:
            return
        b = self.b
        kv = shape.kv_nbytes(batch, prompt + gen, b)
        self.add(
            Item(
                "KV cache",
                "host",
                kv,
                "train",
                f"2 × {shape.n_layer} layers × batch {batch} × {prompt + gen} positions × {shape.n_kv_head} "
                f"KV heads × {shape.head_dim} × {b} B (Hugging Face's cache, host memory)",
                heap=True,
            )
        )
        self.add(
            Item(
                "KV cache growth",
                "host",
                kv // max(1, shape.n_layer),
                "train",
                "one layer's cache again while a decode step makes it one position longer",
                heap=True,
            )
        )
        self.add(
            Item(
                "prefill working memory",
                "device",
                shape.prefill_nbytes(batch, prompt, b),
                "train",
                f"batch {batch} × prompt {prompt}: hidden states, attention scores, last logits "
                "(measured coefficients, see [Note: inference activations])",
                heap=True,
            )
        )


def itemise_inference(
    spec: ModelSpec,
    cfg: InfinityConfig,
    *,
    shape: DecoderShape | None,
    batch: int,
    prompt: int,
    gen: int,
    world_size: int,
    device_type: str,
    baseline_nbytes: int,
    zero_init: bool,
    runtime: RuntimePlan | None = None,
) -> Breakdown:
    """The items of an inference run of ``batch`` × (``prompt`` + ``gen``) under ``cfg`` (stage 3)."""
    runtime = runtime or plan_runtime(spec.module, cfg, world_size=world_size, trains=False)
    p = _InferenceItemiser(spec, cfg, runtime, device_type)
    p.add(
        Item(
            "process baseline",
            "host",
            baseline_nbytes,
            "run",
            "torch and infinity imported" + (", the CUDA context" if p.cuda else ""),
        )
    )
    p.model_as_built(zero_init)
    p.parameter_store()
    p.gathered()
    p.add(
        Item(
            "initialisation transient",
            "host",
            runtime.staging_numel * (4 + p.b),
            "init",
            "build.py _full_values: one unit's flat fp32 values and its converted shard",
            heap=True,
        )
    )
    p.generation(shape, batch, prompt, gen)
    p.overheads()
    zero = cfg.zero_optimization
    return Breakdown(
        setting=ZeroSetting(3, zero.offload_param.device, "none"),
        dtype=p.dname,
        items=tuple(p.items),
        problems=tuple(p.problems),
        device_type=device_type,
        nvme_by_path=tuple(p.nvme_paths.items()),
        nvme_traffic_nbytes=sum(runtime.at_rest_nbytes(u) for u in runtime.nvme_units()),
        runtime=runtime,
    )  # a forward reads every shard on NVMe once, writes nothing


def inference_config(
    config: Any,
    *,
    world_size: int,
    precision: str | None,
    nvme_path: str | os.PathLike | Sequence[str | os.PathLike] | None,
) -> InfinityConfig:
    """The config an estimate is for: the user's (which must be stage 3), else stage 3 with the weights on
    NVMe at ``nvme_path``, none kept in host memory (max_in_cpu 0: streamed, not DeepSpeed's default of
    keeping up to 1e9 elements) and DeepSpeed's default sizes otherwise."""
    if config is None:
        config = {
            "zero_optimization": {
                "stage": 3,
                "offload_param": {
                    "device": "nvme",
                    "max_in_cpu": 0,
                    "nvme_path": nvme_path_value(nvme_path),
                },
            }
        }
    cfg = estimate_config(config, world_size, precision, None)
    if cfg.zero_optimization.stage != 3:
        raise ConfigError(
            f"inference streams weights at zero_optimization.stage 3; the config has stage "
            f"{cfg.zero_optimization.stage}"
        )
    return cfg


@dataclasses.dataclass(frozen=True)
class GenerationSize:
    """What generate is asked to make: ``batch`` sequences of ``prompt`` tokens, each grown by ``gen``
    new tokens."""

    batch: int = 1
    prompt: int = 128
    gen: int = 16

    def __post_init__(self) -> None:
        for name, v in (("batch", self.batch), ("prompt", self.prompt), ("gen", self.gen)):
            if v < (0 if name != "prompt" else 1):
                raise ValueError(
                    f"{name} must be {'>= 1' if name == 'prompt' else '>= 0'}; got {v}"
                )


@dataclasses.dataclass(frozen=True)
class InferenceOptions:
    """What an inference estimate is asked (see estimate_inference for each option's meaning)."""

    config: Any = None
    """A DeepSpeed-style config at stage 3 (path, dict or InfinityConfig)."""
    size: GenerationSize = GenerationSize()
    model_config: GPTConfig | None = None
    """The shape of a parameter count's GPT stand-in."""
    precision: str | None = None
    nvme_path: str | os.PathLike | Sequence[str | os.PathLike] | None = None
    device: str = "auto"
    world_size: int = 1
    zero_init: bool | None = None
    baseline_nbytes: int | None = None
    machine: MachineView | bool = True
    max_batch: int = 1 << 16

    @classmethod
    def from_keywords(cls, **keywords: Any) -> InferenceOptions:
        """The options from estimate_inference's keywords: ``batch``, ``prompt`` and ``gen`` (the
        GenerationSize), and every other field by its name."""
        size = {k: keywords.pop(k) for k in ("batch", "prompt", "gen") if k in keywords}
        names = [f.name for f in dataclasses.fields(cls) if f.name != "size"]
        unknown = sorted(set(keywords) - set(names))
        if unknown:
            raise TypeError(
                f"estimate_inference got unknown keyword(s) {', '.join(unknown)}; it takes "
                f"{', '.join(['batch', 'prompt', 'gen', *names])}"
            )
        return cls(size=GenerationSize(**size), **keywords)


def estimate_inference(
    model_or_param_count: nn.Module | int | float | GPTConfig,
    options: InferenceOptions | None = None,
    /,
    **keywords: Any,
) -> InferenceEstimate:
    """Per-rank bytes of generating ``batch`` × (``prompt`` + ``gen``) tokens with the weights streamed from
    NVMe, checked against this machine, and the largest batch that fits (up to ``max_batch``).

    ``model_or_param_count``: an nn.Module (an HF model, on the meta device or built; not modified), a
    GPTConfig, or a parameter count (a GPT-shaped stand-in of that size, shaped by ``model_config``
    when given). The options: an InferenceOptions, or these keywords (not both): ``config``: a
    DeepSpeed-style config at stage 3 (default: the weights on NVMe at ``nvme_path``, DeepSpeed's
    sizes). ``batch``, ``prompt``, ``gen``: the GenerationSize (default 1, 128, 16).
    ``precision``: the weights' dtype (default: the config's, else the model's as loaded; bf16 for a
    count). ``device``: "auto" (CUDA when available), "cpu" or "cuda". ``world_size``: the ranks
    sharing the weights. ``zero_init``: the model is built under infinity.zero.Init (default:
    detected for a module, assumed for a count). ``baseline_nbytes``: the process baseline (default:
    measured in this process, less the model). ``machine``: True to read this machine, a
    MachineView, or False for no fit check. ``max_batch``: the largest batch tried.
    """
    if options is not None and keywords:
        raise TypeError("estimate_inference takes an InferenceOptions or keywords, not both")
    return _estimate(model_or_param_count, options or InferenceOptions.from_keywords(**keywords))


def _estimate(
    model_or_param_count: nn.Module | int | float | GPTConfig, opts: InferenceOptions
) -> InferenceEstimate:
    config, model_config, precision = opts.config, opts.model_config, opts.precision
    device, world_size, zero_init = opts.device, opts.world_size, opts.zero_init
    baseline_nbytes, machine = opts.baseline_nbytes, opts.machine
    batch, prompt, gen = opts.size.batch, opts.size.prompt, opts.size.gen
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = describe_model(model_or_param_count, model_config=model_config)
    if precision is None and not isinstance(model_or_param_count, nn.Module) and config is None:
        precision = "bf16"
    cfg = inference_config(
        config, world_size=world_size, precision=precision, nvme_path=opts.nvme_path
    )
    shape = decoder_shape(spec.gpt if spec.gpt is not None else model_or_param_count)
    if zero_init is None:  # [Note: a model on the meta device] in infinity/estimate/model.py
        zero_init = spec.built_under_zero_init()
    if baseline_nbytes is None:
        baseline_nbytes = max(0, runtime_baseline_nbytes() - spec.built_nbytes)
    runtime = plan_runtime(spec.module, cfg, world_size=world_size, trains=False)

    def itemise(b: int) -> Breakdown:
        return itemise_inference(
            spec,
            cfg,
            shape=shape,
            batch=b,
            prompt=prompt,
            gen=gen,
            world_size=world_size,
            device_type=device,
            baseline_nbytes=baseline_nbytes,
            zero_init=zero_init,
            runtime=runtime,
        )

    own = itemise(batch)
    view = (
        machine_view(path for path, _ in own.nvme_by_path) if machine is True else machine or None
    )
    fit = check_fit(own, view, ranks_per_node=1) if view is not None else None
    largest = None
    if view is not None and shape is not None:
        largest = _largest_batch(
            lambda b: check_fit(itemise(b), view, ranks_per_node=1).ok, opts.max_batch
        )
    return InferenceEstimate(
        model=spec.description,
        num_params=spec.num_params,
        dtype=str(runtime.dtype).removeprefix("torch."),
        device_type=device,
        batch=batch,
        prompt=prompt,
        gen=gen,
        shape=shape,
        breakdown=own,
        fit=fit,
        machine=view,
        largest_batch=largest,
    )


def _largest_batch(fits, limit: int) -> int | None:
    """The largest b in [1, limit] with fits(b) (fits is monotone: a larger batch needs more memory)."""
    if not fits(1):
        return None
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def preflight_inference(
    model: nn.Module,
    cfg: InfinityConfig,
    *,
    device: torch.device | str = "cpu",
    group: DataParallelGroup | None = None,
    runtime: RuntimePlan | None = None,
    machine: MachineView | None = None,
) -> Breakdown | None:
    """Before the inference engine allocates: do its weights' stores fit this machine (generation's KV
    cache and activations come later, with the batch)? Raises PreflightError with the itemised breakdown."""
    if not cfg.preflight:
        warn_preflight_skipped()
        return None
    group = group or DataParallelGroup()
    device_type = "cuda" if torch.device(device).type == "cuda" else "cpu"
    spec = describe_model(model)
    held = runtime_baseline_nbytes()
    zinit = zero_init_mod.init_store_of(list(model.parameters())) is not None
    own = itemise_inference(
        spec,
        cfg,
        shape=None,
        batch=0,
        prompt=1,
        gen=0,
        world_size=group.world_size,
        device_type=device_type,
        baseline_nbytes=max(0, held - spec.built_nbytes),
        zero_init=zinit,
        runtime=runtime,
    )
    ranks = ranks_on_this_node()
    view = machine or machine_view(path for path, _ in own.nvme_by_path)
    fit = check_fit(own, view, ranks_per_node=ranks, held_nbytes=held * ranks, engine_checks=True)
    failed = torch.tensor([0 if fit.ok else 1], dtype=torch.int32)
    group.all_reduce_max(failed)
    if fit.ok and not int(failed):
        return own
    lines = [
        "infinity.initialize: the inference engine's weights do not fit (pre-flight check; nothing has been "
        "allocated):"
    ]
    lines += ["  " + r for r in fit.reasons] or [
        f"  another rank's check failed; rank {group.rank} stops too"
    ]
    lines.append(
        "It would allocate per rank (the KV cache and activations come on top, with the batch):"
    )
    lines += ["  " + ln for ln in items_table(own)]
    lines.append(
        "Fix: lower zero_optimization.offload_param.buffer_count or buffer_size (the parameter pool), "
        'keep the weights on NVMe (offload_param.device "nvme", max_in_cpu 0), quantise them '
        '("weight_quantization"), or skip this check with "preflight": false'
    )
    raise PreflightError("\n".join(lines), own, fit.reasons)
