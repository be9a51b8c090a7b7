"""DeepSpeed's ``zero.Init(dtype=...)`` through the compat face: floating-point parameters are
partitioned in that dtype whatever the config says ([Note: zero.Init's dtype] in
infinity/zero/init.py), with DeepSpeed's attributes. Oracle: the same transformers model built in
plain PyTorch (fp32) and cast."""

from __future__ import annotations

import torch

import infinity.compat.deepspeed as deepspeed
from tests.hf.models import ARCHS, build, config, ds_config
from tests.zero.test_init_dtype import assert_rests_as_cast


def test_deepspeeds_dtype_wins_over_the_config(nvme_dir):
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds_config(nvme_dir), dtype=torch.bfloat16):
        cast = ARCHS["llama"][0](config("llama"))
    plain = build("llama", seed=0)
    assert_rests_as_cast(cast, plain, torch.bfloat16)
    for (n, p), (_, want) in zip(cast.named_parameters(), plain.named_parameters(), strict=True):
        assert tuple(p.ds_shape) == tuple(want.shape), n  # DeepSpeed's attributes as well
