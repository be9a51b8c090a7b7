"""Every source of an "auto" value, and every way an argument can fail to fit the config."""

import logging
from types import SimpleNamespace

import pytest
import torch

from infinity.config import ConfigError, describe_config, load_config


def _adam_auto():
    return {
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
    }


def test_argument_fills_auto():
    cfg = load_config(_adam_auto(), lr=0.01, betas=[0.8, 0.9], eps=1e-7, weight_decay=0.05)
    p = cfg.optimizer.params
    assert (p.lr, p.betas, p.eps, p.weight_decay) == (0.01, (0.8, 0.9), 1e-7, 0.05)
    assert dict(cfg.auto_filled)["optimizer.params.betas"] == "betas="


def test_passed_optimizer_fills_auto_from_its_first_param_group():
    w = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW(
        [{"params": [w], "lr": 0.02}, {"params": [b], "lr": 0.5, "weight_decay": 0.0}],
        betas=(0.85, 0.95),
        eps=1e-6,
        weight_decay=0.3,
    )
    cfg = load_config(_adam_auto(), optimizer=opt)
    p = cfg.optimizer.params
    assert (p.lr, p.betas, p.eps, p.weight_decay) == (0.02, (0.85, 0.95), 1e-6, 0.3)
    assert dict(cfg.auto_filled)["optimizer.params.lr"] == "the optimizer passed in"


def test_tensor_lr_of_a_passed_optimizer_is_read_as_a_number():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.003))
    cfg = load_config(_adam_auto(), optimizer=opt)
    assert cfg.optimizer.params.lr == pytest.approx(0.003)


def test_argument_wins_over_passed_optimizer():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.02)
    cfg = load_config(_adam_auto(), optimizer=opt, lr=0.07)
    assert cfg.optimizer.params.lr == 0.07
    assert cfg.optimizer.params.eps == opt.defaults["eps"]


def test_defaults_where_deepspeed_has_them():
    raw = _adam_auto()
    raw.update(
        gradient_clipping="auto",
        fp16={"enabled": "auto", "loss_scale_window": "auto"},
        bf16={"enabled": "auto"},
        zero_optimization={
            "stage": 3,
            "reduce_bucket_size": "auto",
            "sub_group_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "overlap_comm": "auto",
            "offload_param": "auto",
        },
        aio={"queue_depth": "auto", "intra_op_parallelism": "auto"},
        steps_per_print="auto",
        scheduler={
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": 100, "cos_min_ratio": "auto"},
        },
    )
    cfg = load_config(raw, lr=1e-3)
    p = cfg.optimizer.params
    assert (p.betas, p.eps, p.weight_decay) == ((0.9, 0.999), 1e-8, 0.0)
    assert cfg.gradient_clipping == 0.0 and cfg.steps_per_print is None
    assert (
        cfg.fp16.enabled is False
        and cfg.fp16.loss_scale_window == 1000
        and cfg.bf16.enabled is False
    )
    z = cfg.zero_optimization
    assert (z.reduce_bucket_size, z.sub_group_size, z.stage3_prefetch_bucket_size) == (
        500_000_000,
        1_000_000_000,
        50_000_000,
    )
    assert z.overlap_comm is True  # DeepSpeed: on at stage 3
    assert z.offload_param.device == "none"
    assert cfg.aio.queue_depth == 32 and cfg.aio.thread_count == 1
    assert cfg.scheduler.params.cos_min_ratio == 0.0001
    sources = dict(cfg.auto_filled)
    assert (
        sources["optimizer.params.weight_decay"]
        == "default (0.0; torch's 0.01 for AdamW with torch_adam)"
    )
    assert sources["zero_optimization.offload_param"] == "defaults"


