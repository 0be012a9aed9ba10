"""What a model folder must agree with before a command uses it: finite weights, a tokenizer whose
ids all have an embedding row, and rows no longer than the model's positions.

    check_tokenizer_fits(tokenizer, "runs/sft/model", "--model")      # before any row is tokenized
    max_seq_len = fit_max_seq_len(512, "runs/sft/model", "--model")   # at most max_position_embeddings
    check_finite(model.named_parameters(), "--model runs/sft/model")  # after a full load

Each is one UserError line naming the folder and the numbers. A NaN weight would otherwise make
every output NaN (chat answers from it), an id past the embedding ends in an IndexError mid-step (a
device-side assert on a GPU), and a row past the positions trains positions the model has none for.
The weights are checked as they are read (`first_nonfinite` over the tensors just loaded, in
memory: fused norms, one host sync), never read from disk again for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig

from rlhf.engine.train_engine import first_non_finite
from rlhf.errors import UserError
from rlhf.logging import get_logger

log = get_logger(__name__)


def first_nonfinite(tensors: Iterable[tuple[str, Tensor]]) -> tuple[str, str] | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, and which
    ("NaN" or "inf"); None when all are finite. The engine's check (fused norms over all the
    tensors, one host sync; a norm that only overflows is no error), then the bad tensor alone."""
    named = list(tensors)
    name = first_non_finite(named)
    if name is None:
        return None
    tensor = dict(named)[name].detach()
    return name, "NaN" if bool(torch.isnan(tensor).any()) else "inf"


def nonfinite_error(where: str, tensor: str, kind: str) -> UserError:
    return UserError(f"{where}: weight {tensor} holds {kind} values, so every output would be {kind}; the model is "
                     "broken (a diverged run or a bad conversion): use an earlier checkpoint or export it again")


def check_finite(tensors: Iterable[tuple[str, Tensor]], where: str) -> None:
    """One UserError naming `where` and the first tensor with a NaN or an infinity."""
    found = first_nonfinite(tensors)
    if found is not None:
        raise nonfinite_error(where, *found)


def text_config(name_or_path: str) -> Any | None:
    """The decoder's config of a model folder (or hub name); None where it cannot be read (the
    model loader names the problem)."""
    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError):
        return None
    return config.get_text_config(decoder=True)


def max_positions(name_or_path: str) -> int | None:
    """The model's max_position_embeddings (GPT-2's n_positions), or None when it has none."""
    config = text_config(name_or_path)
    value = getattr(config, "max_position_embeddings", None) if config is not None else None
    return int(value) if isinstance(value, int) and value > 0 else None


def check_tokenizer_fits(tokenizer: Any, name_or_path: str, flag: str, tokenizer_of: str = "its tokenizer") -> None:
    """Every id `tokenizer` can produce has a row in the embedding of the model at `name_or_path`:
    len(tokenizer) and each special token's id below config.json's vocab_size. `tokenizer_of`
    names the tokenizer when it is another folder's ("the --actor tokenizer" for a critic)."""
    config = text_config(name_or_path)
    rows = getattr(config, "vocab_size", None) if config is not None else None
    if not isinstance(rows, int):
        return
    where = f"{flag} {name_or_path}"
    fix = ("resize the embedding to the tokenizer (model.resize_token_embeddings(len(tokenizer))) and save the model "
           "again, or use the tokenizer the model was trained with")
    if len(tokenizer) > rows:
        raise UserError(f"{where}: {tokenizer_of} has {len(tokenizer)} ids but the model's embedding has {rows} rows "
                        f"(vocab_size); {fix}")
    special = zip(tokenizer.all_special_ids, tokenizer.all_special_tokens)
    beyond = sorted((i, str(t)) for i, t in special if isinstance(i, int) and i >= rows)
    if beyond:
        token_id, token = beyond[0]
        raise UserError(f"{where}: {tokenizer_of}'s special token {token!r} has id {token_id} but the model's "
                        f"embedding has {rows} rows (vocab_size); {fix}")


def fit_max_seq_len(max_seq_len: int, name_or_path: str, flag: str) -> int:
    """`max_seq_len` capped at the model's max_position_embeddings (one log line when it binds):
    the rows are then truncated to the model's positions, and counted, as any row over
    --max-seq-len is."""
    positions = max_positions(name_or_path)
    if positions is None or max_seq_len <= positions:
        return max_seq_len
    log.info("--max-seq-len %d capped at %d, the max_position_embeddings of %s %s: longer rows are truncated to "
             "it (counted below)", max_seq_len, positions, flag, name_or_path)
    return positions


__all__ = ["check_finite", "check_tokenizer_fits", "first_nonfinite", "fit_max_seq_len", "max_positions",
           "nonfinite_error", "text_config"]
