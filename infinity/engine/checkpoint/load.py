"""load_checkpoint: check everything, then read the shards straight into the stores.

[Note: a failed load changes nothing]
Phases, each ending in ``agree`` across ranks:
1. Plan (no data read): resolve the directory, parse the manifest, compare
   the model (every parameter's name and shape), the optimizer's param
   groups, the scheduler and the buffers with this engine, check every file's
   size, read and checksum the rank files, parse the part headers, and
   decode the small state. Each rank then knows every byte range it will
   read and where it goes.
2. Verify (``verify=True``, the default): read every saved tensor this rank
   will use and compare its CRC32C. Only reads; nothing is changed.
3. Apply: read each unit's master / exp_avg / exp_avg_sq into its store keys
   (fetched with overwrite, then written home), rebuild the 16-bit or module
   parameters from the masters, then restore counters, schedule, loss scale,
   hyperparameters, buffers and RNG.
What is restored follows DeepSpeed's switches ([Note: what a load restores]
in scope.py). Any error in phases 1-2, on any rank, leaves every engine
untouched. Phase 3
checks each tensor's CRC32C again where it reads it whole; a mismatch there
(the file changed since phase 2, or the drive misread) says that the state is
partly loaded. ``verify=False`` skips phase 2 (half the reads) and accepts
that risk.

Re-partitioning: unit shards are flat ranges of the unit's buffer, so a
destination shard is filled from the overlapping ranges of the saved
partitions (zeros for padding). Any world size loads any other, for every
stage, as long as units are built the same way (same stage-3 persistence
threshold); optimizer step counts then come from every saved rank.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from infinity.aio import AioHandle
from infinity.engine.checkpoint import nodes
from infinity.engine.checkpoint.collective import agree
from infinity.engine.checkpoint.errors import CheckpointMismatchError
from infinity.engine.checkpoint.files import Check, verify
from infinity.engine.checkpoint.format import parse_dtype_name
from infinity.engine.checkpoint.model import (
    check_buffers_match,
    check_units_match,
    describe_units,
    state_dict_names,
)
from infinity.engine.checkpoint.progress import Progress
from infinity.engine.checkpoint.quantised import check_same_format, partition_format, spec_of
from infinity.engine.checkpoint.reader import CheckpointReader
from infinity.engine.checkpoint.save import (
    frozen_shard_crcs,
    param_names,
    partitions_of,
    shard_rank,
    unit_state_refs,
)
from infinity.engine.checkpoint.scope import (
    Hyperparameters,
    LoadScope,
    hyperparameters,
    messages,
    schedule_differences,
)
from infinity.engine.checkpoint.sources import SourceFiles, check_files, shard_crc
from infinity.engine.checkpoint.state import (
    check_param_groups,
    param_group_of,
    restore_rng,
    restore_scheduler,
)
from infinity.engine.checkpoint.stream import LoadGroup, LoadItem, Piece, read_into
from infinity.engine.checkpoint.target import CheckpointTarget, ShardOptimizer, TrainingParts
from infinity.engine.checkpoint.threads import torch_threads
from infinity.engine.checkpoint.values import decode
from infinity.engine.checkpoint.window import StoreRef
from infinity.store import StoreFuture
from infinity.weights.quant import ShardFormat, quantize_into
from infinity.zero.unit import ParamUnit

log = logging.getLogger("infinity.checkpoint")

FP32 = torch.float32


@dataclasses.dataclass
class _Plan:
    groups: list[LoadGroup]
    checks: list[Check]
    apply_nbytes: int
    small: dict[str, Any]  # decoded small state, applied last
    writes: list[StoreFuture]  # 16-bit shards written home during the apply, awaited at its end
    scope: LoadScope
    said: list[tuple[int, str]]  # (log level, line): which hyperparameters and schedule are in use
    source_checks: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    """Frozen units read back from their files: each reads this rank's shard and compares its CRC32C."""


