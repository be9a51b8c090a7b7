"""Throughput of aio settings on one test file (or a stripe over several), measured the way fio
measures it, and interleaved with fio.

One *run* reads or writes the whole test file sequentially as one vectored request whose segments
cycle through a ring buffer of ``queue_depth x block_size x thread_count`` bytes (at least one 2 MiB
page): the memory fio's job cycles through for the same setting, so the two tools move the same
bytes through the same amount of memory (on a VM's virtual disk the host copies that memory; a
larger footprint measured slower for both). Slots are reused as soon as the engine may issue the
next piece, so two reads can land in one slot; the data is discarded. The page cache is defeated with O_DIRECT, or, on a
file system that refuses it, by dropping caches before each read (root) and fsyncing writes.

A Stripe is one test file per drive, read and written as a store's swap space striped over those
drives is laid out ([Note: striping] in infinity/store/swapspace.py): the same vectored request,
block_size pieces going round the drives in turn. fio's reference for it is one job per file, all
running at once, their bandwidth summed: what the drives do together at most.

Used by ``infinity bench aio``, ``infinity tune nvme`` and the benches under ``bench/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from infinity import host
from infinity.aio import (
    HUGE_PAGE_SIZE,
    AioConfig,
    AioError,
    AioHandle,
    aligned_empty,
    huge_page_fraction,
)
from infinity.measure.fio import FioError, FioJob, IoMem, shmhuge_fits
from infinity.measure.sizes import format_size
from infinity.measure.testfiles import Target

Op = Literal["read", "write"]


@dataclass(frozen=True)
class Setting:
    """One point of a sweep: the AioHandle keyword arguments that matter for throughput."""

    block_size: int
    queue_depth: int
    thread_count: int = 1
    engine: str = "auto"
    single_submit: bool = False

    @property
    def label(self) -> str:
        extra = " single" if self.single_submit else ""
        return f"{format_size(self.block_size)} qd{self.queue_depth} t{self.thread_count}{extra}"

    def ring_nbytes(self, file_nbytes: int) -> int:
        """queue_depth x block_size x threads, at least one 2 MiB page (so huge pages can back it),
        at most the file rounded up to a block."""
        ring = max(self.block_size * self.queue_depth * self.thread_count, HUGE_PAGE_SIZE)
        ring = -(-ring // self.block_size) * self.block_size
        return min(ring, -(-file_nbytes // self.block_size) * self.block_size)

    def config(self) -> AioConfig:
        """The handle settings of this point (the rest at their defaults); ValueError naming a bad
        value."""
        return AioConfig.from_dict(dataclasses.asdict(self))

    def handle(self) -> AioHandle:
        return AioHandle(self.config())


def check_settings(settings: Sequence[Setting]) -> None:
    """Refuses (naming the value) a setting the engine would refuse, before any file is written."""
    for s in settings:
        try:
            s.config()
        except ValueError as e:
            raise SystemExit(f"{s.label}: {e}") from None


@dataclass
class Sample:
    """Repeated runs of one setting and one direction: ours and, when compared, fio's (GB/s)."""

    setting: Setting
    op: Op
    ours: list[float] = field(default_factory=list)
    fio: list[float] = field(default_factory=list)
    engine: str = ""
    huge_fraction: float = 1.0
    """Smallest fraction of the ring backed by 2 MiB pages over the runs."""
    target: str = ""
    """What was measured where several paths were: one path, or "stripe" (all of them); "" for one
    path."""

    @property
    def median(self) -> float:
        return statistics.median(self.ours) if self.ours else 0.0

    @property
    def fio_median(self) -> float:
        return statistics.median(self.fio) if self.fio else 0.0

    @property
    def ratio(self) -> float:
        """Median of the per-repetition ratios ours/fio (each pair measured back to back)."""
        pairs = [a / b for a, b in zip(self.ours, self.fio, strict=False) if b > 0]
        return statistics.median(pairs) if pairs else 0.0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            **({"target": self.target} if self.target else {}),
            **dataclasses.asdict(self.setting),
            "engine": self.engine or self.setting.engine,
            "op": self.op,
            "huge_page_fraction": round(self.huge_fraction, 3),
            "gbps": _stats(self.ours),
        }
        if self.fio:
            d["fio_gbps"] = _stats(self.fio)
            d["ratio"] = round(self.ratio, 3)
        return d


def _stats(xs: Sequence[float]) -> dict[str, Any]:
    return {
        "median": round(statistics.median(xs), 3),
        "min": round(min(xs), 3),
        "max": round(max(xs), 3),
        "runs": [round(x, 3) for x in xs],
    }


