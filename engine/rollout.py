"""Rollout mode: the actor's FSDP2 training shards -> tensor-parallel inference placements.

    with rollout_mode(actor_engine, tp_size=2) as rollout:
        out = rollout.generate(prompt_ids, prompt_mask, sampling)   # KV cache allocated last
    # back in train mode: inference copies and cache freed, training params untouched

The transition is an explicit sequence, memory logged at each step:
  1. the first time: build an inference skeleton of the actor on the meta device and materialise it
     in the compute dtype; apply the model family's tensor-parallel plan (HF `base_model_tp_plan`:
     attention and MLP projections colwise/rowwise) over the TP sub-mesh. The skeleton is kept
     with the engine and reused by every later switch (`RolloutSkeleton`): its parameter storage
     is released on exit and allocated again on entry, so nothing is rebuilt and train mode does
     not pay for an idle copy;
  2. fill it from the training shards param by param with DTensor redistribution: when the TP group
     spans the FSDP group and the dim divides evenly, each rank receives only the slices it needs
     (colwise: none, rowwise: an all-to-all); otherwise the param is gathered and sliced;
  3. generation allocates its KV cache (the last allocation);
  4. a parity check compares train-mode and rollout-mode log-probs of a few generated tokens and
     raises past a tolerance;
  5. on exit the inference copies' storage and the cache are freed; the training params were only
     read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import AutoModelForCausalLM

from rlhf.engine.distributed import DistributedContext
from rlhf.engine.sharding import COMPUTE_DTYPES
from rlhf.engine.backends.registry import backend_for
from rlhf.engine.fast_decode import share_fused_storage
from rlhf.engine.multi_turn import Respond, TurnsOutput, generate_turns
from rlhf.engine.generation import GenerationOutput, generate
from rlhf.engine.inference import causal_lm_logprobs
from rlhf.engine.adapters import merged_parameters
from rlhf.engine.sampling import SamplingParams
from rlhf.engine.train_engine import TrainEngine
from rlhf.errors import UserError
from rlhf.logging import get_logger

log = get_logger(__name__)

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


class RolloutParityError(RuntimeError):
    """Rollout-mode log-probs disagree with train mode beyond the tolerance: a resharding bug."""


def memory_snapshot(device: torch.device) -> str:
    """Allocated/reserved GPU memory, or this process's resident memory on CPU."""
    if device.type == "cuda":
        return (f"allocated={torch.cuda.memory_allocated(device) / 2**30:.2f}GiB "
                f"reserved={torch.cuda.memory_reserved(device) / 2**30:.2f}GiB")
    try:
        pages = int(open("/proc/self/statm").read().split()[1])
        return f"rss={pages * os.sysconf('SC_PAGE_SIZE') / 2**30:.2f}GiB"
    except OSError:
        return "rss=?"


def tensor_parallel_plan(model: nn.Module, tp_size: int) -> dict[str, nn.Module]:
    """FQN -> ParallelStyle for every decoder-layer projection named in the family's TP plan."""
    config = model.config
    plan_spec = getattr(config, "base_model_tp_plan", None) or {}
    if not plan_spec:
        raise UserError(
            f"inference_tp_size={tp_size}: the {config.model_type} family has no tensor-parallel plan; "
            "use --inference-tp-size 1"
        )
    for attr in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, attr, None)
        if value is not None and value % tp_size:
            raise UserError(f"inference_tp_size={tp_size} must divide the model's {attr} ({value})")
    prefix = model.base_model_prefix
    plan: dict[str, nn.Module] = {}
    module_names = {name for name, _ in model.named_modules()}
    for pattern, style in plan_spec.items():
        if style not in _STYLES:
            continue  # e.g. embedding/norm styles: those stay replicated
        for i in range(config.num_hidden_layers):
            fqn = f"{prefix}.{pattern.replace('*', str(i))}"
            if fqn in module_names:
                plan[fqn] = _STYLES[style]()
    return plan