def load_checkpoint(
    engine: CheckpointTarget,
    load_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    verify_checksums: bool = True,
    progress: bool | None = None,
) -> Any:
    """Restores the state saved by save_checkpoint (``tag`` default: what ``latest`` names); returns the
    client_state this rank saved. Every rank must call it. The switches are DeepSpeed's (see [Note: what a
    load restores] in scope.py); see also [Note: a failed load changes nothing]."""
    group = engine.group
    err = None
    reader = None
    handle = None
    sources = SourceFiles()
    try:
        scope = LoadScope.of(
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )
        engine.synchronize()  # an optimizer step still running behind the forward finishes first
        handle = AioHandle.from_config(engine.config.aio)
    except Exception as e:
        err = e
    try:
        # Collective: every rank takes part whatever failed above ([Note: node-local checkpoints]).
        reader = nodes.open_checkpoint(group, load_dir, tag, warn=group.rank == 0)
        if err is None:
            assert handle is not None  # made above, or err says why not
            parts = engine.checkpoint_parts()
            plan = _plan(engine, parts, reader, handle, scope, sources)
    except Exception as e:
        err = err or e
    try:
        agree(group, err, "checking the checkpoint")
        # agree() raised, had this rank failed to open them.
        assert reader is not None and handle is not None
        nodes.fetch_tensors(reader)
        total = (
            sum(c.entry.nbytes for c in plan.checks) if verify_checksums else 0
        ) + plan.apply_nbytes
        with Progress(total, f"load {reader.tag}", progress if group.rank == 0 else False) as bar:
            if verify_checksums:
                err = None
                try:
                    verify(handle, plan.checks, progress=bar)
                    for check in plan.source_checks:
                        check()
                except Exception as e:
                    err = e
                agree(group, err, "verifying the checkpoint's checksums")
            _apply(engine, parts, plan, handle, bar)
        agree(group, None, "loading the checkpoint")
    finally:
        sources.close()
        if reader is not None:
            nodes.close(reader)
        if handle is not None:
            handle.close()
    if group.rank == 0:
        for level, line in plan.said:
            log.log(level, line)
    log.info(
        "loaded checkpoint '%s'%s",
        reader.dir,
        " (the module's weights and buffers only)" if scope.module_only else "",
    )
    return plan.small["client_state"]


# -- phase 1 ------------------------------------------------------------------


