"""InferenceEngine: forward and generate over a model whose weights stream from NVMe (ZeRO-Inference).

``infinity.initialize(model, config)`` builds one when nothing makes an
optimizer (none passed, no ``optimizer`` section, no ``lr=``) at
zero_optimization.stage 3. Its RuntimePlan has no optimizer (``trains=False``:
[Note: frozen units] in infinity/estimate/runtime_plan.py), so nothing but
the weights is allocated: the parameter store (shards on NVMe in the dtype
they were loaded in, or group-quantised: [Note: quantised shards] in
infinity/weights/quant.py), its pinned pool, and the stage-3 partitioner over a
prefetch scheduler. No gradient, master weight or optimizer state exists;
every forward runs under ``torch.no_grad()`` with the module in eval mode
(``engine.train()`` switches the module's mode, never grad); ``backward``,
``step`` and ``zero_grad`` refuse with a TypeError naming the missing
``optimizer`` section, as a training loop handed this engine by mistake
calls them).

[Note: one decode step, one trace step]
Hugging Face's ``generate`` calls the model once per new token (the prefill,
then one decode step per token), each a full pass over the same modules in
the same order. The engine makes each call of the root module one step of
the prefetch scheduler (hooks on the root module): the first forward the
engine runs records the order units are used in, and every later one —
prefill or decode, this generation or the next — replays it, reading the
units after the one in use ahead within stage3_prefetch_bucket_size, so the
reads of layer i+1.. overlap the compute of layer i. Within a generation a
step ends with ``end_step(keep_for_next=True)``: what the next decode step
starts with stays held and is read ahead for during the sampling in between
([Note: across the step boundary] in infinity/schedule/scheduler.py); when
``generate`` returns, that read-ahead is given back. A model that takes
another path (another branch, an encoder run once) switches between
remembered traces or diverges and re-records; nothing is ever served from
the wrong unit (traces name keys, not data).

The KV cache is Hugging Face's own, on the compute device: host memory on a
CPU device; on CUDA the engine asks ``generate`` for the offloaded cache
(host memory, each layer's part copied to the GPU when used) unless the call
names a cache. infinity.estimate counts it (estimate_inference).

Threading: one thread runs forwards (the prefetch scheduler's I/O threads
are its own).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import torch
from torch import nn

from infinity.config import ConfigError, InfinityConfig
from infinity.engine.build import Runtime, build_runtime
from infinity.estimate.runtime_plan import RuntimePlan
from infinity.inference.stats import InferenceStats, Mark
from infinity.schedule import PrefetchScheduler
from infinity.store.errors import NvmePathError
from infinity.zero.collectives import DataParallelGroup

log = logging.getLogger("infinity.inference")


class InferenceEngine:
    def __init__(
        self,
        model: nn.Module,
        config: InfinityConfig,
        *,
        group: DataParallelGroup | None = None,
        device: torch.device | None = None,
        plan: RuntimePlan | None = None,
    ):
        """``plan``: what to allocate (infinity.initialize passes the one its pre-flight check read; it
        must be made with ``trains=False``); by default plan_runtime's for this rank."""
        if config.zero_optimization.stage != 3:
            raise ConfigError(
                f"inference streams the weights from their shards, which needs zero_optimization.stage 3; "
                f"got stage {config.zero_optimization.stage}: set it to 3 (with offload_param.device nvme "
                "to keep the weights on NVMe)"
            )
        if plan is not None and plan.optimizer is not None:
            raise ValueError(
                "the runtime plan has optimizer state; plan inference with trains=False"
            )
        self.module = model
        self.config = config
        self.group = group or DataParallelGroup()
        self.device = device or torch.device("cpu")
        self._closed = False
        try:
            self.runtime: Runtime = build_runtime(
                model, config, None, group=self.group, device=self.device, plan=plan
            )
        except NvmePathError as e:  # nvme_path is a key of the config: refused like the others
            raise ConfigError(str(e)) from None
        source = self.runtime.shard_source
        if not isinstance(source, PrefetchScheduler):
            raise TypeError(
                f"the inference engine reads ahead with a PrefetchScheduler, not {type(source).__name__}"
            )
        self.scheduler: PrefetchScheduler = source
        if self.device.type == "cuda":
            for b in model.buffers():
                b.data = b.data.to(self.device)
        self._kinds: Counter = Counter()
        self._generating = False
        self._created = self._mark()
        self.last_generation: InferenceStats | None = None
        """What the last ``generate`` call read and how its steps replayed the trace."""
        # The root module's call is one trace step (see [Note: one decode step, one trace step]); the
        # pre-hook runs before the partitioner's, which gathers the root's own units.
        self._hooks = [
            model.register_forward_pre_hook(self._begin_step, prepend=True),
            model.register_forward_hook(self._end_step),
        ]
        model.eval()

    # -- one forward, one trace step ------------------------------------------------

    def _begin_step(self, module: nn.Module, args: Any) -> None:
        if not self.scheduler.step_open:
            self.scheduler.begin_step()

    def _end_step(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.scheduler.step_open:
            snap = self.scheduler.end_step(keep_for_next=self._generating)
            self._kinds[snap.kind] += 1

    def _abort(self) -> None:
        snap = (
            self.scheduler.abort_step()
        )  # with no step open: gives back what was read ahead for the next
        if snap is not None:
            self._kinds[snap.kind] += 1

    # -- the public surface ------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward under no_grad, its weights read ahead of use."""
        self._check_open()
        try:
            with torch.no_grad():
                return self.module(*args, **kwargs)
        except BaseException:
            self._abort()
            raise

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``module.generate(...)`` (a Hugging Face model's) under no_grad: every decode step replays the
        trace and reads ahead (see [Note: one decode step, one trace step]). ``last_generation`` then
        holds its statistics."""
        self._check_open()
        gen = getattr(self.module, "generate", None)
        if not callable(gen):
            raise TypeError(
                f"{type(self.module).__name__} has no generate(); engine.generate runs Hugging Face's "
                "GenerationMixin.generate (use engine(...) for a forward)"
            )
        if (
            self.device.type == "cuda"
            and "past_key_values" not in kwargs
            and "cache_implementation" not in kwargs
        ):
            kwargs["cache_implementation"] = "offloaded"  # the KV cache in host memory
        before = self._mark()
        self._generating = True
        try:
            with torch.no_grad():
                out = gen(*args, **kwargs)
        finally:
            self._generating = False
            self._abort()
        self.last_generation = self._mark().since(before, tokens=_new_tokens(out, args, kwargs))
        return out

    # -- what a training loop calls: refused, naming why there is no optimizer ----------------------

    def backward(self, loss: Any = None) -> None:
        raise TypeError(_does_not_train("backward"))

    def step(self) -> None:
        raise TypeError(_does_not_train("step"))

    def zero_grad(self) -> None:
        raise TypeError(_does_not_train("zero_grad"))

    def stats(self) -> InferenceStats:
        """Everything since the engine was built."""
        return self._mark().since(self._created)

    def io_stats(self) -> dict[str, float]:
        """Bytes the parameter store read and wrote so far, and the seconds callers waited for it."""
        store = self.runtime.param_store
        if store is None or store.closed:
            return {"read_nbytes": 0, "write_nbytes": 0, "wait_s": 0.0}
        st = store.stats()
        return {"read_nbytes": st.read.nbytes, "write_nbytes": st.write.nbytes, "wait_s": st.wait_s}

    def eval(self) -> InferenceEngine:
        self.module.eval()
        return self

    def train(self, mode: bool = True) -> InferenceEngine:
        """Sets the module's mode (dropout); forwards still run without grad."""
        self.module.train(mode)
        return self

    @property
    def num_parameters(self) -> int:
        return sum(u.layout.numel for u in self.runtime.unit_map.units)

    def close(self) -> None:
        """Removes the hooks, releases the buffers, deletes the swap files. The model's parameters are
        left empty (their data lived in the shards)."""
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        self.runtime.close()

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine is closed")

    def _mark(self) -> Mark:
        return Mark(
            Counter(self._kinds),
            self.scheduler.stats().total,
            self.io_stats()["read_nbytes"],
            time.perf_counter(),
        )


def _new_tokens(out: Any, args: tuple, kwargs: dict) -> int:
    """New tokens in a generate() result: (batch × length of the sequences) less the prompt's."""
    seqs = getattr(out, "sequences", out)
    prompt = kwargs.get("input_ids", args[0] if args else None)
    if (
        not isinstance(seqs, torch.Tensor)
        or not isinstance(prompt, torch.Tensor)
        or seqs.dim() != 2
    ):
        return 0
    if prompt.dim() == 1:
        prompt = prompt[None]
    return seqs.shape[0] * max(0, seqs.shape[1] - prompt.shape[1])


def _does_not_train(call: str) -> str:
    return (
        f"engine.{call}(): this is an InferenceEngine, which does not train: infinity.initialize builds it "
        "when nothing makes an optimizer at zero_optimization.stage 3 (no 'optimizer' section in the "
        "config, none passed, no lr=). To train, add an 'optimizer' section to the config (e.g. "
        '"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}), pass initialize(optimizer=...), or '
        "pass lr= for the HF Trainer's default AdamW"
    )
