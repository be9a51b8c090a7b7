"""Activation memory of any model, counted in one forward of it on fake tensors.

Where the architecture is not known (only infinity.models.GPT has fitted
coefficients, activations.py), the estimator runs the model's own forward
once with fake tensors for its parameters, buffers and inputs, at the real
micro-batch and sequence length (fake tensors cost no memory and no compute,
so nothing is scaled), and counts what autograd saves.

[Note: counting saved tensors]
A saved-tensor hook counts each saved tensor's storage once (views and
tensors saved twice share it); parameters and buffers are not activations
and are left out. The hooks are pushed at the root and again at every
module's forward, so they are the innermost everywhere, also inside a
non-reentrant checkpoint (whose own hooks would otherwise take the saves);
a module entered with grad disabled inside a forward that runs with grad is
inside a reentrant checkpoint (which runs its function under no_grad), and
grad is turned on for it. Each save is attributed to
- the checkpoint region it is made in: a module entered with grad disabled,
  or with saved-tensor hooks other than ours on top (a non-reentrant
  checkpoint, save_on_cpu);
- the layer it is made in: the children of the model's repeated stack (the
  largest ModuleList by parameters), the candidates for checkpointing.
A checkpointed unit is a layer with saves in regions (a layer that
checkpoints its own forward below its module hooks, as transformers'
GradientCheckpointingLayer does, opens a region per child), else a region
outside the layers. From these (SavedCount, exact):
- ``saved``: every save (no checkpointing);
- ``kept``: as the model checkpoints: the saves outside its units plus each
  unit's inputs (saved by a reentrant checkpoint, held by a non-reentrant
  one), the same for both torch modes;
and the estimate (traced_activations):
- ``saved``: every save, and the heap's margin;
- ``saved_checkpointed``: ``kept`` plus the largest unit's saves (its
  recomputation) and the heap's margin, which holds their gradients; for a
  model that checkpoints nothing, as if every layer were checkpointed: the
  layers' inputs, the saves outside layers, and the largest layer;
- ``working``: backward's transient at its start: 2.1 × the largest save
  outside the layers (the loss's upcast logits and their gradient) plus
  infinity GPT's working set of one layer, scaled to its saves;
the heap's margin is [Note: the CPU heap's margin].
Model inputs are made for the shapes the model takes: ``idx, targets`` for
infinity.models.GPT, ``input_ids`` and ``labels`` for a transformers model
whose main input is ``input_ids``; any other model needs ``inputs``.

[Note: mixture of experts]
A mixture-of-experts layer routes each token to its top-k experts by the
router's values, which fake tensors do not have. transformers' default
experts implementation (grouped_mm) computes every routed token in one
grouped matrix product whose shapes do not depend on the routing: the tokens
are sorted by expert, top_k × tokens rows in all, so what it saves is the
same for any routing and counted exactly (tests/estimate/test_traced.py
checks it against a real forward). Its meta kernel accepts bf16 alone (the
CUDA kernel's rule), so the trace gives the CPU kernel's shapes itself
(``_grouped_mm``). transformers' eager loop branches on the routing in Python
(which experts any token chose); a model set to it is counted as its
grouped_mm implementation computes it — the same tokens through the same
experts — and the estimate's source says so: the loop keeps a few more
copies of the routed tokens (5-7% of all saves on tiny Mixtral and
Qwen2-MoE shapes), inside the heap's margin. A forward that cannot run on
fake tensors otherwise is reported in one line (model_activations), never
with torch's traceback.

Threading: runs on the caller's thread; the model is not modified (its
parameters are swapped for fake tensors through torch.func.functional_call
for the one forward, and its hooks are removed after it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from infinity.estimate.activations import (
    SAVED_PER_BLOCK,
    THREAD_LOGITS,
    WORK_BTD,
    WORK_LOGITS_TENTHS,
    Activations,
    gpt_activations,
)
from infinity.estimate.model import ModelSpec, placeholder_shapes
from infinity.models import GPT
from infinity.zero.cpu_linear import linears_multiply_in_fp32

log = logging.getLogger("infinity.estimate")

# [Note: the CPU heap's margin]
# Measured, not mirrored: peak RSS on the CPU holds more than the live tensors, as glibc's heap keeps
# freed intermediates. Once torch frees its first multi-MiB tensor, glibc raises its mmap threshold to
# that size, so every activation up to it comes from the heap, and the heap's top only grows while
# backward frees saves out of order; which pages stay resident varies from run to run. Training
# transformers' GPT-2 and Llama through infinity.initialize (stage 2, fp32 and bf16, 4-8 layers,
# micro-batch 4 × 256 tokens, torch 2.13, tests/estimate/probe.py), the peak exceeded the saves by
# 0.5-1.2 × the layers' saves without checkpointing (the most with 8 narrow layers, whose 4 MiB
# activations all stay under the threshold; 1.19 × in 1 of 16 runs) and by at most one layer's
# transient (what it allocates beyond its saves) with checkpointing. The figures add the upper end
# with a margin: 1.25 × the layers' saves, or one layer's transient; the estimates came out never
# below the peak and 5-32% above it (the same run's peak varied by up to 15% between runs).
HEAP_MARGIN_QUARTERS = 5
"""The heap's margin without checkpointing, in quarters of the layers' saves ([Note: the CPU heap's margin])."""

Inputs = Callable[[int, int], tuple[tuple[Any, ...], dict[str, Any]]]
"""(micro_batch, seq) -> (args, kwargs) on the meta device: a model's forward arguments."""


@dataclasses.dataclass
class _Tally:
    """Saved storages by key, with where each was first saved."""

    nbytes: dict[int, int] = dataclasses.field(default_factory=dict)
    region: dict[int, int | None] = dataclasses.field(default_factory=dict)
    layer: dict[int, int | None] = dataclasses.field(default_factory=dict)
    layer_inputs: dict[int, dict[int, int]] = dataclasses.field(
        default_factory=dict
    )  # layer -> storage -> nbytes
    region_inputs: dict[int, dict[int, int]] = dataclasses.field(
        default_factory=dict
    )  # region -> storage -> nbytes
    regions: int = 0
    allocated: dict[int | None, int] = dataclasses.field(default_factory=dict)
    """Bytes of every new tensor made in each layer (None: outside layers), saved or not."""
    alive: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Every tensor seen, kept until the count is done: a storage freed during the trace (a reentrant
    checkpoint's inner graph) would otherwise give its key to a later one."""


@dataclasses.dataclass(frozen=True)
class SavedCount:
    """What one forward keeps for backward, in bytes, exactly as counted ([Note: counting saved tensors])."""

    saved: int
    """Every save (a storage once; parameters and buffers left out), checkpoint regions included."""
    kept: int
    """What stays from forward to backward as the model checkpoints: the saves outside its checkpoint
    regions and each region's inputs; ``saved`` when it checkpoints nothing."""
    largest_region: int
    """The saves of the largest checkpoint region (0 without checkpointing)."""
    layers: tuple[int, ...]
    """The saves made in each layer of the repeated stack."""
    layer_inputs: int
    """The layers' inputs not saved outside them: what checkpointing every layer keeps of them."""
    outside_layers: int
    """The saves made outside the layers (embeddings, the head, the loss)."""
    largest_outside: int
    """The largest save outside the layers (usually the loss's logits)."""
    transient: int
    """The most any one layer allocates beyond what it saves (freed intermediates)."""
    checkpoints: bool
    """The model checkpoints some of its forward (a reentrant or non-reentrant region)."""
    experts_switched: bool = False
    """Its mixture-of-experts layers, set to transformers' eager loop, were counted as its grouped_mm
    implementation computes them ([Note: mixture of experts])."""


PREFLIGHT_MAX_SEQ = 2048
"""The sequence length the pre-flight check counts at most when it takes it from a model's maximum
context (the GPT stand-in's default too): a long context is usually trained shorter."""


def model_activations(
    spec: ModelSpec,
    *,
    micro_batch: int,
    seq: int | None,
    dtype: torch.dtype,
    inputs: Inputs | None = None,
    device_type: str = "cpu",
) -> tuple[Activations | None, bool]:
    """(activations of one micro-batch, whether the model checkpoints) for the model an estimate is for.

    infinity GPT (a stand-in built from its shape, or the user's module) uses its measured coefficients;
    any other module is traced (any architecture). Whether the model checkpoints is traced for the
    user's module (as it is set up), none for a stand-in. ``seq``: the sequence length (default: the
    model's maximum context). (None, False) when the model's inputs or sequence length are not known,
    or its forward cannot run on fake tensors (a warning says why)."""
    seq = seq or max_context(spec.module)
    if seq is None:
        return None, False
    traced = None
    if spec.live:
        try:
            traced = traced_activations(
                spec.module,
                micro_batch=micro_batch,
                seq=seq,
                dtype=dtype,
                shapes=placeholder_shapes(spec.module),
                inputs=inputs,
            )
        except (
            Exception
        ) as e:  # a forward fake tensors cannot run (data-dependent Python control flow)
            log.warning(
                "activations of %s are not counted: its forward could not run on fake tensors (%s: %s); "
                "the estimate leaves them out",
                type(spec.module).__name__,
                type(e).__name__,
                e,
            )
    if (
        spec.gpt is not None
    ):  # infinity GPT's coefficients are measured; the trace says if it checkpoints
        itemsize = torch.empty(0, dtype=dtype).element_size()
        acts = gpt_activations(
            spec.gpt,
            micro_batch=micro_batch,
            seq=seq,
            itemsize=itemsize,
            fp32_linears=device_type == "cpu" and linears_multiply_in_fp32(dtype),
        )
        return acts, bool(traced and traced[1])
    return traced if traced is not None else (None, False)


def max_context(model: nn.Module) -> int | None:
    """The longest sequence the model takes (GPT's seq_len, a transformers config's positions)."""
    if isinstance(model, GPT):
        return model.cfg.seq_len
    config = getattr(model, "config", None)
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def default_inputs(model: nn.Module) -> Inputs | None:
    """The forward arguments of a model whose inputs are known (infinity GPT, transformers LMs)."""
    if isinstance(model, GPT):

        def gpt(b: int, t: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
            idx = torch.zeros(b, t, dtype=torch.long)
            return (idx, idx), {}

        return gpt
    config = getattr(model, "config", None)
    if getattr(model, "main_input_name", None) == "input_ids" and getattr(
        config, "vocab_size", None
    ):

        def hf(b: int, t: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
            ids = torch.zeros(b, t, dtype=torch.long)
            return (), {"input_ids": ids, "labels": ids}

        return hf
    return None


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The model's repeated stack: the children of its largest ModuleList (by parameters)."""
    best: list[nn.Module] = []
    best_n = -1
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 1:
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = list(mod), n
    return best


def count_saved(
    model: nn.Module,
    *,
    micro_batch: int,
    seq: int,
    dtype: torch.dtype,
    shapes: dict[nn.Parameter, torch.Size] | None = None,
    inputs: Inputs | None = None,
) -> SavedCount | None:
    """What one forward of ``model`` on a micro-batch keeps for backward, counted on fake tensors; None
    when the model's inputs are not known and ``inputs`` is not given, or its parameters are managed
    by a partitioner (its hooks would fetch). ``shapes``: true shapes of parameters left as
    placeholders (zero.Init); ``dtype``: the training dtype of floating-point parameters."""
    if micro_batch < 1 or seq < 1:
        raise ValueError(f"micro_batch and seq must be >= 1; got {micro_batch} and {seq}")
    make = inputs or default_inputs(model)
    if make is None or any(type(m._parameters) is not dict for m in model.modules()):
        return None
    with _countable_experts(model) as experts_switched:
        tally = _trace(model, make, micro_batch, seq, dtype, shapes or {})
    n_layers = len(layers_of(model))
    # A checkpointed unit is a layer where its saves are in a region (a layer may checkpoint its
    # forward below its own hooks, as transformers' GradientCheckpointingLayer does, so its children
    # open one region each), else the region.
    units: dict[tuple[str, int], int] = {}
    unit_inputs: dict[int, int] = {}
    by_layer = [0] * n_layers
    for key, nbytes in tally.nbytes.items():
        region, layer = tally.region[key], tally.layer[key]
        if region is not None:
            unit = ("layer", layer) if layer is not None else ("region", region)
            units[unit] = units.get(unit, 0) + nbytes
        if layer is not None:
            by_layer[layer] += nbytes
    for kind, index in units:
        unit_inputs.update(
            tally.layer_inputs.get(index, {}) if kind == "layer" else tally.region_inputs[index]
        )
    saved = sum(tally.nbytes.values())
    # A unit's inputs stay alive to its recomputation (a reentrant checkpoint saves them, a
    # non-reentrant one holds them): counted unless a save outside every region counted them already.
    inputs_inside = sum(
        n for k, n in unit_inputs.items() if k not in tally.nbytes or tally.region[k] is not None
    )
    kept = saved - sum(units.values()) + inputs_inside if units else saved
    all_layer_inputs = {
        k: n for per_layer in tally.layer_inputs.values() for k, n in per_layer.items()
    }
    outside = [n for k, n in tally.nbytes.items() if tally.layer[k] is None]
    return SavedCount(
        saved=saved,
        kept=kept,
        largest_region=max(units.values(), default=0),
        layers=tuple(by_layer),
        layer_inputs=sum(
            n
            for k, n in all_layer_inputs.items()
            if k not in tally.nbytes or tally.layer[k] is not None
        ),
        outside_layers=sum(outside),
        largest_outside=max(outside, default=0),
        transient=max(
            (tally.allocated.get(i, 0) - by_layer[i] for i in range(n_layers)), default=0
        ),
        checkpoints=bool(units),
        experts_switched=experts_switched,
    )


def traced_activations(
    model: nn.Module,
    *,
    micro_batch: int,
    seq: int,
    dtype: torch.dtype,
    shapes: dict[nn.Parameter, torch.Size] | None = None,
    inputs: Inputs | None = None,
) -> tuple[Activations, bool] | None:
    """(activations, whether the model checkpoints) for one micro-batch: count_saved's figures with
    the allocator's margins ([Note: counting saved tensors]); None where count_saved gives None."""
    count = count_saved(
        model, micro_batch=micro_batch, seq=seq, dtype=dtype, shapes=shapes, inputs=inputs
    )
    if count is None:
        return None
    largest_layer = max(count.layers, default=0)
    # [Note: the CPU heap's margin]: 1.25 × the layers' saves without checkpointing, one layer's
    # transient with it (which also holds the recomputed unit's gradients).
    if count.checkpoints:
        saved_checkpointed = (
            count.kept + count.largest_region + max(count.transient, count.largest_region)
        )
    else:
        saved_checkpointed = (
            count.outside_layers
            + count.layer_inputs
            + largest_layer
            + max(count.transient, largest_layer)
        )
    itemsize = _itemsize(dtype)
    working = (
        WORK_LOGITS_TENTHS * count.largest_outside // 10
        + WORK_BTD * largest_layer * 4 // itemsize // SAVED_PER_BLOCK
    )
    return Activations(
        micro_batch=micro_batch,
        seq=seq,
        saved=count.saved + HEAP_MARGIN_QUARTERS * sum(count.layers) // 4,
        saved_checkpointed=saved_checkpointed,
        working=working,
        thread=THREAD_LOGITS * count.largest_outside,
        source=f"counted in one forward of {type(model).__name__}"
        + (
            " (its experts as transformers' grouped_mm computes them: the eager loop it is set to"
            " keeps a few more copies of the routed tokens)"
            if count.experts_switched
            else ""
        ),
    ), count.checkpoints


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _meta_state(
    model: nn.Module, dtype: torch.dtype, shapes: dict[nn.Parameter, torch.Size]
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, p in model.named_parameters():  # a tied parameter once: functional_call ties the rest
        shape = shapes.get(p, p.shape)
        pdt = dtype if p.is_floating_point() else p.dtype
        state[name] = torch.empty(shape, dtype=pdt, requires_grad=p.requires_grad)
    for name, b in model.named_buffers():
        state[name] = torch.empty(b.shape, dtype=b.dtype)
    return state


def _trace(
    model: nn.Module,
    make: Inputs,
    b: int,
    t: int,
    dtype: torch.dtype,
    shapes: dict[nn.Parameter, torch.Size],
) -> _Tally:
    with _quiet_fake_tensors(), FakeTensorMode(allow_non_fake_inputs=True):
        return _trace_fake(model, make, b, t, dtype, shapes)


@contextlib.contextmanager
def _quiet_fake_tensors() -> Iterator[None]:
    """torch logs a traceback at ERROR for every operator whose meta kernel fails under fake tensors,
    before raising it; the estimate reports such a failure itself, in one line (model_activations)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _countable_experts(model: nn.Module) -> Iterator[bool]:
    """A transformers model set to its eager experts loop, switched to grouped_mm for the trace and
    back ([Note: mixture of experts]); yields whether it was."""
    current = getattr(getattr(model, "config", None), "_experts_implementation", None)
    switch = getattr(model, "set_experts_implementation", None)
    if current != "eager" or switch is None:
        yield False
        return
    try:
        switch("grouped_mm")
    except ValueError:  # transformers' answer for a model without experts (eager is its default)
        yield False
        return
    try:
        yield True
    finally:
        switch(current)


def _grouped_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """aten._grouped_mm's result under fake tensors: its meta kernel accepts bf16 alone (CUDA's
    rule), where the CPU kernel, which transformers' mixture-of-experts layers call in any precision,
    computes every one ([Note: mixture of experts]). The shapes are the meta kernel's."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        assert offs is not None  # the groups of a 2-D × 2-D product are its offsets
        shape = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif mat_a.dim() == 2:
        shape = [mat_a.size(0), mat_b.size(-1)]
    elif mat_b.dim() == 2:
        shape = [mat_a.size(1), mat_b.size(1)]
    else:
        shape = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


def _trace_fake(
    model: nn.Module,
    make: Inputs,
    b: int,
    t: int,
    dtype: torch.dtype,
    shapes: dict[nn.Parameter, torch.Size],
) -> _Tally:
    state = _meta_state(model, dtype, shapes)
    excluded = {v.untyped_storage()._cdata for v in state.values()}
    tally = _Tally()
    layer_index = {id(m): i for i, m in enumerate(layers_of(model))}
    stack: list[dict[str, Any]] = []  # per running module: its hooks, region, layer, grad mode

    def pack(x: torch.Tensor) -> torch.Tensor:
        tally.alive.append(x)
        key = x.untyped_storage()._cdata
        if key not in excluded and key not in tally.nbytes:
            top = stack[-1] if stack else {"region": None, "layer": None}
            tally.nbytes[key] = x.untyped_storage().nbytes()
            tally.region[key] = top["region"]
            tally.layer[key] = top["layer"]
        return x

    def unpack(x: torch.Tensor) -> torch.Tensor:
        return x

    def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
        parent = stack[-1] if stack else {"region": None, "layer": None}
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        foreign = top is not None and top[0] is not pack
        region = parent["region"]
        grad_was = torch.is_grad_enabled()
        if region is None and (foreign or not grad_was):
            tally.regions += 1
            region = tally.regions
            tally.region_inputs[region] = {}
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, torch.Tensor):
                    tally.alive.append(a)
                    tally.region_inputs[region][a.untyped_storage()._cdata] = (
                        a.untyped_storage().nbytes()
                    )
        layer = layer_index.get(id(module), parent["layer"])
        if id(module) in layer_index:
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    tally.alive.append(a)
                    key = a.untyped_storage()._cdata
                    tally.layer_inputs.setdefault(layer_index[id(module)], {})[key] = (
                        a.untyped_storage().nbytes()
                    )
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        torch.set_grad_enabled(True)
        stack.append(
            {"region": region, "layer": layer, "hooks": hooks, "grad": grad_was, "module": module}
        )

    def post(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        while stack:
            frame = stack.pop()
            torch.set_grad_enabled(frame["grad"])
            frame["hooks"].__exit__(None, None, None)
            if frame["module"] is module:
                break

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func is torch.ops.aten._grouped_mm.default:
                out = _grouped_mm(*args, **(kwargs or {}))
            else:
                out = func(*args, **(kwargs or {}))
            layer = stack[-1]["layer"] if stack else None
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor) and o._base is None:
                    tally.allocated[layer] = (
                        tally.allocated.get(layer, 0) + o.untyped_storage().nbytes()
                    )
            return out

    handles = []
    for mod in model.modules():
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True, always_call=True))
    args, kwargs = make(b, t)
    try:
        with (
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(pack, unpack),
            Allocations(),
        ):
            torch.func.functional_call(model, state, args, kwargs, tie_weights=True, strict=False)
    finally:
        for h in handles:
            h.remove()
        while stack:
            frame = stack.pop()
            torch.set_grad_enabled(frame["grad"])
            frame["hooks"].__exit__(None, None, None)
    return tally