def _plan(
    engine: CheckpointTarget,
    parts: TrainingParts,
    reader: CheckpointReader,
    handle: AioHandle,
    scope: LoadScope,
    sources: SourceFiles,
) -> _Plan:
    m = reader.manifest
    rank = engine.group.rank
    passthrough = parts.passthrough is not None
    if passthrough != (m.get("optimizer") == "passthrough"):
        raise CheckpointMismatchError(
            f"the checkpoint was saved with {'a torch optimizer stepping whole parameters (stage 0)' if not passthrough else 'the partitioned Adam'}"
            f" and this engine runs {'the partitioned Adam' if not passthrough else 'a torch optimizer on whole parameters'}; "
            "load it into an engine with the same optimizer and stage"
        )
    if parts.partitioner is not None and parts.partitioner.gathered_units():
        raise RuntimeError(
            "load_checkpoint() was called while parameters are gathered (inside GatheredParameters or a forward "
            "pass); call it between training steps"
        )
    if not passthrough:  # parameters first: the most telling difference
        zero = engine.config.zero_optimization
        check_units_match(
            reader.units,
            describe_units(engine.module, parts.units),
            saved_threshold=m.get("persistence_threshold"),
            live_threshold=int(zero.stage3_param_persistence_threshold) if engine.stage == 3 else 0,
        )
    es = reader.engine_state()
    _, live_buffers = state_dict_names(engine.module)
    check_buffers_match(
        {n: (parse_dtype_name(b["dtype"], n), tuple(b["shape"])) for n, b in m["buffers"].items()},
        live_buffers,
    )
    names = param_names(engine, parts)
    opt = engine.optimizer
    if scope.optimizer_states or scope.lr_scheduler_states:
        check_param_groups(
            es["param_groups"],
            es["param_group_of"],
            opt.param_groups,
            param_group_of(opt.param_groups, parts.params),
            names,
        )
    if scope.lr_scheduler_states:
        _check_scheduler(es, engine.lr_scheduler)
    writes: list[StoreFuture] = []
    source_checks: list[Callable[[], None]] = []
    if parts.passthrough is not None:
        groups, checks, nbytes, optimizer_state = _plan_passthrough(
            parts, parts.passthrough, reader, handle, names, scope
        )
    else:
        groups, checks, nbytes, writes = _plan_units(engine, parts, reader, handle, scope)
        frozen = _plan_frozen(engine, parts, reader, handle, sources, writes)
        groups += frozen.groups
        checks += frozen.checks
        nbytes += frozen.nbytes
        source_checks = frozen.source_checks
        optimizer_state = None
    rank0_tensors = reader.rank(0)[1]
    own = rank < reader.world_size
    state, tensors = reader.rank(rank if own else 0)
    lr_state = (
        decode(es["lr_scheduler"], rank0_tensors, "lr_scheduler")
        if scope.lr_scheduler_states
        else None
    )
    hyper, said = _what_is_used(engine, es, lr_state, scope)
    small = {
        "client_state": decode(state["client_state"], tensors, "client_state"),
        "rng": (state["rng"], tensors) if own and scope.run_state else None,
        "param_steps": _param_steps(engine, parts, reader, own)
        if scope.optimizer_states and not passthrough
        else None,
        "buffers": {n: tensors[f"buffer.{n}"] for n in live_buffers},  # this rank's, else rank 0's
        "lr_scheduler": lr_state,
        "engine": es,
        "optimizer_state": optimizer_state,
        "counters": _counters(engine, m) if scope.run_state else None,
        "hyper": hyper,
    }
    return _Plan(groups, checks, nbytes, small, writes, scope, said, source_checks)


def _what_is_used(
    engine: CheckpointTarget, es: dict[str, Any], lr_state: Any, scope: LoadScope
) -> tuple[Hyperparameters, list[tuple[int, str]]]:
    """The param group values the load sets, and the log lines saying which values are in use where
    the checkpoint's and this engine's differ. ``lr_state``: the decoded scheduler state to restore."""
    opt, scheduler = engine.optimizer, engine.lr_scheduler
    restored = lr_state is not None and scheduler is not None
    if scope.module_only:
        hyper = Hyperparameters([{} for _ in opt.param_groups], [], [])
    else:
        hyper = hyperparameters(
            [decode(g, {}, "optimizer.param_groups") for g in es["param_groups"]],
            opt.param_groups,
            scope=scope,
            scheduled=scheduler is not None,
            schedule_restored=restored,
        )
    said = messages(
        hyper,
        schedule=None if scheduler is None else type(scheduler).__qualname__,
        schedule_used=(
            schedule_differences(lr_state, scheduler.state_dict())
            if lr_state is not None and scheduler is not None
            else []
        ),
        schedule_kept=not scope.lr_scheduler_states
        and not scope.module_only
        and scheduler is not None
        and es["lr_scheduler"] is not None,
    )
    return hyper, said


def _check_scheduler(es: dict[str, Any], scheduler: Any) -> None:
    saved = es.get("lr_scheduler_type")
    if saved is not None and scheduler is not None:
        if saved != type(scheduler).__qualname__:
            raise CheckpointMismatchError(
                f"the checkpoint's lr scheduler is a {saved} and this engine's a {type(scheduler).__qualname__}; "
                "configure the same scheduler as the saved run"
            )
        data = es["lr_scheduler"]
        keys = set(data) - {"__dict__"} if isinstance(data, dict) else set()
        live = set(scheduler.state_dict())
        if keys and keys != live:
            raise CheckpointMismatchError(
                f"the checkpoint's {saved} state has the keys {sorted(keys)} and this engine's {sorted(live)}; "
                "configure the same scheduler as the saved run"
            )


