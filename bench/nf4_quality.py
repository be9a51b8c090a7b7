"""What quantising a frozen base at rest costs in accuracy: a Llama-shaped model whose weights have a
real-shaped distribution, its matrices at rest in NF4, NF4 with double quantisation and int8 (infinity's
own formats, infinity/weights/quant.py, groups of 64), against the same model in bf16.

No checkpoint can be downloaded here, so the weights are synthesised with the shape measured
distributions of trained LLM weights are described with:
- heavy-tailed values: Student-t with NU degrees of freedom, scaled to unit variance (Dotzel et al.,
  "Learning from Students: Applying t-Distributions to Explore Accurate and Efficient Formats for
  LLMs", ICML 2024, fit trained LLM weights with a Student-t better than with a normal; QLoRA's NF4
  assumes a normal, so the tails are where it loses);
- per-output-channel scales, log-normal (sigma ROW_SIGMA): rows of a trained projection differ in
  norm;
- a few outlier input channels (OUTLIER_FRACTION of the hidden dimensions, OUTLIER_SCALE times the
  rest), the emergent outlier features of LLM.int8() (Dettmers et al. 2022), which widen every
  group they fall in;
- base standard deviation 0.02 (Llama's initializer_range), RMSNorm weights log-normal around 1.
Every matrix (2-D and up: projections, embeddings, the head) is quantised, as the engine quantises a
frozen base; norms stay bf16. All variants compute in fp32 on their (dequantised) bf16 values, so the
differences are the format's alone.

Reported against the bf16 model, over PROMPTS random prompts: max and mean |Δlogit| over every
position of the prompts (teacher-forced), the bf16 logits' standard deviation and median top-1 margin
(the gap between the greedy token's logit and the runner-up's) for scale, and greedy decoding of NEW
tokens from each prompt: the share of positions whose token equals bf16's, and the mean length of the
prefix that agrees. A model with random (if real-shaped) weights has flat next-token distributions:
its top-1 margins are far smaller than a trained model's, so greedy agreement here is a harsh, lower
figure; the |Δlogit| columns are the format's error itself. These figures do not depend on the
machine's load.

    python bench/nf4_quality.py           # hidden 512, 4 layers, 8 prompts of 32, 32 new tokens
    python bench/nf4_quality.py --quick   # a tiny Llama: seconds (CI)

``bench/lora.py --quality`` runs this. Writes a JSON into bench/results/ (INFINITY_BENCH_RESULTS
overrides the folder).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infinity.weights.quant import (  # noqa: E402
    QuantSpec,
    dequantize_into,
    quantize_into,
    shard_format,
)

NU = 5
ROW_SIGMA = 0.3
OUTLIER_FRACTION = 0.005
OUTLIER_SCALE = 8.0
STD = 0.02
GROUP = 64
FORMATS = {
    "NF4": QuantSpec(4, GROUP, True, "nf4"),
    "NF4 + double quant": QuantSpec(4, GROUP, True, "nf4", double_quant=True),
    "int8": QuantSpec(8, GROUP, False),
}
SHAPES = {
    # hidden, layers, MLP, heads, kv heads, vocabulary, prompts, prompt length, new tokens
    "quick": (64, 2, 176, 4, 2, 256, 2, 8, 8),
    "small": (512, 4, 1408, 8, 2, 4096, 8, 32, 32),
}


def real_shaped(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """A matrix as the module docstring describes: Student-t values, log-normal row scales, a few
    outlier input channels."""
    rows, cols = shape[0], shape[-1]
    # Student-t: a normal over sqrt(chi-squared / nu), the chi-squared a sum of nu squared normals
    chi2 = sum(torch.randn(shape, generator=g) ** 2 for _ in range(NU))
    t = torch.randn(shape, generator=g) / torch.sqrt(chi2 / NU)
    t /= (NU / (NU - 2)) ** 0.5  # unit variance
    rows_scale = torch.exp(torch.randn(rows, generator=g) * ROW_SIGMA)
    cols_scale = torch.ones(cols)
    outliers = torch.randperm(cols, generator=g)[: max(1, int(cols * OUTLIER_FRACTION))]
    cols_scale[outliers] = OUTLIER_SCALE
    return STD * t * rows_scale[:, None] * cols_scale[None, :]


def build(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    h, n, mlp, heads, kv, vocab, *_ = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=mlp,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(real_shaped(tuple(p.shape), g))
            else:
                p.copy_(torch.exp(torch.randn(p.shape, generator=g) * 0.2))
            p.copy_(p.to(torch.bfloat16).float())  # the bf16 base: every variant starts from it
    return model


def quantised_copy(model, spec: QuantSpec):
    """The model with every matrix replaced by its dequantised values in ``spec`` (bf16 at rest)."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            if p.dim() < 2:
                continue
            w = p.detach().to(torch.bfloat16).reshape(-1)
            fmt = shard_format([(0, w.numel(), tuple(p.shape))], w.numel(), torch.bfloat16, spec)
            packed = torch.zeros(fmt.nbytes, dtype=torch.uint8)
            quantize_into(fmt, w, packed)
            back = torch.empty(w.numel(), dtype=torch.bfloat16)
            dequantize_into(fmt, packed, back)
            p.copy_(back.view(p.shape).float())
    return out


