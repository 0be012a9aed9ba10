"""The engine's own configuration: sharding, precision, batch arithmetic, optimizer and schedule.

The engine depends on nothing above it; the app (`rlhf.config`) composes this dataclass into each
stage's config as its `engine:` section. Each field's docstring opens with its CLI help (one
paragraph of at most ~160 characters; further paragraphs are the longer explanation that
docs/config.md shows), and each numeric field declares its allowed values where it is defined
(`bounded(default, ge=..)`); the app checks them whenever a field is set from a flag, a config file
or a ds_config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from rlhf.errors import UserError

ZeroStage = Literal[0, 1, 2, 3]
Dtype = Literal["auto", "fp32", "bf16", "fp16"]
Scheduler = Literal["constant", "linear", "cosine"]
OptimizerImpl = Literal["auto", "fused", "torch"]


class FieldRule(Protocol):
    """A per-field constraint, checked each time the field is set from a flag or a file."""

    def violation(self, value: Any) -> str | None:
        """None when `value` is allowed, else what it must be (the end of "<value> must be <rule>")."""


def _number(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True)
class Bounds:
    """A numeric field's allowed range; a float must also be finite (never NaN or inf)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def violation(self, value: Any) -> str | None:
        if isinstance(value, float) and not math.isfinite(value):
            return "a finite number"
        ok = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
              and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))
        return None if ok else self.text

    @property
    def text(self) -> str:
        """The rule as the error shows it: ">= 1", "> 0", "in [0, 1)"."""
        low = f"[{_number(self.ge)}" if self.ge is not None else f"({_number(self.gt)}" if self.gt is not None else ""
        high = f"{_number(self.le)}]" if self.le is not None else f"{_number(self.lt)})" if self.lt is not None else ""
        if low and high:
            return f"in {low}, {high}"
        if low:
            return (">= " if low[0] == "[" else "> ") + low[1:]
        if high:
            return ("<= " if high[-1] == "]" else "< ") + high[:-1]
        return "a finite number"


FINITE = Bounds()
"""The rule of every float field that names no other: any finite number."""


def checked(default: Any, rule: FieldRule) -> Any:
    """A dataclass field with a per-field rule (`rlhf.config` checks it whenever the field is set)."""
    return field(default=default, metadata={"rule": rule})


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None) -> Any:
    """A numeric dataclass field that must lie in a range: `lr: float = bounded(1e-5, gt=0)`."""
    return checked(default, Bounds(ge=ge, gt=gt, le=le, lt=lt))


@dataclass
class EngineConfig:
    """How a model is trained: sharding, precision, batch arithmetic, optimizer and schedule."""

    zero_stage: ZeroStage = 3
    """ZeRO stage: 3 shards params, grads and optimizer state; 1 and 2 keep params gathered between forward and
    backward; 0 replicates (DDP-like).

    Stage 3 is FSDP2 with reshard after forward.
    """
    offload: bool = False
    """ZeRO-Offload: keep sharded params, grads and optimizer state on CPU and step the optimizer there."""
    dtype: Dtype = "auto"
    """Compute precision: bf16 or fp16 (params cast for compute, fp32 master weights and reductions), fp32, or auto
    (bf16 on a GPU that supports it, else fp32)."""
    micro_batch_size: int = bounded(4, ge=1)
    """Samples per rank per forward/backward (DeepSpeed train_micro_batch_size_per_gpu)."""
    grad_accum: int | None = bounded(None, ge=1)
    """Micro-batches accumulated per optimizer step; derived from train_batch_size when unset, else 1."""
    train_batch_size: int | None = bounded(None, ge=1)
    """Global batch per optimizer step; must equal micro_batch_size x grad_accum x data-parallel size."""
    lr: float = bounded(1e-5, gt=0)
    """Peak learning rate."""
    weight_decay: float = bounded(0.0, ge=0)
    """AdamW decoupled weight decay; never applied to biases and norm weights (1-D params)."""
    adam_beta1: float = bounded(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = bounded(0.95, ge=0, lt=1)
    """AdamW beta2."""
    adam_eps: float = bounded(1e-8, gt=0)
    """AdamW epsilon."""
    optimizer_impl: OptimizerImpl = "auto"
    """AdamW implementation: fused (csrc kernels), torch (torch.optim.AdamW), or auto (fused where it is built)."""
    grad_clip: float = bounded(1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    lr_scheduler: Scheduler = "cosine"
    """Learning-rate schedule after warmup: constant, linear decay or cosine decay to min_lr_ratio x lr."""
    warmup_steps: int = bounded(0, ge=0)
    """Linear warmup steps from warmup_start_ratio x lr to lr (overrides warmup_ratio when > 0)."""
    warmup_ratio: float = bounded(0.0, ge=0, le=1)
    """Warmup as a fraction of the total optimizer steps, used when warmup_steps is 0."""
    warmup_start_ratio: float = bounded(0.0, ge=0, le=1)
    """Learning rate at the start of warmup, as a fraction of lr."""
    min_lr_ratio: float = bounded(0.0, ge=0, le=1)
    """Final learning rate of linear/cosine decay, as a fraction of lr."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward to save memory."""
    compile: bool = False
    """torch.compile each decoder layer, fusing its elementwise ops (RMSNorm, RoPE, SwiGLU, ...); costs a one-off
    compile time.

    Off by default; on the CPU, --cpu-fused-layers (on by default) already runs these ops of Llama-family
    layers as fused csrc kernels, without compiling.
    """
    loss_scale: float = bounded(0.0, ge=0)
    """fp16 only: static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = bounded(16, ge=0, le=64)
    """fp16 dynamic scaling: the initial scale is 2**initial_scale_power."""
    loss_scale_window: int = bounded(1000, ge=1)
    """fp16 dynamic scaling: steps without overflow before the scale doubles."""
    hysteresis: int = bounded(2, ge=1)
    """fp16 dynamic scaling: overflows tolerated before the scale is halved."""
    min_loss_scale: float = bounded(1.0, gt=0)
    """fp16 dynamic scaling: the scale never drops below this."""
    max_skipped_steps: int = bounded(10, ge=0)
    """Stop the run after this many optimizer steps in a row were skipped for a non-finite (NaN/inf) loss or gradient;
    0: never stop.

    A stopped run writes no model and no DONE; checkpoints already saved are kept. With fp16 dynamic loss
    scaling only overflows at min_loss_scale count. With 0 every such step is skipped and counted.
    """
    seed: int = bounded(42, ge=0)
    """Seed of model init, data order, dropout and sampling."""
    dist_timeout: float = bounded(600.0, gt=0)
    """Seconds a collective may wait for the other ranks, and a rank may go without progress, before the job stops
    with one line naming the rank.

    A rank that makes no progress for this long (stopped, hung, or its host gone) is named by the other
    ranks, which stop the job.
    """

    def validate(self, where: str = "config") -> None:
        """Rules between fields, checked once after every source is applied (each field's own
        rule was checked when it was set; the batch arithmetic needs the world size and is
        resolved and checked by `rlhf.engine.batch_size.resolved_batch`)."""
        if self.offload and self.zero_stage == 0:
            raise UserError(f"{where}: offload: true must be used with zero_stage 1, 2 or 3 (ZeRO-Offload moves "
                            "sharded optimizer state to the CPU; zero_stage 0 shards nothing)")
