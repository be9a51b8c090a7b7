"""Fabric on InfinityFabricStrategy trains as plain Fabric does and as infinity's own loop does (fp32).

The oracle is plain Fabric (strategy="auto" on CPU) running the loop a Fabric user writes: loss /
accumulation, fabric.clip_gradients, optimizer.step() every GAS micro-batches, the StepLR schedule
stepped after each update. With InfinityFabricStrategy the loop is DeepSpeed's: optimizer.step()
after every backward, accumulation and clipping from the config, the schedule handed to
fabric.setup. Losses, evaluation losses and weights agree within 1e-5 relative; fabric.save /
fabric.load in the middle gives the uninterrupted run's losses.
"""

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies.deepspeed import DeepSpeedStrategy as FabricDeepSpeedStrategy

from infinity.integrations.fabric import InfinityFabricPrecision, InfinityFabricStrategy, log_steps
from tests.engine.models import tiny_gpt
from tests.integrations.lightning_runs import (
    GAS,
    LIGHTNING_WARNINGS,
    assert_close,
    assert_weights_close,
    dataset,
    engine_config,
    engine_run,
    fabric_run,
    optimizer_and_schedule,
)

pytestmark = LIGHTNING_WARNINGS


def stage3_nvme(nvme_dir, **kwargs):
    return InfinityFabricStrategy(config=engine_config(nvme_dir), **kwargs)


@pytest.fixture(scope="module")
def plain():
    return fabric_run("auto")


def test_stage3_nvme_matches_plain_fabric_and_infinitys_loop(plain, nvme_dir):
    losses, val_losses, weights, built_numel = fabric_run(stage3_nvme(nvme_dir))
    assert built_numel == 0  # fabric.init_module() partitioned the parameters as they were built
    assert_close(losses, plain[0], "training loss")
    assert_close(val_losses, plain[1], "evaluation loss")
    assert_weights_close(weights, plain[2])
    own_losses, own_val, own_weights = engine_run(engine_config(nvme_dir))
    assert_close(own_losses, plain[0], "training loss of infinity's loop")
    assert_close(own_val, plain[1], "evaluation loss of infinity's loop")
    assert_weights_close(own_weights, plain[2])


@pytest.mark.parametrize("stage,offload", [(1, "cpu"), (2, "nvme")])
def test_lower_stages_match_plain_fabric(plain, nvme_dir, stage, offload):
    losses, val_losses, weights, _ = fabric_run(
        InfinityFabricStrategy(config=engine_config(nvme_dir, stage=stage, offload=offload))
    )
    assert_close(losses, plain[0], "training loss")
    assert_weights_close(weights, plain[2])


def test_save_and_load_continue_exactly(plain, tmp_path, nvme_dir):
    """fabric.save after the first epoch; a new Fabric, model and optimizer, fabric.load, and the
    loop goes on from state["epoch"] with the uninterrupted run's losses (plain Fabric's)."""
    fabric_run(stage3_nvme(nvme_dir), epochs=1, save_after=1, path=tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "checkpoint").is_dir()
    losses, val_losses, weights, _ = fabric_run(
        stage3_nvme(nvme_dir), resume_from=tmp_path / "ckpt"
    )
    per_epoch = len(dataset(1))
    assert_close(losses, plain[0][per_epoch:], "training loss after fabric.load")
    assert_close(val_losses, plain[1][2:], "evaluation loss after fabric.load")
    assert_weights_close(weights, plain[2])


def test_load_full_weights_reads_a_plain_fabric_file(tmp_path, nvme_dir):
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(1)
    model = fabric.setup(tiny_gpt())
    x, y = dataset(1)[0]
    want = model(x, y).item()
    fabric.save(tmp_path / "plain.pt", {"model": model})

    fabric = Fabric(
        accelerator="cpu", devices=1, strategy=stage3_nvme(nvme_dir, load_full_weights=True)
    )
    fabric.launch()
    torch.manual_seed(0)  # other weights than the file's
    module = tiny_gpt()
    model, _ = fabric.setup(module, torch.optim.AdamW(module.parameters()))
    assert fabric.load(tmp_path / "plain.pt", {"model": model}) == {}
    with torch.no_grad():
        assert model(x, y).item() == pytest.approx(want, rel=1e-6)
    model._forward_module.engine.close()


