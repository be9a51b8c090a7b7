"""zero.Init: build a model straight into partitioned storage, so it may be larger than host memory.

Inside the context every parameter is partitioned as soon as the module that
owns it is complete — when it is assigned to its parent (torch's global
module-registration hook fires after the child's ``__init__`` has returned),
or at the end of the context for the root. Partitioning writes this rank's
slice of the parameter to an init store (NVMe or host memory, as
``offload_param`` says) and leaves an empty placeholder in ``.data``.

Parent code that touches children's parameters afterwards —
``self.apply(self._init_weights)``, ``module.weight.data.normal_()``, tying —
still works and consumes the RNG exactly as without Init: a TorchFunctionMode
sees every torch function a partitioned parameter takes part in (``.data``,
``.shape`` and in-place inits included), materialises the parameter first,
and writes it back as soon as a torch function involves other parameters
(or the context ends). At most the parameters of one operation are
materialised at a time.

``infinity.initialize`` then lays the parameters out in units (which may
differ from construction-time modules after tying) from the init store.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from infinity.aio import AioConfig
from infinity.config import ConfigError
from infinity.memory import BufferPool, FreedMemory
from infinity.store import TieredStore
from infinity.store.errors import NvmePathError
from infinity.store.nvme_path import rank_dir
from infinity.zero.collectives import DataParallelGroup
from infinity.zero.layout import make_layout

log = logging.getLogger("infinity.zero")

_INIT_POOL_NBYTES = 64 << 20
# A shard is stored as keys of at most this many bytes (contiguous on disk), so a
# layer of any size passes through the fixed pool.
_INIT_CHUNK_NBYTES = 32 << 20


@dataclasses.dataclass
class _Record:
    keys: list[tuple[str, int, int]]  # (store key, lo, hi) over the flat shard
    shape: torch.Size
    dtype: torch.dtype
    shard_numel: int
    numel: int


class InitStore:
    """Where parameters built under zero.Init wait for ``initialize``: this rank's slice of each."""

    def __init__(self, *, home: str, nvme_path: str | None, aio: AioConfig, group: DataParallelGroup):
        self.home = home
        self.group = group
        path = None
        if nvme_path:
            try:
                path = rank_dir(nvme_path, group.rank, o_direct=aio.o_direct)
            except NvmePathError as e:  # a key of the config: refused like the others
                raise ConfigError(str(e)) from None
        pool = BufferPool(1, _INIT_POOL_NBYTES if home == "nvme" else 4096)
        self.store = TieredStore(path, pool=pool, aio=aio, name="zero-init")
        self._freed = FreedMemory()
        self.records: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensors compare elementwise: key by id
        self._next = 0

    def __contains__(self, p: nn.Parameter) -> bool:
        return p in self.records

    def partition(self, p: nn.Parameter) -> None:
        data = p.data.detach().reshape(-1)
        layout = make_layout(["p"], [p.shape], p.dtype, self.group.world_size)
        lo, hi = layout.shard_range(self.group.rank)
        shard = torch.zeros(layout.shard_numel, dtype=p.dtype)
        part = data[lo:min(hi, data.numel())]
        shard[: part.numel()] = part
        keys = self._register(layout.shard_numel, p.dtype)
        self._write(keys, shard)
        self.records[p] = _Record(keys, p.shape, p.dtype, layout.shard_numel, data.numel())
        _store_of[p] = self
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._freed.freed(data.numel() * data.element_size())

    def _register(self, numel: int, dtype: torch.dtype) -> list[tuple[str, int, int]]:
        step = max(1, _INIT_CHUNK_NBYTES // dtype.itemsize)
        keys = []
        for lo in range(0, numel, step):
            key = f"init{self._next}"
            self._next += 1
            hi = min(lo + step, numel)
            self.store.register(key, (hi - lo,), dtype, home=self.home)
            keys.append((key, lo, hi))
        return keys

    def _write(self, keys: list[tuple[str, int, int]], shard: torch.Tensor) -> None:
        for key, lo, hi in keys:
            self.store.write(key, shard[lo:hi]).result()

    def shape(self, p: nn.Parameter) -> torch.Size:
        """The parameter's true shape (its ``.data`` is a placeholder while it waits here)."""
        rec = self.records.get(p)
        return rec.shape if rec is not None else p.shape

    def full(self, p: nn.Parameter) -> torch.Tensor:
        """The whole parameter (all ranks' slices gathered); every rank must call in the same order."""
        rec = self.records[p]
        full = torch.empty(rec.shard_numel * self.group.world_size, dtype=rec.dtype)
        if len(rec.keys) == 1:  # gathered straight from the pool's buffer
            key = rec.keys[0][0]
            try:
                self.group.all_gather(full, self.store.fetch(key).result())
            finally:
                self.store.release(key)
            return full[: rec.numel].view(rec.shape)
        shard = torch.empty(rec.shard_numel, dtype=rec.dtype)
        for key, lo, hi in rec.keys:
            try:
                shard[lo:hi].copy_(self.store.fetch(key).result())
            finally:
                self.store.release(key)
        self.group.all_gather(full, shard)
        return full[: rec.numel].view(rec.shape)

    def rewrite(self, p: nn.Parameter, value: torch.Tensor) -> None:
        rec = self.records[p]
        flat = value.detach().reshape(-1)
        lo = self.group.rank * rec.shard_numel
        shard = torch.zeros(rec.shard_numel, dtype=rec.dtype)
        part = flat[lo : min(lo + rec.shard_numel, flat.numel())]
        shard[: part.numel()] = part
        self._write(rec.keys, shard)
        self._freed.freed(flat.numel() * flat.element_size())

    def forget(self, p: nn.Parameter) -> None:
        """Drops a parameter initialize() has moved home; closes the store after the last one."""
        rec = self.records.pop(p, None)
        _store_of.pop(p, None)
        if rec is not None:
            for key, _, _ in rec.keys:
                self.store.unregister(key)
        if not len(self.records):
            self.close()

    def close(self) -> None:
        if not self.store.closed:
            self.store.close()


# Each partitioned parameter keeps its InitStore alive (weakly keyed by the
# parameter, strongly holding the store) until initialize() takes it over.
_store_of: WeakIdKeyDictionary = WeakIdKeyDictionary()


def init_store_of(params: Iterable[nn.Parameter]) -> InitStore | None:
    """The InitStore holding any of ``params`` (a model built under zero.Init), if one does."""
    for p in params:
        store = _store_of.get(p)
        if store is not None:
            return store
    return None


class _InitMode(TorchFunctionMode):
    def __init__(self, store: InitStore):
        super().__init__()
        self.store = store
        self.materialized: dict[nn.Parameter, torch.Tensor] = {}
        self.tracked: list[weakref.ref[nn.Parameter]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        involved = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, nn.Parameter) and a in self.store]
        self.flush(keep=involved)
        for p in involved:
            if p not in self.materialized:
                full = self.store.full(p).clone()
                p.data = full
                self.materialized[p] = full
        return func(*args, **kwargs)

    def flush(self, keep: list[nn.Parameter] = ()) -> None:
        """Writes back every materialised parameter not in ``keep``."""
        for p in [q for q in self.materialized if all(q is not k for k in keep)]:
            full = self.materialized.pop(p)
            with torch._C.DisableTorchFunction():
                self.store.rewrite(p, full)
                p.data = torch.empty(0, dtype=full.dtype, device=full.device)

    def on_module_registered(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is None:
            return
        with torch._C.DisableTorchFunction():
            self.flush()
            for p in child._parameters.values():
                if p is not None and p not in self.store and p.numel() > 0:
                    self.store.partition(p)

    def on_param_registered(self, module: nn.Module, name: str, p: nn.Parameter | None) -> None:
        if p is not None:
            self.tracked.append(weakref.ref(p))

    def finish(self) -> None:
        with torch._C.DisableTorchFunction():
            self.flush()
            for ref in self.tracked:
                p = ref()
                if p is not None and p not in self.store and p.numel() > 0:
                    self.store.partition(p)


class Init:
    """Context manager: modules built inside have their parameters partitioned as they are created.

    ``config`` is the training config (path or dict) or an already loaded
    InfinityConfig; it decides where parameters wait (``offload_param``). With a
    stage below 3 the context does nothing (DeepSpeed's behaviour), and says so.
    """

    def __init__(self, config: Any = None, *, enabled: bool = True, **auto_values: Any):
        self.enabled = enabled
        self.config = config
        self.auto_values = auto_values
        self._mode: _InitMode | None = None
        self._handles: list[Any] = []
        self.store: InitStore | None = None

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        from infinity.config import InfinityConfig, load_config

        group = DataParallelGroup()
        cfg = self.config
        if not isinstance(cfg, InfinityConfig):
            cfg = load_config(cfg if cfg is not None else {"zero_optimization": {"stage": 3}},
                              world_size=group.world_size, **self.auto_values)
        zero = cfg.zero_optimization
        if zero.stage != 3:
            log.warning("zero.Init does nothing with zero_optimization.stage=%d (it partitions for stage 3)", zero.stage)
            self.enabled = False
            return self
        offload = zero.offload_param
        # "auto": the placement planner has not run yet (it needs the model); the model as built waits
        # on NVMe, which holds any model, and goes home from there.
        home = "nvme" if offload.device in ("nvme", "auto") else "cpu"
        self.store = InitStore(home=home, nvme_path=str(offload.nvme_path) if home == "nvme" else None,
                               aio=cfg.aio, group=group)
        self._mode = _InitMode(self.store)
        self._handles = [
            module_hooks.register_module_module_registration_hook(self._mode.on_module_registered),
            module_hooks.register_module_parameter_registration_hook(self._mode.on_param_registered),
        ]
        self._mode.__enter__()

        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is None:
            return
        mode = self._mode
        self._mode = None

        mode.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        mode.finish()
