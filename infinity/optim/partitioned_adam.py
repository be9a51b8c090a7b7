"""PartitionedAdam: Adam/AdamW over this rank's flat shards, its state in a TieredStore (host or NVMe).

For every unit shard the optimizer keeps the fp32 arrays its ShardSpec names
(``state_keys``, from the runtime plan) in ``state_store``: ``m``, ``v``, the
accumulated gradient ``g`` and, unless the parameters are fp32 stage-3 shards
(which are their own master copy), an fp32 ``master`` — each at the home the
spec gives it (``state_homes``: host memory or NVMe, per shard and per array,
as the plan's placement says).
The step streams sub-groups of units (at most ``sub_group_numel`` elements
each): the reads of sub-group i+1 are issued before sub-group i is updated,
and i's dirty state is evicted (written back asynchronously) right after —
read i+1 ‖ update i ‖ write i-1, bounded by the store's buffer pool.

Numerics follow torch.optim.Adam/AdamW (foreach=False) parameter by
parameter: each parameter keeps its own step count, and a parameter that got
no gradient in the window is skipped entirely (no decay, no moment update),
as torch skips ``p.grad is None``. The squares behind the gradient norm are
summed in double in a fixed order (``sum_squares``), so clipping gives the
same bits on every machine. Param groups are shared with the torch
optimizer the user passed, so an lr scheduler bound to either works.

This module is the GradSink of infinity.zero's GradReducer (``open``/``close``)
and knows nothing of modules or hooks: shards arrive as ShardSpecs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any

import torch

from infinity.aio.waits import result_of
from infinity.optim.functional import AdamHyper, adam_step, sum_squares
from infinity.store import Home, TieredStore
from infinity.timeline import Timeline

log = logging.getLogger("infinity.optim")

HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class ShardSegment:
    """Elements [lo, hi) of a shard belong to parameter ``param`` (index into ``params``),
    which is slot ``slot`` of its unit (the index into that unit's has-grad flags)."""

    param: int
    slot: int
    lo: int
    hi: int


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """One unit's shard on this rank, as the optimizer sees it."""

    index: int
    numel: int
    param_dtype: torch.dtype
    segments: tuple[ShardSegment, ...]
    param_key: Hashable | None = None  # the shard in the parameter store (stage 3), else None
    state_keys: tuple[str, ...] = dataclasses.field(kw_only=True)
    """The fp32 arrays kept for it in the state store, as the plan says (infinity.estimate.runtime_plan):
    "m", "v", "g" and "master", which only an fp32 shard in the parameter store (its own master) lacks."""
    state_homes: tuple[Home, ...] = dataclasses.field(kw_only=True)
    """Where each of ``state_keys`` rests in the state store ("cpu" or "nvme"), in the same order."""

    def __post_init__(self) -> None:
        if len(self.state_homes) != len(self.state_keys) or not set(self.state_homes) <= {
            "cpu",
            "nvme",
        }:
            raise ValueError(
                f'shard {self.index}: state_homes {self.state_homes} must give "cpu" or "nvme" for each of '
                f"state_keys {self.state_keys}"
            )


class PartitionedAdam(torch.optim.Optimizer):
    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        defaults: dict[str, Any],
        params: Sequence[torch.nn.Parameter],
        shards: Sequence[ShardSpec],
        *,
        state_store: TieredStore,
        param_store: TieredStore | None,
        adamw: bool,
        sub_group_numel: int,
        on_updated: Callable[[int, torch.Tensor], None] | None = None,
    ):
        # torch.optim.Optimizer bookkeeping: param_groups is *shared* with the
        # user's optimizer (same dicts), so schedulers bound to it still work.
        torch.optim.Optimizer.__init__(self, [{"params": [torch.empty(0)]}], dict(defaults))
        self.param_groups = param_groups
        self.defaults = defaults
        self.params = list(params)
        self.shards = list(shards)
        self._shard_of = {s.index: s for s in self.shards}  # by unit index (frozen units have none)
        in_params = [s.index for s in self.shards if s.param_key is not None]
        if in_params and param_store is None:
            raise ValueError(
                f"shards {in_params[:5]} have a param_key but param_store is None: pass the store "
                "holding the parameter shards, or shards without param_key"
            )
        self.state_store = state_store
        self.param_store = param_store
        self.adamw = adamw
        self.on_updated = on_updated
        self._group_of = self._map_groups()
        self.param_steps = [0] * len(self.params)
        self._sumsq: dict[int, float] = {}
        self._open_grads: dict[int, torch.Tensor] = {}
        self._master_in_param_store = {s.index: _master_in_param_store(s) for s in self.shards}
        self.sub_group_numel = sub_group_numel
        self._issue_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.sub_groups = _split(self.shards, sub_group_numel)
        self._register()

    # -- setup ----------------------------------------------------------------

    def _map_groups(self) -> list[int | None]:
        where = {}
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                where[id(p)] = gi
        return [where.get(id(p)) for p in self.params]

    def _params_of(self, s: ShardSpec) -> tuple[TieredStore, Hashable]:
        """The parameter store and key of a shard with a param_key (__init__ refuses such a shard
        without a param_store)."""
        assert self.param_store is not None and s.param_key is not None, s
        return self.param_store, s.param_key

    def _keys(self, s: ShardSpec) -> list[tuple[int, str]]:
        return [(s.index, n) for n in s.state_keys]

    def _register(self) -> None:
        by_home: dict[Home, list] = {"nvme": [], "cpu": []}
        for s in self.shards:
            for key, home in zip(self._keys(s), s.state_homes, strict=True):
                by_home[home].append((key, (s.numel,), torch.float32))
        # The NVMe arrays registered in step order, each unit's side by side: a
        # sub-group comes back in few large reads.
        for home, specs in by_home.items():
            if specs:
                self.state_store.register_many(specs, home=home)

    def init_state(self, index: int, master: torch.Tensor | None) -> None:
        """Sets a shard's starting state: master = ``master`` (fp32, unless the parameter
        store holds it), moments and gradient zero."""
        s = self._shard_of[index]
        for key in self._keys(s):
            t = self.state_store.fetch(key, overwrite=True).result()
            if key[1] == "master":
                if master is None:
                    raise ValueError(f"shard {index} needs its initial fp32 master values")
                t.copy_(master)
            else:
                t.zero_()
            self.state_store.mark_dirty(key)
            self.state_store.release(key)
            _evict_unheld(self.state_store, key)

    def overwrite_master(self, index: int, values: torch.Tensor, changed: torch.Tensor) -> None:
        """Shard ``index``'s fp32 master takes ``values`` where ``changed`` (the parameters were changed
        outside a step: GatheredParameters). Moments and the accumulated gradient stay as they are. A unit
        the optimizer has no shard of (a frozen one) has no master: the parameters are all there is."""
        if index not in self._master_in_param_store:
            return
        if self._master_in_param_store[index]:
            raise ValueError(
                f"shard {index} is an fp32 stage-3 parameter shard, its own master: write the parameter "
                "shard instead (the partitioner does)"
            )
        key = (index, "master")
        master = self.state_store.fetch(key).result()
        try:
            master.copy_(torch.where(changed.to(master.device), values.to(master.device), master))
            self.state_store.mark_dirty(key)
        finally:
            self.state_store.release(key)
        _evict_unheld(self.state_store, key)

    # -- GradSink ---------------------------------------------------------------

    def open(self, unit_index: int, *, first: bool) -> torch.Tensor:
        key = (unit_index, "g")
        self._sumsq.pop(unit_index, None)  # the gradient changes: its norm is taken again
        g = self.state_store.fetch(key, overwrite=first).result()
        if first:
            g.zero_()
        self._open_grads[unit_index] = g
        return g

    def close(self, unit_index: int, *, final: bool) -> None:
        key = (unit_index, "g")
        g = self._open_grads.pop(unit_index)
        if final:  # the window's last contribution: take the norm while it is in memory
            self._sumsq[unit_index] = sum_squares(g)
        self.state_store.mark_dirty(key)
        self.state_store.release(key)
        _evict_unheld(self.state_store, key)

    # -- step -------------------------------------------------------------------

    def local_grad_sumsq(self, has_grad: Sequence[torch.Tensor]) -> float:
        """Sum of squares of this rank's accumulated grads (the engine all-reduces it)."""
        total = 0.0
        for s in self.shards:
            if not bool(has_grad[s.index].any()):
                continue
            if s.index not in self._sumsq:
                key = (s.index, "g")
                g = self.state_store.fetch(key).result()
                self._sumsq[s.index] = sum_squares(g)
                self.state_store.release(key)
                _evict_unheld(self.state_store, key)
            total += self._sumsq[s.index]
        self._sumsq.clear()  # the next window's norms start afresh
        return total

    def hyperparameters(self) -> list[AdamHyper]:
        """Each param group's hyper-parameters as they are now (a value: the lr schedule moving on
        later does not change it)."""
        out = []
        for g in self.param_groups:
            beta1, beta2 = g["betas"]
            out.append(
                AdamHyper(
                    lr=float(g["lr"]),
                    beta1=float(beta1),
                    beta2=float(beta2),
                    eps=float(g["eps"]),
                    weight_decay=float(g["weight_decay"]),
                    adamw=bool(self.adamw),
                )
            )
        return out

    @torch.no_grad()
    # The engine's step: it needs has_grad, so it cannot be called as Optimizer.step().
    def step(  # type: ignore[override]
        self,
        closure: Any = None,
        *,
        grad_scale: float = 1.0,
        has_grad: Sequence[torch.Tensor],
        only: Collection[int] | None = None,
        hyper: list[AdamHyper] | None = None,
        on_shard_done: Callable[[int], None] | None = None,
    ) -> None:
        """One Adam step over every shard (or the shards whose index is in ``only``).

        ``grad_scale`` multiplies the grads first (loss-scale removal and clipping);
        ``has_grad[unit][slot]`` says which parameters got a gradient in this window;
        ``hyper`` fixes the hyper-parameters (taken now by default) so a step running in
        another thread is not affected by the lr schedule advancing meanwhile;
        ``on_shard_done(index)`` is called as each shard's new values are in place.
        """
        if closure is not None:
            raise ValueError("PartitionedAdam.step does not take a closure")
        hyper = hyper if hyper is not None else self.hyperparameters()
        groups = (
            self.sub_groups
            if only is None
            else _split([s for s in self.shards if s.index in only], self.sub_group_numel)
        )
        # [Note: issuing reads from a helper thread] A fetch blocks its caller until the
        # pool has a contiguous run for it. Issued from this thread while sub-group i is
        # held, the read of i+1 could wait for room that only releasing i would make
        # (a fragmented pool); from the issuer thread it waits while i is updated and
        # released here.
        issuer = self._issuer()
        pending = issuer.submit(self._fetch, groups[0]) if groups else None
        current: dict[tuple[int, str], Any] = {}
        updated: set[int] = set()  # shards of ``current`` whose keys _update_shard gave back
        try:
            for i, group in enumerate(groups):
                assert pending is not None  # submitted for every group before its turn
                current, updated = {}, set()
                current = result_of(
                    pending,
                    what=f"the reads of optimizer sub-group {i} of {len(groups)} "
                    "(issued from thread infinity-optim-reads)",
                    log=log,
                    kind="read",
                )
                pending = issuer.submit(self._fetch, groups[i + 1]) if i + 1 < len(groups) else None
                tl = Timeline.active
                span = None
                if tl is not None:
                    span = tl.begin(
                        f"Adam sub-group {i} of {len(groups)}",
                        "optimizer",
                        {"units": [s.index for s in group], "numel": sum(s.numel for s in group)},
                    )
                try:
                    self._update_group(
                        group, current, grad_scale, has_grad, hyper, on_shard_done, updated
                    )
                finally:
                    if span is not None and tl is not None:
                        tl.end(span)
        except BaseException:
            # A step that raises (Ctrl-C above all) still holds the keys of the sub-group it was
            # updating and of the next one, read ahead: held, they would stay pinned in the pool
            # for as long as the store lives (close() warned of them).
            self._give_back({k: f for k, f in current.items() if k[0] not in updated}, pending)
            raise

    def _give_back(
        self, held: dict[tuple[int, str], Any], pending: concurrent.futures.Future | None
    ) -> None:
        """Releases the keys a step that raised still holds: ``held`` (fetched, not updated) and
        those of ``pending``, the next sub-group's reads, once issued. Each read is waited for
        first (a read in flight cannot be given back); a failed one holds nothing."""
        if pending is not None:
            try:
                held = {
                    **held,
                    **result_of(
                        pending,
                        what="the reads of the next optimizer sub-group, to give them back",
                        log=log,
                    ),
                }
            except Exception:
                log.exception("infinity optimizer: the next sub-group's reads failed")
        for (index, name), fut in held.items():
            if name == "param":
                store, key = self._params_of(self._shard_of[index])
            else:
                store, key = self.state_store, (index, name)
            try:
                if fut.exception() is None:
                    store.release(key)
            except Exception:  # never in place of the error being raised
                log.exception("infinity optimizer: giving back key %r after a failed step", key)

    def _update_group(
        self,
        group: list[ShardSpec],
        current: dict[tuple[int, str], Any],
        grad_scale: float,
        has_grad: Sequence[torch.Tensor],
        hyper: list[AdamHyper],
        on_shard_done: Callable[[int], None] | None,
        updated: set[int],
    ) -> None:
        """Updates one sub-group's shards, whose reads ``current`` holds; each shard's index is
        added to ``updated`` once its keys are given back."""
        for s in group:
            self._update_shard(
                s,
                {k[1]: f.result() for k, f in current.items() if k[0] == s.index},
                grad_scale,
                has_grad[s.index],
                hyper,
            )
            updated.add(s.index)
            for seg in s.segments:
                if self._group_of[seg.param] is not None and bool(has_grad[s.index][seg.slot]):
                    self.param_steps[seg.param] += 1
            if on_shard_done is not None:
                on_shard_done(s.index)

    def _issuer(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._issue_pool is None:
            self._issue_pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="infinity-optim-reads"
            )
        return self._issue_pool

    def shutdown(self) -> None:
        """Stops the read-issuing thread (the GradSink's ``close`` is another thing)."""
        if self._issue_pool is not None:
            self._issue_pool.shutdown(wait=True)
            self._issue_pool = None

    def _fetch(self, group: list[ShardSpec]) -> dict[tuple[int, str], Any]:
        futures: dict[tuple[int, str], Any] = {}
        for s in group:
            keys = self._keys(s)
            for key, fut in zip(keys, self.state_store.fetch_many(keys), strict=True):
                futures[key] = fut
            if s.param_key is not None:
                # fp32: the parameter shard is the master copy (read, update in
                # place); 16-bit: it receives the new values (nothing to read).
                overwrite = not self._master_in_param_store[s.index]
                store, param_key = self._params_of(s)
                futures[(s.index, "param")] = store.fetch(param_key, overwrite=overwrite)
        return futures

    def _update_shard(
        self,
        s: ShardSpec,
        t: dict[str, torch.Tensor],
        grad_scale: float,
        flags: torch.Tensor,
        hyper: list[AdamHyper],
    ) -> None:
        in_param_store = self._master_in_param_store[s.index]
        master = t["param"] if in_param_store else t["master"]
        half = t["param"] if s.param_key is not None and not in_param_store else None
        g, m, v = t["g"], t["m"], t["v"]
        if grad_scale != 1.0 and bool(flags.any()):
            g.mul_(grad_scale)
        for seg in s.segments:
            gi = self._group_of[seg.param]
            lo, hi = seg.lo, seg.hi
            if gi is None or not bool(flags[seg.slot]):
                if half is not None:  # unchanged, but the half copy is written whole
                    half[lo:hi].copy_(master[lo:hi])
                continue
            adam_step(
                master[lo:hi],
                g[lo:hi],
                m[lo:hi],
                v[lo:hi],
                hyper[gi],
                step=self.param_steps[seg.param] + 1,
                out_half=None if half is None else half[lo:hi],
            )
        if self.on_updated is not None:
            self.on_updated(s.index, half if half is not None else master)
        for key in self._keys(s):
            if key[1] != "g":
                self.state_store.mark_dirty(key)
            self.state_store.release(key)
            _evict_unheld(self.state_store, key)  # write i-1 starts now, behind the next update
        if s.param_key is not None:
            # The new parameter values are written home now but stay cached (clean): the
            # next forward reads them first, and the pool can drop them without waiting
            # for a write when it needs the room.
            store, param_key = self._params_of(s)
            store.mark_dirty(param_key)
            store.release(param_key)
            _flush_unheld(store, param_key)