def _counters(engine: CheckpointTarget, m: dict[str, Any]) -> dict[str, int]:
    saved_gas = (m.get("config") or {}).get("gradient_accumulation_steps")
    micro = int(m["micro_steps"])
    if saved_gas != engine.gradient_accumulation_steps:
        micro = int(m["global_steps"]) * engine.gradient_accumulation_steps
    return {
        "global_steps": int(m["global_steps"]),
        "micro_steps": micro,
        "skipped_steps": int(m["skipped_steps"]),
    }


def _param_steps(
    engine: CheckpointTarget, parts: TrainingParts, reader: CheckpointReader, own: bool
) -> list[int]:
    """This rank's step counts: its own when the partitioning is unchanged, else the largest over the
    saved ranks (a parameter's count is kept by the ranks holding part of it, 0 elsewhere)."""
    n = len(_partitioned(parts).param_steps)
    same = (
        own
        and reader.partitions == partitions_of(parts)
        and reader.world_size == engine.group.world_size
    )
    ranks = [engine.group.rank] if same else range(reader.world_size)
    steps = [0] * n
    for r in ranks:
        saved = reader.rank(r)[0]["param_steps"]
        if saved is None or len(saved) != n:
            raise CheckpointMismatchError(
                f"the checkpoint has step counts for {None if saved is None else len(saved)} parameters and this "
                f"engine has {n}; load a checkpoint of this model"
            )
        steps = [max(a, int(b)) for a, b in zip(steps, saved, strict=True)]
    return steps


def _plan_units(
    engine: CheckpointTarget,
    parts: TrainingParts,
    reader: CheckpointReader,
    handle: AioHandle,
    scope: LoadScope,
) -> tuple[list[LoadGroup], list[Check], int, list[StoreFuture]]:
    rank = 0 if engine.stage == 0 else engine.group.rank
    p_old = reader.partitions
    groups: list[LoadGroup] = []
    checks: dict[tuple[int, str], Check] = {}
    nbytes = 0
    writes: list[StoreFuture] = []
    for unit, saved in zip(parts.units, reader.units, strict=True):
        if not unit.trainable:
            continue  # _plan_frozen
        s_new, s_old = unit.layout.shard_numel, saved.shard_numel
        same = p_old == unit.layout.world_size and s_old == s_new
        # Flat elements [lo_new, end) of the unit go to this rank's shard; beyond the saved data: zeros.
        lo_new = rank * s_new
        end = lo_new + s_new if same else min(lo_new + s_new, saved.numel)
        items = []
        for role, ref in unit_state_refs(parts, unit):
            name = f"u{unit.index}.{role}"
            if role != "master" and not scope.optimizer_states:
                if not scope.module_only:  # the moments start afresh: no pieces, so zeros
                    items.append(LoadItem(name, s_new * 4, [], ref=ref))
                    nbytes += s_new * 4
                continue
            pieces = []
            for q in [rank] if same else range(p_old):
                lo, hi = max(lo_new, q * s_old), min(end, (q + 1) * s_old)
                if lo >= hi:
                    continue
                entry = reader.entry(q, name, FP32, s_old)
                f = reader.open_part(q, handle)
                checks[(q, name)] = Check(reader.part_path(q), f, entry, reader.part_crc(q, name))
                pieces.append(
                    Piece(f, entry.begin + (lo - q * s_old) * 4, (lo - lo_new) * 4, (hi - lo) * 4)
                )
            # Read whole, a tensor's checksum is checked again as it lands (see the Note).
            crc = reader.part_crc(rank, name) if same else None
            items.append(
                LoadItem(
                    name,
                    s_new * 4,
                    pieces,
                    ref=ref,
                    crc=crc,
                    path=reader.part_path(rank if same else 0),
                )
            )
            nbytes += s_new * 4
        groups.append(LoadGroup(items, _after_master(parts, unit, writes)))
    return groups, list(checks.values()), nbytes, writes


