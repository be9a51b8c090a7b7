"""Bad input is refused before training starts, with a message naming what is wrong and the fix."""

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import infinity
from infinity.config import ConfigError
from tests.engine.models import tiny_gpt
from tests.engine.reference import engine_config

ROOT = Path(__file__).resolve().parents[2]


def test_missing_nvme_path_is_named(tmp_path):
    missing = tmp_path / "no" / "such" / "dir"
    cfg = engine_config(3, "nvme", "nvme", missing, gas=1)
    with pytest.raises(ConfigError, match=f"nvme_path '{missing}' does not exist"):
        infinity.initialize(tiny_gpt(), cfg)


def test_non_writable_nvme_path_is_named():
    d = Path(tempfile.mkdtemp(prefix="infinity-ro-"))
    try:
        d.chmod(0o555)
        script = textwrap.dedent(f"""
            import os, sys
            sys.path.insert(0, {str(ROOT)!r})
            import infinity
            from infinity.config import ConfigError
            from tests.engine.models import tiny_gpt
            from tests.engine.reference import engine_config
            model = tiny_gpt()
            initialize = infinity.initialize  # load the runtime while /root is still readable
            import infinity.engine.build, infinity.store, infinity.optim.partitioned_adam
            if os.geteuid() == 0:  # root ignores file modes: become nobody
                os.setgid(65534); os.setuid(65534)
            try:
                initialize(model, engine_config(3, "nvme", "nvme", {str(d)!r}, gas=1))
            except ConfigError as e:
                print(e); sys.exit(0)
            sys.exit("no error")
        """)
        r = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"nvme_path '{d}' is not writable by this process" in r.stdout
    finally:
        d.chmod(0o755)
        d.rmdir()


@pytest.fixture
def small_fs():
    """A 2 MiB file system (tmpfs mounted here; needs root and mount permission)."""
    d = Path(tempfile.mkdtemp(prefix="infinity-small-"))
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)], capture_output=True, text=True
    )
    if r.returncode != 0:
        d.rmdir()
        pytest.skip(
            f"cannot mount a small tmpfs here ({r.stderr.strip() or 'mount failed'}): needs root"
        )
    yield d
    subprocess.run(["umount", str(d)], check=False)
    d.rmdir()


def test_nvme_path_without_room_names_bytes_needed_and_free(small_fs):
    cfg = engine_config(3, "nvme", "nvme", small_fs, gas=1)
    torch.manual_seed(0)
    model = infinity.models.GPT(
        infinity.models.GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=128)
    )
    with pytest.raises(ConfigError) as e:
        infinity.initialize(model, cfg)
    msg = str(e.value)
    assert f"not enough free space at nvme_path '{small_fs}'" in msg
    assert (
        "bytes of swap files (parameters" in msg
        and "optimizer state" in msg
        and "bytes are free" in msg
    )
    assert not (small_fs / "rank0").exists()  # nothing was written, no folder made


def test_unresolvable_auto_is_named():
    cfg = engine_config(2, "none", "cpu", "/unused", gas=1)
    cfg["optimizer"]["params"]["lr"] = "auto"
    with pytest.raises(ValueError, match=r"optimizer\.params\.lr"):
        infinity.initialize(tiny_gpt(), cfg)


def test_pool_too_small_for_the_largest_layer_names_it(nvme_dir):
    cfg = engine_config(3, "nvme", "cpu", nvme_dir, gas=1)
    cfg["zero_optimization"]["offload_param"].update(buffer_count=2, buffer_size=512)
    with pytest.raises(ConfigError) as e:
        infinity.initialize(tiny_gpt(), cfg)
    msg = str(e.value)
    # the largest unit: an MLP Linear, 32 x 128 fp32 elements (the first of the equal ones)
    assert "cannot hold layer 'blocks.0.mlp.fc', whose shard is 16384 bytes (4096 elements)" in msg
    assert "offload_param.buffer_count=2 x buffer_size=512" in msg
    assert "raise zero_optimization.offload_param.buffer_count or buffer_size" in msg


@pytest.mark.parametrize(
    "stage,offload_optimizer", [(0, "none"), (1, "nvme"), (2, "nvme"), (2, "cpu"), (3, "none")]
)
@pytest.mark.parametrize("with_optimizer", [True, False])
def test_a_model_without_parameters_is_refused_at_initialize(
    stage, offload_optimizer, with_optimizer, nvme_dir
):
    """A pure function has nothing to train or stream: stages 0-2 used to build an engine whose step()
    crashed ('NoneType' object has no attribute 'param_groups', through the frameworks' optimizer);
    now every stage refuses at initialize, before anything is allocated or made under nvme_path."""

    class Empty(nn.Module):
        def forward(self, x):
            return (x * 2).sum()

    cfg = engine_config(stage, "none", offload_optimizer, nvme_dir, gas=1)
    if not with_optimizer:
        del cfg["optimizer"]
    with pytest.raises(ValueError) as e:
        infinity.initialize(Empty(), cfg)
    assert str(e.value) == (
        "initialize() needs a model with parameters, and Empty has none (a pure function): there is "
        "nothing to train, offload or stream; call the module directly, without an engine"
    )
    assert os.listdir(nvme_dir) == []
    # the estimate of such a module still answers (it allocates nothing of its own)
    estimate = infinity.estimate_memory(Empty(), config=cfg, machine=False)
    assert estimate.settings and estimate.table()


def test_unsupported_optimizer_is_refused_with_the_reason(nvme_dir):
    model = tiny_gpt()
    cfg = engine_config(3, "none", "cpu", nvme_dir, gas=1)
    del cfg["optimizer"]
    with pytest.raises(ValueError, match="SGD cannot run partitioned or offloaded"):
        infinity.initialize(model, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
