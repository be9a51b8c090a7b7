"""Unknown keys: one warning listing all, with suggestions. Known keys without effect: one log per process."""

import logging
import warnings

import pytest

from infinity.config import (
    NOT_ACTED_ON,
    OPAQUE,
    ConfigError,
    InfinityConfigWarning,
    acted_on,
    load_config,
)
from infinity.config.schema import alias_paths, known_paths

TYPOS = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clip": 1.0,  # typo of gradient_clipping
    "tensorbaord": {"enabled": True},  # typo of an opaque section
    "stage3_prefetch_bucket_size": 10,  # right key, wrong place
    "zero_optimization": {
        "stage": 3,
        "stage3_max_live_parameter": 5,  # missing s
        "offload_param": {"device": "cpu", "pin_memroy": True},
        "frobnicate": 1,  # nothing like it
    },
    "aio": {"num_threads": 4},  # what ds_nvme_tune writes
}


def test_one_warning_lists_every_unknown_key_with_suggestions():
    with pytest.warns(InfinityConfigWarning) as record:
        cfg = load_config(TYPOS)
    assert len(record) == 1
    msg = str(record[0].message)
    assert msg.startswith("7 unknown key(s) in the config, ignored: ")
    for expected in (
        "gradient_clip (did you mean gradient_clipping?)",
        "tensorbaord (did you mean tensorboard?)",
        "stage3_prefetch_bucket_size (did you mean zero_optimization.stage3_prefetch_bucket_size?)",
        "zero_optimization.stage3_max_live_parameter (did you mean zero_optimization.stage3_max_live_parameters?)",
        "zero_optimization.offload_param.pin_memroy (did you mean zero_optimization.offload_param.pin_memory?)",
        "aio.num_threads (did you mean aio.thread_count (DeepSpeed's ds_nvme_tune writes num_threads",
    ):
        assert expected in msg
    assert "zero_optimization.frobnicate" in msg and "zero_optimization.frobnicate (" not in msg
    assert record[0].filename == __file__  # points at the caller of load_config
    # the unknown keys are ignored: their defaults stand
    assert cfg.gradient_clipping == 0.0
    assert cfg.zero_optimization.stage3_max_live_parameters == 1_000_000_000
    assert cfg.zero_optimization.offload_param.pin_memory is True
    assert cfg.aio.thread_count == 1
    assert set(cfg.unknown_keys) == {
        "gradient_clip",
        "tensorbaord",
        "stage3_prefetch_bucket_size",
        "zero_optimization.stage3_max_live_parameter",
        "zero_optimization.offload_param.pin_memroy",
        "zero_optimization.frobnicate",
        "aio.num_threads",
    }


def test_no_warning_without_unknown_keys():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({"zero_optimization": {"stage": 2}, "tensorboard": {"enabled": False}})


def test_unknown_scheduler_param_is_a_typo_warning_and_another_schedules_param_an_error():
    raw = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}}
    with pytest.warns(
        InfinityConfigWarning,
        match=r"scheduler\.params\.warmup_num_step \(did you mean scheduler\.params\.warmup_num_steps\?\)",
    ):
        load_config(raw)
    raw = {"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}}
    with pytest.raises(
        ConfigError,
        match=r"^scheduler\.params\.total_num_steps is not a parameter of WarmupLR \(it takes last_batch_iteration, "
        r"warmup_max_lr, warmup_min_lr, warmup_num_steps, warmup_type\); WarmupDecayLR, WarmupCosineLR take it$",
    ):
        load_config(raw)


def test_not_acted_on_keys_are_logged_once_per_process(caplog):
    caplog.set_level(logging.WARNING, "infinity.config")
    raw = {
        "wall_clock_breakdown": True,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "round_robin_gradients": True},
        "tensorboard": {"enabled": True},
        "aio": {"use_gds": False},
    }
    cfg = load_config(raw)
    messages = [r.getMessage() for r in caplog.records if r.name == "infinity.config"]
    assert messages == [
        "these DeepSpeed config keys are accepted but have no effect in infinity: aio.use_gds, "
        "tensorboard, wall_clock_breakdown, zero_optimization.overlap_comm, zero_optimization.round_robin_gradients"
    ]
    assert cfg.ignored_keys() == [
        "aio.use_gds",
        "tensorboard",
        "wall_clock_breakdown",
        "zero_optimization.overlap_comm",
        "zero_optimization.round_robin_gradients",
    ]
    caplog.clear()
    load_config(raw)
    assert [r for r in caplog.records if r.name == "infinity.config"] == []
    # a key not reported before is reported on its own
    load_config(
        {
            "zero_optimization": {"stage": 1, "contiguous_gradients": False},
            "wall_clock_breakdown": True,
        }
    )
    assert [r.getMessage() for r in caplog.records if r.name == "infinity.config"] == [
        "these DeepSpeed config keys are accepted but have no effect in infinity: zero_optimization.contiguous_gradients"
    ]


