"""Fixtures for the framework adapters: deepspeed unimportable, and no process group,
environment or "infinity" logger level left behind by a Lightning run."""

import gc
import logging
import os
import sys

import pytest
import torch.distributed as dist

try:
    import lightning  # noqa: F401
except ImportError:
    raise ImportError(
        "tests/integrations need lightning (the test extra pins 2.6.6): pip install -e '.[test]'"
    ) from None


@pytest.fixture(autouse=True, scope="module")
def no_deepspeed():
    """``import deepspeed`` raises ImportError in every test module here (module-scoped fixtures
    included): nothing on these paths may need it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "deepspeed", None)
        yield
        leaked = sorted(
            m
            for m in sys.modules
            if m.startswith("deepspeed.") or (m == "deepspeed" and sys.modules[m])
        )
        assert not leaked, f"deepspeed modules were imported: {leaked}"


def _restore(before: dict[str, str], level: int) -> None:
    logging.getLogger("infinity").setLevel(
        level
    )  # the strategies set it as DeepSpeedStrategy sets deepspeed's
    if dist.is_initialized():
        dist.destroy_process_group()
    for k in set(os.environ) - set(before):
        del os.environ[k]
    os.environ.update(before)
    gc.collect()  # engines hold buffer pools and swap files until they are collected


# Lightning's launchers write the rank layout into os.environ (LOCAL_RANK, NODE_RANK, WORLD_SIZE,
# MASTER_*) and its DDP-style strategies join a gloo group of one: a process that later launches
# a script with this environment would make the script believe its ranks were started for it.
# Restored after every test, and after every module (its module-scoped fixtures train too).


@pytest.fixture(autouse=True, scope="module")
def clean_module():
    before = dict(os.environ)
    level = logging.getLogger("infinity").level
    yield
    _restore(before, level)


@pytest.fixture(autouse=True)
def clean_process():
    before = dict(os.environ)
    level = logging.getLogger("infinity").level
    yield
    _restore(before, level)
