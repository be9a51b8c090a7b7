"""Loss scaling for fp16 training, with DeepSpeed's ``fp16`` keys and semantics.

``loss_scale`` > 0: a static scale. ``loss_scale`` == 0: dynamic — start at
2**initial_scale_power; on a step whose gradients overflow, skip the step and
(once ``hysteresis`` overflows have been absorbed) halve the scale, never below
``min_loss_scale``; after ``loss_scale_window`` clean steps, double it.
"""

from __future__ import annotations

import dataclasses

from infinity.config import FP16Config


@dataclasses.dataclass
class LossScaler:
    dynamic: bool
    scale: float
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    consecutive_hysteresis: bool = False
    _clean_steps: int = 0
    _hysteresis_left: int = dataclasses.field(default=-1)

    def __post_init__(self) -> None:
        if self._hysteresis_left < 0:
            self._hysteresis_left = self.hysteresis

    @classmethod
    def static(cls, scale: float = 1.0) -> LossScaler:
        return cls(dynamic=False, scale=float(scale))

    @classmethod
    def from_fp16_config(cls, fp16: FP16Config) -> LossScaler:
        if fp16.loss_scale and fp16.loss_scale > 0:
            return cls.static(fp16.loss_scale)
        return cls(
            dynamic=True,
            scale=float(2**fp16.initial_scale_power),
            window=int(fp16.loss_scale_window),
            hysteresis=int(fp16.hysteresis),
            min_scale=float(fp16.min_loss_scale),
            consecutive_hysteresis=fp16.consecutive_hysteresis,
        )

    def update(self, overflow: bool) -> None:
        """Called once per optimizer step (taken or skipped)."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self._hysteresis_left <= 1:
                self.scale = max(
                    self.scale / 2, self.min_scale
                )  # hysteresis stays spent, as in DeepSpeed
            else:
                self._hysteresis_left -= 1
            self._clean_steps = 0
            return
        if self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis
        self._clean_steps += 1
        if self._clean_steps % self.window == 0:
            self.scale *= 2
            if not self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "clean_steps": self._clean_steps,
            "hysteresis_left": self._hysteresis_left,
        }

    def load_state_dict(self, d: dict) -> None:
        self.scale = float(d["scale"])
        self._clean_steps = int(d["clean_steps"])
        self._hysteresis_left = int(d["hysteresis_left"])
