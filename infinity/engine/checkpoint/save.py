"""save_checkpoint: every rank streams its shards from the stores to the checkpoint, then rank 0 publishes it.

Phases (each ends in ``agree``, see collective.py):
1. Capture the small state in memory (RNG, counters, client state, ...): a
   client_state that a checkpoint cannot hold fails here, before any file.
2. Rank 0 takes the root's lock ([Note: one save per root] in lock.py) and
   creates the hidden directory (see [Note: publishing a checkpoint]).
3. Each rank < partitions writes its part file (units in order, a unit's
   master / exp_avg / exp_avg_sq fetched from the stores and written with the
   aio engine, never the full model in memory); every rank writes its rank
   file. Each file is fsynced.
4. Rank 0 checks every rank's file is there, writes manifest.json, renames
   the directory into place, then points ``latest`` at it.
On an exception in any phase every rank raises, and rank 0 removes the
hidden directory and releases the lock; a killed process leaves the
directory for loaders to skip (and its lock is released by the kernel).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from infinity.aio import DIRECT_ALIGNMENT, AioHandle, crc32c
from infinity.engine.checkpoint import atomic
from infinity.engine.checkpoint.collective import agree, shared_nonce
from infinity.engine.checkpoint.format import (
    DIR_MODE,
    FORMAT,
    MANIFEST,
    VERSION,
    dtype_name,
    manifest_bytes,
    part_name,
    rank_name,
)
from infinity.engine.checkpoint.lock import SaveLock
from infinity.engine.checkpoint.model import describe_units, state_dict_names
from infinity.engine.checkpoint.model_files import model_files
from infinity.engine.checkpoint.nodes import (
    Topology,
    node_index,
    node_manifest_bytes,
    node_manifest_name,
)
from infinity.engine.checkpoint.progress import Progress
from infinity.engine.checkpoint.quantised import spec_json
from infinity.engine.checkpoint.sources import shard_crc
from infinity.engine.checkpoint.state import (
    capture_hyperparameters,
    capture_rng,
    capture_scheduler,
    param_group_of,
)
from infinity.engine.checkpoint.stream import SaveItem, write_part
from infinity.engine.checkpoint.target import CheckpointTarget, TrainingParts
from infinity.engine.checkpoint.values import TensorSink, encode
from infinity.engine.checkpoint.window import StoreRef
from infinity.weights.header import Header, build_header
from infinity.weights.in_memory import tensors_to_bytes
from infinity.zero.unit import ParamUnit

log = logging.getLogger("infinity.checkpoint")

FP32 = torch.float32


@dataclasses.dataclass
class _Planned:
    """One tensor of the part file before offsets are known."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    ref: StoreRef | None = None
    tensor: torch.Tensor | None = None


def unit_state_refs(parts: TrainingParts, unit: ParamUnit) -> list[tuple[str, StoreRef]]:
    """(role, where it lives) of a unit shard's fp32 state: the master (in the parameter store when the
    fp32 stage-3 shard is its own master), exp_avg and exp_avg_sq."""
    ss = parts.state_store
    if ss is None:
        raise ValueError(
            f"unit {unit.index} has optimizer state, and the engine no state store to hold it"
        )
    i = unit.index
    if (i, "master") in ss or parts.param_store is None:
        master = StoreRef(ss, (i, "master"))
    else:
        master = StoreRef(parts.param_store, unit.key)
    return [
        ("master", master),
        ("exp_avg", StoreRef(ss, (i, "m"))),
        ("exp_avg_sq", StoreRef(ss, (i, "v"))),
    ]


def partitions_of(parts: TrainingParts) -> int:
    return parts.units[0].layout.world_size if parts.units else 1


def _plan_units(parts: TrainingParts, referenced: set[int], rank: int) -> list[list[_Planned]]:
    """Per unit: a trainable one's fp32 master and moments; a frozen one's shard in its dtype, unless
    ``referenced`` ([Note: frozen units in a checkpoint] in sources.py)."""
    groups = []
    for u in parts.units:
        shape = (u.layout.shard_numel,)
        if u.trainable:
            groups.append(
                [
                    _Planned(f"u{u.index}.{role}", FP32, shape, ref=ref)
                    for role, ref in unit_state_refs(parts, u)
                ]
            )
        elif u.index not in referenced:
            if parts.param_store is not None:
                fmt = parts.formats.get(u.index)  # packed: [Note: a quantised base in a checkpoint]
                groups.append(
                    [
                        _Planned(
                            f"u{u.index}.param",
                            u.layout.dtype if fmt is None else torch.uint8,
                            shape if fmt is None else (fmt.nbytes,),
                            ref=StoreRef(parts.param_store, u.key),
                        )
                    ]
                )
            else:
                groups.append(
                    [
                        _Planned(
                            f"u{u.index}.param",
                            u.layout.dtype,
                            shape,
                            tensor=resident_shard(u, rank),
                        )
                    ]
                )
    return groups


