"""The data-parallel group, as the partitioner uses it: all-gather shards, reduce-scatter grads.

World size 1 needs no process group: every collective is a local copy. With
``torchrun``, the default group is used (gloo on CPU, NCCL on GPU); this module
never opens sockets of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_gather_fn():
    # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to
    # *_single and deprecated the old names; torch >= 2.4 has the old ones.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DataParallelGroup:
    """Rank, world size and the collectives of one data-parallel group."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """full[r * n:(r + 1) * n] = shard of rank r, for every r."""
        if self.world_size == 1:
            if full.data_ptr() != shard.data_ptr():
                full.copy_(shard)
            return
        _all_gather_fn()(full, shard, group=self.group)

    def reduce_scatter_mean(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """shard = mean over ranks of full[rank's slice]."""
        if self.world_size == 1:
            shard.copy_(full)
            return
        _reduce_scatter_fn()(shard, full, op=dist.ReduceOp.SUM, group=self.group)
        shard.div_(self.world_size)

    def all_reduce_mean(self, t: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
            t.div_(self.world_size)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)

    def all_reduce_max(self, t: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        if self.world_size > 1:
            dist.broadcast(t, src=src, group=self.group)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
