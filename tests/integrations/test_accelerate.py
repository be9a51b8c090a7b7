"""Accelerate with infinity's prepare() trains as plain Accelerate does and as infinity's own loop does (fp32).

The oracle is plain Accelerate on CPU (torch AdamW, no offload) running the loop an Accelerate user
writes: ``accelerator.accumulate``, ``accelerator.backward``, ``clip_grad_norm_`` at each sync,
``optimizer.step()`` / ``scheduler.step()`` / ``zero_grad()``. With infinity's ``prepare`` the loop
is the one Accelerate's DeepSpeed plugin asks for (backward, step, schedule, zero_grad on every
micro-batch; accumulation, clipping and the schedule are the engine's). Same tiny GPT, data, seed
and hyper-parameters as tests/engine and the Lightning tests: per-step losses and weights within
1e-5 relative. ``accelerator.save_state`` / ``load_state`` in the middle give the uninterrupted
run's losses. deepspeed is unimportable throughout (conftest.py).
"""

import json
import sys

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
from torch.utils.data import DataLoader

import infinity
from infinity.config import ConfigError
from infinity.integrations.accelerate import prepare, prepare_frozen
from tests.distributed import run_distributed
from tests.engine.models import tiny_gpt
from tests.integrations.accelerate_runs import (
    auto_config,
    infinity_run,
    layer_major_run,
    loader,
    plain_run,
)
from tests.integrations.lightning_runs import (
    GAS,
    MICRO_PER_EPOCH,
    assert_close,
    assert_weights_close,
    dataset,
    engine_config,
    engine_run,
)
from tests.integrations.subprocesses import ROOT, run, without_deepspeed

CONFIGS = ROOT / "tests" / "config" / "data"  # the configs users bring (tests/config)


@pytest.fixture(autouse=True)
def fresh_accelerate():
    """Accelerate keeps its state in process-wide singletons: each test starts from none."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def plain():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return plain_run()


def test_stage3_nvme_matches_plain_accelerate_and_infinitys_loop(plain, nvme_dir):
    losses, weights, _ = infinity_run(auto_config(nvme_dir))
    assert len(losses) == 2 * MICRO_PER_EPOCH
    assert_close(losses, plain[0], "training loss")
    assert_weights_close(weights, plain[1])
    own_losses, _, own_weights = engine_run(engine_config(nvme_dir))
    assert_close(own_losses, plain[0], "training loss of infinity's loop")
    assert_weights_close(own_weights, plain[1])


def test_windows_of_the_prepared_loader_through_train_batch_match_plain_accelerate(plain, nvme_dir):
    """An Accelerate loop that hands the engine each window (``model.engine.train_batch``) trains
    as plain Accelerate's ``accumulate`` loop: the same losses and weights, within the tolerances
    of the micro-batch-major run above (train_batch's own tolerance, 1e-6, is tighter)."""
    losses, weights = layer_major_run(auto_config(nvme_dir))
    assert len(losses) == 2 * MICRO_PER_EPOCH
    assert_close(losses, plain[0], "training loss")
    assert_weights_close(weights, plain[1])


def test_stage2_cpu_offload_matches_plain_accelerate(plain, nvme_dir):
    losses, weights, _ = infinity_run(auto_config(nvme_dir, stage=2, offload="cpu"))
    assert_close(losses, plain[0], "training loss")
    assert_weights_close(weights, plain[1])


def test_save_state_and_load_state_continue_exactly(plain, tmp_path, nvme_dir):
    """accelerator.save_state after the first epoch (the engine's checkpoint in <dir>/infinity_model/);
    a new Accelerator, model and optimizer, accelerator.load_state, and the second epoch's losses and
    the final weights are the uninterrupted run's."""
    first, _, lr_saved = infinity_run(auto_config(nvme_dir), epochs=1, save_to=tmp_path / "state")
    assert (tmp_path / "state" / "infinity_model").is_dir()
    assert first == pytest.approx(plain[0][:MICRO_PER_EPOCH], rel=1e-5)
    losses, weights, _ = infinity_run(auto_config(nvme_dir), start=1, load_from=tmp_path / "state")
    assert_close(losses, plain[0][MICRO_PER_EPOCH:], "training loss after accelerator.load_state")
    assert_weights_close(weights, plain[1])


def test_auto_values_are_filled_as_accelerates_deepspeed_plugin_fills_them(nvme_dir):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3, mixed_precision="bf16")
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2},
    }
    torch.manual_seed(0)
    model = tiny_gpt()
    model, opt, dl = prepare(
        accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader(), config=cfg
    )
    c = model.engine.config
    assert (
        c.train_micro_batch_size_per_gpu,
        c.gradient_accumulation_steps,
        c.train_batch_size,
    ) == (2, 3, 6)
    assert c.gradient_clipping == 1.0 and c.bf16.enabled and not c.fp16.enabled
    model.engine.close()


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_a_guides_config_unchanged_with_its_optimizer_and_schedule(mixed_precision, nvme_dir):
    """The zero2_offload_cpu.json users copy from DeepSpeed's guides (optimizer and WarmupLR sections,
    "auto" everywhere, bf16 under its alias bfloat16): optimizer=None uses the config's, keyword
    Accelerate's DummyOptim/DummyScheduler stand for its optimizer and scheduler sections and fill
    their "auto" values, as with Accelerate's DeepSpeed plugin."""
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=GAS, mixed_precision=mixed_precision
    )
    torch.manual_seed(0)
    model = tiny_gpt()
    dummy = DummyOptim(model.parameters(), lr=1e-3)
    model, opt, dl, sched = prepare(
        accelerator,
        model,
        dummy,
        loader(),
        DummyScheduler(dummy, warmup_num_steps=2),
        config=CONFIGS / "zero2_offload_cpu.json",
    )
    c = model.engine.config
    assert c.bf16.enabled is (mixed_precision == "bf16") and not c.fp16.enabled
    assert (
        c.train_micro_batch_size_per_gpu,
        c.gradient_accumulation_steps,
        c.gradient_clipping,
    ) == (2, GAS, 1.0)
    losses = []
    for x, y in dl:
        loss = model(x, y)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert model.engine.global_steps == MICRO_PER_EPOCH // GAS and losses[-1] < losses[0]
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)  # WarmupLR reached warmup_max_lr
    model.engine.close()


