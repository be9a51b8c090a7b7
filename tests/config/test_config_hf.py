"""HF's own "auto" filling as the oracle: transformers 5.23's HfTrainerDeepSpeedConfig.

For each config and ``TrainingArguments``, HF's ``trainer_config_process`` +
``trainer_config_finalize`` fill the config (or refuse it with their list of
mismatches); ``load_config`` given the same values as keyword arguments
(``training_arguments_values``: HF's names, the way an adapter passes them)
must fill every key of HF's table to the same value, or refuse the same keys.

The oracle runs HF's code unchanged, without deepspeed: transformers derives
HfTrainerDeepSpeedConfig from accelerate's HfDeepSpeedConfig only where
deepspeed is installed (else from ``object``, whose __init__ takes no config),
and the filling methods are its own and need no deepspeed. ``HfOracle`` is
accelerate's base class (config navigation, zero stage) with transformers'
methods copied on, its __init__ that of transformers minus the deepspeed
version check and the global weakref.
"""

import json
import re
from pathlib import Path

import accelerate.utils.deepspeed as accelerate_deepspeed
import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlavaConfig,
    LlavaForConditionalGeneration,
    ResNetConfig,
    ResNetModel,
    T5Config,
    T5ForConditionalGeneration,
    TrainingArguments,
)
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

from infinity.config import TRAINING_ARGUMENTS, ConfigError, load_config, training_arguments_values

DATA = Path(__file__).parent / "data"


class HfOracle(accelerate_deepspeed.HfDeepSpeedConfig):
    def __init__(self, config):
        super().__init__(config)  # accelerate's: reads the stage and offload
        self._dtype = None  # the rest of HfTrainerDeepSpeedConfig.__init__
        self.mismatches = []


for _name, _method in vars(HfTrainerDeepSpeedConfig).items():
    if not _name.startswith("__"):  # dtype, is_auto, fill_match, fill_only, trainer_config_*
        setattr(HfOracle, _name, _method)


# Every key HF's table fills (trainer_config_process, trainer_config_finalize).
TABLE_KEYS = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "gradient_clipping",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_max_lr",
    "fp16.enabled",
    "bf16.enabled",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "scheduler.params.total_num_steps",
    "scheduler.params.warmup_num_steps",
)
# HF fills these at stage 3 only and leaves "auto" below it; infinity takes DeepSpeed's defaults.
STAGE3_DEFAULTS = {
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "zero_optimization.stage3_param_persistence_threshold": 100_000,
}


def _shared(name):
    return json.loads((DATA / name).read_text())


# The two configs of Accelerate's guide to several models in one run (its Chinese edition),
# trailing commas removed; the verbatim copies are data/seeds/accelerate_zero{3_teacher,2_student}.json.
TEACHER = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": "auto",
        "stage3_max_reuse_distance": "auto",
    },
    "train_micro_batch_size_per_gpu": 1,
}
STUDENT = {
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True, "adam_w_mode": True},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "gradient_accumulation_steps": 1,
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}
DECAY = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "total_num_steps": "auto",
            "warmup_num_steps": "auto",
            "warmup_max_lr": "auto",
            "warmup_min_lr": "auto",
        },
    },
    "fp16": {"enabled": "auto"},
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "zero_optimization": {
        "stage": 2,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}
COSINE = {
    "optimizer": {"type": "Adam", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"},
    },
    "gradient_clipping": "auto",
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": 1000,
    },
}


def gpt2():
    cfg = GPT2Config(
        n_embd=40,
        n_layer=1,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def t5():  # d_model, which its config answers to hidden_size
    return T5ForConditionalGeneration(
        T5Config(d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2, vocab_size=64)
    )


def resnet():  # hidden_sizes: the largest counts
    return ResNetModel(ResNetConfig(embedding_size=8, hidden_sizes=[8, 24, 16], depths=[1, 1, 1]))


def llava():  # no hidden size of its own: its text_config's
    text = dict(
        model_type="llama",
        hidden_size=24,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
    )
    vision = dict(
        model_type="clip_vision_model",
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=8,
        patch_size=4,
        projection_dim=16,
    )
    return LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision))


def plain():  # not an HF model: no config
    return torch.nn.Linear(4, 4)


# (id, config, TrainingArguments keywords, num_training_steps, model)
CASES = [
    (
        "zero2_offload_cpu",
        _shared("zero2_offload_cpu.json"),
        dict(
            learning_rate=3e-4,
            weight_decay=0.01,
            adam_beta2=0.98,
            adam_epsilon=1e-6,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_grad_norm=0.5,
            warmup_steps=50,
        ),
        1000,
        plain,
    ),
    (
        "zero3_offload_cpu",
        _shared("zero3_offload_cpu.json"),
        dict(learning_rate=5e-5, fp16=True, warmup_steps=0.1, per_device_train_batch_size=2),
        95,
        gpt2,
    ),
    (
        "zero3_infinity_nvme",
        _shared("zero3_infinity_nvme.json"),
        dict(
            learning_rate=1e-4,
            adam_beta2=0.95,
            weight_decay=0.1,
            per_device_train_batch_size=1,
            bf16=True,
            use_cpu=True,
        ),
        10,
        gpt2,
    ),
    (
        "accelerate_teacher_t5",
        TEACHER,
        dict(bf16_full_eval=True, use_cpu=True, per_device_train_batch_size=1),
        10,
        t5,
    ),
    ("accelerate_teacher_resnet", TEACHER, dict(per_device_train_batch_size=1), 10, resnet),
    ("accelerate_teacher_llava", TEACHER, dict(per_device_train_batch_size=1), 10, llava),
    (
        "accelerate_student",
        STUDENT,
        dict(learning_rate=2e-5, weight_decay=0.05, warmup_steps=7, per_device_train_batch_size=3),
        100,
        plain,
    ),
    (
        "warmup_decay_fraction_stage2",
        DECAY,
        dict(
            learning_rate=1e-3,
            adam_beta1=0.8,
            gradient_accumulation_steps=4,
            fp16_full_eval=True,
            warmup_steps=0.25,
        ),
        41,
        gpt2,
    ),
    ("warmup_cosine_no_warmup", COSINE, dict(learning_rate=1e-3, max_grad_norm=2.0), 30, gpt2),
]