@dataclasses.dataclass
class _FrozenPlan:
    groups: list[LoadGroup]
    checks: list[Check]
    nbytes: int
    source_checks: list[Callable[[], None]]


def _plan_frozen(
    engine: CheckpointTarget,
    parts: TrainingParts,
    reader: CheckpointReader,
    handle: AioHandle,
    files: SourceFiles,
    writes: list[StoreFuture],
) -> _FrozenPlan:
    """The frozen units' weights ([Note: frozen units in a checkpoint] in sources.py): read from the part
    files where saved, else from the files the checkpoint refers to (after checking that they are there,
    unchanged), or left as they are where this engine's unit comes from the same files with the same
    values. Loaded whatever the switches say: they are the module's weights. A unit resting quantised
    is made again in this engine's format ([Note: a quantised base in a checkpoint] in quantised.py);
    the shards quantised here are written home during the apply (``writes``)."""
    rank = shard_rank(engine)
    out = _FrozenPlan([], [], 0, [])
    frozen = [(u, s) for u, s in zip(parts.units, reader.units, strict=True) if not u.trainable]
    if not frozen:
        return out
    saved_files = reader.manifest.get("source_files") or {}
    own = engine.group.rank < reader.world_size
    saved_crcs = (reader.rank(engine.group.rank)[0].get("frozen_crc32c") or {}) if own else {}
    live_crcs = frozen_shard_crcs(engine, parts) if any(s.source for _, s in frozen) else {}
    store = parts.param_store
    whole = store is None  # stages 0-2: every rank holds the whole unit
    for unit, saved in frozen:
        same = (
            reader.partitions == unit.layout.world_size
            and saved.shard_numel == unit.layout.shard_numel
        )
        lo, hi = unit.layout.shard_range(rank)
        lo_new, end = (
            (0, unit.layout.numel) if whole else (lo, min(hi, saved.numel) if not same else hi)
        )
        dtype, isz = unit.layout.dtype, unit.layout.itemsize
        n_dest = unit.layout.numel if whole else unit.layout.shard_numel
        dest: torch.Tensor | Callable[[], torch.Tensor] | None = (
            torch.empty(n_dest, dtype=dtype) if whole else None
        )
        ref = None if store is None else StoreRef(store, unit.key)
        after = _to_params(unit) if whole else None
        name = f"u{unit.index}.param"
        live_fmt = parts.formats.get(unit.index)
        live_spec = live_fmt.spec if live_fmt is not None else None
        saved_spec = spec_of(saved.quant)
        if live_fmt is not None:  # values land in host memory and are quantised into the store
            dest, ref = functools.partial(torch.empty, n_dest, dtype=dtype), None
            after = _to_packed(parts, unit, live_fmt, writes)
        if saved.source is None and saved_spec is not None:
            check_same_format(saved.name, saved_spec, live_spec, same and not whole)
            assert live_fmt is not None  # check_same_format: the same format
            assert store is not None  # a quantised unit rests in the parameter store (stage 3)
            entry = reader.entry(rank, name, torch.uint8, live_fmt.nbytes)
            f = reader.open_part(rank, handle)
            packed_crc = reader.part_crc(rank, name)
            out.checks.append(Check(reader.part_path(rank), f, entry, packed_crc))
            piece = Piece(f, entry.begin, 0, live_fmt.nbytes)
            out.groups.append(
                LoadGroup(
                    [
                        LoadItem(
                            name,
                            live_fmt.nbytes,
                            [piece],
                            ref=StoreRef(store, unit.key),
                            crc=packed_crc,
                            path=reader.part_path(rank),
                        )
                    ]
                )
            )
            out.nbytes += live_fmt.nbytes
            continue
        if saved.source is None:
            pieces = []
            for q in range(reader.partitions) if whole or not same else [rank]:
                a, b = max(lo_new, q * saved.shard_numel), min(end, (q + 1) * saved.shard_numel)
                if a >= b:
                    continue
                entry = reader.entry(q, name, dtype, saved.shard_numel)
                f = reader.open_part(q, handle)
                out.checks.append(Check(reader.part_path(q), f, entry, reader.part_crc(q, name)))
                pieces.append(
                    Piece(
                        f,
                        entry.begin + (a - q * saved.shard_numel) * isz,
                        (a - lo_new) * isz,
                        (b - a) * isz,
                    )
                )
            crc = reader.part_crc(rank, name) if same and not whole else None
            out.groups.append(
                LoadGroup(
                    [
                        LoadItem(
                            name,
                            n_dest * isz,
                            pieces,
                            ref=ref,
                            tensor=dest,
                            crc=crc,
                            path=reader.part_path(rank if same else 0),
                        )
                    ],
                    after,
                )
            )
            out.nbytes += n_dest * isz
            continue
        tensors = [(str(p), str(n)) for p, n in saved.source["tensors"]]
        used = {p: saved_files[p] for p, _ in tensors}
        check_files(used, saved.name)
        for (p, n), slot in zip(tensors, saved.slots, strict=True):
            files.tensor(p, n, slot.shape)
        want = saved_crcs.get(str(unit.index)) if same else None
        live = parts.sources.get(unit.index)
        if (
            want is not None
            and live is not None
            and saved_spec == live_spec
            and [list(t) for t in live.tensors] == [list(t) for t in tensors]
            and live_crcs.get(unit.index) == int(want)
        ):
            continue  # this engine's unit already holds those files' values

        def read(out_t: torch.Tensor, tensors=tensors, unit=unit, lo_new=lo_new) -> None:
            files.read_unit(tensors, unit.layout.slots, lo_new, lo_new + out_t.numel(), out_t)

        def saved_crc(shard: torch.Tensor, unit=unit, spec=saved_spec) -> int:
            """The CRC32C of the shard as it rested when saved: its packed bytes where quantised."""
            if spec is None:
                return shard_crc(shard)
            fmt = partition_format(
                unit.layout.slots, rank, unit.layout.shard_numel, unit.layout.dtype, spec
            )
            packed = torch.zeros(fmt.nbytes, dtype=torch.uint8)
            quantize_into(fmt, shard, packed, name=unit.module_name)
            return shard_crc(packed)

        def check(tensors=tensors, unit=unit, want=want, lo=lo, hi=hi, saved_crc=saved_crc) -> None:
            shard = torch.empty(hi - lo, dtype=unit.layout.dtype)
            files.read_unit(tensors, unit.layout.slots, lo, hi, shard)
            if saved_crc(shard) != int(want):
                paths = sorted({p for p, _ in tensors})
                raise CheckpointMismatchError(
                    f"the frozen weights of {unit.module_name!r} read from {', '.join(repr(p) for p in paths)} "
                    "differ from those the checkpoint was saved with (CRC32C of this rank's shard): the files "
                    "changed; restore the files the checkpoint was saved with"
                )

        if want is not None:
            out.source_checks.append(check)

        def fill(
            dests: list[torch.Tensor],
            read=read,
            after=after,
            check=check,
            want=want,
            saved_crc=saved_crc,
        ) -> None:
            read(dests[0])
            if want is not None and not whole:
                if saved_crc(dests[0]) != int(want):
                    check()  # raises naming the files
            if after is not None:
                after(dests)

        out.groups.append(LoadGroup([LoadItem(name, n_dest * isz, [], ref=ref, tensor=dest)], fill))
        out.nbytes += n_dest * isz
    return out


