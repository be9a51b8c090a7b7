"""One training, two ways through Accelerate: plain (no offload, torch AdamW) and infinity's prepare().

The model, data, seed and hyper-parameters are lightning_runs' (tests/engine's tiny GPT, AdamW with
eps 1e-6, clipping at 0.05, accumulation 2, a StepLR schedule stepped once per update). The data is
lightning_runs' micro-batches as rows that a ``DataLoader(batch_size=2)`` collates back, sharded by
``accelerator.prepare`` (rank r gets batches r, r + world_size, ...: the micro-batches infinity's own
loop gives rank r in lightning_runs.engine_run).
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from infinity.integrations.accelerate import EngineOptimizer, EngineScheduler, prepare
from tests.engine.models import tiny_gpt
from tests.engine.reference import CLIP
from tests.integrations.lightning_runs import (
    GAS,
    dataset,
    engine_config,
    full_weights,
    optimizer_and_schedule,
)


def loader(*, world_size: int = 1) -> DataLoader:
    rows = [(x[i], y[i]) for x, y in dataset(1, world_size=world_size) for i in range(x.shape[0])]
    return DataLoader(rows, batch_size=2, shuffle=False)


def auto_config(nvme_dir, **kwargs) -> dict:
    """engine_config with what Accelerate fills left "auto"; clipping is the test's, not Accelerate's 1.0."""
    cfg = engine_config(nvme_dir, **kwargs)
    cfg["train_micro_batch_size_per_gpu"] = "auto"
    cfg["gradient_accumulation_steps"] = "auto"
    cfg["train_batch_size"] = "auto"
    return cfg


def plain_run(*, epochs: int = 2, world_size: int = 1):
    """The loop an Accelerate user writes (accumulate, backward, clip at each sync, step, zero_grad).
    The schedule is stepped once per update: ``step_scheduler_with_optimizer=False`` and a step at each
    sync (by default Accelerate would step it once per process at each update)."""
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=GAS, step_scheduler_with_optimizer=False
    )
    torch.manual_seed(0)
    model = tiny_gpt()
    opt, sched = optimizer_and_schedule(model.parameters())
    model, opt, dl, sched = accelerator.prepare(model, opt, loader(world_size=world_size), sched)
    losses = []
    for _ in range(epochs):
        for x, y in dl:
            with accelerator.accumulate(model):
                loss = model(x, y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                if accelerator.sync_gradients:
                    sched.step()
                opt.zero_grad()
            losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
    return losses, weights


def infinity_run(
    config, *, epochs: int = 2, start: int = 0, save_to=None, load_from=None, world_size: int = 1
):
    """The DeepSpeed-plugin loop through infinity's prepare(); epochs [start, epochs); optionally
    ``accelerator.load_state`` first or ``accelerator.save_state`` at the end. Returns the losses,
    the final weights and the lr."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=GAS)
    torch.manual_seed(0)
    model = tiny_gpt()
    opt, sched = optimizer_and_schedule(model.parameters())
    model, opt, dl, sched = prepare(
        accelerator, model, opt, loader(world_size=world_size), sched, config=config
    )
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


def layer_major_run(config, *, epochs: int = 2):
    """infinity_run's training with the accumulation windows layer-major: the prepared loader's
    batches gradient_accumulation_steps at a time through ``model.engine.train_batch`` (the loop
    owns the batches, so it hands the engine a window; docs/layer-major.md)."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=GAS)
    torch.manual_seed(0)
    model = tiny_gpt()
    opt, sched = optimizer_and_schedule(model.parameters())
    model, opt, dl, sched = prepare(accelerator, model, opt, loader(), sched, config=config)
    losses = []
    for _ in range(epochs):
        batches = iter(dl)
        while True:
            try:
                _, each = model.engine.train_batch(data_iter=batches, return_losses=True)
            except StopIteration:
                break
            losses += [loss.item() for loss in each]
    weights = full_weights(model.module)
    model.engine.close()
    return losses, weights