def test_torch_adamw_weight_decay_default_is_torchs():
    cfg = load_config(
        {"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "weight_decay": "auto"}}}
    )
    assert cfg.optimizer.params.weight_decay == 0.01
    cfg = load_config(
        {"optimizer": {"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}}
    )
    assert cfg.optimizer.params.weight_decay == 0.0 and not cfg.optimizer.adamw_mode


def test_lr_auto_with_nothing_to_fill_it_is_refused_naming_the_key():
    with pytest.raises(
        ConfigError,
        match=r'^optimizer\.params\.lr is "auto" and no lr= was given to initialize\(\) \(nor an optimizer to read it from\); pass lr=\.\.\., or write a value in the config$',
    ):
        load_config(_adam_auto())


def test_total_num_steps_auto_is_refused():
    raw = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}
    with pytest.raises(
        ConfigError,
        match=r'scheduler\.params\.total_num_steps is "auto" and no total_num_steps= was given',
    ):
        load_config(raw)
    cfg = load_config(raw, total_num_steps=500)
    assert cfg.scheduler.params.total_num_steps == 500


def test_several_refusals_are_reported_together():
    raw = _adam_auto()
    raw["scheduler"] = {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}
    with pytest.raises(ConfigError) as e:
        load_config(raw)
    assert str(e.value).startswith("config problems:")
    assert "optimizer.params.lr" in str(e.value) and "scheduler.params.total_num_steps" in str(
        e.value
    )


def test_auto_argument_is_validated_naming_argument_and_key():
    with pytest.raises(
        ConfigError, match=r"^lr= \(for optimizer\.params\.lr\) must be a number >= 0; got -1$"
    ):
        load_config(_adam_auto(), lr=-1)


def test_hidden_size_derives_the_three_sizes_as_hf_does():
    raw = {
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        }
    }
    cfg = load_config(raw, hidden_size=4096)
    z = cfg.zero_optimization
    assert z.reduce_bucket_size == 4096 * 4096
    assert z.stage3_prefetch_bucket_size == int(0.9 * 4096 * 4096)
    assert z.stage3_param_persistence_threshold == 40960
    # a direct argument wins over the derived value
    cfg = load_config(raw, hidden_size=4096, reduce_bucket_size=7)
    assert cfg.zero_optimization.reduce_bucket_size == 7


def test_bf16_and_fp16_arguments_fill_enabled_including_the_bfloat16_alias():
    cfg = load_config({"bfloat16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}, bf16=True)
    assert cfg.bf16.enabled and not cfg.fp16.enabled
    cfg = load_config(
        {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}, bfloat16=False, fp16=True
    )
    assert cfg.fp16.enabled and not cfg.bf16.enabled


def test_a_precision_section_written_as_auto_takes_the_boolean_argument():
    cfg = load_config({"bf16": "auto", "fp16": "auto"}, bf16=True)
    assert cfg.bf16.enabled and not cfg.fp16.enabled
    assert dict(cfg.auto_filled)["bf16.enabled"] == "bf16="


def test_alias_argument_names_fill_the_canonical_key():
    cfg = load_config({"aio": {"intra_op_parallelism": "auto"}}, intra_op_parallelism=4)
    assert cfg.aio.thread_count == 4
    cfg = load_config(
        {"zero_optimization": {"stage3_prefetch_bucket_size": "auto"}}, prefetch_bucket_size=9
    )
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 9


def test_conflicting_alias_arguments_are_refused():
    with pytest.raises(
        ConfigError,
        match=r"bf16= and bfloat16= name the same setting and disagree \(True vs False\)",
    ):
        load_config({"bf16": {"enabled": "auto"}}, bf16=True, bfloat16=False)


def test_unknown_argument_is_a_type_error_naming_the_closest_name():
    with pytest.raises(
        TypeError,
        match=r"^unexpected keyword argument\(s\) learnig_rate= \(did you mean learning_rate=\?\), "
        r"warmup_num_step= \(did you mean warmup_num_steps=\?\), zzz=: keyword arguments fill",
    ):
        load_config(_adam_auto(), learnig_rate=1e-3, warmup_num_step=10, zzz=1)
    # TrainingArguments fields HF's table does not read: refused with the argument that is read
    with pytest.raises(
        TypeError,
        match=r"^unexpected keyword argument\(s\) max_steps= \(HF's table does not read it: pass "
        r"num_training_steps=",
    ):
        load_config(_adam_auto(), lr=1e-3, max_steps=100)
    with pytest.raises(
        TypeError, match=r"warmup_ratio= \(HF's table does not read it: pass warmup_steps="
    ):
        load_config(_adam_auto(), lr=1e-3, warmup_ratio=0.1)


def test_arguments_that_fill_nothing_are_ignored_with_one_info_line(caplog):
    caplog.set_level(logging.INFO, "infinity.config")
    # WarmupLR has no total_num_steps, there is no gradient_clipping key, reduce_bucket_size is
    # written (hidden_size= only fills "auto"): one script, many configs, as with HF's trainer
    raw = {
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 5},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    }
    cfg = load_config(raw, total_num_steps=1000, max_grad_norm=1.0, hidden_size=64)
    assert cfg.gradient_clipping == 0.0 and cfg.zero_optimization.reduce_bucket_size == 5
    lines = [r for r in caplog.records if "ignored" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert lines[0].getMessage() == (
        "arguments with nothing to fill in this config, ignored: "
        "max_grad_norm= (for gradient_clipping); "
        "hidden_size= (for zero_optimization.reduce_bucket_size, "
        "zero_optimization.stage3_prefetch_bucket_size, "
        "zero_optimization.stage3_param_persistence_threshold); "
        "total_num_steps= (for scheduler.params.total_num_steps)"
    )
    caplog.clear()
    load_config({"gradient_clipping": "auto"}, gradient_clipping=1.0)
    assert not [r for r in caplog.records if "ignored" in r.getMessage()]


def test_argument_agreeing_with_an_explicit_value_is_fine_and_disagreeing_is_refused():
    raw = {
        "gradient_clipping": 1.0,
        "optimizer": {"type": "adam", "params": {"lr": 1e-4, "betas": [0.9, 0.95]}},
    }
    cfg = load_config(raw, gradient_clipping=1, lr=0.0001, betas=(0.9, 0.95))
    assert cfg.gradient_clipping == 1.0
    with pytest.raises(
        ConfigError,
        match=r'^lr=0\.001 was given but the config sets optimizer\.params\.lr to 0\.0001; write "auto" there to take the argument, or drop the argument$',
    ):
        load_config(raw, lr=1e-3)


def test_warmup_max_lr_auto_follows_the_optimizer_lr():
    raw = {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}
    # nothing known: each param group's own lr when the scheduler is built
    cfg = load_config(raw)
    assert cfg.scheduler.params.warmup_max_lr is None
    # a passed optimizer with per-group lrs keeps them
    w, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [w], "lr": 0.1}, {"params": [b], "lr": 0.2}])
    assert load_config(raw, optimizer=opt).scheduler.params.warmup_max_lr == (0.1, 0.2)
    opt1 = torch.optim.SGD([w], lr=0.3)
    assert load_config(raw, optimizer=opt1).scheduler.params.warmup_max_lr == 0.3
    # the config's optimizer lr (HF's rule), explicit or filled
    raw["optimizer"] = {"type": "AdamW", "params": {"lr": "auto"}}
    assert load_config(raw, lr=0.004).scheduler.params.warmup_max_lr == 0.004
    # and its own argument first
    assert load_config(raw, lr=0.004, warmup_max_lr=0.002).scheduler.params.warmup_max_lr == 0.002