def build_inference_skeleton(train_model: nn.Module, ctx: DistributedContext, tp_size: int, dtype: torch.dtype) -> nn.Module:
    """An empty copy of the actor in the compute dtype on this rank's device, TP-parallelised.

    Built from the config, never copied from the train model, so its layers are plain even when
    train mode compiled them (`--compile`): a decode step through a KV cache would recompile."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(train_model.config, dtype=dtype)
    model.to_empty(device=ctx.device)
    # to_empty gives every module its own new tensor, which unties tied input/output embeddings
    # (Llama-3.2, Qwen2, SmolLM, Gemma): tie them again so the head reads the embedding.
    if getattr(model.config.get_text_config(decoder=True), "tie_word_embeddings", False):
        model.tie_weights()
    # Non-persistent buffers (rotary inv_freq, ...) are not in any checkpoint: take them from train mode.
    train_buffers = dict(train_model.named_buffers())
    for name, buf in model.named_buffers():
        if name in train_buffers:
            buf.copy_(train_buffers[name].to(buf.dtype) if buf.is_floating_point() else train_buffers[name])
    model.eval()
    if tp_size > 1:
        parallelize_module(model, ctx.tp_mesh(tp_size)["tp"], tensor_parallel_plan(model, tp_size))
    else:
        # q/k/v and gate/up rows side by side, once: the fast decoder reads them fused in place.
        share_fused_storage(model)
        # Layers and linears as train mode runs them (the device backend's): HF generation's too.
        backend_for(ctx.device).prepare_like(model, train_model)
    model.requires_grad_(False)
    return model


class RolloutSkeleton:
    """An actor's inference skeleton, kept across rollouts: built once, its parameter storage
    released between them (`release`) and allocated again before the weights are loaded
    (`allocate`). Module structure, TP wrappers and buffers (RoPE tables) stay."""

    def __init__(self, model: nn.Module, tp_size: int, dtype: torch.dtype) -> None:
        self.model = model
        self.tp_size = tp_size
        self.dtype = dtype
        # Unique parameters only (a tied head is the embedding), with their storage sizes.
        self._storages = [(local, local.untyped_storage().nbytes())
                          for local in (_local(p) for p in model.parameters())]
        self.allocated = True

    def release(self) -> None:
        """Free the parameter storage (the tensors stay, empty, until `allocate`)."""
        for local, _ in self._storages:
            local.untyped_storage().resize_(0)
        self.allocated = False

    def allocate(self) -> None:
        """Give every parameter its storage back (uninitialised: `load_rollout_weights` fills it)."""
        for local, nbytes in self._storages:
            storage = local.untyped_storage()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
        self.allocated = True


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


_SKELETONS: weakref.WeakKeyDictionary[TrainEngine, RolloutSkeleton] = weakref.WeakKeyDictionary()


def rollout_skeleton(engine: TrainEngine, tp_size: int, dtype: torch.dtype) -> RolloutSkeleton:
    """`engine`'s kept skeleton with its storage allocated, built on the first call (or when the
    TP size or dtype changed)."""
    skeleton = _SKELETONS.get(engine)
    if skeleton is None or skeleton.tp_size != tp_size or skeleton.dtype != dtype:
        skeleton = RolloutSkeleton(build_inference_skeleton(engine.model, engine.ctx, tp_size, dtype), tp_size, dtype)
        _SKELETONS[engine] = skeleton
        log.info("rollout mode: inference skeleton built (kept for later rollouts)")
    elif not skeleton.allocated:
        skeleton.allocate()
    return skeleton


def _local_target(src: torch.Tensor, dst: torch.Tensor, ctx: DistributedContext, tp_size: int) -> torch.Tensor:
    """This rank's part of training param `src` in the placement of inference param `dst`."""
    if not isinstance(src, DTensor):
        return src
    if src.device_mesh.size() == 1 and not isinstance(dst, DTensor):  # one rank holds it whole: no collective
        return src.to_local()
    if not isinstance(dst, DTensor):
        return src.full_tensor()
    target = dst.placements[0]
    mesh = dst.device_mesh
    same_group = tp_size == ctx.world_size and src.device_mesh.ndim == 1
    if same_group and src.placements == (Shard(0),) and src.shape[0] % ctx.world_size == 0:
        # FSDP2's dim-0 shards over the world are exactly Shard(0) over the TP group: redistribute
        # moves only what the target placement needs (nothing for colwise, an all-to-all for rowwise).
        as_tp = DTensor.from_local(src.to_local(), mesh, [Shard(0)], run_check=False, shape=src.shape, stride=src.stride())
        return as_tp.redistribute(mesh, [target]).to_local()
    full = src.full_tensor()
    if isinstance(target, Replicate):
        return full
    assert isinstance(target, Shard)
    return torch.chunk(full, tp_size, dim=target.dim)[mesh.get_local_rank()]


