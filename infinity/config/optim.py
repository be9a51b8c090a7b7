"""The ``optimizer`` and ``scheduler`` sections: Adam/AdamW and the warmup lr schedules.

Facts carried over from DeepSpeed (``deepspeed/runtime/config.py``,
``engine.py``, ``lr_schedules.py``): optimizer type names are matched
case-insensitively and stored lower-case; type "Adam" runs AdamW (decoupled
weight decay) unless ``adam_w_mode`` is false; ``torch_adam`` selects
torch's implementation, whose AdamW decays weights by 0.01 by default, where
DeepSpeed's own Adam kernels default to 0. Scheduler type names are matched
exactly, as DeepSpeed looks them up by attribute name.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from infinity.config.errors import ConfigError
from infinity.config.values import check_section, internal, knob

SUPPORTED_OPTIMIZERS: tuple[str, ...] = ("adam", "adamw")
# DeepSpeed's other optimizers, named so the refusal can say what they are.
DEEPSPEED_ONLY_OPTIMIZERS: tuple[str, ...] = (
    "adagrad",
    "lamb",
    "onebitadam",
    "zerooneadam",
    "onebitlamb",
    "muadam",
    "muadamw",
    "musgd",
    "lion",
    "muon",
)
SUPPORTED_SCHEDULERS: tuple[str, ...] = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
DEEPSPEED_ONLY_SCHEDULERS: tuple[str, ...] = ("LRRangeTest", "OneCycle")

WarmupType = Literal["log", "linear"]
LrValue = float | tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class AdamParams:
    """``optimizer.params`` of Adam / AdamW."""

    PATH: ClassVar[str] = "optimizer.params"

    lr: float = knob(1e-3, ge=0.0, auto_default=False)
    """Learning rate. DeepSpeed's Adam defaults to 1e-3 when the key is absent; "auto" needs lr=."""
    betas: tuple[float, float] = knob((0.9, 0.999), ge=0.0, lt=1.0)
    """Moment decay rates (beta1, beta2)."""
    eps: float = knob(1e-8, ge=0.0)
    """Added to the denominator."""
    weight_decay: float | None = knob(None, ge=0.0)
    """Weight decay; unset means 0, or torch's 0.01 for AdamW with torch_adam (DeepSpeed's behaviour)."""
    adam_w_mode: bool = knob(True)
    """Decoupled weight decay for type Adam (DeepSpeed: Adam means AdamW unless this is false)."""
    torch_adam: bool = knob(False)
    """DeepSpeed: use torch.optim.Adam/AdamW instead of its fused/CPU kernels."""
    bias_correction: bool = knob(True)
    """Adam's bias correction. Only true is supported; false is refused."""
    amsgrad: bool = knob(False)
    """AMSGrad variant. Only false is supported; true is refused."""

    def __post_init__(self) -> None:
        check_section(self)
        if self.amsgrad:
            raise ConfigError(
                "optimizer.params.amsgrad is true; infinity's Adam has no AMSGrad variant: "
                "remove the key, or train with a torch optimizer without offload"
            )
        if not self.bias_correction:
            raise ConfigError(
                "optimizer.params.bias_correction is false; infinity's Adam always applies "
                "bias correction: remove the key"
            )


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: the optimizer the engine builds when the user passes none."""

    PATH: ClassVar[str] = "optimizer"

    type: Literal["adam", "adamw"] = knob("adamw", casefold=True)
    """Adam or AdamW, any case (stored lower-case, as DeepSpeed does)."""
    params: AdamParams = knob(AdamParams())
    """Hyper-parameters."""
    legacy_fusion: bool = knob(False)
    """DeepSpeed (fp16, legacy): fused fp16 optimizer step."""
    hf_trainer_default: bool = internal(False)
    """Not a DeepSpeed key: the config had no optimizer section and load_config wrote this one
    from lr= etc., as the HF Trainer builds its default AdamW; the engine then leaves biases and
    normalisation weights without weight decay, as the Trainer's param groups do (see
    [Note: where an "auto" value comes from])."""

    def __post_init__(self) -> None:
        t = self.type
        if isinstance(t, str) and t.lower() not in SUPPORTED_OPTIMIZERS:
            what = (
                "a DeepSpeed optimizer infinity does not implement"
                if t.lower() in DEEPSPEED_ONLY_OPTIMIZERS
                else "not an optimizer infinity knows"
            )
            raise ConfigError(
                f"optimizer.type {t!r} is {what}; supported: Adam, AdamW (any case). "
                "Or pass your own torch optimizer to initialize(optimizer=...) and drop the "
                "optimizer section"
            )
        check_section(self)
        if self.params.weight_decay is None:
            wd = 0.01 if self.params.torch_adam and self.adamw_mode else 0.0
            object.__setattr__(self, "params", dataclasses.replace(self.params, weight_decay=wd))

    @property
    def adamw_mode(self) -> bool:
        """Whether weight decay is decoupled (AdamW): type adamw, or adam with adam_w_mode."""
        return self.type == "adamw" or self.params.adam_w_mode


@dataclasses.dataclass(frozen=True)
class WarmupLRParams:
    """``scheduler.params`` of WarmupLR: warm up from min to max lr, then hold."""

    PATH: ClassVar[str] = "scheduler.params"

    warmup_min_lr: LrValue = knob(0.0, ge=0.0)
    """Starting lr (one number, or one per param group)."""
    warmup_max_lr: LrValue | None = knob(None, ge=0.0)
    """Final lr; unset means each param group's own lr (DeepSpeed's code; its docs say 0.001)."""
    warmup_num_steps: int = knob(1000, ge=1)
    """Warmup length in optimizer steps (values below 2 act as 2, as in DeepSpeed)."""
    warmup_type: WarmupType = knob("log")
    """log or linear ramp."""
    last_batch_iteration: int = knob(-1, ge=-1)
    """Resume point: the index of the last step taken (-1 starts from the beginning)."""

    def __post_init__(self) -> None:
        check_section(self)


@dataclasses.dataclass(frozen=True)
class WarmupDecayLRParams:
    """``scheduler.params`` of WarmupDecayLR: warm up, then decay linearly to 0 at total_num_steps."""

    PATH: ClassVar[str] = "scheduler.params"

    total_num_steps: int = knob(ge=1, auto_default=False)
    """Steps at which the lr reaches 0 (required)."""
    warmup_min_lr: LrValue = knob(0.0, ge=0.0)
    """Starting lr (one number, or one per param group)."""
    warmup_max_lr: LrValue | None = knob(0.001, ge=0.0)
    """Peak lr (DeepSpeed default 0.001); null means each param group's own lr."""
    warmup_num_steps: int = knob(1000, ge=1)
    """Warmup length in optimizer steps (values below 2 act as 2)."""
    warmup_type: WarmupType = knob("log")
    """log or linear ramp."""
    last_batch_iteration: int = knob(-1, ge=-1)
    """Resume point: the index of the last step taken."""

    def __post_init__(self) -> None:
        check_section(self)