def test_nvme_path_argument_is_the_engines_fallback(tmp_path):
    raw = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme"},
            "offload_optimizer": {"device": "nvme", "nvme_path": "auto"},
        }
    }
    cfg = load_config(raw, nvme_path=tmp_path)
    assert cfg.zero_optimization.offload_param.nvme_path == str(tmp_path)
    assert cfg.zero_optimization.offload_optimizer.nvme_path == str(tmp_path)
    # passing it where no section uses nvme is not an error
    assert load_config({}, nvme_path=tmp_path).zero_optimization.offload_param.nvme_path is None
    # a list of folders, one per drive, fills it as the config's own list would
    cfg = load_config(raw, nvme_path=[tmp_path / "d0", tmp_path / "d1"])
    assert cfg.zero_optimization.offload_param.nvme_path == (
        str(tmp_path / "d0"),
        str(tmp_path / "d1"),
    )
    with pytest.raises(
        ConfigError,
        match=r"^nvme_path= \(for zero_optimization\.offload_optimizer\.nvme_path\) must be a "
        r"non-empty string or a list of non-empty strings or null; got \[\]$",
    ):
        load_config(raw, nvme_path=[])


def test_preflight_argument_fills_a_missing_key_and_must_agree_with_an_explicit_one():
    assert load_config({}, preflight=False).preflight is False
    assert load_config({"preflight": "auto"}, preflight=False).preflight is False
    assert load_config({"preflight": False}).preflight is False
    with pytest.raises(
        ConfigError, match="preflight=True was given but the config sets preflight to False"
    ):
        load_config({"preflight": False}, preflight=True)


def test_batch_arguments_fill_auto_batch_keys():
    raw = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
    }
    cfg = load_config(
        raw, train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=4, world_size=2
    )
    assert cfg.train_batch_size == 64
    cfg = load_config(raw, train_batch_size=64, world_size=4)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 1)


def test_non_optimizer_is_refused():
    with pytest.raises(ConfigError, match="optimizer= must be a torch.optim.Optimizer; got dict"):
        load_config(_adam_auto(), optimizer={"lr": 1})


