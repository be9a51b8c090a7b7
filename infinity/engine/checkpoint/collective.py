"""Agreement between ranks at each step of a save or load, so that one rank's failure stops all of them.

Every phase of a save or load runs on every rank and ends in ``agree``: an
all-gather of "did it fail" (plus a few integers a phase reports). A rank
that failed re-raises its own exception; the others raise
CheckpointPeerError naming it. Nobody is left waiting in a collective that a
failed rank will never join.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch
import torch.distributed as dist

from infinity.engine.checkpoint.errors import CheckpointPeerError
from infinity.zero.collectives import DataParallelGroup


def agree(
    group: DataParallelGroup, error: BaseException | None, what: str, values: Sequence[int] = ()
) -> list[list[int]]:
    """All ranks' ``values`` (by rank) if no rank failed ``what``; raises otherwise."""
    n = len(values)
    row = [0, *values] if error is None else [1] + [0] * n
    mine = torch.tensor(row, dtype=torch.int64, device=collective_device(group))
    full = torch.zeros(group.world_size * (n + 1), dtype=torch.int64, device=mine.device)
    group.all_gather(full, mine)
    rows = full.view(group.world_size, n + 1).tolist()
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        raise CheckpointPeerError(
            f"{what} failed on rank(s) {', '.join(map(str, failed))}; their own errors say why (this rank's "
            "part succeeded and was rolled back with the rest)"
        )
    return [row[1:] for row in rows]


def shared_nonce(group: DataParallelGroup) -> str:
    """A random name part chosen by rank 0 and known to every rank."""
    t = torch.tensor(
        [secrets.randbits(62) if group.rank == 0 else 0],
        dtype=torch.int64,
        device=collective_device(group),
    )
    group.broadcast(t, src=0)
    return f"{int(t.item()):016x}"


def collective_device(group: DataParallelGroup) -> torch.device:
    """Where tensors for the group's collectives must live: the current GPU under NCCL, else the CPU."""
    if group.distributed and dist.get_backend(group.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
