"""Train mode: apply activation checkpointing and FSDP2 to a plain Hugging Face model.

The order is fixed (as in torchtitan): activation checkpointing per decoder layer, then
`fully_shard` on each decoder layer, then on the root (embeddings, final norm, head). ZeRO stages
map onto FSDP2 as DESIGN.md says:

    3    -> shard params, grads and optimizer state; reshard params after forward
    1, 2 -> shard grads and optimizer state; keep params gathered from forward until backward
    0    -> replicate everything (HSDP over a (world, 1) mesh: data parallel, nothing sharded)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from rlhf.engine.distributed import DistributedContext
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.engine.layers import decoder_layers

log = get_logger(__name__)

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """Turn "auto" into bf16 on a GPU that supports it, else fp32."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def mixed_precision_policy(dtype: str) -> MixedPrecisionPolicy:
    """Compute in `dtype`, keep fp32 master params, reduce gradients in fp32."""
    if dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPES[dtype], reduce_dtype=torch.float32)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every decoder layer in backward (non-reentrant checkpointing)."""
    target = getattr(model, "backbone", model)
    if not hasattr(target, "gradient_checkpointing_enable"):
        raise UserError(f"{type(model).__name__} does not support gradient checkpointing; drop --gradient-checkpointing")
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = getattr(target, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False


def apply_fsdp(
    model: nn.Module,
    ctx: DistributedContext,
    zero_stage: int,
    dtype: str,
    offload: bool,
    gradient_checkpointing: bool = False,
) -> nn.Module:
    """Wrap `model` in place for training; returns it (now an FSDPModule with DTensor params)."""
    if zero_stage not in (0, 1, 2, 3):
        raise UserError(f"zero_stage={zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3")
    if offload and zero_stage == 0:
        raise UserError("offload needs sharded optimizer state: use zero_stage 1, 2 or 3 with --offload")
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    mesh = ctx.replicate_mesh if zero_stage == 0 else ctx.mesh
    reshard = zero_stage == 3
    mp_policy = mixed_precision_policy(dtype)
    offload_policy: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if offload else OffloadPolicy()
    )
    if not offload:
        model.to(ctx.device)
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload_policy)
    log.info(
        "FSDP2: zero_stage=%d dtype=%s offload=%s layers=%d activation_checkpointing=%s world=%d",
        zero_stage, dtype, offload, len(layers), gradient_checkpointing, ctx.world_size,
    )
    return model


def local_parameter_count(model: nn.Module) -> int:
    """Parameters stored on this rank (local shards of DTensors)."""
    total = 0
    for p in model.parameters():
        total += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    return total
