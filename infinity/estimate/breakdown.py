"""Breakdown: the itemised bytes one setting (stage × offload) allocates per rank, by resource and phase.

The items are made by itemise.py from the setting's RuntimePlan ([Note: one
sizing model]) plus what only the estimator knows. Two phases matter for a
peak: ``init`` (inside initialize: the model as the user built it is still
resident while the stores fill) and ``train`` (forward, backward, step);
``run`` items exist in both. A resource's peak is the larger phase sum. On a
CPU compute device, device and host share RAM: ``ram_nbytes`` is the larger
phase sum of both.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from infinity.estimate.runtime_plan import RuntimePlan
from infinity.estimate.setting import ZeroSetting

Resource = Literal["device", "host", "nvme"]
"""What an item takes: device memory, host memory or NVMe space (not the store's residency tiers)."""
Phase = Literal["init", "train", "run"]

_NEARNESS = {"none": 0, "cpu": 1, "auto": 1, "nvme": 2}
"""How far a section's state rests from the compute, for the speed ranking."""


@dataclasses.dataclass(frozen=True)
class Item:
    """One allocation (or group of like allocations) of a rank."""

    name: str
    resource: Resource
    nbytes: int
    phase: Phase
    detail: str = ""
    """What it is and which code allocates it."""
    key: str | None = None
    """The config key that sizes it (the fix when it is too big); several: ", "-separated."""
    counted: bool = True
    """False for budgets shown for sizing that live inside another item."""
    heap: bool = False
    """Allocated and freed by torch's allocator step after step (not an mmap'd buffer made once):
    the heap keeps some of it after it is freed (see rules.SLACK_PERCENT)."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """A setting the runtime would refuse or stall on, whatever the machine."""

    message: str
    fix: str
    engine_refuses: bool = False
    """True where initialize itself refuses it, clearly and before allocating (build.py checks it):
    the pre-flight check then leaves it to the engine's own message."""


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """The itemised bytes one setting allocates per rank (see the module docstring)."""

    setting: ZeroSetting
    dtype: str
    items: tuple[Item, ...]
    problems: tuple[Problem, ...]
    device_type: str
    nvme_by_path: tuple[tuple[str, int], ...]
    """NVMe bytes per rank by directory (offload_param and offload_optimizer may differ)."""
    nvme_traffic_nbytes: int
    """Bytes a rank moves to and from NVMe per optimizer step with no cache hits (the speed ranking's
    first key: it depends on where the state rests, not on pool sizes): traffic.worst_case_traffic."""
    changes: tuple[tuple[str, int, int], ...] = ()
    """(config key, the config's value, the value planned) for a tuned setting."""
    layer_major_block: int | None = None
    """Trained by engine.train_batch in blocks of this many micro-batches (None: the micro-batch
    loop); [Note: layer-major blocks] in blocks.py."""
    runtime: RuntimePlan | None = dataclasses.field(default=None, compare=False, repr=False)
    """The RuntimePlan the engine would allocate for this setting, which the items are read from."""

    def layer_major_blocks(self) -> int | None:
        """Blocks per step under engine.train_batch (None: the micro-batch loop, or no plan)."""
        if self.layer_major_block is None or self.runtime is None:
            return None
        return -(-self.runtime.gradient_accumulation_steps // self.layer_major_block)

    def keys(self) -> str:
        """The config keys that select this setting (its stage and offload, plus tuned sizes)."""
        extra = [f"{k.removeprefix('zero_optimization.')}={new:,}" for k, _old, new in self.changes]
        return ", ".join([self.setting.keys()] + extra)

    def resource_nbytes(self, resource: Resource, phase: Phase) -> int:
        return sum(
            i.nbytes
            for i in self.items
            if i.counted and i.resource == resource and i.phase in (phase, "run")
        )

    def peak(self, resource: Resource) -> int:
        return max(self.resource_nbytes(resource, "init"), self.resource_nbytes(resource, "train"))

    @property
    def device_nbytes(self) -> int:
        return self.peak("device")

    @property
    def host_nbytes(self) -> int:
        return self.peak("host")

    @property
    def nvme_nbytes(self) -> int:
        return self.peak("nvme")

    @property
    def ram_nbytes(self) -> int:
        """Host memory when the compute device is the CPU (device and host share RAM)."""
        return max(
            self.resource_nbytes("host", ph) + self.resource_nbytes("device", ph)
            for ph in ("init", "train")
        )

    @property
    def pinned_pool_nbytes(self) -> int:
        """Bytes of pinned pools of at least one huge page (they may come from the hugetlb pool)."""
        return sum(
            i.nbytes
            for i in self.items
            if i.counted
            and i.resource == "host"
            and i.name.endswith(" pool")
            and i.nbytes >= (2 << 20)
        )

    def speed_key(self) -> tuple:
        """Fastest first: NVMe bytes per step, then how far parameters and optimizer state are
        from the compute (none < cpu < nvme), then the stage (communication grows with it)."""
        s = self.setting
        return (
            self.nvme_traffic_nbytes,
            _NEARNESS[s.offload_param],
            _NEARNESS[s.offload_optimizer],
            s.stage,
            s.tuned,
        )