def resident_shard(unit: ParamUnit, rank: int) -> torch.Tensor:
    """Stages 0-2: shard ``rank`` of a unit whose parameters the module holds whole (zeros past its end)."""
    lo, hi = unit.layout.shard_range(rank)
    shard = torch.zeros(hi - lo, dtype=unit.layout.dtype)
    for p, s in zip(unit.params, unit.layout.slots, strict=True):
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < b:
            shard[a - lo : b - lo].copy_(p.detach().reshape(-1)[a - s.offset : b - s.offset])
    return shard


def shard_rank(engine: CheckpointTarget) -> int:
    """The rank whose part of each unit this rank holds (stage 0 keeps whole units: rank 0's)."""
    return 0 if engine.stage == 0 else engine.group.rank


def frozen_shard_crcs(engine: CheckpointTarget, parts: TrainingParts) -> dict[int, int]:
    """CRC32C of this rank's shard of every frozen unit, as it is now (read once, nothing written)."""
    out = {}
    rank = shard_rank(engine)
    for u in parts.units:
        if u.trainable:
            continue
        if parts.param_store is None:
            out[u.index] = shard_crc(resident_shard(u, rank))
            continue
        store = parts.param_store
        t = store.fetch(u.key).result()
        try:
            out[u.index] = shard_crc(t)
        finally:
            store.release(u.key)
    return out


def referenced_units(parts: TrainingParts, crcs: dict[int, int]) -> list[int]:
    """1 per unit whose values on this rank are still those of its files, else 0 (agreed over ranks)."""
    return [
        int(
            u.index in crcs
            and u.index in parts.sources
            and crcs[u.index] == parts.sources[u.index].shard_crc32c
        )
        for u in parts.units
    ]


def _plan_passthrough(
    parts: TrainingParts, optimizer: torch.optim.Optimizer, param_names: list[str]
) -> tuple[list[list[_Planned]], Any]:
    """Stage 0 with a torch optimizer of the user's: the parameters whole, and the optimizer's tensors."""
    groups = [
        [_Planned(f"param.{n}", p.dtype, tuple(p.shape), tensor=p.data)]
        for n, p in zip(param_names, parts.params, strict=True)
    ]
    sink = TensorSink("optim.", copy=False)
    skeleton = encode(optimizer.state_dict(), sink, "optimizer.state_dict()")
    groups += [[_Planned(n, t.dtype, tuple(t.shape), tensor=t)] for n, t in sink.tensors.items()]
    return groups, skeleton


def param_names(engine: CheckpointTarget, parts: TrainingParts) -> list[str]:
    """Each trained parameter's first state_dict name, in the optimizer's order."""
    names, _ = state_dict_names(engine.module)
    return [
        names[id(p)][0] if id(p) in names else f"<unnamed {i}>" for i, p in enumerate(parts.params)
    ]


