"""ParamUnit's gathered buffer: only a GATHERED unit has one."""

import pytest
import torch
from torch import nn

from infinity.zero.layout import make_layout
from infinity.zero.unit import ParamUnit


def _unit() -> ParamUnit:
    params = [nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(5))]
    layout = make_layout(["w", "b"], [p.shape for p in params], torch.float32, world_size=1)
    return ParamUnit(
        0, "block", params, ["w", "b"], layout, persistent=False, device=torch.device("cpu")
    )


def test_gathered_is_the_buffer_the_parameters_view():
    unit = _unit()
    full = torch.arange(unit.layout.padded_numel, dtype=torch.float32)
    unit.to_gathered(full)
    assert unit.gathered() is full
    assert unit.params[1].data_ptr() == full[6:].data_ptr()
    assert unit.to_released() is full


def test_a_released_unit_has_no_gathered_buffer():
    unit = _unit()
    with pytest.raises(RuntimeError, match="unit 'block' used as gathered while RELEASED"):
        unit.gathered()
    unit.to_gathered(torch.zeros(unit.layout.padded_numel))
    unit.to_released()
    with pytest.raises(RuntimeError, match="unit 'block' used as gathered while RELEASED"):
        unit.gathered()
