"""GatheredParameters: DeepSpeed's context for reading (or changing) partitioned parameters whole.

Inside the context the given parameters have their full shape and values on
every rank. With ``modifier_rank`` set, that rank's values at exit become
every rank's: the parameters (or their shards) and the fp32 master copy the
optimizer keeps (see [Note: changes made under GatheredParameters reach the
fp32 master] in masters.py), in every precision and at every stage. Every
rank must enter it, with the same parameters.

The context does the collectives; what to gather and where a change goes is
the business of each parameter's owner (a ``ParamOwner``), found through
``PARAM_OWNERS`` (see [Note: finding a parameter's owner] in owners.py):
an engine's Stage3Partitioner or ResidentParams, or zero.Init's store before
``initialize``. Parameters no owner holds are left as they are.

[Note: user gathers outside the pool]
DeepSpeed users write ``with GatheredParameters(model.parameters()):
torch.save(model.state_dict())`` — the whole model at once, which may be far
more than the parameter pool holds (the pool is sized for a few layers at a
time). So a unit gathered for a user is copied into memory of its own on the
compute device, one shard at a time, and its pool buffer is given back at
once: the gather never waits for pool room, never holds room the next
forward, the prefetcher or an optimizer step still running in the background
needs (that step reads and writes through the same pool; the gather only
waits, per unit, for the unit's update to be in place), and the pool's
contents are untouched by a change made without ``modifier_rank`` (lost, as
DeepSpeed documents). Before anything is gathered the bytes asked are checked
against the memory free on that device (MemAvailable, or CUDA's free memory)
and refused at once (MemoryError), with both figures, when they cannot fit —
on every rank when on one (the gathers are collectives).

Threading: the training thread, outside forward and backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from infinity.host import meminfo
from infinity.zero.owners import LiveOwners


class UserGather(Protocol):
    """Parameters an owner made whole for one GatheredParameters context."""

    def release(self, *, commit: bool) -> None:
        """Ends the gather. ``commit``: the modifier rank's values (if one was named) become every
        rank's, parameters and fp32 masters alike. Every rank calls it, in the same order."""
        ...


@runtime_checkable
class ReshapingGather(Protocol):
    """A UserGather whose owner lays a parameter out anew when the context gave it another shape
    (zero.Init's store, before ``initialize``). Hugging Face's ``resize_token_embeddings`` does that
    (``embedding.weight.data = larger``); an engine's units have a fixed layout, so its owners refuse it."""

    def release(self, *, commit: bool) -> None: ...

    def repartitions(self) -> bool:
        """True: a committed change of shape (``modifier_rank`` set) is kept."""
        ...


class ParamOwner(Protocol):
    """What holds the data of some parameters (Stage3Partitioner, ResidentParams, InitStore)."""

    def __contains__(self, p: object) -> bool: ...

    def gather_for_user(
        self, params: Sequence[nn.Parameter], *, modifier_rank: int | None
    ) -> UserGather:
        """Makes ``params`` (all this owner's) whole on this rank until the returned gather is released;
        with ``modifier_rank``, keeps what it needs to tell a change made meanwhile. Every rank calls it,
        with the same parameters in the same order."""
        ...


@runtime_checkable
class ModelHolder(Protocol):
    """An engine, as GatheredParameters takes it (DeepSpeed accepts one): its model is ``module``."""

    module: nn.Module


# Every open engine's ParamOwner and every zero.Init store not yet taken over by initialize()
# (see [Note: finding a parameter's owner]).
PARAM_OWNERS: LiveOwners[ParamOwner] = LiveOwners()


def _as_params(
    params: nn.Parameter | nn.Module | ModelHolder | Iterable[nn.Parameter | None],
) -> list[nn.Parameter]:
    if isinstance(params, nn.Parameter):
        return [params]
    if isinstance(params, nn.Module):
        return list(params.parameters())
    if isinstance(params, ModelHolder) and isinstance(params.module, nn.Module):
        return list(params.module.parameters())
    return [p for p in params if p is not None]


