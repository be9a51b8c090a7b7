"""Every source of an "auto" value, and every way an argument can fail to fit the config."""

import pytest
import torch

from infinity.config import ConfigError, load_config


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


def test_unknown_argument_is_refused_with_a_suggestion():
    with pytest.raises(
        ConfigError,
        match=r"^unknown argument\(s\) learning_rate= \(did you mean lr=\?\), warmup_num_step= "
        r"\(did you mean warmup_num_steps=\?\), zzz=: arguments fill",
    ):
        load_config(_adam_auto(), learning_rate=1e-3, warmup_num_step=10, zzz=1)


def test_argument_that_fills_nothing_is_refused():
    # WarmupLR has no total_num_steps: a caller expecting a decay must hear about it
    raw = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    with pytest.raises(
        ConfigError,
        match=r"^total_num_steps= fills nothing: scheduler\.params\.total_num_steps is not in this config",
    ):
        load_config(raw, total_num_steps=1000)
    with pytest.raises(
        ConfigError,
        match=r"^gradient_clipping= fills nothing: gradient_clipping is not in this config; "
        r'write "auto" there to take the value from the argument, or drop the argument$',
    ):
        load_config({}, gradient_clipping=1.0)
    with pytest.raises(
        ConfigError,
        match=r'^hidden_size= fills nothing: none of zero_optimization\.reduce_bucket_size, .* is "auto" here',
    ):
        load_config({"zero_optimization": {"reduce_bucket_size": 5}}, hidden_size=64)


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
    assert cfg.zero_optimization.offload_param.nvme_path == (str(tmp_path / "d0"), str(tmp_path / "d1"))
    with pytest.raises(ConfigError, match=r"^nvme_path= \(for zero_optimization\.offload_optimizer\.nvme_path\) must be a "
                       r"non-empty string or a list of non-empty strings or null; got \[\]$"):
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
