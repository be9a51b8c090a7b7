"""build_units: how a module tree is cut into ParamUnits (per module, per dtype, persistent or not)."""

import torch
from torch import nn

from infinity.zero.units import build_units


def test_each_unit_keeps_its_parameters_dtype_without_a_training_dtype():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double(), nn.Linear(4, 4).half())
    units = build_units(model, world_size=1, persistence_threshold=0, device=torch.device("cpu"))
    assert [u.layout.dtype for u in units.units] == [torch.float32, torch.float64, torch.float16]


def test_a_training_dtype_applies_to_every_floating_point_unit():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    units = build_units(
        model,
        world_size=2,
        persistence_threshold=5,
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
    )
    # each Linear: a partitioned unit (weight, 16 elements) and a persistent one (bias, 4 < 5)
    assert [(u.layout.dtype, u.persistent) for u in units.units] == [
        (torch.bfloat16, False),
        (torch.bfloat16, True),
    ] * 2
