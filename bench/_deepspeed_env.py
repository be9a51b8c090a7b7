"""DeepSpeed contenders' shared set-up: helpers, not a bench (tests/test_benchmarks.py skips "_" files).

`deepspeed` is never a dependency: the benches run it from the environment bench/deepspeed_venv.sh makes.
"""

from __future__ import annotations

import os


def single_process_env() -> None:
    """The torch.distributed rendezvous of a one-process run, as a launcher would set it: without it,
    deepspeed.initialize falls back to MPI discovery (mpi4py)."""
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000)),
                       ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def block_io_nbytes() -> dict[str, int]:
    """Bytes this process (every thread) had the block layer read and write so far: /proc/self/io, which
    counts O_DIRECT transfers (DeepSpeed's aio) and never the page cache's hits."""
    fields = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = int(value)
    return {"read_nbytes": fields.get("read_bytes", 0), "write_nbytes": fields.get("write_bytes", 0)}
