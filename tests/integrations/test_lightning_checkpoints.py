"""Lightning's checkpoint flow on InfinityStrategy: resuming continues exactly, evaluation reads the weights.

Oracles: a run that was never interrupted (its losses from the resume point on), and plain
Lightning (strategy="auto") doing the same thing. Checkpoints are taken at epoch ends: from a
mid-epoch checkpoint plain Lightning itself restarts the epoch's data, so nothing resumes exactly there.
"""

import os

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from infinity.integrations.lightning import InfinityStrategy
from tests.integrations.lightning_runs import (
    GAS,
    LIGHTNING_WARNINGS,
    MODULES,
    STEPS_PER_EPOCH,
    assert_close,
    dataset,
    infinity_strategy,
    lightning_config,
    lightning_run,
    loader,
    trainer,
)

pytestmark = [
    *LIGHTNING_WARNINGS,
    # a resumed Trainer writes its checkpoints beside the one it resumes from, as users do
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]

EPOCHS = 4


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Four epochs without a stop: plain Lightning, and InfinityStrategy (stage 3, NVMe)."""
    nvme = tmp_path_factory.mktemp("nvme")
    plain = lightning_run("auto", epochs=EPOCHS)
    ours = lightning_run(infinity_strategy(nvme), epochs=EPOCHS)
    assert_close(ours[0], plain[0], "uninterrupted training loss")
    assert_close(ours[1], plain[1], "uninterrupted validation loss")
    return ours


def _fit(strategy, *, epochs, build_in="init", ckpt_path=None, callbacks=()):
    module = MODULES[build_in](build_in)
    t = trainer(
        strategy, epochs=epochs, callbacks=list(callbacks), enable_checkpointing=bool(callbacks)
    )
    data = dataset(epochs)
    t.fit(module, loader(data), loader(data[:2]), ckpt_path=ckpt_path)
    return module, t


def _micro(epoch: int) -> int:
    return epoch * GAS * STEPS_PER_EPOCH


@pytest.mark.parametrize("resume_from", ["epoch=0-step=3.ckpt", "last"])
def test_resume_with_model_checkpoint_continues_exactly(
    uninterrupted, tmp_path, nvme_dir, resume_from
):
    """ModelCheckpoint saves at each epoch end (and last.ckpt); fit(ckpt_path=...) in a new Trainer
    with a new module gives the uninterrupted run's losses from there on."""
    ckpt = tmp_path / "ckpt"
    callbacks = lambda: [ModelCheckpoint(dirpath=ckpt, save_top_k=-1, save_last=True)]  # noqa: E731
    _fit(infinity_strategy(nvme_dir), epochs=2, callbacks=callbacks())
    assert sorted(os.listdir(ckpt)) == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    assert (
        ckpt / "epoch=1-step=6.ckpt" / "checkpoint"
    ).is_dir()  # the engine's layout: <path>/checkpoint/
    start = 1 if resume_from.startswith("epoch=0") else 2
    path = resume_from if resume_from == "last" else str(ckpt / resume_from)
    module, _ = _fit(
        infinity_strategy(nvme_dir), epochs=EPOCHS, ckpt_path=path, callbacks=callbacks()
    )
    assert_close(module.losses, uninterrupted[0][_micro(start) :], "training loss after resuming")
    assert_close(module.val_losses, uninterrupted[1][2 * start :], "validation loss after resuming")


@pytest.mark.parametrize("build_in", ["init", "configure_model"])
def test_resume_from_trainer_save_checkpoint(uninterrupted, tmp_path, nvme_dir, build_in):
    """trainer.save_checkpoint(path) after fit, then fit(ckpt_path=path) for more epochs; the
    zero.Init-built module resumes the same way."""
    _, t = _fit(infinity_strategy(nvme_dir), epochs=2, build_in=build_in)
    t.save_checkpoint(tmp_path / "two_epochs")
    module, _ = _fit(
        infinity_strategy(nvme_dir),
        epochs=EPOCHS,
        build_in=build_in,
        ckpt_path=tmp_path / "two_epochs",
    )
    assert_close(module.losses, uninterrupted[0][_micro(2) :], "training loss after resuming")


def test_validate_test_and_predict_after_fit(nvme_dir):
    """The fitted engine evaluates (the module's parameters live in it); plain Lightning is the oracle."""

    def run(strategy):
        module, t = _fit(strategy, epochs=1)
        val = loader(dataset(1)[:2])
        module.val_losses.clear()
        t.validate(module, val)
        t.test(module, val)
        predicted = [p.item() for p in t.predict(module, val)]
        return module.val_losses, predicted

    plain = run("auto")
    ours = run(infinity_strategy(nvme_dir))
    assert_close(ours[0], plain[0], "validate and test losses")
    assert_close(ours[1], plain[1], "predictions")


def test_validate_a_checkpoint_in_a_fresh_trainer(uninterrupted, tmp_path, nvme_dir):
    """A Trainer that never fitted: validate(ckpt_path=...) builds an engine and loads the weights."""
    _, t = _fit(infinity_strategy(nvme_dir), epochs=2)
    t.save_checkpoint(tmp_path / "two_epochs")
    module = MODULES["configure_model"]("configure_model")
    trainer(infinity_strategy(nvme_dir)).validate(
        module, loader(dataset(1)[:2]), ckpt_path=tmp_path / "two_epochs"
    )
    assert_close(module.val_losses, uninterrupted[1][2:4], "validation loss of the checkpoint")


@pytest.mark.parametrize("stage", [2, 3])
def test_load_full_weights_reads_a_plain_lightning_checkpoint(tmp_path, nvme_dir, stage):
    """load_full_weights=True: a single-file checkpoint that plain Lightning wrote is read into the
    engine (whole under stage 2, module by module into the shards under stage 3)."""
    module, t = _fit("auto", epochs=1)
    t.save_checkpoint(tmp_path / "plain.ckpt")
    module.val_losses.clear()
    t.validate(module, loader(dataset(1)[:2]))

    strategy = InfinityStrategy(
        config=lightning_config(nvme_dir, stage=stage), load_full_weights=True
    )
    fresh = MODULES["init"]("init")
    trainer(strategy).validate(fresh, loader(dataset(1)[:2]), ckpt_path=tmp_path / "plain.ckpt")
    assert_close(fresh.val_losses, module.val_losses, "validation loss of the plain checkpoint")


def test_a_plain_checkpoint_is_refused_with_the_fix(tmp_path, nvme_dir):
    module, t = _fit("auto", epochs=1)
    t.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(FileNotFoundError, match="load_full_weights=True"):
        trainer(infinity_strategy(nvme_dir)).validate(
            MODULES["init"]("init"), loader(dataset(1)[:2]), ckpt_path=tmp_path / "plain.ckpt"
        )
