"""Knowledge distillation with Accelerate on infinity: a frozen ZeRO-3 teacher on NVMe, a ZeRO-2 student.

The scenario of Accelerate's "multiple models with DeepSpeed" guide, in one process and without
deepspeed: the teacher is built under ``infinity.zero.Init`` straight into stage-3 shards whose
parameters live on NVMe, and served by ``prepare_frozen`` (no gradient, no optimizer state, eval
mode); the student trains at ZeRO stage 2 with its Adam state offloaded to CPU, through
``prepare`` (Accelerate prepares the dataloader and handles ranks, the engine owns the student and
its optimizer). The student learns the teacher's logits: the loss is KL(teacher || student) over
the teacher's softened distribution. The loop is Accelerate's DeepSpeed loop.

    python examples/distill_accelerate.py              # 40 steps, saves ./distill_accelerate
    python examples/distill_accelerate.py --quick      # a few seconds (what the tests run)
    python examples/distill_accelerate.py --quick --resume --steps 8   # load_state, 2 more steps

Self-contained (infinity.models.GPT and its built-in corpus). Prints one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

import infinity
from infinity.integrations.accelerate import prepare, prepare_frozen
from infinity.models import GPT, GPTConfig, TextCorpus

ACCUMULATE = 2
TEMPERATURE = 0.05  # the teacher's logits are sharpened: a random teacher's are nearly flat


def teacher_config(nvme_path: str, largest_layer: int) -> dict:
    """The guide's zero3_config.json: inference only, parameters on NVMe; "auto" values filled by infinity."""
    return {
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": "auto",
            "stage3_max_reuse_distance": "auto",
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme_path,
                "buffer_count": 4,
                "buffer_size": largest_layer,
                "max_in_cpu": 0,
            },
        },
        "train_micro_batch_size_per_gpu": 1,
    }


def student_config() -> dict:
    """The guide's zero2_config.json, with the optimizer and schedule passed in as torch objects."""
    return {
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }


class Windows(Dataset):
    """Token windows of the built-in corpus, one per index."""

    def __init__(self, corpus: TextCorpus, seq_len: int, n: int):
        self.corpus, self.seq_len, self.n = corpus, seq_len, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        start = (i * 997) % (len(self.corpus.tokens) - self.seq_len)
        return self.corpus.tokens[start : start + self.seq_len]


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    target = F.log_softmax(teacher_logits.float() / TEMPERATURE, dim=-1)
    log_student = F.log_softmax(student_logits.float(), dim=-1)
    return F.kl_div(
        log_student.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--nvme-path",
        default="./infinity_nvme",
        help="swap folder (default ./infinity_nvme, created)",
    )
    p.add_argument("--out", default="distill_accelerate", help="accelerator.save_state folder")
    p.add_argument("--steps", type=int, help="optimizer steps in all (default 40; 6 with --quick)")
    p.add_argument(
        "--resume", action="store_true", help="accelerator.load_state(<out>) first and continue"
    )
    p.add_argument("--quick", action="store_true", help="tiny models, 6 steps")
    args = p.parse_args(argv)

    if args.quick:
        t_cfg, s_cfg, steps, micro = (
            GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=64),
            GPTConfig(seq_len=32, n_layer=1, n_head=2, d_model=32),
            args.steps or 6,
            4,
        )
    else:
        t_cfg, s_cfg, steps, micro = (
            GPTConfig(seq_len=64, n_layer=6, n_head=4, d_model=256),
            GPTConfig(seq_len=64, n_layer=2, n_head=2, d_model=128),
            args.steps or 40,
            8,
        )
    largest_layer = 4 * t_cfg.d_model * t_cfg.d_model + 4 * t_cfg.d_model
    os.makedirs(args.nvme_path, exist_ok=True)

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(), gradient_accumulation_steps=ACCUMULATE
    )

    # The teacher: built into stage-3 shards on NVMe, then served frozen.
    teacher_cfg = teacher_config(args.nvme_path, largest_layer)
    torch.manual_seed(1)
    with infinity.zero.Init(config=teacher_cfg):
        teacher = GPT(t_cfg)
    teacher = prepare_frozen(teacher, teacher_cfg, accelerator=accelerator)

    # The student: ZeRO-2, Adam state in host memory.
    torch.manual_seed(0)
    student = GPT(s_cfg)
    optimizer = torch.optim.AdamW(
        student.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    data = DataLoader(
        Windows(
            TextCorpus(), s_cfg.seq_len, steps * ACCUMULATE * micro * accelerator.num_processes
        ),
        batch_size=micro,
        shuffle=False,
    )
    student, optimizer, data, scheduler = prepare(
        accelerator, student, optimizer, data, scheduler, config=student_config()
    )
    start = 0
    if args.resume:
        accelerator.load_state(args.out)
        start = student.engine.global_steps

    losses = []
    student.train()
    for i, tokens in enumerate(data):
        if i < start * ACCUMULATE:
            continue  # micro-batches the saved run has trained on
        with torch.no_grad():
            teacher_logits = teacher(tokens)
        loss = distill_loss(student(tokens), teacher_logits)
        accelerator.backward(loss)  # the engine's backward
        optimizer.step()  # the engine's step: one update per ACCUMULATE micro-batches
        scheduler.step()  # nothing: the engine steps the schedule
        optimizer.zero_grad()  # nothing: the engine's window starts empty
        losses.append(loss.item())
    accelerator.save_state(args.out)
    if accelerator.is_main_process:
        print(
            json.dumps(
                {
                    "teacher_params": t_cfg.num_params,
                    "student_params": s_cfg.num_params,
                    "steps": student.engine.global_steps,
                    "first_loss": losses[0] if losses else None,
                    "last_loss": losses[-1] if losses else None,
                    "teacher_nvme_read_nbytes": teacher.io_stats()["read_nbytes"],
                    "checkpoint": args.out,
                }
            )
        )
    teacher.close()
    student.engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
