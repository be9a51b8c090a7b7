"""infinity.checkpointing keeps deepspeed.checkpointing's API and acts on its config where it means something.

The oracle is the function run without checkpointing (same RNG seed: dropout
must replay in the recomputation). What a checkpoint keeps between forward
and backward is seen by recording the module's ``_KeptInput`` records (one
per input it moved or split; none where it keeps the input as it is).
"""

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import infinity
from infinity.zero import checkpointing
from tests.distributed import run_distributed
from tests.zero.checkpointed import build, engine_run, oracle_run, stage3_nvme_config, train_step

FUNCTIONS = {
    "checkpoint": infinity.checkpointing.checkpoint,
    "non_reentrant_checkpoint": infinity.checkpointing.non_reentrant_checkpoint,
}


class Block(nn.Module):
    """A block with dropout, a keyword tensor argument, and a tuple output with a non-tensor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.grad_modes: list[bool] = []

    def forward(self, x, *, scale):
        self.grad_modes.append(torch.is_grad_enabled())
        return F.dropout(torch.tanh(self.fc(x)) * scale, p=0.5, training=True), "tag"


def _grads(fn, block, device="cpu"):
    torch.manual_seed(0)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    scale = torch.tensor(1.5, device=device, requires_grad=True)
    torch.manual_seed(1)
    y, tag = fn(block, x, scale=scale)
    y.square().sum().backward()
    out = (y.detach(), x.grad, scale.grad, block.fc.weight.grad.clone(), tag)
    block.fc.weight.grad = None
    block.fc.bias.grad = None
    return out


def _plain(block, *args, **kwargs):
    return block(*args, **kwargs)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_checkpoint_keeps_deepspeeds_semantics(name):
    torch.manual_seed(0)
    block = Block()
    want = _grads(_plain, block)
    block.grad_modes.clear()
    got = _grads(FUNCTIONS[name], block)
    for g, w in zip(got[:4], want[:4], strict=True):
        torch.testing.assert_close(
            g, w, rtol=0, atol=0
        )  # the same dropout mask in the recomputation
    assert got[4] == "tag"
    # DeepSpeed's checkpoint is reentrant: forward runs without grad, the recomputation with it
    assert block.grad_modes == ([False, True] if name == "checkpoint" else [True, True])


def test_non_reentrant_checkpoint_gives_parameters_grads_when_no_input_requires_grad():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    infinity.checkpointing.non_reentrant_checkpoint(lin, x).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


class WorldMpu:
    """Megatron's model-parallel state with every rank in one model-parallel group."""

    def get_model_parallel_group(self):
        return torch.distributed.group.WORLD


def test_configure_follows_deepspeed(caplog):
    caplog.set_level(
        logging.INFO, logger="infinity.zero"
    )  # an adapter may have set "infinity" to WARNING
    assert not infinity.checkpointing.is_configured()
    cfg = {"activation_checkpointing": {"cpu_checkpointing": True, "partition_activations": True}}
    infinity.checkpointing.configure(None, deepspeed_config=cfg)
    s = infinity.checkpointing.settings()
    assert infinity.checkpointing.is_configured()
    assert s.cpu_checkpointing and s.partition_activations
    # no model-parallel group: data-parallel ranks hold different activations, nothing to split
    assert s.partitions == 1
    assert any("checkpoint inputs are kept whole" in r.getMessage() for r in caplog.records)
    # defaults, then the config, then the arguments given
    infinity.checkpointing.configure(None, deepspeed_config=cfg, checkpoint_in_cpu=False)
    assert not infinity.checkpointing.settings().cpu_checkpointing
    infinity.checkpointing.configure(None)
    assert infinity.checkpointing.settings() == checkpointing.CheckpointSettings()
    # keys without effect are accepted and reported
    infinity.checkpointing.configure(
        None, contiguous_checkpointing=True, num_checkpoints=4, profile=True
    )
    assert any(
        "no effect in infinity: activation_checkpointing.contiguous_memory_optimization, "
        "activation_checkpointing.number_checkpoints, activation_checkpointing.profile"
        in r.getMessage()
        for r in caplog.records
    )
    with pytest.raises(TypeError, match=r"mpu_ must have get_model_parallel_group\(\)"):
        infinity.checkpointing.configure(object())


