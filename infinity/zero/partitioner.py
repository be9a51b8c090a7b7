"""Stage-3 partitioner: gathers each unit's parameters around its use and releases them after.

Forward: a pre-hook on every module gathers the units it needs (its own and
shared ones) into a *frame*; the post-hook (always called, also when forward
raises) releases the frame's units. A parameter read outside its owner's
forward — ``F.linear(x, self.wte.weight)`` — is caught where every parameter
read goes through, the module's ``_parameters`` dict, and gathered into the
innermost running frame.

Backward: tensors autograd saves are packed (saved-tensor hooks) so that a
view of a gathered buffer is stored as (unit, size, stride, offset) rather
than as memory; unpacking gathers the unit again, on demand or already
prefetched. A unit gathered for backward is released once all its parameters'
grads have been reduced, or at the end of backward.

[Note: recomputation under stage 3]
Activation checkpointing runs a module's forward a second time inside
backward (torch.utils.checkpoint in either mode, infinity.checkpointing).
A forward whose outermost module starts while autograd runs a backward
(``torch._C._current_graph_task_id() != -1``) is such a recomputation, and
the partitioner treats it differently in two ways:
- it pushes no saved-tensor hooks: the non-reentrant checkpoint collects the
  recomputed tensors with its own hooks (``_recomputation_hook``), which must
  be the innermost ones, and the reentrant one saves them for its inner
  backward, which runs at once;
- the units it gathers are not released at the module's post-hook but handed
  to backward (held as ``_unpack`` holds them): the recomputed graph saved
  views of their gathered memory itself, not references, so the memory must
  stay until the unit's grads are reduced (GradHooks' ``on_unit_done``) or,
  for a unit whose grads never all arrive, until the end of backward.
A parameter read during backward outside any module's forward (a
checkpointed layer's own parameter, read by its forward before any child
module runs: transformers checkpoints ``forward``, not ``__call__``) is
gathered and handed to backward the same way. The recomputation's gathers are
ordinary acquires of the step: the prefetch trace records them in step 0 and
replays them after (the order is the same every step), so a recomputation
costs reads ahead of use, not on-demand misses.

[Note: frozen units in backward]
A frozen unit (no parameter requires grad: a LoRA base) has no grads whose
reduction would say that backward is done with it, so a hold for backward
would keep it until the end of backward, and with it every frozen unit the
backward gathers: the whole base, dequantised where it rests quantised. A
frozen unit gathered while autograd runs a backward (for a recomputation or to
unpack a saved tensor) is therefore gathered into a buffer that goes back to
the TensorCache when the unit is released — the one its dequantisation fills
(QuantizedShards), the one an all-gather fills (world size > 1), or at world
size 1 a copy of its pooled shard, whose pool room is given back at once —
and released as any forward releases it: at its module's post-hook in a
recomputation, right after the view is made when unpacking. The tensors
autograd saved keep viewing the buffer, which lives until the last of them is
gone, and the TensorCache reuses no buffer a tensor still views
(zero/buffers.py). So a frozen unit's memory lasts exactly as long as the
backward nodes that need it: at most a checkpointed layer's frozen units at
once, however many layers there are. A recomputation reads a frozen parameter
as a detached view (``_on_param_read``): a saved tensor then views the buffer
rather than being the Parameter, whose ``.data`` the release points back at
the placeholder. A frozen unit that was gathered into pool memory before the
backward needed it (held by a frame or by the user) is held for backward as
before.

Gradients are handed to the GradReducer by GradHooks (grad_hooks.py), which
is built with ``on_unit_done=partitioner.release_backward``: a unit gathered
for backward is released once its grads are reduced, everything else at the
end of backward (a callback the partitioner queues on the autograd engine).

GatheredParameters: the partitioner is the ParamOwner of its parameters
(``PARAM_OWNERS`` holds it while installed; see [Note: finding a parameter's
owner] in owners.py). A unit gathered for the user is a copy outside the
shard source's pool ([Note: user gathers outside the pool] in gathered.py).
A change made on the modifier rank is broadcast into every rank's gathered
buffer, written to its shard, and handed to ``masters`` (16-bit training:
the optimizer's fp32 masters; see masters.py).

Threading: all hooks run on the thread doing forward or backward; the shard
source (store or prefetch scheduler) is the only part shared with I/O threads.
What a running forward has open (its frames, saved-tensor hooks) is per thread
(``_ForwardState``): engine.train_batch runs one micro-batch's forward per
thread, one thread at a time ([Note: layer-major accumulation] in
infinity/engine/layer_major.py); ``on_gather`` and ``hold``/``unhold`` let it
keep a unit gathered across those forwards.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from infinity.timeline import Timeline
from infinity.zero.buffers import TensorCache
from infinity.zero.collectives import DataParallelGroup
from infinity.zero.gathered import PARAM_OWNERS, room_refusal
from infinity.zero.masters import MasterCopy, ShardSnapshot
from infinity.zero.unit import ParamUnit, UnitState
from infinity.zero.units import UnitMap


def _in_backward() -> bool:
    """Whether this thread is running autograd's backward (a forward now is a recomputation)."""
    return torch._C._current_graph_task_id() != -1