def _capture_small(
    engine: CheckpointTarget,
    parts: TrainingParts,
    client_state: Any,
    param_names: list[str],
    extra: dict[str, Any],
    crcs: dict[int, int],
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's small state (JSON, tensors) and rank 0's additions to the manifest. Raises TypeError
    for a client_state a checkpoint cannot hold, before anything is written."""
    sink = TensorSink("t.")
    state: dict[str, Any] = {
        "rank": engine.group.rank,
        "rng": capture_rng(sink),
        "client_state": encode(client_state, sink, "client_state"),
        "param_steps": list(parts.optimizer.param_steps) if parts.optimizer is not None else None,
    }
    manifest_extra: dict[str, Any] = {}
    if crcs:  # the frozen units' shards, checked against their files on load
        state["frozen_crc32c"] = {str(i): c for i, c in crcs.items()}
    _, buffers = state_dict_names(engine.module)
    if engine.group.rank == 0:
        manifest_extra["buffers"] = {
            n: {"dtype": dtype_name(b.dtype), "shape": list(b.shape)} for n, b in buffers.items()
        }
        if parts.passthrough is not None:
            aliases, _ = state_dict_names(engine.module)
            manifest_extra["params"] = [
                {
                    "name": n,
                    "dtype": dtype_name(p.dtype),
                    "shape": list(p.shape),
                    "aliases": [n] + [a for a in aliases.get(id(p), []) if a != n],
                }
                for n, p in zip(param_names, parts.params, strict=True)
            ]
        opt = engine.optimizer
        state["engine"] = {
            "loss_scaler": engine.loss_scaler.state_dict(),
            "lr_scheduler": capture_scheduler(engine.lr_scheduler, sink),
            "lr_scheduler_type": None
            if engine.lr_scheduler is None
            else type(engine.lr_scheduler).__qualname__,
            "param_groups": capture_hyperparameters(opt.param_groups),
            "param_group_of": param_group_of(opt.param_groups, parts.params),
            "param_names": param_names,
            **extra,
        }
    tensors = dict(sink.tensors)
    # Every rank's buffers: nothing keeps them equal across ranks (BatchNorm statistics of each rank's data).
    for name, b in buffers.items():
        tensors[f"buffer.{name}"] = b.detach().to("cpu", copy=True).contiguous()
    return state, tensors, manifest_extra


def _rank_file(
    state: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    part_file: str | None,
    part_crcs: dict[str, int] | None,
    header_crc: int | None,
) -> bytes:
    """The rank file: the small state as JSON in __metadata__, with the CRC32C of its part's tensors and
    of its part's header."""
    state = {
        **state,
        "part": None
        if part_file is None
        else {"file": part_file, "crc32c": part_crcs, "header_crc32c": header_crc},
    }
    meta = {"format": FORMAT, "version": str(VERSION), "kind": "rank", "state": json.dumps(state)}
    return tensors_to_bytes(tensors, meta)


@dataclasses.dataclass
class _Prepared:
    """Phase 1's result on one rank: what its part file holds and its small state."""

    partitions: int
    groups: list[list[_Planned]]
    header: bytes
    layout: Header
    small: tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]
    parts: TrainingParts
    model_files: dict[str, bytes]
    """Rank 0: config.json, adapter_config.json (model_files.py)."""


def _prepare(
    engine: CheckpointTarget,
    parts: TrainingParts,
    client_state: Any,
    crcs: dict[int, int],
    referenced: set[int],
) -> _Prepared:
    rank = engine.group.rank
    names = param_names(engine, parts)
    partitions = partitions_of(parts)
    writes_part = rank < partitions
    if parts.passthrough is not None:
        groups, skeleton = (
            _plan_passthrough(parts, parts.passthrough, names) if writes_part else ([], None)
        )
        extra = {
            "optimizer_state": skeleton,
            "optimizer_type": type(parts.passthrough).__qualname__,
        }
    else:
        groups = _plan_units(parts, referenced, shard_rank(engine)) if writes_part else []
        extra = {}
    small = _capture_small(engine, parts, client_state, names, extra, crcs)
    files: dict[str, bytes] = {}
    if rank == 0:
        files, small[2]["peft"] = model_files(engine.module)
    small[2]["references"] = {i: parts.sources[i].reference_json() for i in referenced}
    small[2]["source_files"] = {
        p: f.to_json() for i in sorted(referenced) for p, f in parts.sources[i].files.items()
    }
    header, layout = build_header(
        [(p.name, p.dtype, p.shape) for g in groups for p in g],
        {
            "format": FORMAT,
            "version": str(VERSION),
            "kind": "part",
            "partition": str(rank),
            "partitions": str(partitions),
        },
        align=DIRECT_ALIGNMENT,
    )
    return _Prepared(partitions, groups, header, layout, small, parts, files)


