"""Weight files written by rank 0 while every rank streams: the one place that opens them, aborts them
on error, closes the aio handle and agrees over the group.

[Note: a collective write]
``save_16bit_model`` and ``save_merged`` stream different tensors, but end the same way. Under stage 3
every rank takes part in the gathers and rank 0 alone writes, so a failure on any rank must stop all of
them at the same two points: after planning (segments, the files opened on rank 0), and after the
stream (committed, or aborted: nothing left under a temporary name). ``rank0_weight_files`` runs the
plan, opens the files, yields to the stream, aborts the files if the stream raised, closes the handle
it opened, and ends each phase in ``agree`` (collective.py). Without a group (a checkpoint exported by
one process, ``export_merged``) the same context writes and aborts with no agreement.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar, cast

from infinity.aio import AioConfig, AioHandle
from infinity.engine.checkpoint.collective import agree
from infinity.engine.checkpoint.weights_out import Segment, WeightFiles
from infinity.zero.collectives import DataParallelGroup

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Planned:
    """What rank 0 writes: ``segments`` into ``weights_name`` (or its shards) under ``directory``
    (created), as WeightFiles takes them."""

    directory: Path
    segments: list[Segment]
    weights_name: str
    max_shard_nbytes: int | None = None
    replace_stale: bool = False


@contextlib.contextmanager
def rank0_weight_files(
    group: DataParallelGroup | None,
    aio: AioConfig | AioHandle,
    what: str,
    plan: Callable[[], tuple[Planned, T]],
) -> Iterator[tuple[T, WeightFiles | None]]:
    """Runs ``plan`` on every rank; rank 0 (or the one process when ``group`` is None) opens its files
    with a handle made from ``aio`` (or ``aio`` itself, borrowed and left open). Yields (what the plan
    returned beside the files, the files on rank 0 else None); the body streams and commits. Raises on
    every rank if any rank's plan or stream failed, naming ``what``; see [Note: a collective write]."""
    rank = group.rank if group is not None else 0
    output: WeightFiles | None = None
    handle: AioHandle | None = None
    owned = False
    err: Exception | None = None
    planned: T | None = None
    try:
        spec, planned = plan()
        if rank == 0:
            if isinstance(aio, AioHandle):
                handle = aio
            else:
                handle, owned = AioHandle.from_config(aio), True
            spec.directory.mkdir(parents=True, exist_ok=True)
            output = WeightFiles(
                spec.directory,
                handle,
                spec.segments,
                weights_name=spec.weights_name,
                max_shard_nbytes=spec.max_shard_nbytes,
                replace_stale=spec.replace_stale,
            )
    except Exception as e:
        err = e
        if owned and handle is not None:
            handle.close()
    _agree(group, err, f"starting to write {what}")
    err = None
    done = False
    try:
        yield cast(T, planned), output  # set: had the plan raised, _agree raised above
        done = True
    except Exception as e:
        err = e
    finally:
        if output is not None and not done:
            output.abort()
        if owned and handle is not None:
            handle.close()
    _agree(group, err, f"writing {what}")


def _agree(group: DataParallelGroup | None, err: Exception | None, what: str) -> None:
    if group is not None:
        agree(group, err, what)
    elif err is not None:
        raise err
