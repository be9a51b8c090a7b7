"""``deepspeed.init_distributed``: joins the process group the launcher describes (``torchrun`` or
the ``deepspeed`` launcher: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment).

A process started without a launcher (``python train.py``) is a group of one, as DeepSpeed makes
it: RANK=0, LOCAL_RANK=0 and WORLD_SIZE=1 are set where absent and a one-process group is made
(over an in-process store: no port is opened). DeepSpeed's MPI discovery is not done: a job
started by ``mpirun`` must export those variables (or use torchrun).
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from infinity.compat.deepspeed.errors import refuse

log = logging.getLogger("infinity.compat")

__all__ = ["init_distributed"]

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialises ``torch.distributed`` unless it is (``dist_init_required=True`` insists on
    nothing more: an initialised group is kept, as DeepSpeed keeps it). ``dist_backend`` None:
    ``nccl`` with CUDA, else ``gloo``. ``rank`` / ``world_size`` given: used in place of the
    environment's. ``auto_mpi_discovery`` and ``verbose`` change nothing here."""
    if config is not None:
        raise refuse(
            "deepspeed.init_distributed(config=...)",
            "it configures DeepSpeed's communication logger, which infinity does not have",
            "leave config None",
        )
    if dist_init_required is False or dist.is_initialized():
        if dist_init_required is False and not dist.is_initialized():
            log.info("init_distributed(dist_init_required=False): torch.distributed left as it is")
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs: dict[str, Any] = {"backend": backend}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if rank >= 0 and world_size > 0:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        kwargs.update(rank=rank, world_size=world_size)
        if init_method is not None:
            kwargs["init_method"] = init_method
    elif init_method is not None:
        kwargs["init_method"] = init_method
    elif all(k in os.environ for k in _LAUNCHER_ENV):
        pass  # env:// reads them
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        missing = [k for k in _LAUNCHER_ENV if k not in os.environ]
        raise RuntimeError(
            f"init_distributed: WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} "
            "not set; start the processes with torchrun (or the deepspeed launcher), which sets them"
        )
    else:
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(**kwargs)
    log.info(
        "initialised torch.distributed (%s): rank %d of %d",
        backend,
        dist.get_rank(),
        dist.get_world_size(),
    )
