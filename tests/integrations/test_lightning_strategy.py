"""InfinityStrategy's arguments, names, precisions and refusals.

Oracles: Lightning's own DeepSpeedStrategy (the config its ``_create_default_config`` builds from
the same arguments, and the names it registers), infinity's own loop for the 16-bit precisions
(the same engine, driven by hand), and the error each misuse must name.
"""

import lightning as L
import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from infinity.config import ConfigError
from infinity.integrations.lightning import InfinityPrecision, InfinityStrategy
from tests.integrations.lightning_runs import (
    LIGHTNING_WARNINGS,
    GPTModule,
    assert_close,
    dataset,
    engine_config,
    engine_run,
    infinity_strategy,
    lightning_config,
    lightning_run,
    loader,
    trainer,
)

pytestmark = LIGHTNING_WARNINGS

# Every DeepSpeedStrategy knob set explicitly (Lightning 1.x guides' names are checked below).
EVERY_KNOB = dict(
    zero_optimization=True,
    stage=3,
    offload_optimizer=True,
    offload_parameters=True,
    offload_params_device="nvme",
    offload_optimizer_device="nvme",
    nvme_path="/local_nvme",
    params_buffer_count=7,
    params_buffer_size=12345,
    max_in_cpu=0,
    optimizer_buffer_count=6,
    block_size=1 << 20,
    queue_depth=16,
    single_submit=False,
    overlap_events=True,
    thread_count=2,
    pin_memory=True,
    sub_group_size=10**9,
    contiguous_gradients=True,
    overlap_comm=True,
    allgather_partitions=True,
    reduce_scatter=True,
    allgather_bucket_size=10**8,
    reduce_bucket_size=10**8,
    zero_allow_untested_optimizer=True,
    logging_batch_size_per_gpu=4,
    partition_activations=True,
    cpu_checkpointing=True,
    contiguous_memory_optimization=False,
    synchronize_checkpoint_boundary=False,
)


def deepspeed_config(**kwargs) -> dict:
    """The config Lightning's DeepSpeedStrategy builds (its method reads none of its instance)."""
    return DeepSpeedStrategy._create_default_config(None, **kwargs)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"stage": 2, "offload_parameters": False, "offload_optimizer_device": "cpu"},
        {"zero_optimization": False},
        {"offload_params_device": "cpu", "pin_memory": False},
    ],
)
def test_arguments_build_deepspeed_strategys_config(changes):
    kwargs = {**EVERY_KNOB, **changes}
    assert InfinityStrategy(**kwargs).config == deepspeed_config(**kwargs)


def test_the_guides_lightning_1_names():
    """DeepSpeedPlugin(cpu_offload=True, ...) in older guides: Lightning 1.3's names for the same knobs."""
    old = InfinityStrategy(
        stage=3,
        cpu_offload=True,
        cpu_offload_params=True,
        cpu_offload_use_pin_memory=True,
        cpu_checkpointing=True,
    ).config
    new = InfinityStrategy(
        stage=3,
        offload_optimizer=True,
        offload_parameters=True,
        pin_memory=True,
        cpu_checkpointing=True,
    ).config
    assert old == new and new["zero_optimization"]["offload_param"]["pin_memory"] is True


def test_knobs_left_unset_are_deepspeeds_defaults():
    """Unset knobs are not written: the engine's defaults are DeepSpeed's config defaults (the aio
    section's are infinity's own, measured on NVMe: see `infinity tune nvme`)."""
    from infinity.config import load_config

    ours = load_config(
        InfinityStrategy(stage=3, offload_optimizer=True, offload_parameters=True).config
    ).to_dict()
    ds = load_config(
        deepspeed_config(
            **{
                **EVERY_KNOB,
                **dict(
                    offload_params_device="cpu",
                    offload_optimizer_device="cpu",
                    nvme_path="./infinity_nvme",
                    params_buffer_count=5,
                    params_buffer_size=100_000_000,
                    max_in_cpu=1_000_000_000,
                    optimizer_buffer_count=4,
                    pin_memory=False,
                    logging_batch_size_per_gpu="auto",
                    partition_activations=False,
                    cpu_checkpointing=False,
                    allgather_bucket_size=500_000_000,
                    reduce_bucket_size=500_000_000,
                ),
            }
        )
    ).to_dict()
    for d in (
        ours,
        ds,
    ):  # keys DeepSpeed acts on for communication only, the activation section, aio
        d.pop("aio")
        d.pop("activation_checkpointing", None)
        d.pop("zero_allow_untested_optimizer", None)
    assert ours == ds