def test_acted_on_keys_are_not_reported(caplog):
    caplog.set_level(logging.WARNING, "infinity.config")
    load_config(
        {
            "zero_optimization": {
                "stage": 3,
                "sub_group_size": 1e8,
                "stage3_max_live_parameters": 1e8,
            },
            "gradient_clipping": 1.0,
            "steps_per_print": 10,
            "preflight": False,
        }
    )
    assert [r for r in caplog.records if r.name == "infinity.config"] == []


def test_the_classification_table_names_only_known_keys():
    known = set(known_paths())
    assert NOT_ACTED_ON <= known, sorted(NOT_ACTED_ON - known)
    assert not (OPAQUE & known)
    assert acted_on("zero_optimization.stage3_prefetch_bucket_size")
    assert acted_on("zero_optimization.offload_optimizer.pipeline_read")
    assert acted_on("zero_optimization.offload_param.max_in_cpu")
    assert acted_on("steps_per_print") and acted_on("preflight") and acted_on("gradient_clipping")
    assert not acted_on("zero_optimization.overlap_comm")
    assert not acted_on("zero_optimization.offload_optimizer.ratio")
    assert not acted_on("aio.use_gds") and not acted_on("tensorboard")


def test_aliases_point_at_known_keys():
    aliases = alias_paths()
    assert aliases["bfloat16"] == "bf16"
    assert aliases["aio.intra_op_parallelism"] == "aio.thread_count"
    assert aliases["zero_optimization.stage3_gather_fp16_weights_on_model_save"] == (
        "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    )
    assert set(aliases.values()) <= set(known_paths())


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"bf16": {"enabled": True}, "bfloat16": {"enabled": False}},
            r"^bf16 and bfloat16 are the same setting and disagree \(\{'enabled': True\} vs \{'enabled': False\}\); keep one$",
        ),
        (
            {"aio": {"thread_count": 2, "intra_op_parallelism": 4}},
            r"^aio\.thread_count and aio\.intra_op_parallelism are the same setting and disagree \(2 vs 4\); keep one$",
        ),
        (
            {
                "zero_optimization": {
                    "stage3_gather_16bit_weights_on_model_save": True,
                    "stage3_gather_fp16_weights_on_model_save": False,
                }
            },
            r"^zero_optimization\.stage3_gather_16bit_weights_on_model_save and "
            r"zero_optimization\.stage3_gather_fp16_weights_on_model_save are the same setting and disagree",
        ),
    ],
)
def test_two_spellings_that_disagree_are_refused(raw, message):
    with pytest.raises(ConfigError, match=message):
        load_config(raw)


def test_two_spellings_that_agree_are_fine():
    cfg = load_config(
        {
            "bf16": {"enabled": True},
            "bfloat16": {"enabled": True},
            "zero_optimization": {"prefetch_bucket_size": 7, "stage3_prefetch_bucket_size": 7},
        }
    )
    assert cfg.bf16.enabled and cfg.zero_optimization.stage3_prefetch_bucket_size == 7


def test_deepspeed_legacy_forms_are_translated():
    assert load_config({"zero_optimization": True}).zero_optimization.stage == 1
    assert load_config({"zero_optimization": False}).zero_optimization.stage == 0
    cfg = load_config(
        {"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True}}
    )
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_param.device == "cpu"
    with pytest.raises(
        ConfigError,
        match=r"zero_optimization\.cpu_offload \(deprecated\) and zero_optimization\.offload_optimizer are both set",
    ):
        load_config(
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu"},
                    "cpu_offload": True,
                }
            }
        )