@dataclasses.dataclass(frozen=True)
class WarmupCosineLRParams:
    """``scheduler.params`` of WarmupCosineLR: ratios of each group's lr, warmup then cosine."""

    PATH: ClassVar[str] = "scheduler.params"

    total_num_steps: int = knob(ge=1, auto_default=False)
    """Steps at which the cosine reaches cos_min_ratio (required)."""
    warmup_min_ratio: float = knob(0.0, ge=0.0, le=1.0)
    """Warmup starts at this fraction of the lr."""
    warmup_num_steps: int = knob(1000, ge=1)
    """Warmup length in optimizer steps (values below 2 act as 2)."""
    cos_min_ratio: float = knob(0.0001, ge=0.0, le=1.0)
    """The cosine ends at this fraction of the lr."""
    warmup_type: WarmupType = knob("log")
    """log or linear ramp."""
    last_batch_iteration: int = knob(-1, ge=-1)
    """Resume point: the index of the last step taken."""

    def __post_init__(self) -> None:
        check_section(self)


SCHEDULE_PARAMS: dict[str, type] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
}

ScheduleParams = WarmupLRParams | WarmupDecayLRParams | WarmupCosineLRParams


def unsupported_scheduler(name: object) -> ConfigError:
    """The refusal for a scheduler type infinity does not run; lists the supported ones."""
    if name in DEEPSPEED_ONLY_SCHEDULERS:
        what = "a DeepSpeed schedule infinity does not implement"
    else:
        what = "not a schedule infinity knows (names are case-sensitive, as in DeepSpeed)"
    return ConfigError(
        f"scheduler.type {name!r} is {what}; supported: {', '.join(SUPPORTED_SCHEDULERS)}. "
        "Or pass your own scheduler to initialize(lr_scheduler=...) and drop the scheduler section"
    )


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: the lr schedule the engine steps after every optimizer step."""

    PATH: ClassVar[str] = "scheduler"

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"] = knob()
    """The schedule."""
    params: ScheduleParams = knob()
    """Its parameters (the class matching type)."""

    def __post_init__(self) -> None:
        if self.type not in SCHEDULE_PARAMS:
            raise unsupported_scheduler(self.type)
        check_section(self)
        expected = SCHEDULE_PARAMS[self.type]
        if not isinstance(self.params, expected):
            raise ConfigError(
                f"scheduler.params is a {type(self.params).__name__} but scheduler.type is "
                f"{self.type}, which takes {expected.__name__}"
            )
