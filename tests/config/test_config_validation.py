"""Every validation error, asserted by its message: key path, value, what is accepted."""

import pytest

from infinity.config import (
    ConfigError,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
    describe_config,
    load_config,
)

NVME = "/tmp/nvme-swap"

CASES = [
    (
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        r"^fp16\.enabled and bf16\.enabled are both true; enable one of them \(or neither, for fp32\)$",
    ),
    (
        {"zero_optimization": {"stage": 4}},
        r"^zero_optimization\.stage must be one of 0, 1, 2, 3; got 4$",
    ),
    (
        {"zero_optimization": {"stage": "3"}},
        r"^zero_optimization\.stage must be one of 0, 1, 2, 3; got '3'$",
    ),
    (
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        r'^zero_optimization\.offload_param\.device is "cpu" but zero_optimization\.stage is 2; parameter offload '
        r'needs stage 3 \(as in DeepSpeed\): set "stage": 3, or "offload_param": \{"device": "none"\}$',
    ),
    (
        {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
        r'^zero_optimization\.offload_optimizer\.device is "cpu" but zero_optimization\.stage is 0, which neither '
        r'partitions nor offloads the optimizer: set "stage" to 1, 2 or 3',
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
        r"^zero_optimization\.offload_param\.nvme_path is required when zero_optimization\.offload_param\.device is "
        r'"nvme": a folder on a fast local disk for the swap files; set it in the config, or pass nvme_path= ',
    ),
    (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
        r"^zero_optimization\.offload_optimizer\.nvme_path is required when",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": []}}},
        r"^zero_optimization\.offload_param\.nvme_path must be a non-empty string or a list of non-empty strings "
        r"or null; got \[\]$",
    ),
    (
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": ["/a", 3]},
            }
        },
        r"^zero_optimization\.offload_optimizer\.nvme_path must be a non-empty string or a list of non-empty "
        r"strings or null; got \['/a', 3\]$",
    ),
    (
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": ["/a", "/b/../a"]},
            }
        },
        r"^zero_optimization\.offload_optimizer\.nvme_path lists the same folder twice: '/a' and '/b/\.\./a' are "
        r"both /a; list each drive's folder once \(the swap space is striped over the folders listed, one per drive\)$",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}},
        r"^zero_optimization\.offload_param\.device must be one of 'none', 'cpu', 'nvme', 'auto'; got 'disk'$",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 0}}},
        r"^zero_optimization\.offload_param\.buffer_count must be an integer >= 1; got 0$",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"buffer_size": 1.5}}},
        r"^zero_optimization\.offload_param\.buffer_size must be an integer >= 1; got 1\.5$",
    ),
    (
        {"zero_optimization": {"sub_group_size": "1e9"}},
        r"^zero_optimization\.sub_group_size must be an integer >= 1; got '1e9'$",
    ),
    (
        {"zero_optimization": {"stage3_prefetch_bucket_size": -1}},
        r"^zero_optimization\.stage3_prefetch_bucket_size must be an integer >= 0; got -1$",
    ),
    (
        {
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "pin_memory": "yes"},
            }
        },
        r"^zero_optimization\.offload_optimizer\.pin_memory must be true or false; got 'yes'$",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 1.5}}},
        r"^zero_optimization\.offload_optimizer\.ratio must be a number in \[0, 1\]; got 1\.5$",
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}},
        r"^optimizer\.params\.betas must be a list of 2 numbers in \[0, 1\); got \[0\.9\]$",
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}},
        r"^optimizer\.params\.betas must be a list of 2 numbers in \[0, 1\); got \[0\.9, 1\.0\]$",
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"lr": -0.1}}},
        r"^optimizer\.params\.lr must be a number >= 0; got -0\.1$",
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"eps": True}}},
        r"^optimizer\.params\.eps must be a number >= 0; got True$",
    ),
    (
        {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}},
        r"^optimizer\.type 'Lamb' is a DeepSpeed optimizer infinity does not implement; supported: Adam, AdamW "
        r"\(any case\)\. Or pass your own torch optimizer to initialize\(optimizer=\.\.\.\)",
    ),
    (
        {"optimizer": {"type": "SGD", "params": {"lr": 1e-3}}},
        r"^optimizer\.type 'SGD' is not an optimizer infinity knows; supported: Adam, AdamW",
    ),
    (
        {"optimizer": {"params": {"lr": 1e-3}}},
        r'^optimizer\.type is missing; DeepSpeed ignores an optimizer section without one: set "type": "AdamW"',
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}},
        r"^optimizer\.params\.max_grad_norm is not supported as an optimizer parameter \(DeepSpeed refuses it too\): "
        r'use the top-level "gradient_clipping" instead$',
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}},
        r"^optimizer\.params\.amsgrad is true; infinity's Adam has no AMSGrad variant",
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"bias_correction": False}}},
        r"^optimizer\.params\.bias_correction is false; infinity's Adam always applies bias correction",
    ),
    (
        {"scheduler": {"type": "OneCycle", "params": {}}},
        r"^scheduler\.type 'OneCycle' is a DeepSpeed schedule infinity does not implement; supported: WarmupLR, "
        r"WarmupDecayLR, WarmupCosineLR\. Or pass your own scheduler to initialize\(lr_scheduler=\.\.\.\)",
    ),
    (
        {"scheduler": {"type": "warmuplr", "params": {}}},
        r"^scheduler\.type 'warmuplr' is not a schedule infinity knows \(names are case-sensitive, as in DeepSpeed\); "
        r"supported: WarmupLR, WarmupDecayLR, WarmupCosineLR",
    ),
    (
        {"scheduler": {"params": {"warmup_num_steps": 5}}},
        r"^scheduler\.type is missing; DeepSpeed ignores a scheduler section without one",
    ),
    (
        {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}},
        r"^scheduler\.params\.total_num_steps is required for WarmupDecayLR and has no default; set it, or write "
        r'"auto" and pass total_num_steps=$',
    ),
    (
        {"scheduler": {"type": "WarmupCosineLR"}},
        r"^scheduler\.params\.total_num_steps is required for WarmupCosineLR and has no default",
    ),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
        r"^scheduler\.params\.warmup_type must be one of 'log', 'linear'; got 'cosine'$",
    ),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
        r"^scheduler\.params\.warmup_num_steps must be an integer >= 1; got 0$",
    ),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": [0.1, -1]}}},
        r"^scheduler\.params\.warmup_min_lr must be a number >= 0 or a list of numbers >= 0 \(one per param group\); "
        r"got \[0\.1, -1\]$",
    ),
    (
        {
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {"total_num_steps": 10, "cos_min_ratio": 2},
            }
        },
        r"^scheduler\.params\.cos_min_ratio must be a number in \[0, 1\]; got 2$",
    ),
    (
        {"fp16": {"enabled": True, "loss_scale": -1}},
        r"^fp16\.loss_scale must be a number >= 0; got -1$",
    ),
    (
        {"fp16": {"enabled": True, "loss_scale": float("inf")}},
        r"^fp16\.loss_scale must be a number >= 0; got inf$",
    ),
    (
        {"fp16": {"enabled": True, "hysteresis": 0}},
        r"^fp16\.hysteresis must be an integer >= 1; got 0$",
    ),
    (
        {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
        r"^fp16\.fp16_master_weights_and_grads is true but zero_optimization\.stage is 0; it needs stage 1, 2 or 3 "
        r"\(as in DeepSpeed\)$",
    ),
    (
        {
            "zero_optimization": {"stage": 1},
            "bf16": {"enabled": True, "bf16_optimizer_states": True},
        },
        r"^bf16\.bf16_optimizer_states needs bf16\.bf16_master_weights_and_grads to be true \(as in DeepSpeed\)$",
    ),
    ({"gradient_clipping": -1.0}, r"^gradient_clipping must be a number >= 0; got -1\.0$"),
    ({"steps_per_print": 0}, r"^steps_per_print must be an integer >= 1 or null; got 0$"),
    (
        {"communication_data_type": "fp8"},
        r"^communication_data_type must be one of 'fp16', 'bf16', 'fp32' or null; got 'fp8'$",
    ),
    ({"preflight": "no"}, r"^preflight must be true or false; got 'no'$"),
    (
        {"aio": {"block_size": 5000}},
        r"^aio\.block_size must be a multiple of 4096 bytes \(O_DIRECT alignment\), got 5000$",
    ),
    ({"aio": {"queue_depth": 0}}, r"^aio\.queue_depth must be in \[1, 4096\], got 0$"),
    ({"fp16": True}, r"^fp16 must be a JSON object \{\.\.\.\}; got True$"),
    (
        {"zero_optimization": None},
        r"^zero_optimization must be a JSON object \{\.\.\.\}; got null$",
    ),
    (
        {"zero_optimization": {"offload_param": [1]}},
        r"^zero_optimization\.offload_param must be a JSON object \{\.\.\.\}; got \[1\]$",
    ),
]