def _make_directory(root: Path, tag: str, tmp: Path) -> SaveLock:
    """Rank 0: the root, its lock ([Note: one save per root]) and the hidden directory of this save."""
    atomic.make_dirs(root)
    final = root / tag
    if final.exists() and not final.is_dir():
        raise NotADirectoryError(
            f"'{final}' is a file, not a directory, so checkpoint '{tag}' cannot be saved there; move the file "
            "away or choose another tag"
        )
    save_lock = SaveLock(root, tag, tmp)
    try:
        for stale in atomic.leftovers(root):
            if stale.name.startswith(f".{tag}{atomic.PARTIAL}"):
                log.info("removing '%s', left by an interrupted save of the same tag", stale)
                shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(DIR_MODE)
        atomic.fsync_path(root, directory=True)
    except BaseException:
        save_lock.release()
        raise
    return save_lock


def _write_files(
    engine: CheckpointTarget, prep: _Prepared, tmp: Path, tag: str, progress: bool | None
) -> list[int]:
    """This rank's part file (if it owns a partition) and rank file; returns [part bytes, rank file bytes,
    rank file CRC32C] for the manifest."""
    rank = engine.group.rank
    crcs = part_file = header_crc = None
    if rank < prep.partitions:
        part_file = part_name(rank, prep.partitions)
        entries = prep.layout.entries
        with (
            Progress(
                prep.layout.file_nbytes, f"save {tag}", progress if rank == 0 else False
            ) as bar,
            AioHandle.from_config(engine.config.aio) as handle,
        ):
            crcs = write_part(
                handle,
                tmp / part_file,
                prep.header,
                ([SaveItem(entries[p.name], p.ref, p.tensor) for p in g] for g in prep.groups),
                file_nbytes=prep.layout.file_nbytes,
                progress=bar,
            )
        header_crc = crc32c(prep.header)
    blob = _rank_file(prep.small[0], prep.small[1], part_file, crcs, header_crc)
    atomic.write_durably(tmp / rank_name(rank), blob, f"rank file '{rank_name(rank)}'")
    return [prep.layout.file_nbytes if part_file else 0, len(blob), crc32c(blob)]


def _describe(
    engine: CheckpointTarget,
    prep: _Prepared,
    tag: str,
    nonce: str,
    sizes: list[list[int]],
    topo: Topology | None,
) -> tuple[bytes, dict[str, bytes], dict[str, dict[str, int]]]:
    """Rank 0: manifest.json's bytes, the model files beside it, and every file's size and CRC32C."""
    files: dict[str, dict[str, int]] = {}
    for r, (part_nbytes, rank_nbytes, rank_crc) in enumerate(sizes):
        if r < prep.partitions:
            files[part_name(r, prep.partitions)] = {"nbytes": part_nbytes}
        files[rank_name(r)] = {"nbytes": rank_nbytes, "crc32c": rank_crc}
    for name, blob in prep.model_files.items():
        files[name] = {"nbytes": len(blob), "crc32c": crc32c(blob)}
    extra = dict(prep.small[2])
    extra["save_id"] = nonce
    if topo is not None:
        extra["nodes"] = {str(n): topo.ranks_of(n) for n in sorted(set(topo.nodes))}
    manifest = _manifest(engine, prep.parts, tag, prep.partitions, files, extra)
    return manifest_bytes(manifest), prep.model_files, files


def _node_files(
    files: dict[str, dict[str, int]], ranks: list[int], partitions: int
) -> dict[str, dict[str, int]]:
    """The files a node holds: its ranks' part and rank files, and the model files (every node has them)."""
    own = {rank_name(r) for r in ranks} | {
        part_name(r, partitions) for r in ranks if r < partitions
    }
    return {n: f for n, f in files.items() if n in own or not n.startswith(("part-", "rank-"))}


def _make_durable(
    tmp: Path,
    described: tuple[bytes, dict[str, bytes], dict[str, dict[str, int]]],
    *,
    node: int | None,
    ranks: list[int],
    partitions: int,
    tag: str,
    nonce: str,
) -> None:
    """A node's leader (rank 0 alone on a shared directory): its ranks' files checked, the model files,
    the node manifest and manifest.json written and fsynced, then the directory fsynced (phase one of
    [Note: node-local checkpoints]; nothing is published yet)."""
    blob, model_blobs, files = described
    held = _node_files(files, ranks, partitions) if node is not None else files
    _check_files_present(
        tmp, {n: f for n, f in held.items() if n not in model_blobs}, node_local=node is not None
    )
    for name, data in model_blobs.items():
        atomic.write_durably(tmp / name, data, name)
    if node is not None:
        atomic.write_durably(
            tmp / node_manifest_name(node),
            node_manifest_bytes(save_id=nonce, tag=tag, node=node, ranks=ranks, files=held),
            node_manifest_name(node),
        )
    atomic.write_durably(tmp / MANIFEST, blob, MANIFEST)
    atomic.fsync_path(tmp, directory=True)


