"""Checkpointing uses nothing of an engine beyond CheckpointTarget ([Note: the checkpoint's view of an
engine] in target.py): save, load and save_16bit_model work through a stand-in that forwards exactly the
protocol's members to a real engine and refuses everything else, and no checkpoint module reaches into
the engine's runtime."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from safetensors.torch import load_file

import infinity.engine.checkpoint as checkpoint
from infinity.engine.checkpoint import CheckpointTarget
from tests.checkpoint.helpers import (
    N_STEPS,
    assert_same,
    config,
    make_engine,
    snapshot,
    train,
    weights,
)

PACKAGE = Path(checkpoint.__file__).parent


def written_members() -> set[str]:
    """The members checkpointing may set: the protocol's plain attributes (the others are
    read-only properties and methods)."""
    return set(CheckpointTarget.__annotations__)


def protocol_members() -> set[str]:
    return written_members() | {
        n
        for n, v in vars(CheckpointTarget).items()
        if (callable(v) or isinstance(v, property)) and not n.startswith("_")
    }


class OnlyTheProtocol:
    """Forwards the CheckpointTarget members (get and set) to ``engine``; anything else is an error."""

    def __init__(self, engine):
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_allowed", protocol_members())
        object.__setattr__(self, "_written", written_members())

    def __getattr__(self, name):
        if name not in self._allowed:
            raise AttributeError(
                f"checkpointing read engine.{name}, which CheckpointTarget does not name"
            )
        return getattr(self._engine, name)

    def __setattr__(self, name, value):
        if name not in self._written:
            raise AttributeError(
                f"checkpointing set engine.{name}, which CheckpointTarget does not name as written"
            )
        setattr(self._engine, name, value)


def test_protocol_names_what_checkpointing_needs():
    assert written_members() == {"global_steps", "micro_steps", "skipped_steps"}
    assert protocol_members() == {
        "module",
        "config",
        "group",
        "stage",
        "dtype",
        "gradient_accumulation_steps",
        "global_steps",
        "micro_steps",
        "skipped_steps",
        "optimizer",
        "lr_scheduler",
        "loss_scaler",
        "synchronize",
        "checkpoint_parts",
    }


def test_save_load_and_16bit_export_through_the_protocol_alone(nvme_dir):
    (nvme_dir / "swap").mkdir()
    engine, _ = make_engine("tied", config(3, "nvme", "nvme", nvme_dir / "swap"), seed=0)
    try:
        target = OnlyTheProtocol(engine)
        train(engine, 0, N_STEPS)
        at_save = snapshot(engine)
        checkpoint.save_checkpoint(target, nvme_dir / "ckpt", client_state={"epoch": 1})
        train(engine, N_STEPS, 1)
        assert checkpoint.load_checkpoint(target, nvme_dir / "ckpt") == {"epoch": 1}
        assert_same(at_save, snapshot(engine), "state after a load through the protocol")
        out = checkpoint.save_16bit_model(target, nvme_dir)
        saved = load_file(str(out))
        for name, w in weights(engine).items():
            assert torch.equal(saved[name], w), name
    finally:
        engine.close()


def test_no_checkpoint_module_reaches_into_the_runtime():
    """The engine's runtime (engine/build.py) is reached only through ``checkpoint_parts()``."""
    found = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "runtime":
                found.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "infinity.engine.build"
            ):
                found.append(f"{path.name}:{node.lineno} imports {node.module}")
    assert not found, found