def test_stage_auto_with_nothing_to_fill_it_is_refused_naming_the_key():
    # It used to take the default, 0: a run with nothing partitioned or offloaded.
    with pytest.raises(
        ConfigError,
        match=r'^zero_optimization\.stage is "auto" and no stage= was given to initialize\(\); '
        r"pass stage=\.\.\., or write one of 0, 1, 2, 3 in the config$",
    ):
        load_config({"zero_optimization": {"stage": "auto", "offload_param": {"device": "cpu"}}})
    # as in Accelerate, whose plugin fills zero_optimization.stage from its zero_stage
    cfg = load_config({"zero_optimization": {"stage": "auto"}}, stage=3)
    assert cfg.zero_optimization.stage == 3
    assert dict(cfg.auto_filled)["zero_optimization.stage"] == "stage="


def test_a_section_written_as_auto_needs_the_keys_that_have_no_auto_default():
    with pytest.raises(
        ConfigError, match=r'^zero_optimization\.stage is "auto" and no stage= was given'
    ):
        load_config({"zero_optimization": "auto"})
    assert load_config({"zero_optimization": "auto"}, stage=2).zero_optimization.stage == 2
    with pytest.raises(ConfigError, match=r'^optimizer\.params\.lr is "auto" and no lr= was given'):
        load_config({"optimizer": "auto"})
    cfg = load_config({"optimizer": "auto"}, lr=0.01)
    assert (cfg.optimizer.type, cfg.optimizer.params.lr) == ("adamw", 0.01)
    # sections with a default for every key still take their defaults
    assert (
        load_config(
            {"zero_optimization": {"stage": 3, "offload_param": "auto"}}
        ).zero_optimization.offload_param.device
        == "none"
    )


# -- HF's table (infinity/config/arguments.py); the oracle test is test_config_hf.py ----------


def test_hf_names_fill_what_infinitys_names_fill():
    raw = {
        **_adam_auto(),
        "gradient_clipping": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"},
        },
    }
    hf = load_config(
        raw,
        learning_rate=0.01,
        adam_beta1=0.8,
        adam_beta2=0.9,
        adam_epsilon=1e-7,
        weight_decay=0.05,
        max_grad_norm=0.5,
        per_device_train_batch_size=4,
        num_training_steps=100,
        warmup_steps=10,
    )
    ours = load_config(
        raw,
        lr=0.01,
        betas=(0.8, 0.9),
        eps=1e-7,
        weight_decay=0.05,
        gradient_clipping=0.5,
        train_micro_batch_size_per_gpu=4,
        total_num_steps=100,
        warmup_num_steps=10,
    )
    assert hf == ours
    assert hf.optimizer.params.lr == 0.01 and hf.scheduler.params.total_num_steps == 100
    sources = dict(hf.auto_filled)
    assert sources["optimizer.params.lr"] == "learning_rate="
    assert sources["optimizer.params.betas"] == "adam_beta1+adam_beta2="
    assert sources["gradient_clipping"] == "max_grad_norm="


def test_one_beta_pairs_with_training_arguments_default_for_the_other():
    assert load_config(_adam_auto(), lr=1, adam_beta1=0.8).optimizer.params.betas == (0.8, 0.999)
    assert load_config(_adam_auto(), lr=1, adam_beta2=0.95).optimizer.params.betas == (0.9, 0.95)
    cfg = load_config(_adam_auto(), lr=1, betas=[0.8, 0.95], adam_beta1=0.8, adam_beta2=0.95)
    assert cfg.optimizer.params.betas == (0.8, 0.95)
    with pytest.raises(
        ConfigError,
        match=r"^betas= and adam_beta1= name the same setting and disagree "
        r"\(\(0\.8, 0\.95\) vs \(0\.8, 0\.999\)\); pass one$",
    ):
        load_config(_adam_auto(), lr=1, betas=(0.8, 0.95), adam_beta1=0.8)


def test_two_names_for_one_setting_must_agree():
    with pytest.raises(
        ConfigError,
        match=r"^lr= and learning_rate= name the same setting and disagree \(0\.1 vs 0\.2\); pass one$",
    ):
        load_config(_adam_auto(), lr=0.1, learning_rate=0.2)
    assert load_config(_adam_auto(), lr=0.1, learning_rate=0.1).optimizer.params.lr == 0.1


