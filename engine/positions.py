"""Positions read from an attention mask: the one place that defines them.

Every forward over padded sequences (generation's prefill, train-mode and rollout-mode log-probs,
frozen reference/reward models, the critic) must give a token the same position id, or the same
sequence scores differently depending on its padding. Hugging Face generation's convention is
the reference: positions count real tokens only, so a left-padded prompt starts at 0.
"""

from __future__ import annotations

import torch
from torch import Tensor


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids [B, T] (int64): real tokens count 0, 1, 2, ...; padding positions get 0.

    As `prepare_inputs_for_generation` in Hugging Face generation (cumsum - 1, then padding set
    to 0), so values and log-probs of a left-padded rollout match those of the same sequence
    without padding. A padding position's id only changes that padding token's own output, which
    every consumer masks out.
    """
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def last_token_index(attention_mask: Tensor) -> Tensor:
    """Index [B] of the last position with attention_mask 1 in each row, whatever the padding side.

    Read from the mask, never from pad ids: a leading BOS may share the pad id (GPT-2 style).
    A row with no real token has no last token, and every caller (a sequence's score, the reward
    put on its last response token) would silently read a padding position instead, so such a row
    raises ValueError. Checking that reads one flag on the host.
    """
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    index = torch.where(attention_mask.bool(), positions, -1).amax(dim=-1)
    empty = index < 0
    if bool(empty.any()):
        raise ValueError(
            f"last_token_index: {int(empty.sum())} row(s) of the attention mask are all zeros; "
            "every sequence needs at least one real token"
        )
    return index
