"""DeepSpeed contenders' shared set-up: helpers, not a bench (tests/test_benchmarks.py skips "_" files).

`deepspeed` is never a dependency: the benches run it from the environment bench/deepspeed_venv.sh makes.
"""

from __future__ import annotations

import os

from infinity import host


def single_process_env() -> None:
    """The torch.distributed rendezvous of a one-process run, as a launcher would set it: without it,
    deepspeed.initialize falls back to MPI discovery (mpi4py)."""
    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(29500 + os.getpid() % 1000)),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(key, value)


def block_io_nbytes() -> dict[str, int]:
    """The block layer's bytes for this process so far (DeepSpeed counts none of its own I/O), as the
    train_step bench's I/O stats name them."""
    read, written = host.block_io_nbytes()
    return {"read_nbytes": read, "write_nbytes": written}