def test_full_eval_flags_are_ored_into_the_precision_as_hf_does():
    raw = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}
    cfg = load_config(raw, fp16=False, fp16_full_eval=True, bf16=False, bf16_full_eval=False)
    assert cfg.fp16.enabled and not cfg.bf16.enabled
    assert dict(cfg.auto_filled)["fp16.enabled"] == "fp16|fp16_full_eval="
    with pytest.raises(
        ConfigError,
        match=r"^bf16_full_eval=True was given but the config sets bf16\.enabled to False; ",
    ):
        load_config({"bf16": {"enabled": False}}, bf16_full_eval=True)


def _warmup(kind="WarmupLR", **params):
    return {"scheduler": {"type": kind, "params": {"warmup_num_steps": "auto", **params}}}


@pytest.mark.parametrize(
    "raw,kwargs,steps",
    [
        (_warmup(), {"warmup_steps": 10}, 10),
        (_warmup(), {"warmup_steps": 10.7}, 10),  # int(), TrainingArguments.get_warmup_steps
        (_warmup(), {"warmup_steps": 0}, 1),  # at least 1, trainer_config_finalize
        (_warmup(), {"warmup_num_steps": 0}, 1),  # one argument, two names, one rule
        # a fraction below 1 is of the training steps, rounded up: ceil(0.1 x 95)
        (
            _warmup("WarmupDecayLR", total_num_steps="auto"),
            {"warmup_steps": 0.1, "num_training_steps": 95},
            10,
        ),
        # ... or of the config's own total_num_steps
        (_warmup("WarmupDecayLR", total_num_steps=40), {"warmup_steps": 0.25}, 10),
    ],
)
def test_warmup_steps_follow_hfs_rule(raw, kwargs, steps):
    assert load_config(raw, **kwargs).scheduler.params.warmup_num_steps == steps


def test_warmup_steps_that_cannot_be_read_are_refused_naming_the_fix():
    with pytest.raises(
        ConfigError,
        match=r"^warmup_steps=0\.1 is a fraction of the training steps \(HF's rule for values below 1\) "
        r"and no num_training_steps= was given, nor a total_num_steps in the config: pass "
        r"num_training_steps=, or a whole number of warmup steps$",
    ):
        load_config(_warmup(), warmup_steps=0.1)
    with pytest.raises(
        ConfigError, match=r"^warmup_steps=-1 \(for scheduler\.params\.warmup_num_steps\) must be"
    ):
        load_config(_warmup(), warmup_steps=-1)
    # a written value is checked against the rule's result, and the message shows both
    raw = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1}}}
    assert load_config(raw, warmup_steps=0).scheduler.params.warmup_num_steps == 1
    with pytest.raises(
        ConfigError,
        match=r"^warmup_steps=0\.5 \(that is 5\) was given but the config sets "
        r"scheduler\.params\.warmup_num_steps to 1; ",
    ):
        load_config(raw, warmup_steps=0.5, num_training_steps=10)


def test_lr_fills_and_checks_warmup_max_lr_as_hfs_learning_rate_does():
    raw = {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.001}},
    }
    with pytest.raises(
        ConfigError,
        match=r"^learning_rate=0\.004 was given but the config sets scheduler\.params\.warmup_max_lr "
        r"to 0\.001; ",
    ):
        load_config(raw, learning_rate=0.004)
    assert load_config(raw, learning_rate=0.001).scheduler.params.warmup_max_lr == 0.001
    # the key's own argument is the one checked when both are given
    cfg = load_config(raw, learning_rate=0.004, warmup_max_lr=0.001)
    assert (cfg.optimizer.params.lr, cfg.scheduler.params.warmup_max_lr) == (0.004, 0.001)


def _zero(stage, **more):
    auto = dict.fromkeys(
        ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"),
        "auto",
    )
    return {"zero_optimization": {"stage": stage, **auto, **more}}


def _sizes(cfg):
    z = cfg.zero_optimization
    return (
        z.reduce_bucket_size,
        z.stage3_prefetch_bucket_size,
        z.stage3_param_persistence_threshold,
    )


def _with_config(**config):
    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(**config)
    return model


