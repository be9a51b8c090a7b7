"""DeepSpeed's initialize joins (or makes) a process group; each test here leaves the process as it
found it: the group it made destroyed, the launcher variables it set removed."""

import os

import pytest
import torch.distributed as dist

_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def own_process_group():
    had_group = dist.is_available() and dist.is_initialized()
    saved = {k: os.environ.get(k) for k in _ENV}
    yield
    if not had_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