MISMATCHES = [
    ("clipping", {"gradient_clipping": 1.0}, dict(max_grad_norm=0.5)),
    ("lr", {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}, dict(learning_rate=3e-4)),
    (
        "warmup_max_lr",
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}},
        dict(learning_rate=5e-5),
    ),
    ("micro_batch", {"train_micro_batch_size_per_gpu": 2}, dict(per_device_train_batch_size=8)),
    # HF's train_batch_size is world x per_device_train_batch_size x accumulation: 8 here
    ("train_batch_size", {"train_batch_size": 32}, dict(per_device_train_batch_size=8)),
    ("fp16", {"fp16": {"enabled": True}}, dict()),
    (
        "warmup",
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}},
        dict(warmup_steps=10),
    ),
    (
        "total_and_betas",
        {
            "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}},
        },
        dict(),
    ),
]


def _args(tmp_path, **kwargs):
    return TrainingArguments(output_dir=str(tmp_path), report_to="none", **kwargs)


def hf_fill(config, args, num_training_steps, model):
    oracle = HfOracle(config)
    oracle.trainer_config_process(args)
    oracle.trainer_config_finalize(args, model, num_training_steps)
    return oracle.config


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        p = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(_flat(v, p))
        else:
            out[p] = v
    return out


def _equal(ours, hf):
    if isinstance(hf, (list, tuple)):
        return isinstance(ours, (list, tuple)) and list(ours) == list(hf)
    return ours == hf and not isinstance(ours, str)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_load_config_fills_as_hf_trainer_deepspeed_config(case, tmp_path):
    _, config, kwargs, steps, make_model = case
    args = _args(tmp_path, **kwargs)
    torch.manual_seed(0)
    model = make_model()
    hf = _flat(hf_fill(config, args, steps, model))
    values = training_arguments_values(args, num_training_steps=steps)
    cfg = load_config(config, model=model, **values)
    ours = _flat(cfg.to_dict())
    compared = 0
    for path in TABLE_KEYS:
        if path not in hf:
            continue  # HF fills nothing where the config has no such key
        if hf[path] == "auto":
            assert path in STAGE3_DEFAULTS and cfg.zero_optimization.stage < 3, path
            assert ours[path] == STAGE3_DEFAULTS[path], path
            continue
        assert _equal(ours[path], hf[path]), (path, ours[path], hf[path])
        compared += 1
    assert compared >= 3
    # HF leaves nothing of its table "auto" that infinity filled from another source
    leftover = {p for p, v in hf.items() if v == "auto"} - set(STAGE3_DEFAULTS)
    leftover -= {"bfloat16.enabled"}  # HF's table spells bf16 only; DeepSpeed's alias is ours too
    leftover -= {p for p in hf if p.startswith("zero_optimization.stage3_max_")}  # not HF's table
    assert not leftover


def test_the_oracle_cases_cover_the_whole_table(tmp_path):
    filled = set()
    for _, config, *_ in CASES:
        filled |= {p for p, v in _flat(config).items() if v == "auto"}
    assert set(TABLE_KEYS) - {"bf16.enabled"} <= filled  # bf16 "auto" is under bfloat16 once
    assert "bf16.enabled" in {p for _, c, *_ in CASES for p in _flat(c)}
    # the names infinity's table takes from TrainingArguments are fields of it
    assert set(TRAINING_ARGUMENTS) <= set(vars(_args(tmp_path)))


def test_hidden_sizes_read_from_hf_models_match_hfs():
    for make_model, h in ((gpt2, 40), (t5, 32), (resnet, 24), (llava, 24)):
        cfg = load_config(TEACHER, model=make_model())
        assert cfg.zero_optimization.reduce_bucket_size == h * h, make_model.__name__
        assert cfg.zero_optimization.stage3_prefetch_bucket_size == int(0.9 * h * h)
        assert cfg.zero_optimization.stage3_param_persistence_threshold == 10 * h


def _hf_mismatched_keys(message):
    return set(re.findall(r"^- ds ([\w.]+)=", message, flags=re.M))


@pytest.mark.parametrize("case", MISMATCHES, ids=[c[0] for c in MISMATCHES])
def test_load_config_refuses_what_hf_refuses_naming_the_same_keys(case, tmp_path):
    _, config, kwargs = case
    args = _args(tmp_path, **kwargs)
    with pytest.raises(ValueError, match="mismatch TrainingArguments") as hf_error:
        hf_fill(config, args, 50, plain())
    keys = _hf_mismatched_keys(str(hf_error.value))
    assert keys
    with pytest.raises(ConfigError) as ours:
        load_config(config, **training_arguments_values(args, num_training_steps=50))
    for key in keys:
        assert key in str(ours.value), key