@torch.no_grad()
def load_rollout_weights(inference: nn.Module, train_model: nn.Module, ctx: DistributedContext, tp_size: int) -> int:
    """Copy (and cast) every training param into the inference model; returns bytes received
    locally. LoRA adapters are merged into their base weights here, on the shards, once per
    switch (`engine.adapters.merged_parameters`): generation runs the plain model."""
    train_params = merged_parameters(train_model)
    moved = 0
    for name, dst in inference.named_parameters():
        src = train_params[name]
        local = _local_target(src.data if not isinstance(src, DTensor) else src, dst, ctx, tp_size)
        dst_local = dst.to_local() if isinstance(dst, DTensor) else dst
        dst_local.copy_(local)
        moved += dst_local.numel() * dst_local.element_size()
    return moved


def sequence_logprobs(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Log-prob of each token given its prefix ([B, T-1], position t scores token t+1).

    The same forward as the frozen reference model's (`causal_lm_logprobs`), so the parity check
    compares exactly what PPO computes in train mode.
    """
    return causal_lm_logprobs(model, sequences, attention_mask)[0]


@dataclass
class Rollout:
    """The actor in rollout mode: generate with it; the first generation is parity-checked."""

    model: nn.Module
    engine: TrainEngine
    tolerance: float
    checks_parity: bool = True
    """Whether the first generation is parity-checked (the trainer checks its first rollout and
    then periodically: the resharding is the same code every time)."""
    parity_sequences: int = 2
    parity_tokens: int = 16
    """Generated tokens of each checked sequence that the check scores (its train-mode forward
    runs over the prompt and these only: causal, so their log-probs are the full sequence's)."""
    parity_max_diff: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None = None,
                 samples_per_prompt: int | torch.Tensor = 1) -> GenerationOutput:
        """`engine.generation.generate` on the rollout model; `samples_per_prompt` as there (group
        sampling: one prefill per unique prompt, sum(counts) output rows)."""
        out = generate(self.model, input_ids, attention_mask, params, generator, samples_per_prompt=samples_per_prompt)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rollout: KV cache allocated and released; %s", memory_snapshot(self.engine.ctx.device))
        if self.checks_parity and self.parity_max_diff is None:
            self.check_parity(out)
        return out

    def generate_turns(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator | None, respond: Respond,
                       samples_per_prompt: int | torch.Tensor = 1) -> TurnsOutput:
        """`engine.multi_turn.generate_turns` on the rollout model: turns answered by `respond`."""
        out = generate_turns(self.model, input_ids, attention_mask, params, generator, respond, samples_per_prompt)
        if self.checks_parity and self.parity_max_diff is None:
            self.check_parity(out)
        return out

    @torch.no_grad()
    def check_parity(self, out: GenerationOutput) -> float:
        """Max |log-prob difference| between train and rollout mode over a few generated tokens
        (the first `parity_tokens` of the first `parity_sequences` rows).
        In fp32 the rollout side is generation's own log-probs (the decode path that sampled them,
        KV cache included; one forward fewer); in 16-bit, where decoding rounds differently from a
        full forward, a rollout-mode forward like the train-mode one."""
        n = min(self.parity_sequences, out.sequences.shape[0])
        width = out.prompt_length + self.parity_tokens
        seqs, mask = out.sequences[:n, :width], out.attention_mask[:n, :width]
        actions = out.action_mask[:n, 1:width]
        train_lp = sequence_logprobs(self.engine.model, seqs, mask)
        if out.logprobs is not None and self.engine.dtype == "fp32":  # column t + 1's token is position t's
            rollout_lp = out.logprobs[:n, 1:width]
        else:
            rollout_lp = sequence_logprobs(self.model, seqs, mask)
        diff = (train_lp.float() - rollout_lp.float()).abs()
        max_diff = float(diff[actions].max()) if actions.any() else 0.0
        max_diff = float(self.engine.ctx.all_reduce_max(torch.tensor(max_diff)))
        self.parity_max_diff = max_diff
        self.metrics["rollout_parity_max_diff"] = max_diff
        if not max_diff <= self.tolerance:
            raise RolloutParityError(
                f"rollout-mode log-probs differ from train mode by {max_diff:.3g} (> tolerance {self.tolerance}); "
                "the resharded weights are wrong"
            )
        return max_diff


def default_parity_tolerance(dtype: str, halved_kv_cache: bool = False) -> float:
    """Max log-prob difference tolerated between modes: tight in fp32, loose in 16-bit. A float16
    KV cache under an fp32 model (`halved_kv_cache`, `Backend.rounds_kv_cache`) rounds
    every cached key and value: on SmolLM2-135M its rollout log-probs differ from the training
    forward's by up to ~9e-3 (mean ~9e-4), so 0.05."""
    if dtype != "fp32":
        return 0.15
    return 0.05 if halved_kv_cache else 1e-3


@contextlib.contextmanager
def rollout_mode(engine: TrainEngine, tp_size: int = 1, tolerance: float | None = None,
                 check_parity: bool = True) -> Iterator[Rollout]:
    """Switch `engine`'s model to tensor-parallel inference for the duration of the block
    (`check_parity`: its first generation is compared with train mode, `Rollout.check_parity`)."""
    ctx = engine.ctx
    ctx.tp_coordinates(tp_size)  # the world-size check, before anything is built
    dtype = COMPUTE_DTYPES[engine.dtype]
    was_training = engine.model.training
    # The first switch is logged; later ones (every PPO iteration) at debug level.
    level = logging.INFO if _SKELETONS.get(engine) is None else logging.DEBUG
    logged = log.isEnabledFor(level)
    if logged:
        log.log(level, "rollout mode: enter (train mode: %s)", memory_snapshot(ctx.device))
    engine.model.eval()
    skeleton = rollout_skeleton(engine, tp_size, dtype)
    moved = load_rollout_weights(skeleton.model, engine.model, ctx, tp_size)
    if logged:
        log.log(level, "rollout mode: tp=%d weights loaded (%.1f MiB local, %s)", tp_size, moved / 2**20,
                memory_snapshot(ctx.device))
    tolerance = tolerance if tolerance is not None else default_parity_tolerance(engine.dtype)
    rollout = Rollout(skeleton.model, engine, tolerance, check_parity)
    rollout.metrics["rollout_weights_mib"] = moved / 2**20
    try:
        yield rollout
    finally:
        rollout.model = None  # type: ignore[assignment]
        # The copies' storage and the KV cache go back to the caching allocator, whose blocks the
        # training phase reuses (emptying the cache would hand them to the driver and back every iteration).
        skeleton.release()
        if was_training:
            engine.model.train()
        if logged:
            log.log(level, "rollout mode: exit, back in train mode (%s)", memory_snapshot(ctx.device))