def _to_params(unit: ParamUnit) -> Callable[[list[torch.Tensor]], None]:
    """Stages 0-2: a frozen unit's loaded flat values into the module's parameters (held whole)."""

    def write(dests: list[torch.Tensor]) -> None:
        for p, s in zip(unit.params, unit.layout.slots, strict=True):
            p.data.view(-1).copy_(dests[0][s.offset : s.offset + s.numel])

    return write


def _to_packed(
    parts: TrainingParts, unit: ParamUnit, fmt: ShardFormat, writes: list[StoreFuture]
) -> Callable[[list[torch.Tensor]], None]:
    """A frozen unit resting quantised: its loaded shard values quantised into its store key."""
    store = parts.param_store
    assert store is not None  # a quantised unit rests in the parameter store (stage 3)

    def write(dests: list[torch.Tensor]) -> None:
        t = store.fetch(unit.key, overwrite=True).result()
        try:
            t.zero_()  # the gaps between parts too: the same bytes as initialize's
            quantize_into(fmt, dests[0], t, name=unit.module_name)
        finally:
            store.release(unit.key)
        spec = store.spec(unit.key)
        if spec.home == "nvme" and spec.holds == 0:
            writes.append(store.evict(unit.key))

    return write


def _after_master(parts: TrainingParts, unit: ParamUnit, writes: list[StoreFuture]):
    """What the parameters need once a unit's master is loaded: the 16-bit shard (stage 3, 16-bit), or the
    module's parameters (stages 0-2, all-gathered); nothing when the fp32 stage-3 shard is the master."""
    if parts.param_store is not None:
        if unit_state_refs(parts, unit)[0][1].store is parts.param_store:
            return None
        store = parts.param_store

        def to_param_shard(dests: list[torch.Tensor]) -> None:
            t = store.fetch(unit.key, overwrite=True).result()
            try:
                t.copy_(dests[0])
            finally:
                store.release(unit.key)
            spec = store.spec(unit.key)
            if spec.home == "nvme" and spec.holds == 0:
                writes.append(store.evict(unit.key))

        return to_param_shard
    on_updated = _partitioned(parts).on_updated
    if on_updated is None:
        return None
    return lambda dests: on_updated(unit.index, dests[0])


