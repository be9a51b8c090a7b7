"""The ``weight_quantization`` section: weights kept group-quantised at rest, as DeepSpeed's ZeRO-Inference keys it.

``weight_quantization.quantized_initialization`` (``num_bits`` 4 or 8,
``group_size``, ``group_dim``, ``symmetric``) asks the inference engine
(infinity.inference) to store every matrix parameter (2-D and up: the weights
of Linear, Embedding, GPT-2's Conv1D) quantised in groups of ``group_size``
consecutive elements along the last dimension, and to dequantise each unit
after it is read (the format: infinity/weights/quant.py). Defaults are those of
DeepSpeed's ZeRO-Inference examples (``group_dim`` 1, asymmetric).
DeepSpeed's other flavour, ``post_init_quant`` (per module name), is refused
by the schema with the reason (schema.py REFUSED).

``quant_type`` (infinity's own key; DeepSpeed's formats are the integer ones)
"nf4" stores QLoRA's 4-bit NormalFloat instead (num_bits 4; bitsandbytes'
layout, dequantised by a C++ kernel: infinity/weights/nf4.py); with ``double_quant``
its scales are quantised again as QLoRA's double quantisation does.

Training quantises only frozen weights ([Note: a quantised frozen base] in
infinity/engine/initialize.py): with this section or DeepSpeed's
``zero_optimization.zero_quantized_nontrainable_weights`` the parameters with
``requires_grad=False`` (a LoRA run's base) rest quantised, and a matrix that
trains is refused unless that key says to leave the trainable ones as they are.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from infinity.config.errors import ConfigError
from infinity.config.values import check_section, knob


@dataclasses.dataclass(frozen=True)
class QuantizedInitializationConfig:
    """``weight_quantization.quantized_initialization``: how the weights are quantised at rest."""

    PATH: ClassVar[str] = "weight_quantization.quantized_initialization"

    num_bits: Literal[4, 8] = knob(8)
    """Bits per quantised element: 8, or 4 (two per byte)."""
    group_size: int = knob(64, ge=2)
    """Elements per group; each group has its own scale (and offset unless symmetric)."""
    group_dim: int = knob(1, ge=0)
    """The dimension groups run along; 1, the last dimension of a 2-D weight, is the one supported."""
    symmetric: bool = knob(False)
    """Symmetric groups (a scale only, zero at zero) instead of min/max groups (a scale and an offset)."""
    quant_type: Literal["int", "nf4"] = knob("int")
    """"int": DeepSpeed's integer codes; "nf4": QLoRA's 4-bit NormalFloat with an fp32 absmax per group
    (needs num_bits 4; symmetric does not apply)."""
    double_quant: bool = knob(False)
    """NF4 only: quantise the absmax scales again, QLoRA's double quantisation (bitsandbytes'
    ``bnb_4bit_use_double_quant`` / ``compress_statistics``): 8-bit codes in blocks of 256 with an
    fp32 absmax each and their mean as offset; 0.5 + 1/64 + 4/(64·256) bytes per weight at group 64
    instead of 0.5 + 4/64."""

    def __post_init__(self) -> None:
        check_section(self)
        if self.quant_type == "nf4" and self.num_bits != 4:
            raise ConfigError(
                f'{self.PATH}.quant_type "nf4" stores 4 bits per weight, and num_bits is '
                f"{self.num_bits}; set num_bits to 4"
            )
        if self.double_quant and self.quant_type != "nf4":
            raise ConfigError(
                f"{self.PATH}.double_quant quantises NF4 scales again, and quant_type is "
                f'"{self.quant_type}"; set quant_type to "nf4" or leave double_quant out'
            )
        if self.group_dim != 1:
            raise ConfigError(
                f"{self.PATH}.group_dim={self.group_dim} is not supported: groups run along the last "
                "dimension (group_dim 1, DeepSpeed's default for 2-D weights); set it to 1"
            )


@dataclasses.dataclass(frozen=True)
class WeightQuantizationConfig:
    """``weight_quantization``: weight-only quantisation at rest (inference; training: frozen weights)."""

    PATH: ClassVar[str] = "weight_quantization"

    quantized_initialization: QuantizedInitializationConfig | None = knob(None)
    """Quantise every matrix parameter as the engine stores it (None: weights stay as loaded)."""

    def __post_init__(self) -> None:
        check_section(self)
