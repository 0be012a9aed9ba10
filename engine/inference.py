"""Inference-only models of the hybrid engine (reference policy, reward model).

They are FSDP2-sharded like the trained models (ZeRO-3 by default, optionally offloaded to CPU)
but have no optimizer; every call runs under no_grad in micro-batches.
"""

from __future__ import annotations

import torch
from torch import nn

from rlhf.engine.distributed import DistributedContext
from rlhf.engine.fsdp import apply_fsdp
from rlhf.engine.logprobs import logprobs_from_logits
from rlhf.logging import get_logger

log = get_logger(__name__)


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only, as generation assigns them to left-padded prompts."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def causal_lm_logprobs(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [B, T-1] of each next token, logits [B, T, V]) of a causal LM."""
    logits = model(input_ids=sequences, attention_mask=attention_mask,
                   position_ids=position_ids_for(attention_mask), use_cache=False).logits
    return logprobs_from_logits(logits, sequences), logits


class FrozenModel:
    """A sharded, frozen model that answers batched log-prob or score queries."""

    def __init__(self, model: nn.Module, ctx: DistributedContext, zero_stage: int, dtype: str, offload: bool,
                 micro_batch_size: int, name: str) -> None:
        model.requires_grad_(False)
        model.eval()
        self.model = apply_fsdp(model, ctx, zero_stage if zero_stage > 0 else 3, dtype, offload)
        self.ctx = ctx
        self.micro_batch_size = micro_batch_size
        self.name = name

    def _chunks(self, n: int) -> list[slice]:
        return [slice(i, min(i + self.micro_batch_size, n)) for i in range(0, n, self.micro_batch_size)]

    @torch.no_grad()
    def logprobs(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Log-prob of each next token ([B, T-1]); the model must be a causal LM."""
        parts = [causal_lm_logprobs(self.model, sequences[s], attention_mask[s])[0] for s in self._chunks(len(sequences))]
        return torch.cat(parts)

    @torch.no_grad()
    def scores(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Sequence scores ([B]) of a value/reward model at each row's last real token."""
        parts = [self.model.score(sequences[s], attention_mask[s], position_ids=position_ids_for(attention_mask[s]))
                 for s in self._chunks(len(sequences))]
        return torch.cat(parts).float()
