"""What a ZeRO stage means under FSDP2, and the compute dtypes: the sharding decisions, before any model.

`sharding_plan` is the one place that reads a ZeRO stage number; `apply_fsdp` (engine/fsdp.py),
`TrainEngine`, `FrozenModel` and the memory plan (engine/memory_plan.py) read the plan it makes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """Turn "auto" into bf16 on a GPU that supports it, else fp32."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


@dataclass(frozen=True)
class ShardingPlan:
    """What a ZeRO stage means under FSDP2, for a trained or a frozen model.

    Trained models:
        3    -> shard params, grads and optimizer state; reshard params after forward; reduce-scatter
                grads every micro-step (they stay sharded)
        1, 2 -> shard grads and optimizer state; keep params gathered from forward until backward;
                accumulate unsharded grads locally and communicate once per optimizer step
        0    -> replicate everything (HSDP over a (world, 1) mesh: data parallel, nothing sharded)
    Frozen models (reference policy, reward model) take the same plan, except that stage 0 is
    sharded like stage 3: a frozen model has no grads and no optimizer state, so sharding its
    params is the only saving ZeRO can offer it, and replicating it would cost memory for nothing.
    """

    zero_stage: int
    """The stage the plan was made from (after the frozen 0 -> 3 rule)."""
    mesh: Literal["shard", "replicate"]
    """"shard": the 1-D ("dp",) mesh over all ranks; "replicate": the (world, 1) HSDP mesh."""
    reshard_after_forward: bool
    """Free the gathered params after forward (gather again in backward) instead of keeping them."""
    sync_grads_every_micro_step: bool
    """Reduce grads after every micro-batch's backward, not only at the accumulation boundary."""


def sharding_plan(zero_stage: int, trainable: bool = True) -> ShardingPlan:
    """The ShardingPlan of `zero_stage` (0-3, validated by the config) for a trained or frozen model."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} is not a ZeRO stage; expected 0, 1, 2 or 3")
    if not trainable and zero_stage == 0:
        zero_stage = 3
    return ShardingPlan(
        zero_stage=zero_stage,
        mesh="replicate" if zero_stage == 0 else "shard",
        reshard_after_forward=zero_stage == 3,
        sync_grads_every_micro_step=zero_stage == 3,
    )


def wraps_in_fsdp(world_size: int, offload: bool, dtype: str, trainable: bool) -> bool:
    """Whether FSDP2 has anything to do for a model: shard it over several processes, offload it,
    or (trained) keep fp32 master weights under 16-bit compute. Otherwise (one process, on the
    device, and for a trained model fp32) it would only copy each layer's weights into its
    all-gather buffer on every forward and each gradient through its reduce-scatter buffer on
    every backward (SmolLM2-135M on a CPU: 19% of PPO's training phase); the model's parameters
    then stay plain tensors, with the same values, gradients and optimizer steps."""
    if world_size > 1 or offload:
        return True
    return trainable and dtype != "fp32"


__all__ = ["COMPUTE_DTYPES", "ShardingPlan", "resolve_dtype", "sharding_plan", "wraps_in_fsdp"]