def _copy_to(p: torch.nn.Parameter) -> Callable[[list[torch.Tensor]], None]:
    """A parameter not read into directly (off the CPU, or not contiguous): its loaded values copied in."""

    def copy(dests: list[torch.Tensor]) -> None:
        p.data.copy_(dests[0])

    return copy


def _partitioned(parts: TrainingParts) -> ShardOptimizer:
    """The partitioned Adam, which steps every engine that trains without a passthrough optimizer."""
    if parts.optimizer is None:
        raise CheckpointMismatchError(
            "this engine has no optimizer (no parameter requires grad), so the checkpoint's optimizer "
            "state has nowhere to go; load it into an engine that trains the same parameters"
        )
    return parts.optimizer


def _plan_passthrough(
    parts: TrainingParts,
    optimizer: torch.optim.Optimizer,
    reader: CheckpointReader,
    handle: AioHandle,
    param_names: list[str],
    scope: LoadScope,
) -> tuple[list[LoadGroup], list[Check], int, Any]:
    m = reader.manifest
    saved = {p["name"]: p for p in m.get("params") or []}
    for name, p in zip(param_names, parts.params, strict=True):
        if name not in saved:
            raise CheckpointMismatchError(
                f"parameter {name!r} of this model is not in the checkpoint; load a checkpoint of this model"
            )
        if tuple(saved[name]["shape"]) != tuple(p.shape):
            raise CheckpointMismatchError(
                f"parameter {name!r} has shape {saved[name]['shape']} in the checkpoint but {list(p.shape)} in this model"
            )
    es = reader.engine_state()
    live_type = type(optimizer).__qualname__
    if scope.optimizer_states and es.get("optimizer_type") != live_type:
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer is a {es.get('optimizer_type')} and this engine's a {live_type}; use the same optimizer"
        )
    f = reader.open_part(0, handle)
    groups, checks, nbytes = [], [], 0

    def item(name: str, dest: torch.Tensor) -> LoadItem:
        e = reader.entry(0, name, dest.dtype, dest.numel())
        crc = reader.part_crc(0, name)
        checks.append(Check(reader.part_path(0), f, e, crc))
        return LoadItem(
            name,
            e.nbytes,
            [Piece(f, e.begin, 0, e.nbytes)],
            tensor=dest,
            crc=crc,
            path=reader.part_path(0),
        )

    for name, p in zip(param_names, parts.params, strict=True):
        direct = p.data.device.type == "cpu" and p.data.is_contiguous()
        dest = p.data if direct else torch.empty(p.shape, dtype=p.dtype)
        groups.append(
            LoadGroup(
                [item(f"param.{name}", dest)],
                None if direct else _copy_to(p),
            )
        )
        nbytes += dest.numel() * dest.element_size()
    if not scope.optimizer_states:
        return groups, checks, nbytes, None
    tensors = {}
    for name, e in reader.part(0).entries.items():
        if name.startswith("optim."):
            tensors[name] = torch.empty(e.shape, dtype=e.dtype)
            groups.append(LoadGroup([item(name, tensors[name])]))
            nbytes += e.nbytes
    state = decode(es["optimizer_state"], tensors, "optimizer state")
    live = optimizer.state_dict()["param_groups"]
    if [len(g["params"]) for g in state["param_groups"]] != [len(g["params"]) for g in live]:
        raise CheckpointMismatchError(
            "the checkpoint's optimizer param groups hold other parameters than this engine's"
        )
    return groups, checks, nbytes, state


