"""The attributes DeepSpeed gives a ZeRO-3 parameter, which user code and libraries read:
``ds_numel``, ``ds_shape``, ``ds_status`` (a ``ZeroParamStatus``) and ``ds_id``.

transformers and PEFT count parameters through ``ds_numel`` and read shapes through ``ds_shape``
when a parameter's ``.data`` is the empty placeholder of a partitioned one; TRL gathers the
parameters whose ``ds_status`` is not AVAILABLE. Under infinity the same holds: a parameter's
``.data`` is its whole tensor or an empty placeholder.

[Note: ds attributes are read, not kept]
The values are read when asked, from what holds the parameter, so they never go stale: the shape
from zero.Init's store while the parameter waits there (a ``resize_token_embeddings`` under
GatheredParameters changes it), else the shape recorded when the parameter was handed to the
engine (an engine's units have a fixed layout); the status from the store's state (whole or at
rest) or from ``.data`` (whole, or the empty placeholder). So the parameter's class gains three
properties: ``mark`` switches it to a subclass of its own class (still an ``nn.Parameter`` to
every ``isinstance``), created once per class, and records its id and shape in a table owned by
that subclass (weakly keyed: the parameter's ``__dict__`` and its pickle stay as they were).
Only stage 3 marks parameters (zero.Init's and initialize's), as DeepSpeed sets the attributes
only there; ``hasattr(p, "ds_numel")`` is False anywhere else. INFLIGHT is never reported:
infinity points ``.data`` at a gathered unit only once its gather is complete.
"""

from __future__ import annotations

import enum
import itertools
import math
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from infinity.zero.gathered import PARAM_OWNERS
from infinity.zero.init import InitState, InitStore


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``zero.ZeroParamStatus``, with its values."""

    AVAILABLE = 1
    """The parameter's ``.data`` is its whole tensor."""
    NOT_AVAILABLE = 2
    """The parameter is partitioned: ``.data`` is an empty placeholder."""
    INFLIGHT = 3
    """Being gathered (DeepSpeed's asynchronous gathers; infinity never reports it)."""


class ZeroParameter:
    """The properties a marked parameter's class gains ([Note: ds attributes are read, not kept])."""

    ids: ClassVar[itertools.count] = itertools.count()
    """DeepSpeed's ``Init.param_id``: one sequence for the process."""
    records: ClassVar[WeakIdKeyDictionary] = WeakIdKeyDictionary()
    """parameter -> (ds_id, the shape recorded when it was handed to the engine)."""
    classes: ClassVar[dict[type, type]] = {}
    """A parameter class -> its marked subclass."""

    def _record(self) -> tuple[int, torch.Size]:
        rec = ZeroParameter.records.get(self)
        if rec is None:  # a copy (deepcopy) of a marked parameter: not partitioned by anything
            raise AttributeError("this parameter is not a ZeRO-3 parameter")
        return rec

    @property
    def ds_id(self) -> int:
        return self._record()[0]

    @property
    def ds_shape(self) -> torch.Size:
        store = _init_store(self)
        if store is not None:
            return store.shape(self)  # type: ignore[arg-type]
        return self._record()[1]

    @property
    def ds_numel(self) -> int:
        return math.prod(self.ds_shape)

    @property
    def ds_status(self) -> ZeroParamStatus:
        store = _init_store(self)
        if store is not None:
            whole = store.records[self].state is InitState.WHOLE
        else:
            self._record()
            whole = self.data.numel() == self.ds_numel  # type: ignore[attr-defined]
        return ZeroParamStatus.AVAILABLE if whole else ZeroParamStatus.NOT_AVAILABLE


def _init_store(p: Any) -> InitStore | None:
    owner = PARAM_OWNERS.owner_of(p)
    return owner if isinstance(owner, InitStore) and p in owner.records else None


def mark(p: nn.Parameter) -> None:
    """Gives ``p`` the ds attributes (once; a marked parameter keeps its id). Its whole shape now:
    zero.Init's store's when it waits there, else its own (call before the engine takes it)."""
    store = _init_store(p)
    shape = store.shape(p) if store is not None else p.shape
    if isinstance(p, ZeroParameter) and p in ZeroParameter.records:
        ZeroParameter.records[p] = (ZeroParameter.records[p][0], shape)
        return
    cls = type(p)
    marked = ZeroParameter.classes.get(cls)
    if marked is None:
        marked = type(f"Zero{cls.__name__}", (ZeroParameter, cls), {"__module__": __name__})
        ZeroParameter.classes[cls] = marked
    p.__class__ = marked
    ZeroParameter.records[p] = (next(ZeroParameter.ids), shape)


def mark_all(params: Any) -> None:
    """``mark`` for each distinct parameter of ``params`` (an iterable of parameters)."""
    for p in dict.fromkeys(params):
        mark(p)