class ShardSource(Protocol):
    """Where the partitioner gets this rank's shard of a unit (a store, or a prefetch scheduler over one)."""

    def acquire(self, key: Hashable) -> torch.Tensor:
        """The shard, resident on the compute device (waits if it must); one hold."""
        ...

    def release(self, key: Hashable) -> None: ...

    def mark_dirty(self, key: Hashable) -> None:
        """The held shard was changed in place; it must reach its home."""
        ...


@dataclasses.dataclass
class _Frame:
    module: nn.Module
    units: list[ParamUnit]
    span: Any = None  # the timeline span of the module's compute, while one records


class _ForwardState(threading.local):
    """What the forward running in a thread has open: its frames, whether it is a recomputation,
    its saved-tensor hooks (torch keeps those per thread too)."""

    def __init__(self) -> None:
        self.frames: list[_Frame] = []
        self.recomputing = False  # the running forward is a recomputation inside backward
        self.saved_hooks: Any = None


@dataclasses.dataclass(frozen=True)
class _SavedParamRef:
    unit: ParamUnit
    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # elements of `dtype` from the start of the unit's flat buffer
    dtype: torch.dtype


class _InterceptingParams(dict):
    """A module's ``_parameters`` that gathers a released parameter when forward code reads it."""

    __slots__ = ("on_read",)

    def __init__(self, params: dict[str, Any], on_read: weakref.WeakMethod):
        super().__init__(params)
        self.on_read = on_read  # weak: the module must not keep a removed partitioner alive

    def __getitem__(self, name: str) -> Any:
        p = dict.__getitem__(self, name)
        on_read = self.on_read()
        if on_read is not None and p is not None:
            return on_read(p)  # p, or a detached view of it ([Note: frozen units in backward])
        return p


@dataclasses.dataclass
class _UserHold:
    """The units one GatheredParameters context holds gathered (a UserGather)."""

    partitioner: Stage3Partitioner
    units: list[ParamUnit]
    modifier_rank: int | None
    snapshots: list[ShardSnapshot]  # empty unless a change must reach separate fp32 masters

    def release(self, *, commit: bool) -> None:
        try:
            if commit and self.modifier_rank is not None:
                self.partitioner.write_back(
                    self.units, src=self.modifier_rank, snapshots=self.snapshots
                )
        finally:
            self.partitioner.unhold_for_user(self.units)