def test_a_written_accumulation_wins_and_the_accelerator_follows(nvme_dir):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    torch.manual_seed(0)
    model = tiny_gpt()
    model, *_ = prepare(
        accelerator,
        model,
        torch.optim.AdamW(model.parameters()),
        loader(),
        config=engine_config(nvme_dir, stage=2, offload="cpu"),
    )
    assert (
        model.engine.gradient_accumulation_steps == GAS == accelerator.gradient_accumulation_steps
    )
    model.engine.close()


def test_prepare_frozen_serves_from_nvme_without_optimizer_state(nvme_dir):
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(nvme_dir),
                "max_in_cpu": 0,
                "buffer_count": 3,
                "buffer_size": 4096,
            },
        },
    }
    torch.manual_seed(0)
    model = tiny_gpt()
    x, _ = dataset(1)[0]
    with torch.no_grad():
        want = model(x)
    teacher = prepare_frozen(model, cfg, accelerator=Accelerator(cpu=True))
    assert isinstance(teacher, infinity.InferenceEngine)
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training
    got = teacher(x)
    assert not got.requires_grad
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (
        teacher.io_stats()["read_nbytes"] > 0
    )  # the pool (3 x 4096 elements) cannot hold the model
    teacher.close()


def test_refusals_say_what_to_do(nvme_dir):
    accelerator = Accelerator(cpu=True)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="config= is required"):
        prepare(accelerator, model, opt, loader(), config=None)
    with pytest.raises(TypeError, match="accelerate.Accelerator first"):
        prepare(model, model, opt, loader(), config={})
    nobatch = DataLoader(dataset(1), batch_size=None)
    with pytest.raises(ValueError, match="batch_size is None"):
        prepare(accelerator, model, opt, nobatch, config=auto_config(nvme_dir))
    with pytest.raises(ValueError, match="no dataloader was passed"):
        prepare(accelerator, model, opt, config=auto_config(nvme_dir))
    wrapped = accelerator.prepare(opt)
    with pytest.raises(RuntimeError, match="accelerator.prepare wrapped it"):
        prepare(accelerator, model, wrapped, loader(), config=engine_config(nvme_dir))
    with pytest.raises(ValueError, match="stage-3 shards; the config has stage 2"):
        prepare_frozen(model, {"zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match="builds no optimizer"):
        prepare_frozen(model, {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}})
    with pytest.raises(ConfigError):  # a written micro-batch that disagrees with train_batch_size
        prepare(
            accelerator,
            model,
            opt,
            loader(),
            config={**engine_config(nvme_dir), "train_batch_size": 3},
        )


def test_a_precision_the_config_contradicts_is_refused(nvme_dir):
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = tiny_gpt()
    with pytest.raises(ValueError, match="mixed_precision is 'bf16' and the config enables fp16"):
        prepare(
            accelerator,
            model,
            torch.optim.AdamW(model.parameters()),
            loader(),
            config={**engine_config(nvme_dir), "fp16": {"enabled": True}},
        )


def test_two_trained_models_on_one_accelerator(tmp_path, nvme_dir):
    """accelerator.backward cannot tell whose loss it is: refused, model.backward(loss) instead;
    save_state / load_state carry both engines (infinity_model/, infinity_model_1/)."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=GAS)
    prepared = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = tiny_gpt()
        model, opt, dl = prepare(
            accelerator,
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            loader(),
            config=auto_config(nvme_dir, stage=2, offload="cpu"),
        )
        prepared.append((model, opt))
    x, y = next(iter(dl))
    with pytest.raises(RuntimeError, match="call model.backward\\(loss\\)"):
        accelerator.backward(prepared[0][0](x, y))
    prepared[0][0].engine.zero_grad()
    for model, opt in prepared:
        for _ in range(GAS):
            model.backward(model(x, y))
            opt.step()
    accelerator.save_state(tmp_path / "two")
    assert (tmp_path / "two" / "infinity_model").is_dir() and (
        tmp_path / "two" / "infinity_model_1"
    ).is_dir()
    want = [model(x, y).item() for model, _ in prepared]
    for model, opt in prepared:  # move both away from the saved weights, then back
        for _ in range(GAS):
            model.backward(model(x, y))
            opt.step()
    accelerator.load_state(tmp_path / "two")
    assert [model(x, y).item() for model, _ in prepared] == want
    for model, _ in prepared:
        model.engine.close()


def test_load_state_of_a_folder_without_the_engine_checkpoint_is_refused(tmp_path, nvme_dir):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=GAS)
    plain_state = tmp_path / "plain"
    accelerator.save_state(plain_state)  # nothing prepared with infinity yet: RNG states only
    torch.manual_seed(0)
    model = tiny_gpt()
    model, *_ = prepare(
        accelerator,
        model,
        torch.optim.AdamW(model.parameters()),
        loader(),
        config=auto_config(nvme_dir, stage=2, offload="cpu"),
    )
    with pytest.raises(FileNotFoundError, match="holds no infinity_model/"):
        accelerator.load_state(plain_state)
    model.engine.close()


def test_nothing_imported_deepspeed():
    assert sys.modules.get("deepspeed") is None
    assert not [m for m in sys.modules if m.startswith("deepspeed.")]


def _own_loop(rank, nvme):
    return engine_run(engine_config(nvme), rank=rank, world_size=2)[0]


@pytest.mark.distributed
def test_world_size_2_matches_plain_accelerate_ddp_and_infinitys_loop(tmp_path, nvme_dir):
    """Two processes started by torchrun (gloo): each rank's losses under prepare() (stage 3, NVMe) are
    plain Accelerate DDP's and those of infinity's own loop at world size 2."""
    own = run_distributed(_own_loop, str(nvme_dir), world_size=2)
    got = {}
    for mode in ("infinity", "plain"):
        run(
            [
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                "tests/integrations/accelerate_world_size_2.py",
                mode,
                str(tmp_path),
                str(nvme_dir),
            ],
            cwd=ROOT,
            env=without_deepspeed(tmp_path),
        )
        got[mode] = [
            json.loads((tmp_path / f"{mode}.rank{r}.json").read_text())["losses"] for r in range(2)
        ]
    for rank in range(2):
        assert_close(got["infinity"][rank], got["plain"][rank], f"training loss (rank {rank})")
        assert_close(
            got["infinity"][rank], own[rank], f"training loss against infinity's loop (rank {rank})"
        )


def test_each_steps_figures_go_to_accelerators_trackers(nvme_dir):
    """accelerator.log reaches every tracker init_trackers started, at the optimizer step."""
    from accelerate.tracking import GeneralTracker

    class Kept(GeneralTracker):
        name, requires_logging_directory, main_process_only = "kept", False, True

        def __init__(self):
            super().__init__()
            self.rows: list[tuple[int, dict]] = []

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            pass

        def log(self, values, step=None, **kwargs):
            self.rows.append((step, dict(values)))

    kept = Kept()
    accelerator = Accelerator(cpu=True, log_with=kept)
    accelerator.init_trackers("infinity-test")
    torch.manual_seed(0)
    model = tiny_gpt()
    model, optimizer, data = prepare(
        accelerator,
        model,
        torch.optim.AdamW(model.parameters()),
        loader(),
        config=engine_config(nvme_dir),
    )
    records = []
    model.engine.add_step_listener(records.append)
    for i, (x, y) in enumerate(data):
        if i == 2 * GAS:
            break
        loss = model(x, y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert [s for s, _ in kept.rows] == [r.step for r in records] == [1, 2]
    for (_, values), record in zip(kept.rows, records, strict=True):
        assert values["Infinity/nvme_read_bytes"] == record.read_nbytes > 0
        assert values["Infinity/prefetch_on_demand"] == record.on_demand
        assert values["Train/Samples/train_loss"] == record.loss
    accelerator.end_training()
    model.engine.close()