@pytest.mark.parametrize(("raw", "message"), CASES, ids=[m[1:40] for _, m in CASES])
def test_refused_with_a_message_naming_key_value_and_fix(raw, message):
    with pytest.raises(ConfigError, match=message):
        load_config(raw)


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_config({"zero_optimization": {"stage": 5}})


def test_world_size_must_be_positive():
    with pytest.raises(ConfigError, match=r"^world_size must be an integer >= 1; got 0$"):
        load_config({}, world_size=0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_nvme_offload_is_accepted_at_stages_1_to_3(stage):
    # DeepSpeed refuses nvme below stage 3; infinity streams optimizer state at every ZeRO stage
    cfg = load_config(
        {
            "zero_optimization": {
                "stage": stage,
                "offload_optimizer": {"device": "nvme", "nvme_path": NVME},
            }
        }
    )
    assert cfg.zero_optimization.offload_optimizer.device == "nvme"


def test_values_are_coerced_to_their_types():
    cfg = load_config(
        {
            "zero_optimization": {
                "stage": 3.0,
                "sub_group_size": 1e9,
                "offload_param": {"device": "cpu", "pin_memory": "false"},
            },
            "optimizer": {"type": "ADAMW", "params": {"lr": 1, "betas": [0, 0.5]}},
            "communication_data_type": "FP32",
        }
    )
    z = cfg.zero_optimization
    assert z.stage == 3 and type(z.stage) is int
    assert z.sub_group_size == 10**9 and type(z.sub_group_size) is int
    assert z.offload_param.pin_memory is False
    assert cfg.optimizer.type == "adamw"
    assert cfg.optimizer.params.lr == 1.0 and type(cfg.optimizer.params.lr) is float
    assert cfg.optimizer.params.betas == (0.0, 0.5)
    assert cfg.communication_data_type == "fp32"


def test_sections_built_in_code_are_validated_too():
    with pytest.raises(
        ConfigError, match=r"^zero_optimization\.offload_param\.nvme_path is required"
    ):
        ZeroConfig(stage=3, offload_param=OffloadParamConfig(device="nvme"))
    with pytest.raises(
        ConfigError,
        match=r'^zero_optimization\.offload_optimizer\.buffer_count is "auto"; "auto" values',
    ):
        OffloadOptimizerConfig(buffer_count="auto")
    z = ZeroConfig(
        stage=3, offload_param=OffloadParamConfig(device="nvme", nvme_path=NVME), sub_group_size=1e8
    )
    assert z.sub_group_size == 100_000_000 and z.overlap_comm is True


def test_sections_are_frozen():
    cfg = load_config({})
    with pytest.raises(AttributeError):
        cfg.gradient_clipping = 1.0
    with pytest.raises(AttributeError):
        cfg.zero_optimization.stage = 3


def test_nvme_path_takes_a_list_of_folders_one_per_drive():
    raw = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": ["/d0", "~/d1"]},
            "offload_optimizer": {"device": "nvme", "nvme_path": "/d2"},
        }
    }
    cfg = load_config(raw)
    p, o = cfg.zero_optimization.offload_param, cfg.zero_optimization.offload_optimizer
    assert (
        p.nvme_path == ("/d0", "~/d1") and o.nvme_path == "/d2"
    )  # as written: "~" is the store's to expand
    assert cfg.to_dict()["zero_optimization"]["offload_param"]["nvme_path"] == ["/d0", "~/d1"]
    assert load_config(cfg.to_dict()) == cfg
    assert "params     nvme striped over 2 folders (/d0, ~/d1)" in describe_config(cfg)
    assert "optimizer  nvme at /d2" in describe_config(cfg)