def test_registered_names_mirror_deepspeeds():
    ours = {
        n: StrategyRegistry[n]["init_params"] for n in StrategyRegistry if n.startswith("infinity")
    }
    theirs = {
        n.replace("deepspeed", "infinity"): StrategyRegistry[n]["init_params"]
        for n in StrategyRegistry
        if n.startswith("deepspeed")
    }
    assert set(theirs) <= set(ours)
    for name, params in theirs.items():
        assert ours[name] == params, name
        assert StrategyRegistry[name]["strategy"] is InfinityStrategy


class Wide(LightningModule):
    """A layer above DeepSpeed's persistence threshold (1e5 elements), so stage 3 swaps it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(400, 400), torch.nn.Tanh(), torch.nn.Linear(400, 1)
        )

    def training_step(self, b, i):
        return self.net(b).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_registered_name_with_bf16_true(tmp_path, nvme_dir, monkeypatch):
    """Trainer(strategy="infinity_stage_3_offload_nvme", precision="bf16-true") after the import:
    stage 3 with both offloads under ./infinity_nvme, the engine in bf16."""
    monkeypatch.chdir(nvme_dir)
    module = Wide()
    t = trainer("infinity_stage_3_offload_nvme", epochs=1, precision="bf16-true")
    assert isinstance(t.strategy, InfinityStrategy)
    assert (
        isinstance(t.precision_plugin, InfinityPrecision)
        and t.precision_plugin.precision == "bf16-true"
    )
    t.fit(module, torch.utils.data.DataLoader(torch.randn(8, 400), batch_size=2))
    engine = t.strategy.engine
    cfg = engine.config.zero_optimization
    assert (cfg.stage, cfg.offload_param.device, cfg.offload_optimizer.device) == (
        3,
        "nvme",
        "nvme",
    )
    assert (
        cfg.offload_param.nvme_path == "./infinity_nvme"
        and (nvme_dir / "infinity_nvme" / "rank0").is_dir()
    )
    assert engine.config.bf16.enabled and engine.io_stats()["write_nbytes"] > 0
    engine.close()


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed", "16-mixed"])
def test_16_bit_precisions_are_the_engines(nvme_dir, precision):
    """The Trainer's precision selects the engine's bf16 / fp16 (fp16 on CPU through the plugin, as
    Lightning turns "16-mixed" into "bf16-mixed" there): the same losses as the engine driven by hand."""
    section = "fp16" if precision.startswith("16") else "bf16"
    cfg = engine_config(nvme_dir)
    cfg[section] = {"enabled": True}
    if section == "fp16":  # Lightning's DeepSpeed defaults for the loss scale
        cfg["fp16"].update(
            loss_scale=0,
            initial_scale_power=16,
            loss_scale_window=1000,
            hysteresis=2,
            min_loss_scale=1,
        )
    want, want_val, _ = engine_run(cfg)
    if section == "fp16":
        strategy = InfinityStrategy(
            config=lightning_config(nvme_dir), precision_plugin=InfinityPrecision(precision)
        )
        got, got_val, _, _ = lightning_run(strategy)
    else:
        got, got_val, _, _ = lightning_run(infinity_strategy(nvme_dir), precision=precision)
    assert_close(got, want, "training loss")
    assert_close(got_val, want_val, "validation loss")


def test_refusals(nvme_dir):
    data = dataset(1)

    def fit(strategy, module=None, **kwargs):
        trainer(strategy, epochs=1, **kwargs).fit(
            module or GPTModule(), loader(data), loader(data[:2])
        )

    with pytest.raises(
        ConfigError, match=r"gradient_accumulation_steps=4 and Trainer\(accumulate_grad_batches=2\)"
    ):
        fit(
            InfinityStrategy(
                config={**lightning_config(nvme_dir), "gradient_accumulation_steps": 4}
            )
        )
    with pytest.raises(MisconfigurationException, match="gradient_clip_algorithm='value'"):
        fit(infinity_strategy(nvme_dir), gradient_clip_algorithm="value")
    with pytest.raises(MisconfigurationException, match="sync_batchnorm=True"):
        fit(infinity_strategy(nvme_dir), sync_batchnorm=True)
    with pytest.raises(ValueError, match="cannot use the precision plugin DoublePrecision"):
        trainer(infinity_strategy(nvme_dir), precision="64-true")
    with pytest.raises(ConfigError, match="enables bf16 but the precision is '32-true'"):
        fit(InfinityStrategy(config={**lightning_config(nvme_dir), "bf16": {"enabled": True}}))

    class TwoOptimizers(GPTModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False  # Lightning's condition for several optimizers

        def configure_optimizers(self):
            return [torch.optim.AdamW(self.parameters()), torch.optim.AdamW(self.parameters())]

    with pytest.raises(
        MisconfigurationException, match="one optimizer; configure_optimizers returned 2"
    ):
        fit(
            infinity_strategy(nvme_dir),
            TwoOptimizers(),
            accumulate_grad_batches=1,
            gradient_clip_val=None,
        )

    class NotSaveable(GPTModule):
        def __init__(self):
            super().__init__()
            self.save_hyperparameters({"device": torch.device("cpu")})

    with pytest.raises(
        TypeError,
        match=r"client_state\['hyper_parameters'\]\['device'\].*save_hyperparameters\(ignore",
    ):
        t = trainer(infinity_strategy(nvme_dir), epochs=1)
        t.fit(NotSaveable(), loader(data), loader(data[:2]))
        t.save_checkpoint(nvme_dir / "ckpt")


def test_a_module_trained_by_another_trainer_is_refused_for_a_new_fit(nvme_dir):
    """Under stage 3 only the first engine holds the weights: a second Trainer may evaluate the
    module, not start a new training of it."""
    _, _, _, module = lightning_run(infinity_strategy(nvme_dir), epochs=1)
    with pytest.raises(RuntimeError, match="already trained by an infinity engine"):
        trainer(infinity_strategy(nvme_dir), epochs=1).fit(
            module, loader(dataset(1)), loader(dataset(1)[:2])
        )


def test_an_epoch_that_splits_a_window_is_said(nvme_dir):
    """5 batches an epoch, windows of 2: the engine's window runs over the epoch's end; a warning says
    so (Lightning's other strategies step on the last batch)."""
    with pytest.warns(UserWarning, match="carries its accumulation window over the epoch's end"):
        lightning_run(infinity_strategy(nvme_dir), epochs=1, limit_train_batches=5)


def test_deepspeed_cannot_be_imported_here():
    """The fixture every test here runs under (conftest.py): the strategies above ran without it."""
    with pytest.raises(ImportError):
        import deepspeed  # noqa: F401


def test_config_from_a_file_or_lightnings_variable(tmp_path, monkeypatch):
    """config= a path (read as DeepSpeed reads it: hjson), or PL_DEEPSPEED_CONFIG_PATH as Lightning's
    DeepSpeed strategies read it; the caller's dict is not changed by the Trainer's fill-ins."""
    path = tmp_path / "ds.json"
    path.write_text(
        '{"zero_optimization": {"stage": 3,}, // DeepSpeed reads hjson\n"gradient_clipping": 1.0}'
    )
    want = {"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0}
    assert InfinityStrategy(config=path).config == want
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(path))
    assert InfinityStrategy().config == want
    given = {"zero_optimization": {"stage": 1}}
    strategy = InfinityStrategy(config=given)
    strategy.config["train_micro_batch_size_per_gpu"] = 2
    assert given == {"zero_optimization": {"stage": 1}}
    with pytest.raises(FileNotFoundError, match="is not a file"):
        InfinityStrategy(config=tmp_path / "missing.json")
    with pytest.raises(
        TypeError, match=r"config= takes a DeepSpeed-style config \(a dict or the path"
    ):
        InfinityStrategy(config=42)


def test_the_trainers_loggers_get_each_steps_figures(nvme_dir):
    """Every logger of the Trainer gets log_metrics of each optimizer step's record."""
    from lightning.pytorch.loggers import Logger

    class Kept(Logger):
        name, version = "kept", 0
        rows: list[tuple[int, dict]] = []

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, dict(metrics)))

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    logger = Kept()
    t = L.Trainer(
        accelerator="cpu",
        strategy=InfinityStrategy(stage=3, offload_parameters=True, nvme_path=str(nvme_dir)),
        max_steps=2,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Wide()
    records = []

    class Listen(L.Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.strategy.engine.add_step_listener(records.append)

    t.callbacks.append(Listen())
    t.fit(module, torch.utils.data.DataLoader(torch.randn(8, 400), batch_size=2))
    steps = [(s, m) for s, m in logger.rows if "Infinity/step_time_s" in m]
    assert len(steps) == len(records) == 2
    for (_, metrics), record in zip(steps, records, strict=True):
        assert metrics["Infinity/nvme_read_bytes"] == record.read_nbytes
        assert metrics["Infinity/prefetch_hits"] == record.prefetch_hits
        assert metrics["Train/Samples/train_loss"] == record.loss
        assert metrics["Infinity/step_time_s"] == record.step_time_s > 0
    t.strategy.engine.close()
