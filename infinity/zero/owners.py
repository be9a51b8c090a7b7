"""LiveOwners: from a bare nn.Parameter to the object that holds its data.

[Note: finding a parameter's owner]
A partitioned parameter's data lives away from it — in zero.Init's InitStore
until ``initialize``, then in an engine's units (Stage3Partitioner), or, at
stages 0-2, in the module with its fp32 master in the optimizer
(ResidentParams). DeepSpeed's API hands over bare parameters
(``GatheredParameters(module.weight)``), so something must lead from a
parameter to its owner, and a tensor leads nowhere by itself. Hanging the
owner on the parameter is ruled out (STYLE: no metadata on nn.Parameter), and
so is a table keyed by parameter beside the owner: it copies the record the
owner already keeps, must be kept in step with it, and (with strong values)
keeps a dropped engine alive through its model.

So each owner answers for its own parameters from the record it keeps anyway
(the UnitMap's ``unit_of``, the InitStore's records), and the only
process-wide state is the list of live owners — a registry of objects, not
of parameters, held weakly: an owner lives as long as its model (the hooks it
installs on the modules hold it) or its engine, and leaves the list when it
is removed or collected. A lookup asks each live owner, newest first (a
model handed to a second engine belongs to the newest, as before); there is
one per engine and one per zero.Init model not yet initialized.

Threading: owners are added, removed and looked up from the training thread.
"""

from __future__ import annotations

import weakref
from collections.abc import Container
from typing import Generic, TypeVar

Owner = TypeVar("Owner", bound=Container)


class LiveOwners(Generic[Owner]):
    """The live owners of one kind, newest first, held weakly."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref[Owner]] = []

    def add(self, owner: Owner) -> None:
        self._refs.insert(0, weakref.ref(owner, self._collected))

    def discard(self, owner: Owner) -> None:
        self._refs = [r for r in self._refs if r() is not owner]

    def owner_of(self, p: object) -> Owner | None:
        """The newest live owner holding ``p``, or None."""
        for ref in list(self._refs):
            owner = ref()
            if owner is not None and p in owner:
                return owner
        return None

    def _collected(self, ref: weakref.ref[Owner]) -> None:
        self._refs = [r for r in self._refs if r is not ref]
