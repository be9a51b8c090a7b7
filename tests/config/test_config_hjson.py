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
        "flops_profiler": {"enabled": True, "output_file": "runs"},
    }
    before = copy.deepcopy(raw)
    cfg = load_config(raw, lr=1e-3, bf16=True, world_size=2)
    assert raw == before
    # nor do later changes to the caller's dict reach the config
    raw["flops_profiler"]["output_file"] = "elsewhere"
    assert cfg.opaque["flops_profiler"]["output_file"] == "runs"


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


@pytest.mark.parametrize("text", ["", "\n  \n", "// ds_config.json\n# nothing yet\n/* to do */\n"])
def test_an_empty_file_is_refused(tmp_path, text):
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    with pytest.raises(
        ConfigError,
        match=rf"^config file '{path}' is empty \(no JSON object, only whitespace and comments\); "
        r"write the config in it",
    ):
        load_config(path)


def test_an_empty_dict_or_object_means_all_defaults(tmp_path):
    # DeepSpeed's own dict is empty before HF or Accelerate fill it; an explicit {} is not a mistake.
    path = tmp_path / "ds_config.json"
    path.write_text("{}\n")
    assert load_config(path) == load_config({}) == load_config(None)


def _error(tmp_path, text):
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    prefix = f"config file '{path}' is not valid JSON/hjson: "
    assert str(e.value).startswith(prefix)
    return str(e.value)[len(prefix) :]


def test_a_comma_missing_mid_line_is_reported_where_it_is_not_at_the_end(tmp_path):
    # hjson reads `true "loss_scale": 0},` as one quoteless string and fails at the end of the file
    text = (
        '{\n  // fp16\n  "fp16": {"enabled": true "loss_scale": 0},\n  "train_batch_size": 8\n}\n'
    )
    assert _error(tmp_path, text) == (
        "line 3, column 28: expected ',' or '}' after the value of 'enabled', found "
        """'"loss_scale"': is a comma missing?\n"""
        """      "fp16": {"enabled": true "loss_scale": 0},\n"""
        "                               ^"
    )


def test_a_comma_missing_after_a_number_that_hjson_would_swallow_is_refused(tmp_path):
    # hjson succeeds here: "stage" becomes the string '3 "offload_param": {"device": "cpu"}'
    text = (
        '{\n  "zero_optimization": {\n    "stage": 3 "offload_param": {"device": "cpu"}\n  }\n}\n'
    )
    assert _error(tmp_path, text) == (
        "line 3, column 16: expected ',' or '}' after the value of 'stage', found "
        """'"offload_param"': is a comma missing? (hjson, as DeepSpeed uses it, reads the rest of """
        "the line as one string)\n"
        """        "stage": 3 "offload_param": {"device": "cpu"}\n"""
        "                   ^"
    )


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (  # all on one line, as a config written by a script
            '{"zero_optimization": {"stage": 3 "offload_param": {"device": "cpu"}}, "gradient_clipping": 1}',
            "line 1, column 35: expected ',' or '}' after the value of 'stage'",
        ),
        (
            '{\n  "gradient_clipping" 1.0\n}\n',
            "line 2, column 23: expected ':' after the key 'gradient_clipping'",
        ),
        (
            '{\n  "fp16": {"enabled": true},,\n  "gradient_clipping": 1\n}\n',
            "line 2, column 29: expected a key or '}', found ','",
        ),
        (
            '{\n  "fp16": {"enabled": true}},\n  "gradient_clipping": 1\n}\n',
            "line 2, column 29: unexpected ','",
        ),
        (
            '{\n  "fp16": {"enabled": true,\n  "gradient_clipping": 1\n}\n',
            "line 1, column 1: this '{' is never closed",
        ),
        (
            '{\n  "betas": [0.9 0.95]\n}\n',
            "line 2, column 17: expected ',' or ']' after a list item",
        ),
        (
            '{\n  "aio": {"engine": "threads}\n}\n',
            'line 2, column 21: this string is not closed with " on its line',
        ),
        ('{\n  /* "fp16": {}\n}\n', "line 2, column 3: this /* comment is never closed with */"),
    ],
)
def test_syntax_errors_name_line_and_column_of_the_mistake(tmp_path, text, where):
    msg = _error(tmp_path, text)
    assert msg.startswith(where)
    lineno = int(where.split(",")[0].split()[1])
    col = int(where.split(",")[1].split(":")[0].split()[1])
    shown, caret = msg.split("\n")[1:]
    assert shown == "    " + text.split("\n")[lineno - 1]
    assert caret == "    " + " " * (col - 1) + "^"


def test_hjson_leniencies_deepspeed_reads_as_meant_still_load(tmp_path):
    # a comma missing after a string or an object, even mid-line: hjson (and DeepSpeed) read it as meant
    path = tmp_path / "ds_config.json"
    path.write_text(
        '{\n  "fp16": {"enabled": false} "bf16": {"enabled": true},\n'
        '  "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu" "pin_memory": false}}\n}\n'
    )
    cfg = load_config(path)
    assert cfg.bf16.enabled and not cfg.fp16.enabled
    assert cfg.zero_optimization.offload_param.pin_memory is False
