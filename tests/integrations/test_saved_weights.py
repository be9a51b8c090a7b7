"""Every way Accelerate, Lightning and Fabric users save a model writes the weights the engine holds.

Each test trains the tiny GPT under stage 3 with parameters and optimizer state on NVMe (every
unit: lightning_runs.engine_config), saves the framework's way, reads the files back with plain
safetensors / torch (an engine checkpoint through ``infinity.engine.checkpoint.export_checkpoint``,
infinity's ``zero_to_fp32``), and compares them with two oracles: the weights the engine holds,
gathered (``GatheredParameters``) — bit for bit — and the weights plain Accelerate / Lightning /
Fabric train on the same data (lightning_runs.assert_weights_close: 1e-5 of a tensor's largest
value, tighter than the 5e-4 fused-vs-foreach AdamW noise). Every file is at least as large as the
tensors its header says it holds, and those have the model's shapes (no ``(0,)`` placeholder).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import AcceleratorState, GradientState
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors import safe_open
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from infinity.engine.checkpoint import export_checkpoint
from infinity.integrations._shared import EngineModule
from infinity.integrations.accelerate import EngineOptimizer, EngineScheduler, prepare
from tests.engine.models import tiny_gpt
from tests.integrations.accelerate_runs import auto_config, infinity_run, loader, plain_run
from tests.integrations.lightning_runs import (
    GAS,
    LIGHTNING_WARNINGS,
    GPTModule,
    assert_weights_close,
    dataset,
    engine_config,
    fabric_run,
    full_weights,
    infinity_strategy,
    lightning_run,
    optimizer_and_schedule,
    trainer,
)
from tests.integrations.lightning_runs import loader as lightning_loader

pytestmark = LIGHTNING_WARNINGS


@pytest.fixture(autouse=True)
def fresh_accelerate():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _shapes() -> dict[str, torch.Size]:
    return {n: t.shape for n, t in tiny_gpt().state_dict().items()}


def assert_files_hold(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Each safetensors file is at least as large as its tensors, and those have the model's shapes;
    returns every tensor of the files."""
    shapes = _shapes()
    out: dict[str, torch.Tensor] = {}
    for path in paths:
        claimed = 0
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = f.get_tensor(name)
                claimed += t.numel() * t.element_size()
                bare = name.split(".", 1)[1] if name.startswith("model.") else name
                assert t.shape == shapes[bare], f"{path.name}: {name} has shape {tuple(t.shape)}"
                out[name] = t
        assert path.stat().st_size >= claimed, (
            f"{path.name}: {path.stat().st_size} bytes hold {claimed}"
        )
    return out


def assert_checkpoint_holds(checkpoint: Path) -> None:
    """An engine checkpoint's files together are at least the fp32 masters they keep."""
    masters = sum(t.numel() * 4 for t in tiny_gpt().parameters())
    files = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    assert files >= masters, f"{checkpoint}: {files} bytes for {masters} bytes of fp32 weights"


def assert_bitwise(got: dict[str, torch.Tensor], held: dict[str, torch.Tensor]) -> None:
    for name, want in held.items():
        assert name in got, f"{name} is missing (the file has {sorted(got)})"
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), (
            f"{name} differs from the engine's"
        )


def exported(checkpoint: Path, tag: str, out: Path) -> dict[str, torch.Tensor]:
    path = export_checkpoint(checkpoint, out, tag=tag)
    assert_checkpoint_holds(checkpoint / tag)
    return assert_files_hold([path])


# -- Accelerate ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_accelerate():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return plain_run()[1]