# -- phase 3 ------------------------------------------------------------------


def _read_shards(parts: TrainingParts, plan: _Plan, handle: AioHandle, bar: Progress) -> None:
    """Reads every shard into its store key, with nothing else holding a copy of one meanwhile: persistent
    units let go of theirs (gathered again afterwards, from the loaded values) and the prefetch scheduler
    gives back what it read ahead — in a step left open by a forward without backward, or for the next
    step (its copies would be stale)."""
    if parts.trace is not None:
        parts.trace.abort_step()
    if parts.partitioner is not None:
        parts.partitioner.release_persistent()
    try:
        with torch.no_grad(), torch_threads(1):  # see [Note: torch threads] in threads.py
            read_into(handle, plan.groups, progress=bar)
        for fut in plan.writes:
            fut.result()
    finally:
        if parts.partitioner is not None:
            parts.partitioner.gather_persistent()


def _apply(
    engine: CheckpointTarget, parts: TrainingParts, plan: _Plan, handle: AioHandle, bar: Progress
) -> None:
    _read_shards(parts, plan, handle, bar)
    s = plan.small
    es = s["engine"]
    scope = plan.scope
    # What the param groups hold now, by position: torch's load_state_dict replaces them with the
    # checkpoint's, and only the values the scope restores (s["hyper"]) may change.
    before = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    if parts.passthrough is not None:
        if scope.optimizer_states:
            parts.passthrough.load_state_dict(s["optimizer_state"])
        elif not scope.module_only:
            parts.passthrough.state.clear()  # momentum and the like start afresh
    elif scope.optimizer_states:
        _partitioned(parts).param_steps[:] = s["param_steps"]
    elif not scope.module_only:
        steps = _partitioned(parts).param_steps
        steps[:] = [0] * len(steps)
    for g, old, values in zip(
        engine.optimizer.param_groups, before, s["hyper"].values, strict=True
    ):
        g.update(old)
        g.update(values)
    if scope.lr_scheduler_states:
        restore_scheduler(s["lr_scheduler"], engine.lr_scheduler)
    if scope.optimizer_states:
        engine.loss_scaler.load_state_dict(es["loss_scaler"])
    _, live_buffers = state_dict_names(engine.module)
    with torch.no_grad():
        for name, b in live_buffers.items():
            b.copy_(s["buffers"][name])
    for k, v in (s["counters"] or {}).items():
        setattr(engine, k, v)
    if s["rng"] is not None:
        restore_rng(*s["rng"])
    elif scope.run_state:
        log.info(
            "rank %d did not exist when the checkpoint was saved: its RNG state is not restored",
            engine.group.rank,
        )
