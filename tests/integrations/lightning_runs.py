"""One training, three ways: Lightning or Fabric on InfinityStrategy, infinity's own loop, plain Lightning.

The model, data, seed and hyper-parameters are tests/engine's (tiny GPT with a tied embedding,
AdamW with eps 1e-6, clipping at 0.05, accumulation 2); a StepLR schedule stepped once per update
runs in all three. The oracle is the plain run: Lightning's (or Fabric's) own loop on CPU with
torch's AdamW, ``clip_grad_norm_`` and Lightning's accumulation.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import infinity
from infinity.integrations.lightning import InfinityStrategy
from tests.engine.models import batch, tiny_gpt
from tests.engine.reference import BETAS, CLIP, EPS, LR, WD

GAS = 2
STEPS_PER_EPOCH = 3
MICRO_PER_EPOCH = GAS * STEPS_PER_EPOCH

# Lightning 2.6 and torch 2.13 disagree on a pytree helper (Lightning's own code warns); Lightning
# says a loader without workers may be slow; neither is ours to change.
LIGHTNING_WARNINGS = [
    pytest.mark.filterwarnings(
        "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"
    ),
    pytest.mark.filterwarnings("ignore:The '\\w+_dataloader' does not have many workers"),
]


def dataset(epochs: int, *, world_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches in the order the oracle sees them: rank r's i-th is item i * world_size + r
    (DistributedSampler without shuffling); the same every epoch."""
    return [batch(i // GAS, i % GAS, r) for i in range(MICRO_PER_EPOCH) for r in range(world_size)]


def loader(data, *, rank: int = 0, world_size: int = 1) -> DataLoader:
    # An explicit DistributedSampler: Lightning keeps it under every strategy (it would shuffle the
    # training data of a distributed strategy otherwise, and not that of strategy="auto").
    return DataLoader(
        data,
        batch_size=None,
        sampler=DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False),
    )


def optimizer_and_schedule(params):
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


class GPTModule(L.LightningModule):
    """The tiny GPT, built in ``__init__`` or in ``configure_model`` / ``configure_sharded_model``
    (then under zero.Init with stage 3); records each micro-batch's loss and each validation loss."""

    def __init__(self, build_in: str = "init"):
        super().__init__()
        self.build_in = build_in
        self.model = None
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.numels_at_build: list[int] = []
        if build_in == "init":
            self._build()

    def _build(self):
        if self.model is None:
            torch.manual_seed(0)
            self.model = tiny_gpt()
            # What the parameters hold: under zero.Init torch functions see them whole (materialised
            # on use), so look past the mode.
            with torch._C.DisableTorchFunction():
                self.numels_at_build = [p.numel() for p in self.model.parameters()]

    def training_step(self, b, i):
        loss = self.model(*b)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, b, i):
        loss = self.model(*b)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss, sync_dist=True)

    def test_step(self, b, i):
        return self.validation_step(b, i)

    def predict_step(self, b, i):
        return self.model(*b)

    def configure_optimizers(self):
        opt, sched = optimizer_and_schedule(self.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ConfiguredGPTModule(GPTModule):
    def configure_model(self):
        self._build()


class ShardedGPTModule(GPTModule):
    """The hook the older guides use (Lightning deprecates it in favour of configure_model)."""

    def configure_sharded_model(self):
        self._build()


MODULES = {
    "init": GPTModule,
    "configure_model": ConfiguredGPTModule,
    "configure_sharded_model": ShardedGPTModule,
}


def engine_config(nvme_dir: Path | str, *, stage: int = 3, offload: str = "nvme") -> dict:
    """Stage 3 with parameters and optimizer state on NVMe (every unit: the persistence threshold is
    lowered and max_in_cpu is 0), accumulation and clipping as the Trainer below asks."""
    zero: dict = {"stage": stage, "sub_group_size": 3000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 100
        if offload != "none":
            zero["offload_param"] = {
                "device": offload,
                "nvme_path": str(nvme_dir),
                "buffer_count": 4,
                "buffer_size": 1 << 16,
                "max_in_cpu": 0,
            }
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "nvme_path": str(nvme_dir)}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
    }