def test_refusals(tmp_path, nvme_dir):
    fabric = Fabric(accelerator="cpu", devices=1, strategy=stage3_nvme(nvme_dir))
    fabric.launch()
    torch.manual_seed(0)
    module = tiny_gpt()
    model, opt = fabric.setup(module, torch.optim.AdamW(module.parameters()))
    x, y = dataset(1)[0]
    fabric.backward(model(x, y))
    with pytest.raises(RuntimeError, match="backward was called twice without an optimizer step"):
        fabric.backward(model(x, y))
    with pytest.raises(
        RuntimeError, match="no_backward_sync.*gradient_accumulation_steps in the config"
    ):
        with fabric.no_backward_sync(model):
            pass
    with pytest.raises(RuntimeError, match="set gradient_clipping in the config"):
        fabric.clip_gradients(model, opt, max_norm=1.0)
    with pytest.raises(ValueError, match="needs the state to restore into"):
        fabric.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="not an infinity checkpoint"):
        fabric.load(tmp_path, {"model": model})
    model._forward_module.engine.close()

    fabric = Fabric(accelerator="cpu", devices=1, strategy=stage3_nvme(nvme_dir))
    fabric.launch()
    module = tiny_gpt()
    with pytest.raises(
        RuntimeError, match="model and optimizer to be set up jointly|sets up the model and its"
    ):
        fabric.setup_optimizers(torch.optim.AdamW(module.parameters()))
    with pytest.raises(ValueError, match="cannot use the precision plugin"):
        Fabric(accelerator="cpu", devices=1, strategy=stage3_nvme(nvme_dir), precision="64-true")


def test_arguments_names_and_precision():
    """Fabric's DeepSpeedStrategy is the oracle for the config its arguments make and its names."""
    kwargs = dict(
        stage=3,
        offload_optimizer=True,
        offload_parameters=True,
        offload_params_device="nvme",
        offload_optimizer_device="nvme",
        nvme_path="/local_nvme",
        params_buffer_count=5,
        params_buffer_size=10**8,
        max_in_cpu=0,
        optimizer_buffer_count=4,
        pin_memory=True,
        block_size=1 << 20,
        queue_depth=8,
        single_submit=False,
        overlap_events=True,
        thread_count=1,
        zero_allow_untested_optimizer=True,
        logging_batch_size_per_gpu=2,
        partition_activations=True,
        cpu_checkpointing=True,
        contiguous_memory_optimization=False,
        synchronize_checkpoint_boundary=False,
        sub_group_size=10**9,
        contiguous_gradients=True,
        overlap_comm=True,
        allgather_partitions=True,
        reduce_scatter=True,
        allgather_bucket_size=10**8,
        reduce_bucket_size=10**8,
    )
    assert InfinityFabricStrategy(
        **kwargs
    ).config == FabricDeepSpeedStrategy._create_default_config(
        None, zero_optimization=True, **kwargs
    )
    ours = {
        n: STRATEGY_REGISTRY[n]["init_params"]
        for n in STRATEGY_REGISTRY
        if n.startswith("infinity")
    }
    theirs = {
        n.replace("deepspeed", "infinity"): STRATEGY_REGISTRY[n]["init_params"]
        for n in STRATEGY_REGISTRY
        if n.startswith("deepspeed")
    }
    assert {n: ours.get(n) for n in theirs} == theirs
    fabric = Fabric(
        accelerator="cpu", devices=1, strategy="infinity_stage_3", precision="bf16-true"
    )
    assert isinstance(fabric.strategy, InfinityFabricStrategy)
    assert isinstance(fabric.strategy.precision, InfinityFabricPrecision)
    assert fabric.strategy.precision.precision == "bf16-true"


def test_log_steps_sends_each_steps_figures_to_fabrics_loggers(nvme_dir, tmp_path):
    """log_steps(fabric, model): each optimizer step's figures reach Fabric(loggers=[...]), read
    back from the CSVLogger's file and compared with the engine's own step records."""
    import csv

    from lightning.fabric.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="run", version=0)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=stage3_nvme(nvme_dir), loggers=[logger])
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module():
        model = tiny_gpt()
    opt, _ = optimizer_and_schedule(model.parameters())
    model, opt = fabric.setup(model, opt)
    log_steps(fabric, model)
    records = []
    fabric.strategy.model.engine.add_step_listener(records.append)
    for x, y in dataset(1)[: 2 * GAS]:
        fabric.backward(model(x, y))
        opt.step()
    fabric.strategy.model.engine.close()  # flushes the loggers (their save())
    with open(logger.log_dir + "/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("Infinity/step_time_s")]
    assert len(rows) == len(records) == 2
    for row, record in zip(rows, records, strict=True):
        assert int(row["step"]) == record.step
        assert float(row["Infinity/nvme_read_bytes"]) == record.read_nbytes
        assert float(row["Infinity/nvme_write_bytes"]) == record.write_nbytes
        assert float(row["Infinity/prefetch_hits"]) == record.prefetch_hits
        assert float(row["Train/Samples/train_loss"]) == pytest.approx(record.loss, rel=1e-6)
    with pytest.raises(TypeError, match="InfinityFabricStrategy"):
        log_steps(Fabric(accelerator="cpu", devices=1))
