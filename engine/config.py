"""The engine's own configuration: sharding, precision, batch arithmetic, optimizer and schedule.

The engine depends on nothing above it; the app (`rlhf.config`) composes this dataclass into each
stage's config as its `engine:` section. Each field's docstring is its CLI help.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Dtype = Literal["auto", "fp32", "bf16", "fp16"]
Scheduler = Literal["constant", "linear", "cosine"]
OptimizerImpl = Literal["auto", "fused", "torch"]


@dataclass
class EngineConfig:
    """How a model is trained: sharding, precision, batch arithmetic, optimizer and schedule."""

    zero_stage: int = 3
    """ZeRO stage: 3 shards params, grads and optimizer state (FSDP2 reshard after forward); 1 and 2 keep params gathered between forward and backward; 0 replicates (DDP-like)."""
    offload: bool = False
    """ZeRO-Offload: keep sharded params, grads and optimizer state on CPU and step the optimizer there."""
    dtype: Dtype = "auto"
    """Compute precision: bf16 or fp16 (params cast for compute, fp32 master weights and reductions), fp32, or auto (bf16 on a GPU that supports it, else fp32)."""
    micro_batch_size: int = 4
    """Samples per rank per forward/backward (DeepSpeed train_micro_batch_size_per_gpu)."""
    grad_accum: int | None = None
    """Micro-batches accumulated per optimizer step; derived from train_batch_size when unset, else 1."""
    train_batch_size: int | None = None
    """Global batch per optimizer step; must equal micro_batch_size x grad_accum x data-parallel size."""
    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay; never applied to biases and norm weights (1-D params)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    optimizer_impl: OptimizerImpl = "auto"
    """AdamW implementation: fused (csrc kernels), torch (torch.optim.AdamW), or auto (fused where it is built)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    lr_scheduler: Scheduler = "cosine"
    """Learning-rate schedule after warmup: constant, linear decay or cosine decay to min_lr_ratio x lr."""
    warmup_steps: int = 0
    """Linear warmup steps from warmup_start_ratio x lr to lr (overrides warmup_ratio when > 0)."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of the total optimizer steps, used when warmup_steps is 0."""
    warmup_start_ratio: float = 0.0
    """Learning rate at the start of warmup, as a fraction of lr."""
    min_lr_ratio: float = 0.0
    """Final learning rate of linear/cosine decay, as a fraction of lr."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward to save memory."""
    loss_scale: float = 0.0
    """fp16 only: static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = 16
    """fp16 dynamic scaling: the initial scale is 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """fp16 dynamic scaling: steps without overflow before the scale doubles."""
    hysteresis: int = 2
    """fp16 dynamic scaling: overflows tolerated before the scale is halved."""
    min_loss_scale: float = 1.0
    """fp16 dynamic scaling: the scale never drops below this."""
    seed: int = 42
    """Seed of model init, data order, dropout and sampling."""
