"""Inference-only models of the hybrid engine (reference policy, reward model).

They are FSDP2-sharded like the trained models, by `sharding_plan(zero_stage, trainable=False)`
(which shards stage 0 like stage 3: see ShardingPlan), optionally offloaded to CPU, but have no
optimizer; every call runs under no_grad in micro-batches. Their weights are held in the compute
dtype (bf16/fp16 halve their memory against fp32): a frozen model has no master weights to keep
precise, and FSDP2's mixed-precision policy casts every parameter to that dtype for each forward
anyway, so the outputs are bit-for-bit those of an fp32 copy run in mixed precision.
"""

from __future__ import annotations

import torch
from torch import nn

from rlhf.engine.distributed import DistributedContext
from rlhf.engine.fsdp import COMPUTE_DTYPES, apply_fsdp, resolve_dtype, sharding_plan
from rlhf.engine.logprobs import logprobs_from_logits
from rlhf.engine.positions import position_ids_from_mask
from rlhf.engine.prompt_sharing import shared_prompt_logprobs
from rlhf.logging import get_logger

log = get_logger(__name__)


def causal_lm_logprobs(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [B, T-1] of each next token, logits [B, T, V]) of a causal LM."""
    logits = model(input_ids=sequences, attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask), use_cache=False).logits
    return logprobs_from_logits(logits, sequences), logits


def micro_batch_slices(n: int, size: int) -> list[slice]:
    """Consecutive slices of at most `size` rows covering range(n): the micro-batches of every
    batched forward (frozen models, the PPO actor's old log-probs and the critic's values)."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


class FrozenModel:
    """A sharded, frozen model that answers batched log-prob or score queries."""

    def __init__(self, model: nn.Module, ctx: DistributedContext, zero_stage: int, dtype: str, offload: bool,
                 micro_batch_size: int, name: str) -> None:
        model.requires_grad_(False)
        model.eval()
        dtype = resolve_dtype(dtype, ctx.device)
        for param in model.parameters():  # parameters only: buffers such as RoPE's inv_freq stay fp32
            param.data = param.data.to(COMPUTE_DTYPES[dtype])
        self.model = apply_fsdp(model, ctx, sharding_plan(zero_stage, trainable=False), dtype, offload)
        self.ctx = ctx
        self.micro_batch_size = micro_batch_size
        self.name = name

    @torch.no_grad()
    def logprobs(self, sequences: torch.Tensor, attention_mask: torch.Tensor, shared_prefix: int = 0) -> torch.Tensor:
        """Log-prob of each next token ([B, T-1]); the model must be a causal LM. With
        `shared_prefix` > 0, rows that share their first shared_prefix columns (a sampled group's
        prompt) run them once (`shared_prompt_logprobs`; positions before it are then 0)."""
        slices = micro_batch_slices(len(sequences), self.micro_batch_size)
        if shared_prefix > 0:
            parts = [shared_prompt_logprobs(self.model, sequences[s], attention_mask[s], shared_prefix)[0]
                     for s in slices]
        else:
            parts = [causal_lm_logprobs(self.model, sequences[s], attention_mask[s])[0] for s in slices]
        return torch.cat(parts)

    @torch.no_grad()
    def scores(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Sequence scores ([B]) of a value/reward model at each row's last real token."""
        parts = [self.model.score(sequences[s], attention_mask[s], position_ids=position_ids_from_mask(attention_mask[s]))
                 for s in micro_batch_slices(len(sequences), self.micro_batch_size)]
        return torch.cat(parts).float()