def greedy(model, prompts: torch.Tensor, new: int) -> torch.Tensor:
    out = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )
    return out[:, prompts.shape[1] :]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny Llama: seconds (CI)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path")
    args = ap.parse_args(argv)
    shape = "quick" if args.quick else "small"
    *_, vocab, nprompts, length, new = SHAPES[shape]
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    results = Path(os.environ.get("INFINITY_BENCH_RESULTS", ROOT / "bench" / "results"))
    out_path = args.out or results / f"nf4-quality{'-quick' if args.quick else ''}.json"

    model = build(shape)
    prompts = torch.randint(
        1, vocab, (nprompts, length), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        ref_logits = model(prompts).logits
        ref_tokens = greedy(model, prompts, new)
    top2 = ref_logits.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]  # how far the greedy choice is from its runner-up
    rows = {}
    for name, spec in FORMATS.items():
        variant = quantised_copy(model, spec)
        with torch.no_grad():
            delta = (variant(prompts).logits - ref_logits).abs()
            tokens = greedy(variant, prompts, new)
        same = tokens == ref_tokens
        prefix = torch.where(same.all(dim=1), new, (~same).int().argmax(dim=1)).float()
        rows[name] = {
            "max_abs_dlogit": float(delta.max()),
            "mean_abs_dlogit": float(delta.mean()),
            "greedy_agreement": float(same.float().mean()),
            "mean_agreeing_prefix": float(prefix.mean()),
        }
        del variant
    h, n, mlp, heads, kv, *_ = SHAPES[shape]
    result = {
        "benchmark": "nf4 quality",
        "command": "python bench/nf4_quality.py" + (" --quick" if args.quick else ""),
        "model": {
            "hidden": h,
            "layers": n,
            "mlp": mlp,
            "heads": heads,
            "kv_heads": kv,
            "vocab": vocab,
            "params": sum(p.numel() for p in model.parameters()),
        },
        "weights": {
            "student_t_nu": NU,
            "row_scale_lognormal_sigma": ROW_SIGMA,
            "outlier_input_channels": OUTLIER_FRACTION,
            "outlier_scale": OUTLIER_SCALE,
            "std": STD,
        },
        "group_size": GROUP,
        "prompts": nprompts,
        "prompt_length": length,
        "new_tokens": new,
        "bf16_logit_std": float(ref_logits.std()),
        "bf16_median_top1_margin": float(margin.median()),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        "results": rows,
    }
    print(
        f"Llama-shaped (hidden {h}, {n} layers, MLP {mlp}, vocab {vocab}), real-shaped weights; "
        f"{nprompts} prompts of {length}, {new} greedy tokens; bf16 logits' std "
        f"{result['bf16_logit_std']:.3f}, median top-1 margin {result['bf16_median_top1_margin']:.4f}"
    )
    print(
        "| base at rest | max abs dlogit | mean abs dlogit | greedy agreement | agreeing prefix |\n"
        "|---|---:|---:|---:|---:|"
    )
    for name, r in rows.items():
        print(
            f"| {name} | {r['max_abs_dlogit']:.4f} | {r['mean_abs_dlogit']:.4f} | "
            f"{r['greedy_agreement']:.1%} | {r['mean_agreeing_prefix']:.1f} / {new} |"
        )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