def save_checkpoint(
    engine: CheckpointTarget,
    save_dir: str | os.PathLike,
    tag: str | None = None,
    client_state: Any = None,
    *,
    save_latest: bool = True,
    progress: bool | None = None,
    node_local: bool | None = None,
) -> Path:
    """Saves the engine's full training state under ``save_dir/tag`` (default tag: ``global_step<N>``) and
    points ``save_dir/latest`` at it (``save_latest=False``: leaves ``latest`` as it was, DeepSpeed's
    switch). ``node_local`` (default: the config's ``checkpoint.use_node_local_storage``): ``save_dir`` is
    each node's own directory ([Note: node-local checkpoints] in nodes.py). Every rank must call it.
    Returns the checkpoint's directory."""
    if engine.micro_steps % engine.gradient_accumulation_steps:
        raise RuntimeError(
            f"save_checkpoint() was called in the middle of a gradient accumulation window (micro step "
            f"{engine.micro_steps % engine.gradient_accumulation_steps} of {engine.gradient_accumulation_steps}); "
            "the gradients accumulated so far are not part of a checkpoint, so call it after engine.step() at "
            "an accumulation boundary"
        )
    tag = atomic.validate_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    if node_local is None:
        node_local = bool(engine.config.checkpoint.use_node_local_storage)
    group = engine.group
    root = Path(save_dir)
    t0 = time.perf_counter()
    prep: _Prepared | None = None
    err: Exception | None = None
    crcs: dict[int, int] = {}
    flags: list[int] = []
    node = 0
    parts = engine.checkpoint_parts()  # the pieces; their values are read after the step below
    try:
        # The overlapped optimizer step (stage 3) may still be updating shards, counts and moments: the
        # checkpoint holds the state after it. Updated shards it left cached and dirty in the store are
        # read through the store (window.py), so their current values are saved, and stay cached.
        engine.synchronize()
        crcs = frozen_shard_crcs(engine, parts)
        flags = referenced_units(parts, crcs)
        node = node_index() if node_local else 0
    except Exception as e:
        err = e
    rows = agree(
        group, err, "checking the frozen units", [node, *(flags or [0] * len(parts.units))]
    )
    topo = Topology(tuple(row[0] for row in rows))
    referenced = {u.index for k, u in enumerate(parts.units) if all(row[1 + k] for row in rows)}
    try:
        prep = _prepare(engine, parts, client_state, crcs, referenced)
    except Exception as e:
        err = e
    agree(group, err, "preparing the checkpoint")
    assert prep is not None  # agree() raised, had this rank failed to prepare

    nonce = shared_nonce(group)
    tmp = atomic.partial_dir(root, tag, nonce)
    my_node = topo.nodes[group.rank]
    leader = group.rank == topo.leader(my_node)
    err, save_lock = None, None
    if leader:
        try:
            save_lock = _make_directory(root, tag, tmp)
        except Exception as e:
            err = e
    try:
        agree(group, err, f"creating '{tmp}'" + (" on every node" if node_local else ""))
        sizes = _write_and_publish(
            engine, prep, root, tmp, tag, nonce, progress, save_latest, topo if node_local else None
        )
    finally:
        if save_lock is not None:
            save_lock.release()
    total = sum(a + b for a, b, _ in sizes)
    dt = time.perf_counter() - t0
    log.info(
        "saved checkpoint '%s': %.2f GB in %.2f s (%.2f GB/s)",
        root / tag,
        total / 1e9,
        dt,
        total / 1e9 / max(dt, 1e-9),
    )
    return root / tag


