"""Inference-only models of the hybrid engine (reference policy, reward model).

They are FSDP2-sharded like the trained models, by `sharding_plan(zero_stage, trainable=False)`
(which shards stage 0 like stage 3: see ShardingPlan), optionally offloaded to CPU, but have no
optimizer; on one process, not offloaded, they are left unsharded (FSDP2 would only copy each
layer's weights on every forward). Every call runs under no_grad in micro-batches. Their weights
are held in the compute dtype (bf16/fp16 halve their memory against fp32): a frozen model has no
master weights to keep precise, and FSDP2's mixed-precision policy casts every parameter to that
dtype for each forward anyway, so the outputs are bit-for-bit those of an fp32 copy run in mixed
precision.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from rlhf.engine.distributed import DistributedContext
from rlhf.engine.fsdp import ShardLoader, apply_fsdp
from rlhf.engine.sharding import COMPUTE_DTYPES, resolve_dtype, sharding_plan, wraps_in_fsdp
from rlhf.engine.logprobs import logprobs_from_logits
from rlhf.engine.positions import position_ids_from_mask
from rlhf.engine.micro_batches import forward_in_micro_batches, length_sorted_micro_batches, padded_tokens
from rlhf.engine.packing import (
    MAX_PACK_TOKENS, packed_logprobs, packed_scores, packing_unsupported_reason, packs_fewer_tokens,
)
from rlhf.engine.prompt_sharing import padded_forward_tokens, response_logprobs, shared_prompt_logprobs
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
    """A frozen model (sharded on several processes) that answers batched log-prob or score
    queries; `compile` and the device backend's modules run its layers as a trained model's (`apply_fsdp`)."""

    def __init__(self, model: nn.Module, ctx: DistributedContext, zero_stage: int, dtype: str, offload: bool,
                 micro_batch_size: int, name: str, *, compile: bool = False, weights: ShardLoader | None = None) -> None:
        """`model` is whole, or on the meta device with `weights` to fill this rank's shards (read
        straight into the compute dtype: the whole model is never held, not even in fp32)."""
        model.requires_grad_(False)
        model.eval()
        dtype = resolve_dtype(dtype, ctx.device)
        for param in model.parameters():  # parameters only: buffers such as RoPE's inv_freq stay fp32
            param.data = param.data.to(COMPUTE_DTYPES[dtype])
        shard = wraps_in_fsdp(ctx.world_size, offload, dtype, trainable=False)
        self._bind(apply_fsdp(model, ctx, sharding_plan(zero_stage, trainable=False), dtype, offload, compile=compile,
                              weights=weights, shard=shard), ctx, micro_batch_size, name)

    def _bind(self, model: nn.Module, ctx: DistributedContext, micro_batch_size: int, name: str) -> None:
        """The fields every query reads: an already sharded model and how to batch its forwards."""
        self.model = model
        self.ctx = ctx
        self.micro_batch_size = micro_batch_size
        self.name = name

    @torch.no_grad()
    def logprobs(self, sequences: torch.Tensor, attention_mask: torch.Tensor, shared_prefix: int = 0,
                 response_start: int = 0, pack_budget: int = 0) -> torch.Tensor:
        """Log-prob of each next token ([B, T-1]); the model must be a causal LM. With
        `response_start` > 0 the LM head runs only at the positions that score columns
        response_start.. (the others are 0). With `shared_prefix` > 0, rows that share their first
        shared_prefix columns (a sampled group's prompt) run them once (`shared_prompt_logprobs`;
        positions before it are then 0). Micro-batches drop their all-padding columns (rows sorted
        by length unless groups share prompts): engine/micro_batches.py. With `pack_budget` > 0 the
        rows' real tokens run packed (engine/packing.py, packs of at most that many tokens) where
        the model packs and that runs fewer tokens than the padded micro-batches."""
        budget = min(pack_budget, MAX_PACK_TOKENS)
        if pack_budget > 0 and self._packs_fewer_tokens(sequences, attention_mask, shared_prefix, budget, shared_prefix):
            return packed_logprobs(self.model, sequences, attention_mask, response_start, budget,
                                   shared_prefix=shared_prefix)[0]
        if shared_prefix > 0:
            def forward(s: torch.Tensor, m: torch.Tensor, lo: int) -> torch.Tensor:
                return shared_prompt_logprobs(self.model, s, m, shared_prefix - lo)[0]
        else:
            def forward(s: torch.Tensor, m: torch.Tensor, lo: int) -> torch.Tensor:
                return response_logprobs(self.model, s, m, max(response_start - lo, 0))[0]
        return forward_in_micro_batches(forward, sequences, attention_mask, self.micro_batch_size,
                                        sort=shared_prefix == 0)

    def packing_unsupported_reason(self) -> str | None:
        """Why this model's forwards never run packed, or None when they can (`logprobs`, `scores`)."""
        if isinstance(self.model, FSDPModule):
            return "sharded over ranks (FSDP2 needs as many forwards on every rank; packs would differ)"
        return packing_unsupported_reason(self.model, self.ctx.device)

    def _packs_fewer_tokens(self, sequences: torch.Tensor, attention_mask: torch.Tensor, shared_prefix: int,
                            budget: int, padded_shared_prefix: int) -> bool:
        """A packed forward applies (the model packs, each row's real tokens are one run, and it is
        not sharded: FSDP2 needs as many forwards on every rank, and packs differ between ranks) and
        its packs of `budget` tokens (as many as the rows need; each group's first `shared_prefix`
        columns once) run fewer tokens than the padded micro-batches would (each group's first
        `padded_shared_prefix` columns once: the log-prob forward shares prompts, the scores' not)."""
        if self.packing_unsupported_reason() is not None:
            return False
        if padded_shared_prefix > 0:
            padded = padded_forward_tokens(sequences, attention_mask, padded_shared_prefix)
        else:
            padded = sum(padded_tokens(attention_mask[rows])
                         for rows in length_sorted_micro_batches(attention_mask, self.micro_batch_size))
        return packs_fewer_tokens(self.model, sequences, attention_mask, padded, shared_prefix, one_forward=False,
                                  budget=budget)

    @torch.no_grad()
    def scores(self, sequences: torch.Tensor, attention_mask: torch.Tensor, pack_budget: int = 0,
               shared_prefix: int = 0) -> torch.Tensor:
        """Sequence scores ([B]) of a value/reward model at each row's last real token (micro-batches
        of rows of similar length, without their all-padding columns). With `pack_budget` > 0 the
        rows' real tokens run packed (`packed_scores`; rows sharing their first `shared_prefix`
        columns run them once) where that runs fewer tokens, as `logprobs`."""
        budget = min(pack_budget, MAX_PACK_TOKENS)
        if pack_budget > 0 and self._packs_fewer_tokens(sequences, attention_mask, shared_prefix, budget, 0):
            return packed_scores(self.model, sequences, attention_mask, budget, shared_prefix)
        return forward_in_micro_batches(
            lambda s, m, lo: self.model.score(s, m, position_ids=position_ids_from_mask(m)), sequences,
            attention_mask, self.micro_batch_size).float()