def _accelerate_trained(nvme_dir):
    """infinity_run's loop, the Accelerator and prepared model left open for saving."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=GAS)
    torch.manual_seed(0)
    model = tiny_gpt()
    opt, sched = optimizer_and_schedule(model.parameters())
    model, opt, dl, sched = prepare(
        accelerator, model, opt, loader(), sched, config=auto_config(nvme_dir)
    )
    for _ in range(2):
        for x, y in dl:
            accelerator.backward(model(x, y))
            opt.step()
            sched.step()
    return accelerator, model


def test_accelerate_unwrap_get_state_dict_and_save_model(plain_accelerate, tmp_path, nvme_dir):
    accelerator, model = _accelerate_trained(nvme_dir)
    user_model = model.module
    held = full_weights(user_model)
    assert_weights_close(held, plain_accelerate)

    assert accelerator.unwrap_model(model) is user_model
    state = accelerator.get_state_dict(model)
    assert state.keys() == user_model.state_dict().keys()
    assert_bitwise(state, held)
    wrapped = accelerator.get_state_dict(model, unwrap=False)
    assert_bitwise({k.removeprefix("module."): v for k, v in wrapped.items()}, held)

    accelerator.save_model(
        model, tmp_path / "saved"
    )  # the folder is created, as Accelerate creates it
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == ["model.safetensors"]
    files = assert_files_hold([tmp_path / "saved" / "model.safetensors"])
    assert_bitwise(files, {n: held[n] for n in files})
    fresh = tiny_gpt()
    fresh.load_state_dict(
        load_file(tmp_path / "saved" / "model.safetensors")
    )  # tied head: same tensor
    assert_bitwise(dict(fresh.named_parameters()), held)

    # Shards of max_shard_size with Accelerate's index, as its save_model writes them.
    accelerator.save_model(model, tmp_path / "sharded", max_shard_size=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted({tmp_path / "sharded" / f for f in index["weight_map"].values()})
    assert len(shards) > 1
    assert_bitwise(assert_files_hold(shards), {n: held[n] for n in index["weight_map"]})
    with pytest.raises(ValueError, match="safe_serialization=True"):
        accelerator.save_model(model, tmp_path / "pickle", safe_serialization=False)
    model.engine.close()


def test_accelerate_save_state_holds_the_weights(plain_accelerate, tmp_path, nvme_dir):
    """accelerator.save_state's engine checkpoint (<dir>/infinity_model/) exports to the weights the
    engine held (resuming from it is test_accelerate.test_save_state_and_load_state_continue_exactly)."""
    _, held, _ = infinity_run(auto_config(nvme_dir), save_to=tmp_path / "state")
    assert_weights_close(held, plain_accelerate)
    assert_bitwise(exported(tmp_path / "state", "infinity_model", tmp_path / "w.safetensors"), held)


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_prepare_returns_what_accelerator_prepare_returns(count, nvme_dir):
    """As many objects as given, in their order, one bare; plain accelerator.prepare is the oracle."""

    def objects():
        torch.manual_seed(0)
        model = tiny_gpt()
        opt, sched = optimizer_and_schedule(model.parameters())
        return [model, opt, loader(), DataLoader(dataset(1)[:2], batch_size=None), sched][:count]

    theirs = Accelerator(cpu=True).prepare(*objects())
    AcceleratorState._reset_state(True)
    config = engine_config(nvme_dir)
    if count == 1:  # no optimizer passed: the config's
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    ours = prepare(
        Accelerator(cpu=True, gradient_accumulation_steps=GAS), *objects(), config=config
    )
    if count == 1:
        assert not isinstance(theirs, tuple) and not isinstance(ours, tuple)
        theirs, ours = (theirs,), (ours,)
    assert len(ours) == len(theirs) == count
    their_kinds = [
        torch.nn.Module,
        AcceleratedOptimizer,
        DataLoader,
        DataLoader,
        AcceleratedScheduler,
    ]
    our_kinds = [EngineModule, EngineOptimizer, DataLoader, DataLoader, EngineScheduler]
    for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        assert isinstance(a, their_kinds[i]) and isinstance(b, our_kinds[i]), (i, type(a), type(b))
    ours[0].engine.close()


def test_prepare_refuses_none_naming_the_placeholder(nvme_dir):
    model = tiny_gpt()
    with pytest.raises(TypeError, match="object 1 is None.*DummyOptim"):
        prepare(Accelerator(cpu=True), model, None, loader(), config=engine_config(nvme_dir))


# -- Lightning and Fabric ----------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_lightning():
    return lightning_run("auto", epochs=2)[2]


def _lightning_fit(nvme_dir, callbacks=()):
    module = GPTModule()
    t = trainer(
        infinity_strategy(nvme_dir),
        epochs=2,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
    )
    data = dataset(2)
    t.fit(module, lightning_loader(data), lightning_loader(data[:2]))
    return module, t


def _prefixed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"model.{n}": w for n, w in weights.items()}  # the LightningModule's names for its GPT


def test_lightning_save_checkpoint_holds_the_weights(plain_lightning, tmp_path, nvme_dir):
    module, t = _lightning_fit(nvme_dir)
    held = full_weights(module.model)
    assert_weights_close(held, plain_lightning)
    t.save_checkpoint(tmp_path / "final.ckpt")
    assert_bitwise(
        exported(tmp_path / "final.ckpt", "checkpoint", tmp_path / "w.safetensors"), _prefixed(held)
    )
    t.strategy.engine.close()


def test_lightning_model_checkpoint_holds_the_weights(plain_lightning, tmp_path, nvme_dir):
    module, t = _lightning_fit(
        nvme_dir, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)]
    )
    held = full_weights(module.model)
    assert_weights_close(held, plain_lightning)
    assert_bitwise(
        exported(tmp_path / "ckpt" / "last.ckpt", "checkpoint", tmp_path / "w.safetensors"),
        _prefixed(held),
    )
    t.strategy.engine.close()


def test_fabric_save_holds_the_weights(tmp_path, nvme_dir):
    from infinity.integrations.fabric import InfinityFabricStrategy

    plain = fabric_run("auto")[2]
    _, _, held, _ = fabric_run(
        InfinityFabricStrategy(config=engine_config(nvme_dir)),
        save_after=2,
        path=tmp_path / "fabric",
    )
    assert_weights_close(held, plain)
    assert_bitwise(exported(tmp_path / "fabric", "checkpoint", tmp_path / "w.safetensors"), held)