class SettingsProbe(nn.Module):
    """Records the checkpoint settings in force while its forward runs (as a model calling
    infinity.checkpointing.checkpoint inside its forward would get them)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.seen: list[checkpointing.CheckpointSettings] = []

    def forward(self, x):
        self.seen.append(infinity.checkpointing.settings())
        return self.lin(x)


def test_an_engine_keeps_its_section_without_configuring_the_process(nvme_dir):
    torch.manual_seed(0)
    cfg = stage3_nvme_config(nvme_dir)
    plain = infinity.initialize(SettingsProbe(), cfg)
    cfg["activation_checkpointing"] = {"cpu_checkpointing": True}
    own = infinity.initialize(SettingsProbe(), cfg)
    try:
        assert (
            not infinity.checkpointing.is_configured()
        )  # building an engine changes nothing process-wide
        assert infinity.checkpointing.settings() == checkpointing.CheckpointSettings()
        assert own.activation_checkpointing.settings().cpu_checkpointing
        for engine in (own, plain, own):
            engine.backward(engine(torch.randn(2, 32)).sum())
        assert [s.cpu_checkpointing for s in own.module.seen] == [True, True]
        # no section: the process-wide settings, whatever configure() sets them to
        infinity.checkpointing.configure(checkpoint_in_cpu=True)
        plain(torch.randn(2, 32))
        assert [s.cpu_checkpointing for s in plain.module.seen] == [False, True]
        assert infinity.checkpointing.settings().cpu_checkpointing  # outside both engines
    finally:
        own.close()
        plain.close()


def _recording(made: list):
    class Recording(checkpointing._KeptInput):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    return Recording


@pytest.fixture
def kept(monkeypatch):
    """Every _KeptInput a checkpoint makes (what it keeps of an input it moves or splits)."""
    made = []

    monkeypatch.setattr(checkpointing, "_KeptInput", _recording(made))
    return made


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_cpu_checkpointing_on_the_cpu_keeps_inputs_as_they_are(name, kept):
    torch.manual_seed(0)
    block = Block()
    want = _grads(_plain, block)
    infinity.checkpointing.configure(checkpoint_in_cpu=True)
    got = _grads(FUNCTIONS[name], block)
    for g, w in zip(got[:4], want[:4], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert kept == []  # already in host memory: nothing copied


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_cpu_checkpointing_keeps_inputs_in_pinned_host_memory(name, kept):
    torch.manual_seed(0)
    block = Block().cuda()
    want = _grads(_plain, block, "cuda")
    infinity.checkpointing.configure(checkpoint_in_cpu=True)
    got = _grads(FUNCTIONS[name], block, "cuda")
    for g, w in zip(got[:4], want[:4], strict=True):
        torch.testing.assert_close(g, w)
    # x and scale: both kept in pinned host memory, given back on the device for the recomputation
    assert [k.numel for k in kept] == [32, 1]
    assert all(
        k.part.device.type == "cpu" and k.part.is_pinned() and k.device.type == "cuda" for k in kept
    )


def _partitioned_rank(rank, mode, nvme_dir, steps):
    """Both ranks train on the same batches (as tensor-parallel ranks see the same activations), with
    the whole world as the model-parallel group: each keeps half of every checkpoint input."""
    made = []
    checkpointing._KeptInput = _recording(made)
    infinity.checkpointing.configure(mpu_=WorldMpu())
    cfg = stage3_nvme_config(nvme_dir)
    cfg["activation_checkpointing"] = {"partition_activations": True, "cpu_checkpointing": True}
    losses, _, _ = engine_run("gpt", mode, cfg, steps=steps, rank=0)
    return losses, [(k.part.numel(), k.numel) for k in made]


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["deepspeed", "deepspeed_non_reentrant"])
def test_partition_activations_splits_inputs_across_the_model_parallel_group(mode, nvme_dir):
    steps = 3
    per_rank = run_distributed(_partitioned_rank, mode, str(nvme_dir), steps, world_size=2)
    ref_losses, _ = oracle_run("gpt", mode, steps=steps)
    for losses, parts in per_rank:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        # one input per checkpointed block per step (the blocks' input: micro-batch x seq x d_model)
        assert len(parts) == 2 * steps
        assert all(part * 2 == numel == 2 * 15 * 32 for part, numel in parts)


def _teacher_and_student_rank(rank, nvme_dir, steps):
    """A teacher whose config partitions checkpoint inputs and a student whose config does not, trained
    in turns in one process (the model-parallel group is the whole world, as above)."""
    made = []
    checkpointing._KeptInput = _recording(made)
    infinity.checkpointing.configure(mpu_=WorldMpu())
    sections = {
        "teacher": {"partition_activations": True},
        "student": {"partition_activations": False},
    }
    engines = {}
    for name, section in sections.items():
        (Path(nvme_dir) / name).mkdir(exist_ok=True)
        cfg = stage3_nvme_config(Path(nvme_dir) / name)
        cfg["activation_checkpointing"] = section
        engines[name] = infinity.initialize(build("gpt", "deepspeed"), cfg)
    losses = {name: {} for name in engines}
    kept = {name: [] for name in engines}
    try:
        for step in range(steps):
            for name, engine in engines.items():
                made.clear()
                loss = train_step(engine, step)
                engine.backward(loss)
                engine.step()
                losses[name][(step, 0)] = loss.item()
                kept[name] += [(k.part.numel(), k.numel) for k in made]
    finally:
        for engine in engines.values():
            engine.close()
    return losses, kept


@pytest.mark.distributed
def test_a_teacher_and_a_student_keep_their_own_checkpoint_settings(nvme_dir):
    """Built one after the other in one process, each engine acts on its own section: the teacher's
    checkpoints keep half of each input on each rank, the student's keep inputs whole."""
    steps = 2
    per_rank = run_distributed(_teacher_and_student_rank, str(nvme_dir), steps, world_size=2)
    ref_losses, _ = oracle_run("gpt", "deepspeed", steps=steps)
    for losses, kept in per_rank:
        for name in ("teacher", "student"):
            assert losses[name] == pytest.approx(ref_losses, rel=1e-5)
        # one input per checkpointed block per step, split in two: micro-batch x seq x d_model
        assert kept["teacher"] == [(15 * 32, 2 * 15 * 32)] * (2 * steps)
        assert kept["student"] == []
