"""Fine-tune a GPT with Lightning's Trainer, ZeRO stage 3, parameters and optimizer state on NVMe.

The Lightning DeepSpeed guide's stage-3 NVMe recipe with the strategy swapped: the model is built in
``configure_model`` (under ``infinity.zero.Init``, so it never exists whole in memory), trained with
the Trainer's accumulation and clipping, checkpointed by ``ModelCheckpoint``, and validated. With
``--resume`` a second run picks up from the last checkpoint and trains on.

    python examples/lightning_stage3_nvme.py                       # 3.3M parameters, 30 steps
    python examples/lightning_stage3_nvme.py --resume --steps 40   # 10 more steps from last.ckpt
    python examples/lightning_stage3_nvme.py --devices 2           # two processes on gloo (CPU)
    python examples/lightning_stage3_nvme.py --quick               # a few seconds (what the tests run)

Self-contained: the model is infinity.models.GPT (plain torch) and the data its built-in text
corpus; nothing is downloaded. Prints one JSON line with the losses at the end (rank 0).
"""

from __future__ import annotations

import argparse
import json
import math
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from infinity.integrations.lightning import InfinityStrategy
from infinity.models import GPT, GPTConfig, TextCorpus


class CorpusWindows(Dataset):
    """Fixed (input, target) windows of the built-in corpus: item i is the same on every run."""

    def __init__(self, n: int, seq_len: int, *, seed: int):
        self.corpus, self.n, self.seq_len, self.seed = TextCorpus(), n, seq_len, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x, y = self.corpus.batch(self.seed * 1_000_000 + i, 1, self.seq_len)
        return x[0], y[0]


class FineTune(L.LightningModule):
    def __init__(self, gpt: GPTConfig, *, lr: float, steps: int, batch_size: int):
        super().__init__()
        self.gpt, self.lr, self.steps, self.batch_size = gpt, lr, steps, batch_size
        self.model: GPT | None = None
        self.losses: list[float] = []

    def configure_model(self):
        if self.model is None:  # the Trainer calls this for every fit/validate; build once
            torch.manual_seed(0)
            self.model = GPT(self.gpt)

    def training_step(self, batch, batch_idx):
        loss = self.model(*batch)
        self.losses.append(loss.item())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(*batch), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)
        warmup = max(1, self.steps // 10)

        def schedule(step: int) -> float:  # linear warm-up, cosine decay to 10%
            if step < warmup:
                return (step + 1) / warmup
            return 0.1 + 0.9 * 0.5 * (
                1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, self.steps - warmup)))
            )

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        n = (
            self.steps
            * self.trainer.accumulate_grad_batches
            * self.batch_size
            * self.trainer.world_size
        )
        return DataLoader(CorpusWindows(n, self.gpt.seq_len, seed=0), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(
            CorpusWindows(4 * self.batch_size, self.gpt.seq_len, seed=1), batch_size=self.batch_size
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--nvme-path",
        default="./infinity_nvme",
        help="swap folder (default ./infinity_nvme, created)",
    )
    p.add_argument(
        "--out",
        default="lightning_stage3_nvme",
        help="checkpoint folder (default ./lightning_stage3_nvme)",
    )
    p.add_argument("--steps", type=int, help="optimizer steps in all (default 30; 6 with --quick)")
    p.add_argument("--devices", type=int, default=1, help="processes (CPU: gloo; default 1)")
    p.add_argument(
        "--precision", default="32-true", help="32-true (default), bf16-true, bf16-mixed, ..."
    )
    p.add_argument("--resume", action="store_true", help="continue from <out>/last.ckpt")
    p.add_argument("--quick", action="store_true", help="a tiny model, 6 steps")
    args = p.parse_args(argv)

    if args.quick:
        gpt = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=64)
        steps, batch_size = args.steps or 6, 2
    else:
        gpt = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=256)
        steps, batch_size = args.steps or 30, 4
    largest_layer = (
        4 * gpt.d_model * gpt.d_model + 4 * gpt.d_model
    )  # the MLP's Linear, with its bias
    strategy = InfinityStrategy(
        stage=3,
        offload_optimizer=True,
        offload_parameters=True,
        remote_device="nvme",
        offload_params_device="nvme",
        offload_optimizer_device="nvme",
        nvme_path=args.nvme_path,
        params_buffer_count=4,
        params_buffer_size=largest_layer,
        sub_group_size=largest_layer,  # the optimizer steps a sub-group's parameters through that pool
        max_in_cpu=0,  # every parameter on NVMe (DeepSpeed keeps the first 1e9 elements in host memory)
    )
    trainer = L.Trainer(
        accelerator="cpu" if not torch.cuda.is_available() else "auto",
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=steps,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        val_check_interval=max(1, steps // 2) * 2,  # in batches: twice per run
        callbacks=[
            ModelCheckpoint(
                dirpath=args.out, save_last=True, every_n_train_steps=max(1, steps // 2)
            )
        ],
        logger=False,
        enable_progress_bar=not args.quick,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = FineTune(gpt, lr=1e-3, steps=steps, batch_size=batch_size)
    trainer.fit(module, ckpt_path="last" if args.resume else None)
    metrics = trainer.validate(module, verbose=False)[0]
    if trainer.is_global_zero:
        io = trainer.strategy.engine.io_stats()
        print(
            json.dumps(
                {
                    "params": gpt.num_params,
                    "steps": trainer.global_step,
                    "world_size": trainer.world_size,
                    "first_loss": module.losses[0] if module.losses else None,
                    "last_loss": module.losses[-1] if module.losses else None,
                    "val_loss": metrics["val_loss"],
                    "nvme_read_nbytes": io["read_nbytes"],
                    "nvme_write_nbytes": io["write_nbytes"],
                    "checkpoint": os.path.join(args.out, "last.ckpt"),
                }
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
