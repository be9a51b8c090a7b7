"""Reading configs as DeepSpeed does: hjson leniency, duplicate keys refused, the caller's dict untouched."""

import copy
import json
from collections import OrderedDict

import pytest

from infinity.config import ConfigError, load_config, read_config_file

LENIENT = """
// a line comment
# a hash comment
{
  /* a block comment */
  "train_micro_batch_size_per_gpu": 2,   // trailing comment
  "gradient_accumulation_steps": 3
  "zero_optimization": {
    "stage": 3,
    "sub_group_size": 1e9,
    "offload_param": {"device": "cpu", "pin_memory": false,},
  },
  optimizer: {"type": "AdamW", params: {lr: 1e-4, betas: [0.9, 0.95,],}},
}
"""


def test_comments_trailing_commas_and_missing_commas_at_line_ends(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(LENIENT)
    cfg = load_config(path, world_size=2)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (2, 3)
    assert cfg.train_batch_size == 12
    z = cfg.zero_optimization
    assert z.stage == 3 and z.sub_group_size == 1_000_000_000
    assert z.offload_param.device == "cpu" and z.offload_param.pin_memory is False
    assert cfg.optimizer.type == "adamw" and cfg.optimizer.params.betas == (0.9, 0.95)


def test_path_given_as_str_and_pathlike(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"gradient_clipping": 0.5}')
    assert load_config(str(path)).gradient_clipping == 0.5
    assert load_config(path).gradient_clipping == 0.5
    assert read_config_file(path) == {"gradient_clipping": 0.5}


def test_duplicate_keys_are_refused_as_deepspeed_does(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"gradient_clipping": 1.0, "zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(ConfigError, match=r"duplicate key\(s\) in the config: stage"):
        load_config(path)


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=rf"config file '{missing}' does not exist"):
        load_config(missing)


def test_unparseable_file_names_path_and_position(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"zero_optimization": {"stage": 3')
    with pytest.raises(
        ConfigError, match=rf"config file '{path}' is not valid JSON/hjson: .*line 1"
    ):
        load_config(path)


def test_top_level_must_be_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        load_config(path)


def test_the_callers_dict_is_never_modified():
    raw = {
        "train_batch_size": "auto",
        "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": [0.9, 0.99]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
        "bfloat16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "stage3_gather_fp16_weights_on_model_save": True,
            "cpu_offload": True,
        },
        "tensorboard": {"enabled": True, "output_path": "runs"},
    }
    before = copy.deepcopy(raw)
    cfg = load_config(raw, lr=1e-3, bf16=True, world_size=2)
    assert raw == before
    # nor do later changes to the caller's dict reach the config
    raw["tensorboard"]["output_path"] = "elsewhere"
    assert cfg.opaque["tensorboard"]["output_path"] == "runs"


def test_any_mapping_is_accepted():
    cfg = load_config(OrderedDict(json.loads('{"zero_optimization": {"stage": 1}}')))
    assert cfg.zero_optimization.stage == 1


def test_none_gives_all_defaults():
    cfg = load_config()
    assert cfg.zero_optimization.stage == 0 and cfg.optimizer is None and cfg.scheduler is None
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == (1, 1, 1)
    assert cfg.aio.queue_depth == 32  # infinity's aio default (DeepSpeed's is 8)


def test_wrong_config_type_is_refused():
    with pytest.raises(
        ConfigError, match="config must be a path, a dict or an InfinityConfig; got int"
    ):
        load_config(3)
