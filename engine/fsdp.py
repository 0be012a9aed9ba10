"""Train mode: apply activation checkpointing, torch.compile and FSDP2 to a plain Hugging Face model.

The order is fixed (as in torchtitan): activation checkpointing per decoder layer, then (opt-in)
torch.compile of each decoder layer, then `fully_shard` on each decoder layer, then on the root
(embeddings, final norm, head). What a ZeRO
stage means is written once, in `sharding_plan` (engine/sharding.py); `apply_fsdp`, `TrainEngine` and
`FrozenModel` read the plan, never the stage number.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import Cache

from rlhf.engine.backends.registry import backend_for
from rlhf.engine.sharding import COMPUTE_DTYPES, ShardingPlan
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.decoder_layers import decoder_layers
from rlhf.errors import UserError
from rlhf.logging import get_logger

log = get_logger(__name__)

def mixed_precision_policy(dtype: str) -> MixedPrecisionPolicy:
    """Compute in `dtype`, keep fp32 master params, reduce gradients in fp32."""
    if dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPES[dtype], reduce_dtype=torch.float32)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every decoder layer in backward (non-reentrant checkpointing)."""
    target = getattr(model, "backbone", model)
    kwargs = {"use_reentrant": False}
    if hasattr(target, "activation_checkpointing_enable"):  # transformers 5.2x's name
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(target, "gradient_checkpointing_enable"):  # before (a deprecated alias since, gone in v6)
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise UserError(f"{type(model).__name__} does not support gradient checkpointing; drop --gradient-checkpointing")
    config = getattr(target, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False


RECOMPILE_LIMIT = 64
"""Dynamo's per-code recompile limit under --compile (torch's default is 8). Every decoder layer of
every model in the process runs one code object (transformers' checkpointing wrapper of `forward`),
so all their variants share the limit: shapes static then dynamic x grad/no-grad x trained/frozen
params x activation checkpointing x padded or not. A PPO run with activation checkpointing reached 8;
past the limit dynamo runs every new variant eager, with one warning."""


def _holds_kv_cache(args: tuple, kwargs: dict) -> bool:
    """A layer call that reads or writes a KV cache (positional for GPT-2, a keyword elsewhere)."""
    return any(isinstance(v, Cache) for v in (*args, *kwargs.values()))


def compile_decoder_layer(layer: nn.Module) -> None:
    """torch.compile one decoder layer in place (`nn.Module.compile`), except its KV-cache calls.

    In place, the layer keeps its type and parameter names: state dicts, DCP checkpoints and the
    rollout copy (built from the config, never copied from a compiled layer) see the plain model,
    unlike a `torch.compile(layer)` wrapper's `_orig_mod.` names. Layers of a class share one
    compiled code (dynamo guards on structure, not on which layer), so the one-off cost does not grow
    with depth; the first change of sequence length compiles once more with dynamic dims, and
    grad/no-grad forwards compile once each. A call through a KV cache (prompt sharing's
    prefix-then-tail forward) runs eager: the cache specialises every layer index and fill state into
    its own graph, which would spend dynamo's recompile limit (shared by all layers) in one forward.
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        # Under activation checkpointing, torch >= 2.14 refuses (and runs eager) a layer whose forward
        # has a side effect: transformers' output-capturing hooks read a context variable. Those
        # hooks record nothing in training, so the recompute in backward need not replay them.
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    layer.compile()
    compiled, eager = layer._compiled_call_impl, layer._call_impl

    def call(*args: object, **kwargs: object) -> object:
        return eager(*args, **kwargs) if _holds_kv_cache(args, kwargs) else compiled(*args, **kwargs)

    layer._compiled_call_impl = call


class ShardLoader(Protocol):
    """What fills a model built on the meta device once it is sharded (the app's safetensors reader,
    rlhf/models/sharded_loading.py): the engine allocates this rank's shards, the loader writes them."""

    def load_local_shards(self, model: nn.Module) -> None:
        """Write every parameter's local shard (`DTensor.to_local()`, already allocated) of `model`."""
        ...


def local_shard(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's storage of `param` and the part of the global tensor it holds: FSDP2's dim-0
    chunk (`torch.chunk` over the mesh: an uneven last chunk, possibly empty; the whole tensor over
    ZeRO-0's replicated mesh) for a DTensor, all of it otherwise. Sharded loading reads exactly
    this part of each checkpoint tensor, and the export writes it back in place."""
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return param.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return param.data, tuple(slice(0, n) for n in param.shape)


def on_meta(model: nn.Module) -> bool:
    """The model's parameters are on the meta device (built for sharded loading)."""
    return any(p.is_meta for p in model.parameters())


@torch.no_grad()
def materialize_local_shards(model: nn.Module, device: torch.device, weights: ShardLoader) -> None:
    """Allocate the local shards of a sharded meta model on `device` and let `weights` fill them.

    `to_empty` also replaces every buffer by an uninitialised one; the buffers are real already
    (non-persistent ones such as RoPE's inv_freq are in no checkpoint), so they are put back. Tied
    parameters stay one (FSDP2 swaps each DTensor parameter's contents in place; an unsharded
    model's are tied again)."""
    buffers = [(module, name, buf) for module in model.modules() for name, buf in module._buffers.items()
               if buf is not None]
    # An unsharded model's tied parameters (an LM head that is the embedding table) are untied by
    # to_empty, which gives every module its own tensor: tie them again afterwards.
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for module, name, buf in buffers:
        module._buffers[name] = buf
    for (first, first_name), *others in places.values():
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    weights.load_local_shards(model)


def apply_fsdp(
    model: nn.Module,
    ctx: DistributedContext,
    plan: ShardingPlan,
    dtype: str,
    offload: bool,
    *,
    gradient_checkpointing: bool = False,
    compile: bool = False,
    weights: ShardLoader | None = None,
    shard: bool = True,
) -> nn.Module:
    """Wrap `model` in place as `plan` says; returns it (now an FSDPModule with DTensor params).
    `shard` False (`wraps_in_fsdp` finds nothing for FSDP2 to do) prepares the model the same
    way (the device backend's layers, compiled layers, device, sharded loading) and leaves its
    parameters plain. First the device's backend swaps in its fast modules
    (`Backend.prepare_model`: on the CPU fused layers and oneDNN linears; nothing under `compile`).
    With `compile`, each decoder layer is compiled before it is sharded (torchtitan's order), so
    FSDP2's all-gather/reshard hooks stay outside the compiled code. A model on the meta device is
    sharded first and then filled by `weights` (only this rank's shards are ever allocated)."""
    if offload and plan.mesh == "replicate":
        # The config rejects offload with zero_stage 0 (EngineConfig); this guards direct callers.
        raise ValueError("offload needs sharded optimizer state: a replicated (ZeRO-0) plan cannot offload")
    deferred = on_meta(model)
    if deferred and weights is None:
        raise ValueError("a model on the meta device needs `weights` (a ShardLoader) to fill its shards")
    swapped = backend_for(ctx.device).prepare_model(model, compile=compile)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    mesh = ctx.replicate_mesh if plan.mesh == "replicate" else ctx.mesh
    reshard = plan.reshard_after_forward
    mp_policy = mixed_precision_policy(dtype)
    offload_policy: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if offload else OffloadPolicy()
    )
    if not offload and not deferred:
        model.to(ctx.device)
    layers = decoder_layers(model)
    for layer in layers:
        if compile:
            compile_decoder_layer(layer)
        if shard:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                        offload_policy=offload_policy)
    if shard:
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload_policy)
    if deferred:
        assert weights is not None
        materialize_local_shards(model, torch.device("cpu") if offload else ctx.device, weights)
    log.info(
        "FSDP2: zero_stage=%d dtype=%s offload=%s layers=%d activation_checkpointing=%s compile=%s swapped=%s "
        "world=%d sharded_loading=%s sharded=%s",
        plan.zero_stage, dtype, offload, len(layers), gradient_checkpointing, compile, swapped or "none", ctx.world_size,
        deferred, shard,
    )
    return model


def local_parameter_count(model: nn.Module) -> int:
    """Parameters stored on this rank (local shards of DTensors)."""
    total = 0
    for p in model.parameters():
        total += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    return total
