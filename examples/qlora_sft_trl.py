"""QLoRA with TRL's SFTTrainer: the frozen base in NF4 on NVMe, LoRA adapters trained, the merged model out.

``infinity_trainer(trl.SFTTrainer)`` is SFTTrainer training through an infinity engine (ZeRO stage 3,
parameters and optimizer state on NVMe). The base model is built under ``infinity.zero.Init`` and read
from its pretrained directory with ``infinity.zero.load_pretrained`` (never whole in memory), PEFT wraps
it as usual, and ``zero_quantized_nontrainable_weights`` + ``weight_quantization`` keep the frozen
base at rest in NF4 (QLoRA's format), dequantised per layer after each read. The Trainer's checkpoints
hold the adapters and their optimizer state and only a reference to the base's files; at the end
``engine.save_merged`` writes base + adapters as ``from_pretrained`` reads it.

    python examples/qlora_sft_trl.py            # a Llama of 0.4M parameters, 12 steps
    python examples/qlora_sft_trl.py --quick    # a few seconds (what the tests run)

Self-contained: the Llama is built from a config with random weights (byte tokens, vocabulary 256)
and saved once as its "pretrained" directory; the data is infinity's built-in text corpus. Prints one
JSON line at the end: the losses, the checkpoint's size, and the merged model's loss reloaded with
from_pretrained (equal to the trained model's).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

import datasets
import peft
import tokenizers
import torch
import trl
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

import infinity
from infinity.integrations.transformers import infinity_trainer
from infinity.models import TextCorpus


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Tokens are the corpus's bytes (ids 0..255): the tokenizer is only asked for its special ids."""
    vocab = {f"b{i}": i for i in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="b0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="b0", eos_token="b1")


def base_model(path: Path, hidden: int) -> None:
    """The stand-in for a downloaded model: a random Llama saved as its pretrained directory."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(config).save_pretrained(path)


def infinity_config(nvme_path: str, group: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path},
            "zero_quantized_nontrainable_weights": True,
        },
        "weight_quantization": {
            "quantized_initialization": {"num_bits": 4, "group_size": group, "quant_type": "nf4"}
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme-path", default="nvme", help="directory for swap files (a local NVMe)")
    ap.add_argument("--out", default="qlora_out", help="run folder: base, checkpoints, merged")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="a smaller model and 6 steps")
    a = ap.parse_args()
    steps = 6 if a.quick else a.steps
    hidden = 64 if a.quick else 128
    out = Path(a.out)
    os.makedirs(a.nvme_path, exist_ok=True)
    if not (out / "base" / "config.json").exists():
        base_model(out / "base", hidden)

    cfg = infinity_config(a.nvme_path, group=64)
    with infinity.zero.Init(cfg):
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(out / "base"))
    infinity.zero.load_pretrained(model, out / "base")
    lora = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    with warnings.catch_warnings():  # peft 0.21 reads transformers 5's deprecated attribute
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        model = peft.get_peft_model(model, lora)

    seq = 64
    x, _ = TextCorpus().batch(0, 4 * steps, seq)
    data = datasets.Dataset.from_dict({"input_ids": x.tolist()})
    with warnings.catch_warnings():  # SFTConfig sets TrainingArguments' deprecated name itself
        warnings.filterwarnings("ignore", "`gradient_checkpointing` is deprecated", FutureWarning)
        args = trl.SFTConfig(
            output_dir=str(out / "run"),
            max_steps=steps,
            per_device_train_batch_size=4,
            learning_rate=3e-3,
            lr_scheduler_type="constant",
            logging_steps=1,
            save_steps=steps,
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            bf16=False,  # SFTConfig's default True would add an enabled bf16 section: fp32 here
        )
    trainer = infinity_trainer(trl.SFTTrainer)(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=byte_tokenizer(),
        infinity_config=cfg,
    )
    trainer.train()
    engine = trainer.engine
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    merged = engine.save_merged(out / "merged")
    ids = x[:2]
    with torch.no_grad():
        trained_loss = engine(input_ids=ids, labels=ids).loss.item()
    engine.close()
    reloaded = AutoModelForCausalLM.from_pretrained(merged)
    with torch.no_grad():
        merged_loss = reloaded(input_ids=ids, labels=ids).loss.item()
    ckpt = out / "run" / f"checkpoint-{steps}" / "infinity"
    print(
        json.dumps(
            {
                "steps": len(losses),
                "first_loss": losses[0],
                "last_loss": losses[-1],
                "checkpoint_nbytes": sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()),
                "base_nbytes": sum(f.stat().st_size for f in (out / "base").glob("*.safetensors")),
                "trained_loss": trained_loss,
                "merged_loss": merged_loss,
            }
        )
    )


if __name__ == "__main__":
    main()
