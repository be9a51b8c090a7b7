"""GradReducer: from autograd's per-parameter grads to this rank's fp32 gradient shard of each unit.

Stages 2 and 3 reduce as backward goes: a parameter's grad is taken in its
post-accumulate hook, placed in its unit's flat buffer, and once the unit's
last grad has arrived the buffer is reduce-scattered (mean over ranks) and
added into the unit's gradient shard, which lives with the optimizer state
(host memory or NVMe) — so no full-model gradient ever exists. Stages 0 and 1
accumulate each unit's full gradient locally, in fp32 (as DeepSpeed's bf16 and
fp16 modes do; 16-bit ``p.grad`` accumulation would round), across the
micro-batches of a window and reduce once at its end (all-reduce for 0,
reduce-scatter for 1).

[Note: the accumulation window]
A window is every backward() between two updates (DeepSpeed's
gradient_accumulation_steps micro-batches, or any number of backward() calls
before one step(), as torch accumulates them into ``.grad``). It is opened by
its first contribution and closed only by ``end_window`` (the optimizer took
the gradient, or the engine dropped it): so a second backward before a step
adds to the first instead of starting over, and a step with no backward
finds no parameter flagged, rather than the previous window's flags. A
backward that raises (``abort_micro``) keeps what it had already added, as
torch's ``.grad`` keeps it, and never touches what earlier backwards added.

The shards are reached through a GradSink (implemented by the optimizer):
``open(unit, first=)`` returns the fp32 shard (zeroed when ``first``: the
unit's first contribution in this accumulation window) and ``close(unit,
final=)`` says the writing is done (``final``: nothing more comes in this
window, so the optimizer may take its norm now, while it is in memory).

The reducer also records which parameters received a gradient in the window:
torch's optimizers skip a parameter whose grad is None (no decay, no moment
update, no step count), and so must we to give the same numbers.
"""

from __future__ import annotations

from typing import Protocol

import torch

from infinity.zero.buffers import TensorCache
from infinity.zero.collectives import DataParallelGroup
from infinity.zero.unit import ParamUnit


class GradSink(Protocol):
    def open(self, unit_index: int, *, first: bool) -> torch.Tensor: ...

    def close(self, unit_index: int, *, final: bool) -> None: ...


