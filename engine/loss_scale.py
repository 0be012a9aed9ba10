"""fp16 loss scaling with DeepSpeed's knobs and semantics.

Dynamic scaling (loss_scale=0): start at 2**initial_scale_power; on an overflow skip the step and,
once `hysteresis` overflows have been absorbed, halve the scale (never below min_loss_scale); after
`loss_scale_window` overflow-free steps double it. A static scale (loss_scale>0) never changes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    """Scale state; `update(overflow)` is called once per optimizer step."""

    scale: float
    dynamic: bool
    window: int
    hysteresis: int
    min_scale: float
    scale_factor: float = 2.0
    step_count: int = 0
    last_overflow_step: int = -1
    remaining_hysteresis: int = 0

    @classmethod
    def from_config(
        cls, loss_scale: float, initial_scale_power: int, loss_scale_window: int, hysteresis: int,
        min_loss_scale: float,
    ) -> "LossScaler":
        dynamic = loss_scale == 0
        return cls(
            scale=float(2**initial_scale_power) if dynamic else float(loss_scale),
            dynamic=dynamic,
            window=loss_scale_window,
            hysteresis=hysteresis,
            min_scale=min_loss_scale,
            remaining_hysteresis=hysteresis,
        )

    @property
    def exhausted(self) -> bool:
        """True when another overflow cannot be absorbed by lowering the scale (a static scale, or a
        dynamic one already at min_scale): the engine then counts the skipped step towards
        --max-skipped-steps, as it does every non-finite step without fp16."""
        return not self.dynamic or self.scale <= self.min_scale

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            self.step_count += 1
            return
        if overflow:
            if self.hysteresis == 1 or self.remaining_hysteresis == 1:
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                self.remaining_hysteresis -= 1
            self.last_overflow_step = self.step_count
        elif (self.step_count - self.last_overflow_step) % self.window == 0:
            self.remaining_hysteresis = self.hysteresis
            self.scale *= self.scale_factor
        self.step_count += 1

    def state_dict(self) -> dict[str, float | int | bool]:
        return {
            "scale": self.scale, "step_count": self.step_count,
            "last_overflow_step": self.last_overflow_step, "remaining_hysteresis": self.remaining_hysteresis,
        }

    def load_state_dict(self, state: dict[str, float | int | bool]) -> None:
        self.scale = float(state["scale"])
        self.step_count = int(state["step_count"])
        self.last_overflow_step = int(state["last_overflow_step"])
        self.remaining_hysteresis = int(state["remaining_hysteresis"])
