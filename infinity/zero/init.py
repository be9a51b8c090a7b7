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
(or the context ends) — unless a view of it is still alive (see [Note: views
of a materialised parameter]). At most the parameters of one operation, and
those a live view points into, are materialised at a time.

``infinity.initialize`` then lays the parameters out in units (which may
differ from construction-time modules after tying) from the init store.
Until then the store is the parameters' owner (``PARAM_OWNERS``; see [Note:
finding a parameter's owner] in owners.py): after the context,
GatheredParameters reads them whole and, with ``modifier_rank``, writes a
change back (Hugging Face loads and initialises weights this way). The
modules holding them keep the store alive — it is their forward pre-hook,
which refuses to run a module whose parameters are still at rest there.

Floating-point parameters rest in the store in the dtype Init was given (its
``dtype=``, else the config's bf16 / fp16 section), as DeepSpeed's zero.Init
casts them; see [Note: zero.Init's dtype].

Threading: the thread that builds the model (hooks and the TorchFunctionMode
are per process; building two models at once in two threads is not supported).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from infinity.aio import DIRECT_ALIGNMENT, AioConfig, crc32c
from infinity.config import ConfigError
from infinity.config.zero import NvmePath
from infinity.memory import BufferPool, FreedMemory
from infinity.store import Home, TieredStore
from infinity.store.errors import NvmePathError
from infinity.store.nvme_path import rank_dirs
from infinity.zero.collectives import DataParallelGroup
from infinity.zero.gathered import PARAM_OWNERS
from infinity.zero.layout import make_layout

log = logging.getLogger("infinity.zero")

_INIT_POOL_NBYTES = 64 << 20
# A shard is stored as keys of at most this many bytes (contiguous on disk), so a
# layer of any size passes through the fixed pool.
_INIT_CHUNK_NBYTES = 32 << 20


# [Note: zero.Init's dtype]
# DeepSpeed's zero.Init gives every floating-point tensor made inside the context the dtype of its
# ``dtype=`` argument, else of the config (bf16 / fp16 enabled, else fp32), so a model written in
# fp32 and built under a bf16 config waits partitioned in bf16: half the bytes at rest, and
# ``p.dtype`` is bf16, as the engine will train it. Here:
# - a floating-point parameter rests in the store in ``InitStore.dtype`` (Init's ``dtype=``, else
#   the config's bf16 / fp16; None: in the dtype it was built in, as before, since the engine casts
#   at initialize and an fp32 config needs no cast, while inference keeps a model's dtype as loaded);
#   its placeholder has that dtype, and GatheredParameters after the context gives it whole in it;
# - inside the context a parameter that a torch function uses is made whole in the dtype it was
#   built in, and rounded as it goes back to rest: the parent's ``_init_weights`` draws its values
#   as the same code would in plain PyTorch, so where each parameter is set by one initialiser (a
#   ``normal_``, a ``fill_``) the values at rest are exactly the plain model's cast to the dtype
#   (DeepSpeed draws them in 16 bits, from other random numbers);
# - buffers are left as built (DeepSpeed's constructor patch makes them 16-bit too, which costs
#   rotary embeddings their precision; the engine keeps buffers as the model made them);
# - initialize starts the fp32 masters from the values at rest, widened — what DeepSpeed's
#   optimizer does with its 16-bit parameters. A model not built under zero.Init keeps its fp32
#   starting values in the masters, as before; ``zero.Init(config, dtype=torch.float32)`` keeps
#   them for one built under it (at twice the bytes at rest until initialize).


class InitState(enum.Enum):
    AT_REST = "at rest"
    """Only this rank's slice exists, in the store; ``.data`` is an empty placeholder."""
    WHOLE = "whole"
    """``.data`` is the whole parameter: a torch function in the Init context uses it, or GatheredParameters holds it."""


@dataclasses.dataclass
class _Record:
    keys: list[tuple[str, int, int]]  # (store key, lo, hi) over the flat shard
    shape: torch.Size
    dtype: torch.dtype  # at rest ([Note: zero.Init's dtype])
    shard_numel: int
    numel: int
    state: InitState = InitState.AT_REST
    holds: int = 0  # GatheredParameters contexts holding the parameter whole
    source: Any = (
        None  # the file tensor ``fill`` read it from, while unchanged since (load_pretrained's)
    )
    source_crc: int = (
        0  # CRC32C of the shard ``fill`` wrote: a rewrite of the same bytes keeps the source
    )
    built: torch.dtype | None = None  # the dtype it was built in, if not its dtype at rest


@dataclasses.dataclass
class _InitHold:
    """The parameters one GatheredParameters context holds whole (a UserGather)."""

    store: InitStore
    params: list[nn.Parameter]
    modifier_rank: int | None

    def release(self, *, commit: bool) -> None:
        for p in self.params:
            if commit and self.modifier_rank is not None:
                if p.shape != self.store.shape(
                    p
                ):  # e.g. resize_token_embeddings: ``.data`` = a larger tensor
                    self.store.repartition(p, src=self.modifier_rank)
                else:
                    self.store.group.broadcast(p.data, src=self.modifier_rank)
                    self.store.rewrite(p, p.data)
            self.store.unhold(p)

    def repartitions(self) -> bool:
        """A parameter given a new shape inside the context is laid out anew (see ReshapingGather)."""
        return True


class InitStore:
    """Where parameters built under zero.Init wait for ``initialize``: this rank's slice of each."""

    def __init__(
        self,
        *,
        home: Home,
        nvme_path: NvmePath,
        aio: AioConfig,
        group: DataParallelGroup,
        dtype: torch.dtype | None = None,
    ):
        self.home = home
        self.group = group
        self.dtype = dtype
        """Floating-point parameters rest in it (None: as built); [Note: zero.Init's dtype]."""
        self.building = True  # the Init context is still open
        paths = None
        if nvme_path:
            try:  # striped over the drives listed, as the engine's stores are
                paths = rank_dirs(nvme_path, group.rank, o_direct=aio.o_direct)
            except NvmePathError as e:  # a key of the config: refused like the others
                raise ConfigError(str(e)) from None
        pool = BufferPool(1, _INIT_POOL_NBYTES if home == "nvme" else DIRECT_ALIGNMENT)
        self.store = TieredStore(paths, pool=pool, aio=aio, name="zero-init")
        self._freed = FreedMemory()
        self.records: WeakIdKeyDictionary = (
            WeakIdKeyDictionary()
        )  # tensors compare elementwise: key by id
        self._next = 0
        self._attached: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._hooks: list[Any] = []
        self.settle: Callable[[], None] = _nothing_to_settle
        """Partitions every parameter built so far now (set by Init: its mode's ``finish``)."""
        PARAM_OWNERS.add(self)

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """The model is complete inside the context (from_pretrained's load, see hf_init.py): its
        parameters are filled as after the context."""
        self.building = False
        try:
            yield
        finally:
            self.building = True

    def __contains__(self, p: object) -> bool:
        return p in self.records

    def attach(self, module: nn.Module) -> None:
        """``module`` holds parameters partitioned here: its pre-hook keeps this store alive until
        ``initialize`` takes them, and refuses to run it while they are at rest."""
        if module not in self._attached:
            self._attached.add(module)
            self._hooks.append(module.register_forward_pre_hook(self._refuse_at_rest))

    def _refuse_at_rest(self, module: nn.Module, args: Any) -> None:
        if self.building:
            return  # inside the context the TorchFunctionMode makes parameters whole on use
        at_rest = [
            n
            for n, p in module.named_parameters(recurse=False)
            if p in self.records and self.records[p].state is InitState.AT_REST
        ]
        if at_rest:
            raise RuntimeError(
                f"{type(module).__name__} was built under infinity.zero.Init and its parameters {at_rest} are "
                "still partitioned in zero.Init's store (their .data is empty); pass the model to "
                "infinity.initialize(model, config) and call the engine it returns, or read them inside "
                "infinity.GatheredParameters"
            )

    def rest_dtype(self, built: torch.dtype) -> torch.dtype:
        """The dtype a parameter built in ``built`` rests in ([Note: zero.Init's dtype])."""
        return self.dtype if self.dtype is not None and built.is_floating_point else built

    def partition(self, p: nn.Parameter) -> None:
        data = p.data.detach()
        self.records[p] = self._store_slice(data)
        p.data = torch.empty(0, dtype=self.records[p].dtype, device=p.device)
        self._freed.freed(data.numel() * data.element_size())

    def partition_meta(self, p: nn.Parameter, shape: torch.Size) -> None:
        """``p`` (an empty CPU parameter standing for a meta one of ``shape``) is partitioned with zeros."""
        self.records[p] = self._store_slice(torch.zeros(0, dtype=p.dtype), shape=shape)
        p.data = torch.empty(0, dtype=self.records[p].dtype, device=p.device)

    def repartition(self, p: nn.Parameter, *, src: int) -> None:
        """``p`` (held whole) was given a new shape: rank ``src``'s ``.data`` becomes its value, laid out
        anew (collective: every rank, with the same new shape)."""
        rec = self.records[p]
        self.group.broadcast(p.data, src=src)
        for key, _, _ in rec.keys:
            self.store.unregister(key)
        new = self._store_slice(p.data.detach())
        rec.keys, rec.shape, rec.dtype, rec.shard_numel, rec.numel, rec.source = (
            new.keys,
            new.shape,
            new.dtype,
            new.shard_numel,
            new.numel,
            None,
        )

    def _store_slice(self, data: torch.Tensor, *, shape: torch.Size | None = None) -> _Record:
        """Writes this rank's slice of the whole tensor ``data`` under new keys, in the dtype it rests
        in; its record (at rest). ``shape``: the parameter's, where ``data`` holds none of it (zeros
        then)."""
        flat = data.reshape(-1)
        shape = data.shape if shape is None else torch.Size(shape)
        dtype = self.rest_dtype(data.dtype)
        layout = make_layout(["p"], [shape], dtype, self.group.world_size)
        lo, hi = layout.shard_range(self.group.rank)
        shard = torch.zeros(layout.shard_numel, dtype=dtype)
        part = flat[lo : min(hi, flat.numel())]
        shard[: part.numel()] = part  # rounded once, where it rests in another dtype
        keys = self._register(layout.shard_numel, dtype)
        self._write(keys, shard)
        built = data.dtype if data.dtype != dtype else None
        return _Record(keys, shape, dtype, layout.shard_numel, shape.numel(), built=built)

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

    def fill(
        self, p: nn.Parameter, read: Callable[[int, int, torch.Tensor], None], *, source: Any = None
    ) -> None:
        """Writes this rank's slice of ``p`` (at rest) from ``read(lo, hi, out)``, which puts the flat
        elements [lo, hi) of the whole parameter into ``out``: a stored piece at a time, straight into
        pool memory, so the parameter is never whole (infinity.zero.load_pretrained). No collective.
        ``source``: the file tensor read, kept until the parameter changes ([Note: frozen units in a
        checkpoint] in infinity/engine/checkpoint/sources.py)."""
        rec = self.records[p]
        rec.source = None
        if rec.state is not InitState.AT_REST:
            raise RuntimeError(
                f"a parameter of shape {tuple(rec.shape)} filled while {rec.state.name}"
            )
        base = self.group.rank * rec.shard_numel
        crc = 0
        for key, lo, hi in rec.keys:
            buf = self.store.fetch(key, overwrite=True).result()
            try:
                n = max(0, min(base + hi, rec.numel) - (base + lo))
                if n:
                    read(base + lo, base + lo + n, buf[:n])
                buf[n:].zero_()  # the shard's padding past the parameter's end
                crc = crc32c(buf.view(torch.uint8), crc)
            finally:
                self.store.release(key)
        rec.source, rec.source_crc = source, crc

    def source(self, p: nn.Parameter) -> Any:
        """The file tensor ``p``'s values were read from, None if they were not or changed since."""
        rec = self.records.get(p)
        return None if rec is None else rec.source

    def _write(self, keys: list[tuple[str, int, int]], shard: torch.Tensor) -> None:
        for key, lo, hi in keys:
            self.store.write(key, shard[lo:hi]).result()

    def to_whole(self, p: nn.Parameter, *, as_built: bool = False) -> None:
        """``.data`` becomes the whole parameter (collective: every rank, the same order), in its
        dtype at rest, or with ``as_built`` in the dtype it was built in (the torch functions of the
        context: [Note: zero.Init's dtype])."""
        rec = self.records[p]
        if rec.state is not InitState.AT_REST:
            raise RuntimeError(
                f"a parameter of shape {tuple(rec.shape)} made whole twice (it is {rec.state.name})"
            )
        dtype = rec.built if as_built and rec.built is not None else rec.dtype
        # a copy, compact: the gathered buffer carries the shards' padding
        p.data = self.full(p).to(dtype, copy=True)
        rec.state = InitState.WHOLE

    def to_rest(self, p: nn.Parameter, *, rewrite: bool) -> None:
        """Back to an empty placeholder, first writing this rank's slice of ``.data`` when ``rewrite``."""
        rec = self.records[p]
        if rec.state is not InitState.WHOLE:
            raise RuntimeError(
                f"a parameter of shape {tuple(rec.shape)} put to rest while {rec.state.name}"
            )
        full = p.data
        if rewrite:
            self.rewrite(p, full)
        p.data = torch.empty(0, dtype=rec.dtype, device=full.device)
        rec.state = InitState.AT_REST
        self._freed.freed(full.numel() * full.element_size())

    # -- GatheredParameters (ParamOwner) ----------------------------------------

    def gather_for_user(
        self, params: Sequence[nn.Parameter], *, modifier_rank: int | None
    ) -> _InitHold:
        if self.building:
            raise RuntimeError(
                "GatheredParameters over parameters of a model still being built under infinity.zero.Init: "
                "inside the context torch functions already see them whole; use it after the context"
            )
        for p in params:
            rec = self.records[p]
            if rec.holds == 0:
                self.to_whole(p)
            rec.holds += 1
        return _InitHold(self, list(params), modifier_rank)

    def unhold(self, p: nn.Parameter) -> None:
        rec = self.records[p]
        rec.holds -= 1
        if rec.holds == 0:
            self.to_rest(p, rewrite=False)  # a change was written by the release that committed it

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
        if rec.source is not None and crc32c(shard.view(torch.uint8)) != rec.source_crc:
            rec.source = None  # no longer the file's values
        self._write(rec.keys, shard)

    def forget(self, p: nn.Parameter) -> None:
        """Drops a parameter initialize() has moved home; closes the store after the last one."""
        rec = self.records.get(p)
        if rec is not None and rec.holds:
            raise RuntimeError(
                "initialize() was called inside GatheredParameters over parameters built under zero.Init; "
                "call it after the context"
            )
        self.records.pop(p, None)
        if rec is not None:
            for key, _, _ in rec.keys:
                self.store.unregister(key)
        if not len(self.records):
            self.close()

    def close(self) -> None:
        # settle is Init's mode's bound method, and the mode holds this store: a cycle that kept the
        # store, its pool's slab (_INIT_POOL_NBYTES, touched) included, alive through training until
        # the cyclic garbage collector happened to run (+62 MiB on tests/hf/test_memory.py's peak)
        self.settle = _nothing_to_settle
        PARAM_OWNERS.discard(self)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if not self.store.closed:
            self.store.close()


def _nothing_to_settle() -> None:
    pass


def init_store_of(params: Iterable[nn.Parameter]) -> InitStore | None:
    """The InitStore holding any of ``params`` (a model built under zero.Init), if one does."""
    for p in params:
        owner = PARAM_OWNERS.owner_of(p)
        if isinstance(owner, InitStore):
            return owner
    return None


# [Note: views of a materialised parameter]
# Initialisers often write through a view rather than the parameter itself:
# ``module.weight.data.normal_()``, ``nn.init.zeros_(emb.weight[padding_idx])``
# (Hugging Face's ``_init_weights``), ``w = p.t(); w.copy_(...)``. The view is a
# plain tensor over the whole parameter's storage, so the torch function that
# writes through it names no partitioned parameter; were the parameter written
# back before it (a torch function "involving other parameters"), the write
# would land in memory the store no longer reads, and be lost without a word.
# So the mode remembers every tensor a torch function over a materialised
# parameter returns that shares that parameter's storage (views of views
# included), weakly: a function given such a view involves its parameter,
# and a parameter stays whole while any view of it is alive — the view holds
# its memory anyway, so keeping the parameter whole costs nothing more. The
# end of the context writes back everything, views or not (writes through a
# view after the context, where no mode watches, reach nothing, as under
# DeepSpeed).


def _shares_storage(t: torch.Tensor, p: nn.Parameter) -> bool:
    return (
        t.layout == torch.strided
        and t.device == p.device
        and p.data.numel() > 0
        and t.untyped_storage().data_ptr() == p.data.untyped_storage().data_ptr()
    )


class InitMode(TorchFunctionMode):
    def __init__(self, store: InitStore):
        super().__init__()
        self.store = store
        self.materialized: list[
            nn.Parameter
        ] = []  # made whole by a torch function, in the store's WHOLE state
        self.tracked: list[tuple[weakref.ref[nn.Module], weakref.ref[nn.Parameter]]] = []
        self.replaced: WeakIdKeyDictionary = (
            WeakIdKeyDictionary()
        )  # a meta parameter -> its partitioned stand-in
        # a live view of a materialised parameter -> that parameter ([Note: views of a materialised parameter])
        self.views: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        involved = self._involved(tree_flatten((args, kwargs))[0])
        self.flush(keep=involved)
        with torch._C.DisableTorchFunction():
            for p in involved:
                if all(p is not q for q in self.materialized):
                    self.store.to_whole(p, as_built=True)
                    self.materialized.append(p)
        out = func(*args, **kwargs)
        if involved:
            self._remember_views(out, involved)
        return out

    def _involved(self, flat: list[Any]) -> list[nn.Parameter]:
        """The partitioned parameters among ``flat``, and those the views among it point into."""
        involved: list[nn.Parameter] = []
        for a in flat:
            if not isinstance(a, torch.Tensor):
                continue
            p = a if isinstance(a, nn.Parameter) and a in self.store else self.views.get(a)
            if p is not None and all(p is not q for q in involved):
                involved.append(p)
        return involved

    def _remember_views(self, out: Any, involved: Sequence[nn.Parameter]) -> None:
        with torch._C.DisableTorchFunction():
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
                    for p in involved:
                        if _shares_storage(t, p):
                            self.views[t] = p
                            break

    def flush(self, keep: Sequence[nn.Parameter] = (), *, force: bool = False) -> None:
        """Writes back every materialised parameter not in ``keep`` and, unless ``force``, that no
        live view points into."""
        if not force:
            keep = [*keep, *self.views.values()]
        kept = []
        with torch._C.DisableTorchFunction():
            for p in self.materialized:
                if any(p is k for k in keep):
                    kept.append(p)
                else:
                    self.store.to_rest(p, rewrite=True)
        self.materialized = kept

    def on_module_registered(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is None:
            return
        self.flush()
        with torch._C.DisableTorchFunction():
            for _, p in child.named_parameters(recurse=False, remove_duplicate=False):
                self._take(child, p)

    def on_param_registered(self, module: nn.Module, name: str, p: nn.Parameter | None) -> None:
        if p is not None:
            self.tracked.append((weakref.ref(module), weakref.ref(p)))

    def finish(self) -> None:
        """The context ends: parameters not yet partitioned (the root's) are partitioned now."""
        self.flush(force=True)
        self.views = WeakIdKeyDictionary()
        with torch._C.DisableTorchFunction():
            for module_ref, p_ref in self.tracked:
                module, p = module_ref(), p_ref()
                if module is not None and p is not None:
                    self._take(module, p)

    def _take(self, module: nn.Module, p: nn.Parameter) -> None:
        """Partitions ``p`` (unless it is already, or empty); ``module``, holding it, is attached. A
        parameter on the meta device (transformers' from_pretrained builds there) is replaced by one
        partitioned with zeros: its values come from the checkpoint (see [Note: from_pretrained under
        zero.Init] in hf_init.py)."""
        if p.is_meta:
            p = self._replace_meta(module, p)
        if p not in self.store and p.numel() > 0:
            self.store.partition(p)
        if p in self.store:
            self.store.attach(module)

    def _replace_meta(self, module: nn.Module, p: nn.Parameter) -> nn.Parameter:
        q = self.replaced.get(p)
        if q is None:
            q = nn.Parameter(
                torch.empty(0, dtype=p.dtype, device="cpu"), requires_grad=p.requires_grad
            )
            self.store.partition_meta(q, p.shape)
            self.replaced[p] = q
        for name, held in list(module._parameters.items()):
            if held is p:
                module._parameters[name] = q
        return q