class GatheredParameters:
    def __init__(
        self,
        params: nn.Parameter | nn.Module | ModelHolder | Iterable[nn.Parameter | None],
        modifier_rank: int | None = None,
        enabled: bool = True,
    ):
        self.params = _as_params(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._held: list[
            tuple[UserGather, list[tuple[nn.Parameter, torch.Size]]]
        ] = []  # with the shapes gathered

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        by_owner: list[
            tuple[ParamOwner, list[nn.Parameter]]
        ] = []  # in first-use order: the same on every rank
        for p in self.params:
            owner = PARAM_OWNERS.owner_of(p)
            if owner is None:
                continue
            for known, owned in by_owner:
                if known is owner:
                    owned.append(p)
                    break
            else:
                by_owner.append((owner, [p]))
        try:
            for owner, owned in by_owner:
                gather = owner.gather_for_user(owned, modifier_rank=self.modifier_rank)
                self._held.append((gather, [(p, p.shape) for p in owned]))
        except BaseException:
            self._release(commit=False)  # __exit__ is not called when __enter__ raises
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._release(commit=exc[0] is None)

    def _release(self, *, commit: bool) -> None:
        """Releases every gather, also after one fails (held units would stay gathered for good);
        the first error is raised."""
        held, self._held = self._held, []
        error: BaseException | None = None
        with torch.no_grad():
            for gather, shapes in held:
                reshaped = [(before, p.shape) for p, before in shapes if p.shape != before]
                if commit and reshaped:
                    error = error or self._reshape_error(gather, reshaped)
                try:
                    gather.release(commit=commit)
                except BaseException as e:
                    error = error or e
        if error is not None:
            raise error

    def _reshape_error(
        self, gather: UserGather, reshaped: list[tuple[torch.Size, torch.Size]]
    ) -> Exception | None:
        """The error for parameters given a new shape inside the context, if their owner cannot keep it."""
        (before, after), *_ = reshaped
        if isinstance(gather, ReshapingGather) and gather.repartitions():
            if self.modifier_rank is not None:
                return None
            return RuntimeError(
                f"a parameter of shape {list(before)} was given shape {list(after)} inside GatheredParameters without "
                "modifier_rank, so the change is dropped at exit; pass modifier_rank=0 to keep it (as for "
                "resize_token_embeddings on a model built under infinity.zero.Init)"
            )
        return RuntimeError(
            f"a parameter of shape {list(before)} was given shape {list(after)} inside GatheredParameters after "
            "infinity.initialize, whose units have a fixed layout; change shapes (e.g. resize_token_embeddings) "
            "before initialize, on the model built under infinity.zero.Init, inside "
            "GatheredParameters(..., modifier_rank=0)"
        )


def free_memory_nbytes(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device`` (host: MemAvailable); None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        info = meminfo()
        return info.get("MemAvailable", info.get("MemFree")) or None
    return None


def room_refusal(need_nbytes: int, device: torch.device, what: str) -> str | None:
    """Why a user gather of ``need_nbytes`` (copies outside the pool, [Note: user gathers outside the
    pool]) cannot be held in ``device``'s free memory, or None when it can; ``what`` names the parameters."""
    free = free_memory_nbytes(device)
    if free is None or need_nbytes <= free:
        return None
    where = "host memory (MemAvailable)" if device.type == "cpu" else f"memory on {device}"
    return (
        f"GatheredParameters needs {need_nbytes:,} bytes to hold {what} whole (gathered outside the parameter "
        f"pool, which holds a few layers at a time), but only {free:,} bytes of {where} are free. Gather fewer "
        "parameters at a time (one module's per context: with GatheredParameters(module.parameters()) for each "
        "module), or write the weights with engine.save_16bit_model(), which streams them. Nothing was gathered."
    )