def page_cache_note(direct: bool) -> str:
    if direct:
        return "bypassed: every run uses O_DIRECT (ours and fio's direct=1)"
    if host.can_drop_caches():
        return "the file system refuses O_DIRECT: caches dropped before each read, writes fsynced"
    return (
        "NOT defeated: the file system refuses O_DIRECT and /proc/sys/vm/drop_caches is not "
        "writable (not root); reads may measure memory copies"
    )


def measure_once(
    setting: Setting, test_file: Target, op: Op, *, ring_nbytes: int | None = None
) -> tuple[float, str, float]:
    """One run: (GB/s, engine used, fraction of the ring in 2 MiB pages)."""
    n = test_file.nbytes
    ring_n = ring_nbytes or setting.ring_nbytes(n)
    ring = aligned_empty(ring_n)
    huge = huge_page_fraction(ring)
    with setting.handle() as h, contextlib.ExitStack() as opened:
        files = [opened.enter_context(h.open(f.path, "rw", create=False)) for f in test_file.files]
        items = test_file.items(ring, setting.block_size, files)
        direct = all(f.direct for f in files)
        if not direct and op == "read" and host.can_drop_caches():
            host.drop_caches()
        t0 = time.perf_counter()
        (h.pwrite_many if op == "write" else h.pread_many)(items).wait()
        if not direct and op == "write":
            for f in files:
                os.fsync(f.fileno())
        seconds = time.perf_counter() - t0
        engine = h.engine
    del items, ring
    gc.collect()  # hand the ring's huge pages back before fio wants them
    return n / seconds / 1e9, engine, huge


def fio_job(setting: Setting, test_file: Target, op: Op, iomem: IoMem, direct: bool) -> FioJob:
    """fio's run of ``setting`` on the test file; on a stripe, one job per file, all at once."""
    paths = tuple(f.path for f in test_file.files)
    if iomem == "shmhuge" and not shmhuge_fits(
        setting.block_size, setting.queue_depth, setting.thread_count * len(paths)
    ):
        iomem = "malloc"
    return FioJob(
        path=paths if len(paths) > 1 else paths[0],
        nbytes=test_file.files[0].nbytes,
        op=op,
        block_size=setting.block_size,
        queue_depth=setting.queue_depth,
        jobs=setting.thread_count,
        iomem=iomem,
        direct=direct,
    )


def run_sweep(
    settings: Sequence[Setting],
    ops: Sequence[Op],
    test_file: Target,
    *,
    repeat: int = 1,
    fio_iomem: IoMem | None = None,
    progress: bool = True,
    desc: str = "bench aio",
    target: str = "",
) -> list[Sample]:
    """Every setting x direction, ``repeat`` times; with ``fio_iomem`` each of our runs is followed
    by fio's. ``target`` labels the samples (where several paths are measured)."""
    from tqdm import tqdm

    direct = test_file.direct_io_works()
    per = 2 if fio_iomem else 1
    samples = []
    total = len(settings) * len(ops) * repeat * per
    with tqdm(
        total=total, desc=desc, unit="run", file=sys.stderr, disable=not progress, leave=False
    ) as bar:
        # Warm-up, not measured: the first pass over a fresh file runs slow (allocation, caches).
        bar.set_postfix_str("warm-up")
        for op in ops:
            measure_once(settings[0], test_file, op)
        for s in settings:
            for op in ops:
                sample = Sample(s, op, target=target)
                for _ in range(repeat):
                    try:
                        gbps, sample.engine, huge = measure_once(s, test_file, op)
                        sample.huge_fraction = min(sample.huge_fraction, huge)
                    except AioError as e:
                        raise SystemExit(f"{s.label} {op}: {e}") from None
                    sample.ours.append(gbps)
                    bar.update()
                    bar.set_postfix_str(f"{s.label} {op} {gbps:.2f} GB/s")
                    if fio_iomem:
                        if not direct and op == "read" and host.can_drop_caches():
                            host.drop_caches()
                        try:
                            fio = fio_job(s, test_file, op, fio_iomem, direct).run()
                        except FioError as e:
                            raise SystemExit(str(e)) from None
                        sample.fio.append(fio)
                        bar.update()
                        bar.set_postfix_str(f"{s.label} {op} fio {fio:.2f} GB/s")
                samples.append(sample)
    return samples


def best(samples: Sequence[Sample]) -> tuple[Setting, dict[str, float]]:
    """The setting with the highest read + write median (or the one direction measured)."""
    by_setting: dict[Setting, dict[str, float]] = {}
    for sm in samples:
        by_setting.setdefault(sm.setting, {})[sm.op] = sm.median
    setting = max(by_setting, key=lambda s: sum(by_setting[s].values()))
    return setting, by_setting[setting]
