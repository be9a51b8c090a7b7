"""Unknown keys: one warning listing all, with suggestions. Known keys without effect: one log per process."""

import logging
import warnings

import pytest

from infinity.config import (
    NOT_ACTED_ON,
    OPAQUE,
    ConfigError,
    acted_on,
    describe_config,
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


def test_one_error_lists_every_unknown_key_with_suggestions():
    with pytest.raises(ConfigError) as e:
        load_config(TYPOS)
    msg = str(e.value)
    assert msg.startswith("7 unknown keys in the config: ")
    for expected in (
        "gradient_clip = 1.0 (did you mean gradient_clipping?)",
        "tensorbaord = {'enabled': True} (did you mean tensorboard?)",
        "stage3_prefetch_bucket_size = 10 (did you mean zero_optimization.stage3_prefetch_bucket_size?)",
        "zero_optimization.stage3_max_live_parameter = 5 (did you mean zero_optimization.stage3_max_live_parameters?)",
        "zero_optimization.offload_param.pin_memroy = True (did you mean zero_optimization.offload_param.pin_memory?)",
        "aio.num_threads = 4 (did you mean aio.thread_count (DeepSpeed's ds_nvme_tune writes num_threads",
    ):
        assert expected in msg
    assert msg.endswith(
        "refuses keys outside it, as DeepSpeed does inside its sections: correct the key or remove it"
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (  # issue 17: these only warned, and the run went on at stage 0 with nothing offloaded
            {"zero_optimisation": {"stage": 3, "offload_param": {"device": "cpu"}}},
            r"^unknown key zero_optimisation = \{'stage': 3, 'offload_param': \{'devic\.\.\. "
            r"\(did you mean zero_optimization\?\)\. ",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimiser": {"device": "cpu"}}},
            r"^unknown key zero_optimization\.offload_optimiser = \{'device': 'cpu'\} "
            r"\(did you mean zero_optimization\.offload_optimizer\?\)\. ",
        ),
        (
            {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sze": 5e7}},
            r"^unknown key zero_optimization\.stage3_prefetch_bucket_sze = 50000000\.0 "
            r"\(did you mean zero_optimization\.stage3_prefetch_bucket_size\?\)\. ",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}},
            r"^unknown key scheduler\.params\.warmup_num_step = 10 "
            r"\(did you mean scheduler\.params\.warmup_num_steps\?\)",
        ),
    ],
)
def test_misspelt_keys_and_sections_are_refused_with_the_spelling_hint(raw, message):
    with pytest.raises(ConfigError, match=message):
        load_config(raw)


def test_a_key_like_no_known_key_is_refused_with_the_keys_its_section_takes():
    with pytest.raises(ConfigError) as e:
        load_config(
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "frobnicate": 1}}}
        )
    assert str(e.value).startswith(
        "unknown key zero_optimization.offload_param.frobnicate = 1 (zero_optimization.offload_param "
        "takes buffer_count, buffer_size, device, integrity, max_in_cpu, nvme_path, pin_memory). "
    )
    with pytest.raises(ConfigError) as e:
        load_config({"frobnicate": True})
    msg = str(e.value)
    assert msg.startswith(
        "unknown key frobnicate = True (the top level takes activation_checkpointing, aim, aio,"
    )
    # the top level lists DeepSpeed's sections infinity keeps unread too
    assert "flops_profiler" in msg and "zero_optimization" in msg and "train_batch_size" in msg


def test_deepspeed_sections_and_keys_without_effect_are_accepted():
    cfg = load_config(
        {
            "seq_parallel_communication_data_type": "fp32",
            "zero_optimization": {"stage": 3, "zeropp_loco_param": {"err_beta": 0.8}},
            "flops_profiler": {"enabled": True, "anything": "inside is not read"},
        }
    )
    assert cfg.ignored_keys() == [
        "flops_profiler",
        "seq_parallel_communication_data_type",
        "zero_optimization.zeropp_loco_param",
    ]


def test_no_warning_without_unknown_keys():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({"zero_optimization": {"stage": 2}, "flops_profiler": {"enabled": False}})


def test_another_schedules_param_is_refused_naming_who_takes_it():
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
        "dump_state": True,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "round_robin_gradients": True},
        "flops_profiler": {"enabled": True},
        "aio": {"use_gds": False},
    }
    cfg = load_config(raw)
    messages = [r.getMessage() for r in caplog.records if r.name == "infinity.config"]
    assert messages == [
        "these DeepSpeed config keys are accepted but have no effect in infinity: aio.use_gds, "
        "dump_state, flops_profiler, zero_optimization.overlap_comm, zero_optimization.round_robin_gradients"
    ]
    assert cfg.ignored_keys() == [
        "aio.use_gds",
        "dump_state",
        "flops_profiler",
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
            "dump_state": True,
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
    assert not acted_on("aio.use_gds") and not acted_on("flops_profiler")
    # the monitor sections and the wall-clock breakdown are acted on (infinity.monitor, the engine)
    assert acted_on("tensorboard.output_path") and acted_on("csv_monitor.job_name")
    assert acted_on("wandb.team") and acted_on("wall_clock_breakdown")


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


def test_activation_checkpointing_is_read_and_names_what_has_no_effect(caplog):
    """cpu_checkpointing and partition_activations are infinity.checkpointing's; the other four are
    accepted without effect (support.py says why) and reported as such."""
    caplog.set_level(logging.WARNING, "infinity.config")
    section = {
        "partition_activations": True,
        "cpu_checkpointing": True,
        "contiguous_memory_optimization": True,
        "number_checkpoints": 4,
        "synchronize_checkpoint_boundary": True,
        "profile": True,
    }
    cfg = load_config({"activation_checkpointing": section})
    ac = cfg.activation_checkpointing
    assert (ac.partition_activations, ac.cpu_checkpointing, ac.number_checkpoints) == (
        True,
        True,
        4,
    )
    no_effect = [
        "activation_checkpointing.contiguous_memory_optimization",
        "activation_checkpointing.number_checkpoints",
        "activation_checkpointing.profile",
        "activation_checkpointing.synchronize_checkpoint_boundary",
    ]
    assert cfg.ignored_keys() == no_effect
    assert [r.getMessage() for r in caplog.records if r.name == "infinity.config"] == [
        "these DeepSpeed config keys are accepted but have no effect in infinity: "
        + ", ".join(no_effect)
    ]
    assert acted_on("activation_checkpointing.cpu_checkpointing")
    assert acted_on("activation_checkpointing.partition_activations")
    assert load_config(cfg.to_dict()).activation_checkpointing == ac
    assert (
        "checkpoint inputs in host memory and split across model-parallel ranks"
        in describe_config(cfg)
    )
    with pytest.raises(
        ConfigError, match=r"^activation_checkpointing\.number_checkpoints must be an integer >= 1"
    ):
        load_config({"activation_checkpointing": {"number_checkpoints": 0}})
    with pytest.raises(
        ConfigError, match=r"did you mean activation_checkpointing\.cpu_checkpointing\?"
    ):
        load_config({"activation_checkpointing": {"cpu_checkpoint": True}})
