"""Runs one phase of tests/hf/test_memory.py in a fresh process and prints one JSON line.

``python tests/hf/memory_probe.py write DIR``: a plain Llama (84M parameters, fp32, 32 layers) saved
with save_pretrained in shards (the files the other phases read; not measured).
``... train DIR NVME OUT CKPT``: built under zero.Init, load_pretrained from DIR, initialize (stage 3,
parameters and optimizer on NVMe), two training steps, save_16bit_model to OUT (Hugging Face layout,
shards of SHARD), the model's own save_pretrained to OUT_pretrained (the same), save_checkpoint to
CKPT (which keeps the model's config.json: the export needs no flag).
``... materialise DIR``: the control. Built under zero.Init as ``train`` builds it, then loaded the way
one would without load_pretrained: the whole model gathered and the files' state dict copied in.
``... export CKPT OUT``: export_checkpoint to OUT (Hugging Face layout, shards of SHARD).

The measured phases print the baseline (resident set after the imports, the model's class included,
before any model exists: infinity.estimate.runtime_baseline_nbytes), the peak host memory (VmHWM plus hugetlb pages,
infinity.host.peak_resident_host_nbytes) after each step of the phase, and the pools the run allocated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODEL = dict(
    vocab_size=512,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=32,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
SHARD = "32MB"  # save_pretrained's, save_16bit_model's and export's shard limit


def _ds(nvme: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 500_000,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme,
                "buffer_count": 4,
                "buffer_size": 600_000,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
    }


def write(directory: str) -> dict:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**MODEL))
    model.save_pretrained(directory, max_shard_size=SHARD)
    files = list(Path(directory).glob("*.safetensors"))
    layer = model.model.layers[0]
    return {
        "file_nbytes": sum(f.stat().st_size for f in files),
        "files": len(files),
        "layer_nbytes": sum(p.numel() * p.element_size() for p in layer.parameters()),
        "num_params": sum(p.numel() for p in model.parameters()),
    }


def _build(nvme: str, peaks: dict):
    """The model under zero.Init, then the heap trimmed and the peak reset: what follows is measured alone."""
    import torch
    import transformers as tf

    import infinity
    from infinity.host import peak_resident_host_nbytes, reset_peak_rss
    from infinity.memory import trim_heap

    torch.manual_seed(1)
    with infinity.zero.Init(_ds(nvme)):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**MODEL))
    # Building under zero.Init frees every parameter as it is partitioned, and the heap keeps what
    # was freed until FreedMemory trims it (up to memory/trim.py's threshold): the estimator's
    # "zero.Init construction heap". That is construction's, not loading's: it is reported, then
    # trimmed, and the peak starts again from here.
    peaks["built"] = peak_resident_host_nbytes()
    trim_heap()
    peaks["reset"] = reset_peak_rss()
    peaks["after build, trimmed"] = peak_resident_host_nbytes()
    return model


def _baseline() -> int:
    """runtime_baseline_nbytes with the model's code imported (transformers imports it on first use)."""
    import transformers as tf

    from infinity.estimate import runtime_baseline_nbytes

    assert tf.LlamaForCausalLM and tf.LlamaConfig
    return runtime_baseline_nbytes()


def train(directory: str, nvme: str, out: str, ckpt: str) -> dict:
    import torch

    import infinity
    from infinity.host import peak_resident_host_nbytes, reset_peak_rss
    from infinity.zero.init import _INIT_POOL_NBYTES

    baseline = _baseline()
    peaks: dict = {}
    model = _build(nvme, peaks)
    result = infinity.zero.load_pretrained(model, directory)
    whole = [n for n, p in model.named_parameters() if p.numel() > 0]
    peaks["loaded"] = peak_resident_host_nbytes()
    ds = _ds(nvme)
    engine = infinity.initialize(model, ds)
    peaks["initialized"] = peak_resident_host_nbytes()
    plan = engine.runtime.plan
    pools = {
        "zero.Init pool": _INIT_POOL_NBYTES,
        "parameter pool": plan.param_store.pool.capacity_nbytes,
        "optimizer pool": plan.state_store.pool.capacity_nbytes,
        "tensor cache": plan.tensor_cache_cap_nbytes,
        "staging": plan.staging_numel * 4,
    }
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(2):
        x = torch.randint(0, MODEL["vocab_size"], (1, 32), generator=g)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    peaks["trained"] = peak_resident_host_nbytes()
    engine.save_16bit_model(out, max_shard_size=SHARD)
    peaks["saved"] = peak_resident_host_nbytes()
    # The user's own call on the model they hold ([Note: saving a partitioned model]), measured alone.
    peaks["reset before save_pretrained"] = reset_peak_rss()
    model.save_pretrained(f"{out}_pretrained", max_shard_size=SHARD)
    peaks["save_pretrained"] = peak_resident_host_nbytes()
    engine.save_checkpoint(ckpt)
    engine.close()
    return {
        "baseline": baseline,
        "peaks": peaks,
        "pools": pools,
        "losses": losses,
        "whole_after_load": whole,
        "missing": result.missing_keys,
        "unexpected": result.unexpected_keys,
    }


def materialise(directory: str, nvme: str) -> dict:
    from safetensors.torch import load_file

    from infinity.host import peak_resident_host_nbytes
    from infinity.zero.gathered import GatheredParameters

    baseline = _baseline()
    peaks: dict = {}
    model = _build(nvme, peaks)
    state = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        state.update(load_file(f))
    with GatheredParameters(list(model.parameters()), modifier_rank=0):
        result = model.load_state_dict(state, strict=False)
    peaks["loaded"] = peak_resident_host_nbytes()
    return {
        "baseline": baseline,
        "peaks": peaks,
        "missing": result.missing_keys,
        "unexpected": result.unexpected_keys,
    }


def export(ckpt: str, out: str) -> dict:
    from infinity.engine.checkpoint import export_checkpoint
    from infinity.host import peak_resident_host_nbytes

    baseline = _baseline()  # transformers included: the export names tensors as it does
    export_checkpoint(ckpt, out, max_shard_size=SHARD, progress=False)
    return {"baseline": baseline, "peaks": {"exported": peak_resident_host_nbytes()}}


if __name__ == "__main__":
    phase, *args = sys.argv[1:]
    print(
        json.dumps(
            {"write": write, "train": train, "materialise": materialise, "export": export}[phase](
                *args
            )
        )
    )