def trainer(strategy, *, epochs: int = 2, **kwargs) -> L.Trainer:
    kwargs = {
        "enable_checkpointing": False,
        "accumulate_grad_batches": GAS,
        "gradient_clip_val": CLIP,
        "devices": 1,
        **kwargs,
    }
    return L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def lightning_config(nvme_dir, **kwargs) -> dict:
    """What InfinityStrategy(config=...) is given: the engine config without what the Trainer fills."""
    cfg = engine_config(nvme_dir, **kwargs)
    for key in ("gradient_accumulation_steps", "gradient_clipping"):
        del cfg[key]
    return cfg


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    with infinity.GatheredParameters(list(module.parameters())):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def lightning_run(strategy, *, build_in: str = "init", epochs: int = 2, **trainer_kwargs):
    """Losses, validation losses and final weights of a fit (the engine closed afterwards)."""
    module = MODULES[build_in](build_in)
    t = trainer(strategy, epochs=epochs, **trainer_kwargs)
    data = dataset(epochs)
    t.fit(module, loader(data), loader(data[:2]))
    weights = full_weights(module.model)
    engine = getattr(t.strategy, "engine", None)
    if engine is not None:
        module.io_stats = engine.io_stats()
        engine.close()
    return module.losses, module.val_losses, weights, module


def engine_run(config: dict, *, epochs: int = 2, rank: int = 0, world_size: int = 1):
    """The same training through infinity.initialize and the engine's loop: forward, backward and step
    every micro-batch; the schedule stepped after each update (as Lightning does); a validation pass
    over the first two micro-batches after each epoch."""
    torch.manual_seed(0)
    model = tiny_gpt()
    opt, sched = optimizer_and_schedule(model.parameters())
    engine = infinity.initialize(model, config, optimizer=opt)
    data = list(loader(dataset(epochs, world_size=world_size), rank=rank, world_size=world_size))
    val = [b for b in dataset(1)[:2]]
    losses, val_losses = [], []
    try:
        for _ in range(epochs):
            for x, y in data:
                loss = engine(x, y)
                engine.backward(loss)
                boundary = engine.is_gradient_accumulation_boundary()
                engine.step()
                if boundary:
                    with warnings.catch_warnings():
                        # the engine stepped in opt's place: torch's check that opt.step() ran first
                        warnings.filterwarnings(
                            "ignore", "Detected call of `lr_scheduler.step\\(\\)` before"
                        )
                        sched.step()
                losses.append(loss.item())
            engine.eval()
            with torch.no_grad():
                val_losses += [engine(x, y).item() for x, y in val]
            engine.train()
        weights = full_weights(model)
    finally:
        engine.close()
    return losses, val_losses, weights


def assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} values, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a == pytest.approx(b, rel=1e-5), f"{what} [{i}]: {a} != {b}"


def assert_weights_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, ref in want.items():
        err = (got[name] - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-5, f"{name}: relative difference {err:.2e}"


def infinity_strategy(nvme_dir, **kwargs) -> InfinityStrategy:
    return InfinityStrategy(config=lightning_config(nvme_dir, **kwargs))


def fabric_run(
    strategy,
    *,
    epochs: int = 2,
    devices: int = 1,
    save_after: int | None = None,
    resume_from=None,
    path=None,
):
    """The training loop (and an evaluation pass after each epoch) as a Fabric user writes it for
    ``strategy``: with InfinityFabricStrategy, DeepSpeed's loop (optimizer.step() after every
    backward; accumulation, clipping and the schedule are the engine's); otherwise the plain loop
    (loss / GAS, fabric.clip_gradients, a step and a schedule step every GAS micro-batches).
    Optionally saves after epoch ``save_after`` or resumes from ``resume_from`` first.
    Returns (losses, evaluation losses, final weights, parameter elements right after construction)."""
    from lightning.fabric import Fabric

    from infinity.integrations.fabric import InfinityFabricStrategy

    ours = isinstance(strategy, InfinityFabricStrategy)
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module():
        model = tiny_gpt()
    built_numel = sum(p.numel() for p in model.parameters())
    opt, sched = optimizer_and_schedule(model.parameters())
    model, opt, sched = fabric.setup(model, opt, scheduler=sched)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "epoch": 0}
    if resume_from is not None:
        remainder = fabric.load(resume_from, state)
        assert remainder == {}, remainder
    data = list(
        loader(dataset(epochs, world_size=devices), rank=fabric.global_rank, world_size=devices)
    )
    val = dataset(1)[:2]
    losses, val_losses = [], []
    for epoch in range(state["epoch"], epochs):
        for i, (x, y) in enumerate(data):
            loss = model(x, y)
            losses.append(loss.item())
            if ours:
                fabric.backward(loss)
                opt.step()
            else:
                fabric.backward(loss / GAS)
                if (i + 1) % GAS == 0:
                    fabric.clip_gradients(model, opt, max_norm=CLIP)
                    opt.step()
                    opt.zero_grad()
                    sched.step()
        model.eval()
        with torch.no_grad():
            val_losses += [model(x, y).item() for x, y in val]
        model.train()
        state["epoch"] = epoch + 1
        if save_after == epoch + 1:
            fabric.save(path, state)
    weights = full_weights(model.module)
    if ours:
        model._forward_module.engine.close()
    return losses, val_losses, weights, built_numel
