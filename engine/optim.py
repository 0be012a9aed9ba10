"""AdamW with weight-decay groups, and learning-rate schedules with warmup."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from rlhf.engine.config import EngineConfig
from rlhf.logging import get_logger

log = get_logger(__name__)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices decay, 1-D params (biases, norm weights) never do."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, config: EngineConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over `model`'s (possibly sharded) params; the implementation follows config.optimizer_impl."""
    groups = param_groups(model, config.weight_decay)
    kwargs = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
    impl = config.optimizer_impl
    if impl in ("auto", "fused"):
        from rlhf.engine.fused_adam import FusedAdamW, fused_adam_available

        if fused_adam_available(device):
            return FusedAdamW(groups, **kwargs)
        if impl == "fused":
            log.warning("optimizer_impl=fused but the fused Adam op is not built for %s; using torch AdamW", device)
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


def lr_lambda(
    schedule: str, total_steps: int, warmup_steps: int, warmup_start_ratio: float, min_lr_ratio: float
) -> Callable[[int], float]:
    """Multiplier of the peak LR at optimizer step `s` (0-based): linear warmup, then the schedule."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return warmup_start_ratio + (1.0 - warmup_start_ratio) * step / warmup_steps
        if schedule == "constant":
            return 1.0
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        if schedule == "linear":
            return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
        if schedule == "cosine":
            return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"unknown lr schedule {schedule!r}")

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, config: EngineConfig, total_steps: int) -> LambdaLR:
    """The LR schedule of `config` over `total_steps` optimizer steps."""
    warmup = config.warmup_steps or int(round(config.warmup_ratio * total_steps))
    return LambdaLR(
        optimizer,
        lr_lambda(config.lr_scheduler, total_steps, warmup, config.warmup_start_ratio, config.min_lr_ratio),
    )