def test_hidden_size_is_read_from_the_models_config_as_hf_reads_it():
    cfg = load_config(_zero(3), model=_with_config(hidden_size=64))
    assert _sizes(cfg) == (64 * 64, int(0.9 * 64 * 64), 640)
    assert dict(cfg.auto_filled)["zero_optimization.reduce_bucket_size"] == (
        "model.config.hidden_size=64"
    )
    # the largest of hidden_sizes; then text_config's
    assert _sizes(load_config(_zero(3), model=_with_config(hidden_sizes=[8, 32, 16])))[0] == 1024
    text = _with_config(text_config=SimpleNamespace(hidden_size=16))
    cfg = load_config(_zero(3), model=text)
    assert _sizes(cfg)[0] == 256
    assert dict(cfg.auto_filled)["zero_optimization.reduce_bucket_size"] == (
        "model.config.text_config.hidden_size=16"
    )
    # hidden_size= wins over the model
    assert _sizes(load_config(_zero(3), model=_with_config(hidden_size=64), hidden_size=8))[0] == 64
    # no hidden size (HF reads d_model only through a config's attribute_map): DeepSpeed's defaults
    defaults = (500_000_000, 50_000_000, 100_000)
    assert _sizes(load_config(_zero(3), model=_with_config(d_model=32))) == defaults
    assert _sizes(load_config(_zero(3), model=torch.nn.Linear(2, 2))) == defaults
    with pytest.raises(
        ConfigError, match=r"^model\.config\.hidden_size must be an integer >= 1; got 'big'$"
    ):
        load_config(_zero(3), model=_with_config(hidden_size="big"))


def test_below_stage_3_only_reduce_bucket_size_follows_the_hidden_size():
    # HF fills the two stage3_* sizes at stage 3 only; below it they do nothing: defaults here
    assert _sizes(load_config(_zero(2), hidden_size=64)) == (4096, 50_000_000, 100_000)
    # a stage filled by its argument counts
    assert _sizes(load_config(_zero("auto"), stage=3, hidden_size=64)) == (4096, 3686, 640)


def test_lr_without_an_optimizer_section_writes_hf_trainers_default_adamw():
    cfg = load_config({"zero_optimization": {"stage": 2}}, learning_rate=3e-4)
    o = cfg.optimizer
    assert o.type == "adamw" and o.hf_trainer_default
    assert (o.params.lr, o.params.betas, o.params.eps, o.params.weight_decay) == (
        3e-4,
        (0.9, 0.999),
        1e-8,
        0.0,
    )
    sources = dict(cfg.auto_filled)
    assert sources["optimizer.params.lr"] == "learning_rate="
    assert sources["optimizer.params.eps"] == "TrainingArguments' default 1e-08"
    assert sources["optimizer"].startswith("no optimizer section and none passed: AdamW")
    assert "(HF Trainer's default: none on biases and norm weights)" in describe_config(cfg)
    cfg = load_config({}, lr=1e-3, adam_beta2=0.95, eps=1e-6, weight_decay=0.1)
    p = cfg.optimizer.params
    assert (p.lr, p.betas, p.eps, p.weight_decay) == (1e-3, (0.9, 0.95), 1e-6, 0.1)
    # the config loaded again (another world size: to_dict writes no bookkeeping) keeps it
    again = load_config(cfg, world_size=2)
    assert again.optimizer == cfg.optimizer and again.optimizer.hf_trainer_default
    # arguments are checked like any other
    with pytest.raises(
        ConfigError, match=r"^lr= \(for optimizer\.params\.lr\) must be a number >= 0; got -1$"
    ):
        load_config({}, lr=-1)


def test_no_default_optimizer_with_a_section_an_optimizer_passed_or_no_lr():
    cfg = load_config({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, lr=1e-3)
    assert not cfg.optimizer.hf_trainer_default
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert load_config({}, optimizer=opt, lr=1e-3).optimizer is None
    assert load_config({}, weight_decay=0.1).optimizer is None


def test_batch_arguments_enter_the_arithmetic_where_the_config_has_train_batch_size():
    # HF: train_batch_size = world x per_device_train_batch_size x accumulation, keys or not
    raw = {"train_batch_size": "auto", "gradient_accumulation_steps": "auto"}
    cfg = load_config(
        raw, per_device_train_batch_size=8, gradient_accumulation_steps=4, world_size=2
    )
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (64, 8)
    assert dict(cfg.auto_filled)["train_micro_batch_size_per_gpu"] == "per_device_train_batch_size="
    with pytest.raises(
        ConfigError,
        match=r"^train_batch_size \(32\) must equal train_micro_batch_size_per_gpu x "
        r"gradient_accumulation_steps x world_size = 8 x 1 x 1 = 8$",
    ):
        load_config(
            {"train_batch_size": 32}, per_device_train_batch_size=8, gradient_accumulation_steps=1
        )
    # without train_batch_size in the config the arguments fill only the keys there are
    cfg = load_config({"gradient_accumulation_steps": 2}, per_device_train_batch_size=8)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.train_batch_size) == (1, 2)