def _write_and_publish(
    engine: CheckpointTarget,
    prep: _Prepared,
    root: Path,
    tmp: Path,
    tag: str,
    nonce: str,
    progress: bool | None,
    save_latest: bool,
    topo: Topology | None,
) -> list[list[int]]:
    """Phases 3 and 4 ([Note: publishing a checkpoint]; node-local: [Note: node-local checkpoints]);
    returns every rank's [part bytes, rank file bytes, rank file CRC32C]. ``topo``: the nodes of a
    node-local save, None on a shared directory (rank 0 describes and publishes it alone)."""
    group = engine.group
    node: int | None = None
    ranks = list(range(group.world_size))
    if topo is not None:
        node = topo.nodes[group.rank]
        ranks = topo.ranks_of(node)
    leader = group.rank == ranks[0]

    def step(what: str, fn, *, cleanup: bool = True) -> Any:
        err, out = None, None
        try:
            out = fn()
        except Exception as e:
            err = e
        try:
            agree(group, err, what)
        except BaseException:
            if leader and cleanup:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out

    err, info = None, [0, 0, 0]
    try:
        info = _write_files(engine, prep, tmp, tag, progress)
    except Exception as e:
        err = e
    try:
        sizes = agree(group, err, f"writing checkpoint '{tag}'", info)
    except BaseException:
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    described = step(
        f"describing checkpoint '{tag}'",
        lambda: _describe(engine, prep, tag, nonce, sizes, topo) if group.rank == 0 else None,
    )
    if topo is not None and group.world_size > 1:
        box = [described]
        dist.broadcast_object_list(box, src=_global_rank(group, 0), group=group.group)
        described = box[0]
    step(
        f"making checkpoint '{tag}' durable" + (" on every node" if topo is not None else ""),
        lambda: (
            _make_durable(
                tmp,
                described,
                node=node,
                ranks=ranks,
                partitions=prep.partitions,
                tag=tag,
                nonce=nonce,
            )
            if leader
            else None
        ),
    )

    def publish() -> None:
        if leader:
            atomic.publish(tmp, root / tag, nonce)
            if save_latest:
                atomic.write_latest(root, tag, nonce)

    # A node that fails here may have renamed its directory: nothing to remove (loads settle it).
    step(f"publishing checkpoint '{tag}'", publish, cleanup=False)
    return sizes


def _global_rank(group, rank: int) -> int:
    return rank if group.group is None else dist.get_global_rank(group.group, rank)


def _check_files_present(tmp: Path, files: dict[str, dict[str, int]], *, node_local: bool) -> None:
    for name, f in files.items():
        p = tmp / name
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            why = (
                "the ranks of one node (torchrun's GROUP_RANK) must see the same directory"
                if node_local
                else "the checkpoint directory must be one directory shared by every rank (a shared file "
                "system), as in DeepSpeed, or set checkpoint.use_node_local_storage for one directory "
                "per node"
            )
            raise FileNotFoundError(
                f"'{p}' is missing although its rank reported writing it: {why}"
            ) from None
        if size != f["nbytes"]:
            raise OSError(f"'{p}' has {size} bytes; its rank wrote {f['nbytes']}")


def _manifest(
    engine: CheckpointTarget,
    parts: TrainingParts,
    tag: str,
    partitions: int,
    files: dict[str, Any],
    extra: dict[str, Any],
) -> dict[str, Any]:
    from infinity import __version__

    zero = engine.config.zero_optimization
    return {
        "format": FORMAT,
        "version": VERSION,
        "tag": tag,
        "created_unix": time.time(),
        "infinity_version": __version__,
        "torch_version": torch.__version__,
        "world_size": engine.group.world_size,
        "stage": engine.stage,
        "partitions": partitions,
        "train_dtype": dtype_name(engine.dtype),
        "persistence_threshold": int(zero.stage3_param_persistence_threshold)
        if engine.stage == 3
        else 0,
        "optimizer": "partitioned_adam" if parts.optimizer is not None else "passthrough",
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "units": [
            u.to_json()
            for u in describe_units(
                engine.module,
                parts.units,
                extra.get("references"),
                {i: spec_json(f.spec) for i, f in parts.formats.items()},
            )
        ],
        "source_files": extra.get("source_files", {}),
        "peft": extra.get(
            "peft"
        ),  # the adapter a PEFT model trains (its config: adapter_config.json)
        "params": extra.get(
            "params"
        ),  # stage 0 with the user's torch optimizer: no units, whole parameters
        "buffers": extra.get("buffers", {}),
        "files": files,
        "config": json.loads(json.dumps(engine.config.to_dict(), default=str)),
        "save_id": extra.get("save_id"),  # every file of one save, on every node, names it
        "nodes": extra.get(
            "nodes"
        ),  # node-local: each node's ranks ([Note: node-local checkpoints])
    }