class Stage3Partitioner:
    def __init__(
        self,
        root: nn.Module,
        unit_map: UnitMap,
        *,
        shards: ShardSource,
        group: DataParallelGroup,
        cache: TensorCache,
        masters: MasterCopy | None,
    ):
        """``masters``: where a change made under GatheredParameters must also go (the optimizer's fp32
        masters in 16-bit training); None where the parameter shards are their own masters."""
        self.root = root
        self.units = unit_map.units
        self.uses = unit_map.uses
        self.unit_of = unit_map.unit_of
        self.shards = shards
        self.group = group
        self.cache = cache
        self.masters = masters
        # Per thread: the forward running in it ([Note: layer-major accumulation] runs one
        # micro-batch's forward per thread).
        self._fw = _ForwardState()
        # Called with each unit gathered in forward, while set (layer-major accumulation holds it
        # until every micro-batch has passed).
        self.on_gather: Callable[[ParamUnit], None] | None = None
        self._ranges: list[
            tuple[int, int, ParamUnit]
        ] = []  # gathered, non-persistent units by address
        self._backward_units: list[ParamUnit] = []
        self._backward_since: dict[int, float] = {}  # unit index -> gathered for backward (tracing)
        self._copies: set[int] = (
            set()
        )  # units whose gathered buffer is a user copy (gather_for_user)
        # World size 1: frozen units gathered for backward into a copy of their pooled shard
        # ([Note: frozen units in backward]), put back into the cache when released.
        self._own: set[int] = set()
        self._handles: list[Any] = []
        self._end_of_backward_queued = False
        self._installed = False

    # -- install / remove -----------------------------------------------------

    def install(self) -> None:
        for unit in self.units:
            for p in unit.params:
                p.data = unit.placeholder
        for unit in self.units:
            if unit.persistent:
                self._gather(unit)
        for mod in self.root.modules():
            self._handles.append(mod.register_forward_pre_hook(self._pre_forward))
            self._handles.append(mod.register_forward_hook(self._post_forward, always_call=True))
            if mod._parameters and not isinstance(mod._parameters, _InterceptingParams):
                mod._parameters = _InterceptingParams(
                    mod._parameters, weakref.WeakMethod(self._on_param_read)
                )
        PARAM_OWNERS.add(self)
        self._installed = True

    def remove(self) -> None:
        """Removes every hook and releases every unit; parameters are left as empty placeholders
        (their data lives in the shards)."""
        self.release_all()
        self.release_persistent()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for mod in self.root.modules():
            if isinstance(mod._parameters, _InterceptingParams):
                mod._parameters = dict(mod._parameters)
        PARAM_OWNERS.discard(self)
        self._installed = False

    # -- gather / release -------------------------------------------------------

    def _gather(self, unit: ParamUnit) -> None:
        if self.group.world_size == 1 and not unit.trainable and _in_backward():
            full = self._own_copy(unit)  # [Note: frozen units in backward]
        elif self.group.world_size == 1:
            full = self.shards.acquire(unit.key)  # zero copy: the shard is the whole (padded) unit
        else:
            shard = self.shards.acquire(unit.key)
            try:
                full = self.cache.get(unit.layout.padded_numel, unit.layout.dtype)
                self.group.all_gather(full, shard)
            finally:
                self.shards.release(unit.key)
        unit.to_gathered(full)
        if not unit.persistent:
            start = full.data_ptr()
            bisect.insort(self._ranges, (start, start + unit.full_nbytes, unit), key=lambda r: r[0])
            if self.on_gather is not None and self._fw.frames:
                self.on_gather(unit)

    def _serves_cache_buffers(self, key: Hashable) -> bool:
        """Whether the shard source serves ``key`` in a TensorCache buffer of its own, put back on
        release (QuantizedShards' dequantised shards), rather than in pool memory."""
        serves = getattr(self.shards, "serves_cache_buffer", None)
        return serves is not None and bool(serves(key))

    def _own_copy(self, unit: ParamUnit) -> torch.Tensor:
        """World size 1: a frozen unit's shard in a buffer that goes back to the TensorCache when the
        unit is released ([Note: frozen units in backward]); its pool room is given back at once."""
        shard = self.shards.acquire(unit.key)
        if self._serves_cache_buffers(unit.key):
            return shard  # released through the shard source, which puts it back into the cache
        try:
            full = self.cache.get(shard.numel(), shard.dtype)
            full.copy_(shard)
        finally:
            self.shards.release(unit.key)
        self._own.add(unit.index)
        return full

    def _handed_to_autograd(self, unit: ParamUnit) -> bool:
        """Whether a frozen unit may be released while autograd's saved tensors still view it: its
        buffer returns to the TensorCache (or is freed), never to the pool."""
        return not unit.trainable and (
            self.group.world_size > 1
            or unit.index in self._own
            or unit.index in self._copies
            or self._serves_cache_buffers(unit.key)
        )

    def _gather_copy(self, unit: ParamUnit) -> None:
        """Gathers ``unit`` into memory of its own, giving its pool buffer back at once
        ([Note: user gathers outside the pool])."""
        full = torch.empty(unit.layout.padded_numel, dtype=unit.layout.dtype, device=unit.device)
        shard = self.shards.acquire(unit.key)
        try:
            self.group.all_gather(full, shard)
        finally:
            self.shards.release(unit.key)
        unit.to_gathered(full)
        self._copies.add(unit.index)
        start = full.data_ptr()
        bisect.insort(self._ranges, (start, start + unit.full_nbytes, unit), key=lambda r: r[0])

    def _ungather(self, unit: ParamUnit) -> None:
        full = unit.to_released()
        self._ranges = [r for r in self._ranges if r[2] is not unit]
        if unit.index in self._copies:
            self._copies.discard(unit.index)  # its own memory, freed with it
        elif unit.index in self._own:
            self._own.discard(unit.index)
            self.cache.put(full)
        elif self.group.world_size == 1:
            self.shards.release(unit.key)
        else:
            self.cache.put(full)

    def _hold(self, unit: ParamUnit) -> None:
        if unit.persistent:
            return
        if unit.state is UnitState.RELEASED:
            self._gather(unit)
        unit.holds += 1

    def _unhold(self, unit: ParamUnit) -> None:
        if unit.persistent:
            return
        unit.holds -= 1
        if unit.holds == 0:
            self._ungather(unit)

    def hold(self, unit: ParamUnit) -> None:
        """One more hold on a gathered unit, kept across forwards until ``unhold`` (layer-major
        accumulation keeps a unit until every micro-batch has passed through it)."""
        if unit.state is not UnitState.GATHERED:
            raise RuntimeError(
                f"unit {unit.key!r} is not gathered: only a gathered unit can be held"
            )
        self._hold(unit)

    def unhold(self, unit: ParamUnit) -> None:
        self._unhold(unit)

    def release_persistent(self) -> None:
        """Before an optimizer step: persistent units let go of their shards, so no device copy
        is held while the step updates the host copy (it is read afresh by gather_persistent)."""
        for unit in self.units:
            if unit.persistent and unit.state is UnitState.GATHERED:
                self._ungather_persistent(unit)

    def gather_persistent(self) -> None:
        """After an optimizer step: persistent units read their updated shards."""
        for unit in self.units:
            if unit.persistent and unit.state is UnitState.RELEASED:
                self._gather(unit)

    def _ungather_persistent(self, unit: ParamUnit) -> None:
        full = unit.to_released()
        if self.group.world_size == 1:
            self.shards.release(unit.key)
        else:
            self.cache.put(full)

    def release_all(self) -> None:
        """Drops every hold (an aborted forward, or engine shutdown)."""
        while self._fw.frames:
            frame = self._fw.frames.pop()
            for unit in frame.units:
                self._unhold(unit)
        for unit in self._backward_units:
            if unit.backward_held:
                unit.backward_held = False
                self._unhold(unit)
        self._backward_units.clear()
        self._fw.recomputing = False
        if self._fw.saved_hooks is not None:
            self._fw.saved_hooks.__exit__(None, None, None)
            self._fw.saved_hooks = None

    # -- GatheredParameters (ParamOwner) -------------------------------------------

    def __contains__(self, p: object) -> bool:
        return p in self.unit_of

    def gather_for_user(
        self, params: Sequence[nn.Parameter], *, modifier_rank: int | None
    ) -> _UserHold:
        units: list[ParamUnit] = []
        for p in params:
            unit = self.unit_of[p][0]
            if all(unit is not u for u in units):
                units.append(unit)
        units.sort(key=lambda u: u.index)  # the same order on every rank
        snapshot = modifier_rank is not None and self.masters is not None
        self._check_room(units, snapshot, f"{len(params)} parameter(s)")
        self.hold_for_user(units)
        try:
            snapshots = (
                [ShardSnapshot(u, self._own_slice(u).clone()) for u in units] if snapshot else []
            )
        except BaseException:
            self.unhold_for_user(units)
            raise
        return _UserHold(self, units, modifier_rank, snapshots)

    def _check_room(self, units: list[ParamUnit], snapshot: bool, what: str) -> None:
        """Refuses (MemoryError) on every rank a user gather that one rank's free memory cannot hold."""
        new = [u for u in units if not u.persistent and u.state is UnitState.RELEASED]
        need = sum(u.full_nbytes for u in new) + (
            sum(u.layout.shard_nbytes for u in units) if snapshot else 0
        )
        device = units[0].device if units else torch.device("cpu")
        refusal = (
            room_refusal(need, device, f"{what} ({len(new)} layer(s) to gather)") if need else None
        )
        if self.group.world_size > 1:
            refused = torch.tensor([refusal is not None], dtype=torch.uint8)
            self.group.all_reduce_max(refused)
            if refused.item() and refusal is None:
                refusal = "GatheredParameters was refused on another rank: its free memory cannot hold the parameters"
        if refusal is not None:
            raise MemoryError(refusal)

    def hold_for_user(self, units: list[ParamUnit]) -> None:
        """Gathers ``units`` until unhold_for_user (persistent units are always gathered), each one
        not gathered yet into a copy of its own ([Note: user gathers outside the pool]). If one
        fails, those it had gathered are released before the error is raised."""
        held: list[ParamUnit] = []
        try:
            for unit in units:
                if not unit.persistent:
                    if unit.state is UnitState.RELEASED:
                        self._gather_copy(unit)
                    unit.holds += 1
                held.append(unit)
        except BaseException:
            self.unhold_for_user(held)
            raise

    def unhold_for_user(self, units: list[ParamUnit]) -> None:
        for unit in units:
            self._unhold(unit)

    def write_back(
        self, units: list[ParamUnit], *, src: int, snapshots: Sequence[ShardSnapshot] = ()
    ) -> None:
        """Rank ``src``'s gathered values become every rank's shard; ``snapshots`` (taken when the
        units were gathered) tell which elements changed, and those reach the fp32 masters."""
        for unit in units:
            full = unit.gathered()
            self.group.broadcast(full, src=src)
            shard = self.shards.acquire(unit.key)
            try:
                if shard.data_ptr() != full.data_ptr():
                    shard.copy_(self._own_slice(unit))
                self.shards.mark_dirty(unit.key)
            finally:
                self.shards.release(unit.key)
        for snap in snapshots:
            if self.masters is None:
                raise RuntimeError(
                    "shard snapshots were taken for a partitioner without fp32 masters"
                )
            snap.commit(self._own_slice(snap.unit), self.masters)

    def _own_slice(self, unit: ParamUnit) -> torch.Tensor:
        """This rank's shard of a gathered unit, as a view of its full buffer."""
        lo, hi = unit.layout.shard_range(self.group.rank)
        return unit.gathered()[lo:hi]

    def gathered_units(self) -> list[ParamUnit]:
        return [u for u in self.units if u.state is UnitState.GATHERED and not u.persistent]

    # -- forward hooks ------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if not self._fw.frames:
            self._fw.recomputing = _in_backward()
            if not self._fw.recomputing:
                # The outermost module entered: from here until it returns, tensors
                # autograd saves that view gathered parameters are packed by reference.
                self._fw.saved_hooks = torch.autograd.graph.saved_tensors_hooks(
                    self._pack, self._unpack
                )
                self._fw.saved_hooks.__enter__()
        frame = _Frame(module, [])
        self._fw.frames.append(frame)
        for unit in self.uses.get(module, ()):
            self._hold(unit)
            frame.units.append(unit)
        tl = Timeline.active
        if tl is not None and frame.units:  # after the holds: compute starts once its units are in
            phase = "recompute" if self._fw.recomputing else "forward"
            keys = [u.key for u in frame.units]
            frame.span = tl.begin(
                f"{phase} {type(module).__name__} {' '.join(keys)}",
                "compute",
                {"phase": phase, "units": keys},
            )

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._fw.frames or self._fw.frames[-1].module is not module:
            return  # a forward that raised before our pre-hook ran
        frame = self._fw.frames.pop()
        tl = Timeline.active
        if frame.span is not None and tl is not None:
            tl.end(frame.span)
        for unit in frame.units:
            if self._fw.recomputing and not self._handed_to_autograd(unit):
                self._hold_for_backward(unit)  # [Note: recomputation under stage 3]
            self._unhold(unit)
        if not self._fw.frames:
            self._fw.recomputing = False
            if self._fw.saved_hooks is not None:
                self._fw.saved_hooks.__exit__(None, None, None)
                self._fw.saved_hooks = None

    def _on_param_read(self, p: nn.Parameter) -> torch.Tensor:
        """What a module's forward reads for ``p``: ``p``, gathered if it was released; in a
        recomputation, a frozen parameter as a detached view ([Note: frozen units in backward])."""
        if not self._fw.frames and not _in_backward():
            return p
        entry = self.unit_of.get(p)
        if entry is None:
            return p
        unit = entry[0]
        if unit.persistent:
            return p
        if unit.state is UnitState.RELEASED:
            if not self._fw.frames:
                self._hold_for_backward(
                    unit
                )  # read by a recomputation outside any module's forward
                return p
            self._hold(unit)
            self._fw.frames[-1].units.append(unit)
        if self._fw.frames and self._fw.recomputing and not unit.trainable:
            return p.detach()
        return p

    # -- saved tensors ------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        if (
            not self._ranges
            or t.layout is not torch.strided
            or t.numel() == 0
            or t.device.type == "meta"
        ):
            return t
        ptr = t.data_ptr()
        i = bisect.bisect_right(self._ranges, ptr, key=lambda r: r[0]) - 1
        if i < 0:
            return t
        start, end, unit = self._ranges[i]
        if ptr >= end:
            return t
        return _SavedParamRef(
            unit, t.size(), t.stride(), (ptr - start) // t.element_size(), t.dtype
        )

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _SavedParamRef):
            return packed
        unit = packed.unit
        if not unit.trainable and (
            unit.state is UnitState.RELEASED or self._handed_to_autograd(unit)
        ):
            # [Note: frozen units in backward]: the view keeps the buffer; the unit is released now.
            self._hold(unit)
            try:
                return self._view(unit, packed)
            finally:
                self._unhold(unit)
        self._hold_for_backward(unit)
        return self._view(unit, packed)  # _hold_for_backward gathered it

    @staticmethod
    def _view(unit: ParamUnit, packed: _SavedParamRef) -> torch.Tensor:
        full = unit.gathered()
        base = full if packed.dtype == unit.layout.dtype else full.view(packed.dtype)
        return base.as_strided(packed.size, packed.stride, base.storage_offset() + packed.offset)

    def _hold_for_backward(self, unit: ParamUnit) -> None:
        self._queue_end_of_backward()
        if unit.backward_held or unit.persistent:
            return
        self._hold(unit)
        unit.backward_held = True
        self._backward_units.append(unit)
        if Timeline.active is not None:
            self._backward_since[unit.index] = time.monotonic()

    # -- backward ---------------------------------------------------------------

    def _queue_end_of_backward(self) -> None:
        # Idempotent within one backward. GradHooks queues its own callback (the
        # reductions left at the end); neither needs the other's to run first:
        # reducing reads the grads, not the gathered parameters.
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def release_backward(self, unit: ParamUnit) -> None:
        """The unit's grads are reduced: let go of what backward gathered of it (GradHooks' on_unit_done)."""
        if unit.backward_held:
            unit.backward_held = False
            self._unhold(unit)
            since = self._backward_since.pop(unit.index, None)
            tl = Timeline.active
            if since is not None and tl is not None:
                # From the unit gathered for backward (its read done) to its gradient reduced.
                tl.span(
                    f"backward {unit.key}",
                    "compute",
                    since,
                    time.monotonic(),
                    track="backward units",
                    args={"phase": "backward", "units": [unit.key]},
                )

    def abort_backward(self) -> None:
        """After a backward that raised (autograd then drops the callback queued for its end):
        lets go of what it gathered, so the next backward starts clean and queues its own."""
        self._end_of_backward()

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        for unit in self._backward_units:
            self.release_backward(unit)
        self._backward_units.clear()
