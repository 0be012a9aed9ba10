"""The batch arithmetic, resolved once per run before any model loads (DeepSpeed's rule):

    train_batch_size = micro_batch_size x grad_accum x data-parallel size

`resolved_batch` returns a new EngineConfig with all three set; the input is left as it was. Each
stage resolves its config once at its start (rlhf.stages.trainer.start_stage), `rlhf plan` with the
same function, and everything after (TrainEngine, the loops, config.yaml) reads the resolved values.
A stage with its own default global batch (PPO: the whole experience) passes it in.
"""

from __future__ import annotations

import dataclasses

from rlhf.engine.config import EngineConfig
from rlhf.errors import UserError


def resolved_batch(config: EngineConfig, dp_size: int, default_train_batch: int | None = None,
                   max_micro: int | None = None, where: str = "config") -> EngineConfig:
    """`config` with micro_batch_size, grad_accum and train_batch_size set and checked
    (micro x accum x dp = global); a new EngineConfig, `config` unchanged.

    With neither train_batch_size nor grad_accum set: the global batch is `default_train_batch`
    when given (in micro-batches of at most `max_micro` rows), else one micro-batch per rank
    (grad_accum 1). The one batch rule that needs the world size; each size's own range (>= 1) is
    checked where EngineConfig defines it. `where` opens the error line (the stage, or "plan")."""
    micro, accum, train = config.micro_batch_size, config.grad_accum, config.train_batch_size
    if train is None and accum is None and default_train_batch is not None:
        train = default_train_batch
        micro = micro if max_micro is None else min(micro, max_micro)
    if train is None:
        accum = accum or 1
        train = micro * accum * dp_size
    elif accum is None:
        if train % (micro * dp_size):
            raise UserError(
                f"{where}: train_batch_size {train} is not divisible by micro_batch_size "
                f"{micro} x data-parallel size {dp_size}; change train_batch_size or micro_batch_size"
            )
        accum = train // (micro * dp_size)
    elif train != micro * accum * dp_size:
        raise UserError(
            f"{where}: train_batch_size {train} != micro_batch_size {micro} x grad_accum "
            f"{accum} x data-parallel size {dp_size} = {micro * accum * dp_size}; "
            "make them agree (or leave one of train_batch_size / grad_accum unset)"
        )
    return dataclasses.replace(config, micro_batch_size=micro, grad_accum=accum, train_batch_size=train)


def is_resolved(config: EngineConfig) -> bool:
    """Whether `config` went through `resolved_batch` (grad_accum and train_batch_size both set)."""
    return config.grad_accum is not None and config.train_batch_size is not None


__all__ = ["is_resolved", "resolved_batch"]