class GradReducer:
    def __init__(
        self,
        units: list[ParamUnit],
        group: DataParallelGroup,
        sink: GradSink,
        *,
        stage: int,
        cache: TensorCache,
    ):
        self.units = units
        self.group = group
        self.sink = sink
        self.stage = stage
        self.cache = cache
        # Stage 0 keeps the whole optimizer state on every rank: its "shard" is the unit.
        self.shard_world = 1 if stage == 0 else group.world_size
        self.shard_rank = 0 if stage == 0 else group.rank
        self.deferred = stage < 2  # reduce once per window, from local fp32 accumulators
        self._local: dict[
            int, torch.Tensor
        ] = {}  # unit -> full fp32 grads of the window (stages 0, 1)
        self._flat: dict[
            int, torch.Tensor
        ] = {}  # unit -> flat fp32 grads of this micro-batch (W > 1)
        self._open: dict[int, torch.Tensor] = {}  # unit -> opened shard (W == 1)
        self._touched: set[int] = set()  # units with a contribution in this window
        self._has_grad = [torch.zeros(len(u.params), dtype=torch.bool) for u in units]
        self._flags_before: list[torch.Tensor] | None = (
            None  # _has_grad as this backward found it (W > 1)
        )
        self._last_micro = True

    # -- window bookkeeping ([Note: the accumulation window]) -----------------

    def begin_micro(self, *, last: bool) -> None:
        """A backward starts. ``last``: it is the window's last micro-batch (the gradient is then
        complete, so the optimizer may take its norm as shards close)."""
        self._last_micro = last
        if not self.deferred and self.shard_world > 1:
            self._flags_before = [f.clone() for f in self._has_grad]

    def end_window(self) -> None:
        """The window's gradient was taken by the optimizer, or dropped: the next contribution
        starts a new window (each shard's first one overwrites it)."""
        self._touched.clear()
        for f in self._has_grad:
            f.zero_()
        for local in self._local.values():
            self.cache.put(local)
        self._local.clear()

    def abort_micro(self) -> bool:
        """The backward raised. What it added to the gradient stays (a parameter's grad is added
        whole or not at all, as into torch's ``.grad``): shards it had opened are closed. With
        more than one rank, the units whose grads it had not yet reduce-scattered are dropped
        (reducing them is a collective the other ranks may not join), and their flags go back to
        what the backward found. Returns whether it dropped any."""
        for index in list(self._open):
            del self._open[index]
            self.sink.close(index, final=self._last_micro)
        before = self._flags_before
        for index, flat in self._flat.items():
            if before is not None:
                self._has_grad[index].copy_(before[index])
            self.cache.put(flat)
        dropped = bool(self._flat)
        self._flat.clear()
        self._flags_before = None
        return dropped

    def window_has_grad(self) -> list[torch.Tensor]:
        """Per unit, per parameter: did it get a gradient in this window, on any rank."""
        if self.group.world_size > 1 and self._has_grad:
            flat = torch.cat([f.to(torch.uint8) for f in self._has_grad])
            self.group.all_reduce_max(flat)
            out, i = [], 0
            for f in self._has_grad:
                out.append(flat[i : i + f.numel()].bool())
                i += f.numel()
            return out
        return [f.clone() for f in self._has_grad]

    # -- stages 2 and 3: reduce as backward goes ----------------------------

    def add(self, unit: ParamUnit, slot: int, grad: torch.Tensor) -> None:
        s = unit.layout.slots[slot]
        self._has_grad[unit.index][slot] = True
        if self.deferred:
            local = self._local.get(unit.index)
            if local is None:
                local = self._local[unit.index] = self.cache.get(
                    unit.layout.padded_numel, torch.float32, zero=True
                )
            local[s.offset : s.offset + s.numel].add_(grad.reshape(-1))
            return
        if self.shard_world == 1:
            view = self._open.get(unit.index)
            if view is None:
                view = self._open[unit.index] = self.sink.open(
                    unit.index, first=unit.index not in self._touched
                )
                self._touched.add(unit.index)
            view[s.offset : s.offset + s.numel].add_(_on(view, grad.reshape(-1)))
            return
        flat = self._flat.get(unit.index)
        if flat is None:
            flat = self._flat[unit.index] = self.cache.get(
                unit.layout.padded_numel, torch.float32, zero=True
            )
        flat[s.offset : s.offset + s.numel].copy_(grad.reshape(-1))

    def finish(self, unit: ParamUnit) -> None:
        """The unit's grads for this micro-batch are complete: reduce them into its shard."""
        if self.deferred:
            return
        if self.shard_world == 1:
            if unit.index in self._open:
                del self._open[unit.index]
                self.sink.close(unit.index, final=self._last_micro)
            return
        flat = self._flat.pop(unit.index, None)
        if flat is None:
            return
        self._reduce_into_shard(unit, flat, first=unit.index not in self._touched)
        self.cache.put(flat)

    def finish_all(self) -> None:
        """End of a backward: reduce every unit still pending (parameters without a grad count as zero)."""
        if self.deferred:
            return
        for idx in sorted(set(self._open) | set(self._flat)):
            self.finish(self.units[idx])

    # -- stages 0 and 1: reduce the window's local accumulators at its end ------

    def reduce_window(self) -> None:
        """Stages 0 and 1, at the update (whatever number of backwards the window had): every unit
        in order (every rank takes part in every collective, with zeros where it has no gradient)."""
        self._last_micro = True  # the window is complete: shards may take their norms as they close
        for unit in self.units:
            local = self._local.pop(unit.index, None)
            if local is None:
                if self.group.world_size == 1:
                    continue
                local = self.cache.get(unit.layout.padded_numel, torch.float32, zero=True)
            if self.stage == 0:
                self.group.all_reduce_mean(local)
                view = self.sink.open(unit.index, first=True)
                view.copy_(local[: view.numel()])
                self.sink.close(unit.index, final=True)
            else:
                self._reduce_into_shard(unit, local, first=True)
            self._touched.add(unit.index)
            self.cache.put(local)

    def _reduce_into_shard(self, unit: ParamUnit, flat: torch.Tensor, *, first: bool) -> None:
        shard = self.cache.get(unit.layout.shard_numel, torch.float32)
        self.group.reduce_scatter_mean(shard, flat)
        view = self.sink.open(unit.index, first=first)
        view.add_(_on(view, shard))
        self._touched.add(unit.index)
        self.sink.close(unit.index, final=self._last_micro)
        self.cache.put(shard)


def _on(target: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` on ``target``'s device: grads come from the compute device, shards live in host memory."""
    return t if t.device == target.device else t.to(target.device)
