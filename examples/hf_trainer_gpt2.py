"""Fine-tune a GPT-2 with the transformers Trainer, ZeRO stage 3, parameters and optimizer state on NVMe.

What ``TrainingArguments(deepspeed="ds_config.json")`` does, with the Trainer class swapped for
``InfinityTrainer`` and the config passed as ``infinity_config=``: the config's "auto" values come
from the TrainingArguments, the Trainer saves checkpoint-N/ folders (HF-layout weights, the engine
checkpoint, trainer state), and ``save_model`` writes what ``from_pretrained`` loads. With
``--resume`` a second run continues from the last checkpoint.

    python examples/hf_trainer_gpt2.py                       # GPT-2 of 3.2M parameters, 12 steps
    python examples/hf_trainer_gpt2.py --resume --steps 20   # 8 more steps from the last checkpoint
    python examples/hf_trainer_gpt2.py --quick               # a few seconds (what the tests run)

Self-contained: the GPT-2 is built from a config with random weights (byte tokens, vocabulary 256)
and the data is infinity's built-in text corpus; nothing is downloaded. Prints one JSON line at the
end: the losses, the NVMe traffic, and the loss of the saved model reloaded with from_pretrained.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from infinity.integrations.transformers import InfinityTrainer
from infinity.models import TextCorpus


class CorpusWindows(Dataset):
    """Fixed windows of the built-in corpus as byte tokens (GPT-2 shifts the labels itself)."""

    def __init__(self, n: int, seq_len: int):
        corpus = TextCorpus()
        x, _ = corpus.batch(0, n, seq_len)
        self.windows = x

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


class Losses(TrainerCallback):
    def __init__(self):
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def ds_config(nvme_path: str, largest_layer: int) -> dict:
    """A DeepSpeed ZeRO-3 NVMe config as users write it for the HF Trainer: "auto" wherever the
    TrainingArguments decide."""
    offload = {"device": "nvme", "nvme_path": nvme_path}
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": {
                **offload,
                "buffer_count": 4,
                "buffer_size": largest_layer,
                "max_in_cpu": 0,
            },
            "offload_optimizer": offload,
            "sub_group_size": largest_layer,
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--nvme-path",
        default="./infinity_nvme",
        help="swap folder (default ./infinity_nvme, created)",
    )
    p.add_argument(
        "--out", default="hf_trainer_gpt2", help="output folder (default ./hf_trainer_gpt2)"
    )
    p.add_argument("--steps", type=int, help="optimizer steps in all (default 12; 6 with --quick)")
    p.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint-N in --out"
    )
    p.add_argument("--quick", action="store_true", help="a tiny model, 6 steps")
    args = p.parse_args(argv)

    if args.quick:
        gpt2 = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2)
        steps, batch_size, seq_len = args.steps or 6, 2, 32
    else:
        gpt2 = GPT2Config(vocab_size=256, n_positions=64, n_embd=256, n_layer=4, n_head=4)
        steps, batch_size, seq_len = args.steps or 12, 4, 64
    gpt2.bos_token_id = gpt2.eos_token_id = 0
    os.makedirs(args.nvme_path, exist_ok=True)
    config_path = os.path.join(args.out, "ds_config.json")
    os.makedirs(args.out, exist_ok=True)
    with open(config_path, "w") as f:
        json.dump(
            ds_config(args.nvme_path, 4 * gpt2.n_embd * gpt2.n_embd + 4 * gpt2.n_embd), f, indent=2
        )

    training_args = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=3e-3,
        warmup_steps=max(1, steps // 10),
        weight_decay=0.1,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=max(1, steps // 2),
        report_to=[],
        seed=0,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=args.quick,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2)
    losses = Losses()
    trainer = InfinityTrainer(
        model=model,
        args=training_args,
        train_dataset=CorpusWindows(256 * batch_size, seq_len),
        callbacks=[losses],
        infinity_config=config_path,
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    io = trainer.engine.io_stats()
    final = os.path.join(args.out, "final")
    trainer.save_model(final)

    # The saved model is an ordinary transformers model.
    reloaded = GPT2LMHeadModel.from_pretrained(final).eval()
    sample = CorpusWindows(4, seq_len)[0]["input_ids"][None]
    with torch.no_grad():
        reloaded_loss = reloaded(input_ids=sample, labels=sample).loss.item()
    print(
        json.dumps(
            {
                "params": trainer.engine.num_parameters,
                "steps": trainer.state.global_step,
                "first_loss": losses.losses[0] if losses.losses else None,
                "last_loss": losses.losses[-1] if losses.losses else None,
                "nvme_read_nbytes": io["read_nbytes"],
                "nvme_write_nbytes": io["write_nbytes"],
                "reloaded_loss": reloaded_loss,
                "saved_model": final,
            }
        )
    )
    trainer.engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
