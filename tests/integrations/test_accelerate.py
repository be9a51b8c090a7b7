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

import sys

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader

import infinity
from infinity.config import ConfigError
from infinity.integrations.accelerate import (
    EngineOptimizer,
    EngineScheduler,
    prepare,
    prepare_frozen,
)
from tests.engine.models import tiny_gpt
from tests.engine.reference import CLIP
from tests.integrations.lightning_runs import (
    GAS,
    MICRO_PER_EPOCH,
    assert_close,
    assert_weights_close,
    dataset,
    engine_config,
    engine_run,
    full_weights,
    optimizer_and_schedule,
)


@pytest.fixture(autouse=True)
def fresh_accelerate():
    """Accelerate keeps its state in process-wide singletons: each test starts from none."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def loader() -> DataLoader:
    """The micro-batches of lightning_runs.dataset, one epoch, as rows a DataLoader(batch_size=2) collates back."""
    rows = [(x[i], y[i]) for x, y in dataset(1) for i in range(x.shape[0])]
    return DataLoader(rows, batch_size=2, shuffle=False)


def auto_config(nvme_dir, **kwargs) -> dict:
    """engine_config with what Accelerate fills left "auto"; clipping is the test's, not Accelerate's 1.0."""
    cfg = engine_config(nvme_dir, **kwargs)
    cfg["train_micro_batch_size_per_gpu"] = "auto"
    cfg["gradient_accumulation_steps"] = "auto"
    cfg["train_batch_size"] = "auto"
    return cfg


def plain_run(epochs: int = 2):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=GAS)
    torch.manual_seed(0)
    model = tiny_gpt()
    opt, sched = optimizer_and_schedule(model.parameters())
    model, opt, dl, sched = accelerator.prepare(model, opt, loader(), sched)
    losses = []
    for _ in range(epochs):
        for x, y in dl:
            with accelerator.accumulate(model):
                loss = model(x, y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def infinity_run(config, *, epochs: int = 2, start: int = 0, save_to=None, load_from=None):
    """The DeepSpeed-plugin loop through infinity's prepare(); epochs [start, epochs); optionally
    ``accelerator.load_state`` first or ``accelerator.save_state`` at the end."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=GAS)
    torch.manual_seed(0)
    model = tiny_gpt()
    opt, sched = optimizer_and_schedule(model.parameters())
    model, opt, dl, sched = prepare(accelerator, model, opt, loader(), sched, config=config)
    assert isinstance(opt, EngineOptimizer) and isinstance(sched, EngineScheduler)
    if load_from is not None:
        accelerator.load_state(load_from)
    losses = []
    for _ in range(start, epochs):
        for x, y in dl:
            loss = model(x, y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
    if save_to is not None:
        accelerator.save_state(save_to)
    weights = full_weights(model.module)
    lr = opt.param_groups[0]["lr"]
    model.engine.close()
    return losses, weights, lr


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
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": 2}}
    torch.manual_seed(0)
    model = tiny_gpt()
    model, opt, dl, sched = prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader(),
                                    config=cfg)
    c = model.engine.config
    assert (c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps, c.train_batch_size) == (2, 3, 6)
    assert c.gradient_clipping == 1.0 and c.bf16.enabled and not c.fp16.enabled
    assert sched is None
    model.engine.close()


def test_a_written_accumulation_wins_and_the_accelerator_follows(nvme_dir):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    torch.manual_seed(0)
    model = tiny_gpt()
    model, *_ = prepare(accelerator, model, torch.optim.AdamW(model.parameters()), loader(),
                        config=engine_config(nvme_dir, stage=2, offload="cpu"))
    assert model.engine.gradient_accumulation_steps == GAS == accelerator.gradient_accumulation_steps
    model.engine.close()


def test_prepare_frozen_serves_from_nvme_without_optimizer_state(nvme_dir):
    cfg = {"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "offload_param": {"device": "nvme", "nvme_path": str(nvme_dir), "max_in_cpu": 0,
                                                   "buffer_count": 3, "buffer_size": 4096}}}
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
    assert teacher.io_stats()["read_nbytes"] > 0  # the pool (3 x 4096 elements) cannot hold the model
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
        prepare(accelerator, model, opt, loader(),
                config={**engine_config(nvme_dir), "train_batch_size": 3})


def test_a_precision_the_config_contradicts_is_refused(nvme_dir):
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = tiny_gpt()
    with pytest.raises(ValueError, match="mixed_precision is 'bf16' and the config enables fp16"):
        prepare(accelerator, model, torch.optim.AdamW(model.parameters()), loader(),
                config={**engine_config(nvme_dir), "fp16": {"enabled": True}})


def test_load_state_of_a_folder_without_the_engine_checkpoint_is_refused(tmp_path, nvme_dir):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=GAS)
    plain_state = tmp_path / "plain"
    accelerator.save_state(plain_state)  # nothing prepared with infinity yet: RNG states only
    torch.manual_seed(0)
    model = tiny_gpt()
    model, *_ = prepare(accelerator, model, torch.optim.AdamW(model.parameters()), loader(),
                        config=auto_config(nvme_dir, stage=2, offload="cpu"))
    with pytest.raises(FileNotFoundError, match="holds no infinity_model/"):
        accelerator.load_state(plain_state)
    model.engine.close()


def test_nothing_imported_deepspeed():
    assert sys.modules.get("deepspeed") is None
    assert not [m for m in sys.modules if m.startswith("deepspeed.")]
