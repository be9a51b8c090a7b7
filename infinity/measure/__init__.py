"""Measuring the disks: the aio engine's sequential throughput per setting, next to fio's.

Used by ``infinity bench aio``, ``infinity tune nvme`` and the benches under ``bench/``; nothing in
the library below imports it. One concept per module: ``sizes`` (sizes as typed and printed),
``testfiles`` (the files a run reads and writes: one drive, or a stripe), ``fio`` (the disk's
reference), ``throughput`` (settings, runs, sweeps and their samples), ``results`` (table and
chart), ``provenance`` (what a result records of the machine).

Imports only infinity.aio and infinity.host (and numpy, torch, tqdm, matplotlib).
"""

from infinity.measure.fio import FioError, FioJob, IoMem, fio_path, fio_version, shmhuge_fits
from infinity.measure.provenance import machine_info, mount_of
from infinity.measure.results import format_table, plot
from infinity.measure.sizes import (
    format_size,
    ints_arg,
    names_arg,
    parse_list,
    parse_size,
    size_arg,
    sizes_arg,
)
from infinity.measure.testfiles import Stripe, Target, TestFile, shared_file_systems, targets
from infinity.measure.throughput import (
    Op,
    Sample,
    Setting,
    best,
    check_settings,
    fio_job,
    measure_once,
    page_cache_note,
    run_sweep,
)

__all__ = [
    "FioError",
    "FioJob",
    "IoMem",
    "Op",
    "Sample",
    "Setting",
    "Stripe",
    "Target",
    "TestFile",
    "best",
    "check_settings",
    "fio_job",
    "fio_path",
    "fio_version",
    "format_size",
    "format_table",
    "ints_arg",
    "machine_info",
    "measure_once",
    "mount_of",
    "names_arg",
    "page_cache_note",
    "parse_list",
    "parse_size",
    "plot",
    "run_sweep",
    "shared_file_systems",
    "shmhuge_fits",
    "size_arg",
    "sizes_arg",
    "targets",
]