def _evict_unheld(store: TieredStore, key: Hashable) -> None:
    """Starts writing ``key`` home now unless someone else still holds it (then the LRU does it later)."""
    spec = store.spec(key)
    if spec.home == "nvme" and spec.holds == 0:
        store.evict(key)


def _flush_unheld(store: TieredStore, key: Hashable) -> None:
    """Starts writing ``key`` home now, keeping it resident, unless someone else still holds it."""
    spec = store.spec(key)
    if spec.home == "nvme" and spec.holds == 0:
        store.flush(key)


def _master_in_param_store(s: ShardSpec) -> bool:
    """Whether the shard's parameter copy is its fp32 master: the state keys say so (no "master"), and
    only an fp32 shard in the parameter store can be one (a 16-bit copy, or none, needs its own)."""
    missing = {"m", "v", "g"} - set(s.state_keys)
    if missing:
        raise ValueError(f"shard {s.index}: state_keys {s.state_keys} lack {sorted(missing)}")
    own_master = s.param_key is not None and s.param_dtype == torch.float32
    if ("master" not in s.state_keys) != own_master:
        raise ValueError(
            f"shard {s.index} ({s.param_dtype}, {'in' if s.param_key is not None else 'not in'} the parameter "
            f"store) {'needs' if not own_master else 'is its own'} fp32 master; state_keys {s.state_keys} "
            f"{'lack' if not own_master else 'add'} one"
        )
    return own_master


def split_sub_groups(numels: Sequence[int], limit: int) -> list[list[int]]:
    """The step's sub-groups: positions of consecutive shards of ``numels`` elements, at most ``limit``
    elements a group (a shard larger than that is a group of its own)."""
    groups: list[list[int]] = []
    size = math.inf
    for i, n in enumerate(numels):
        if size + n > limit or not groups:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def _split(shards: Sequence[ShardSpec], limit: int) -> list[list[ShardSpec]]:
    return [[shards[i] for i in g] for g in split_sub_groups([s.numel for s in shards], limit)]
