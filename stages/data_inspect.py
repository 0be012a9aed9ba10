"""`rlhf data inspect`: a stage's first rows exactly as it will tokenize them, and the counts.

    rlhf data inspect --stage sft --model runs/base --data chats.jsonl --rows 3
    rlhf data inspect --stage reward --model runs/sft/model --data prefs --data-train-split train_prefs --json

It loads and renders the rows through the very functions the stage uses (`load_stage_rows`,
`rlhf.data.rendering`, `rlhf.data.tokenization`), so what it shows is what trains: the rendered
text with the trained spans marked, and how many rows are kept, truncated and dropped.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from rlhf.config import DataConfig
from rlhf.data.formats import ParsedRow
from rlhf.data.rendering import Piece, render_continuation, render_prompt, sft_pieces
from rlhf.data.stage_rows import load_stage_rows
from rlhf.data.tokenization import (
    TokenizeStats, encode_pieces, encode_prompt, tokenize_pairs, tokenize_prompts, tokenize_sft,
)
from rlhf.models.checks import fit_max_seq_len
from rlhf.models.loading import load_tokenizer

Stage = Literal["sft", "reward", "dpo", "ppo"]
TRAINED_OPEN, TRAINED_CLOSE = "\u27e6", "\u27e7"  # ⟦ ⟧ around trained text in the plain view


@dataclass
class Inspection:
    """The shown rows (one JSON-ready dict each) and the stage's counts."""

    stage: Stage
    rows: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


def _pieces_json(pieces: list[Piece]) -> list[dict[str, Any]]:
    return [{"text": p.text, "trained": p.trained} for p in pieces]


def describe_row(row: ParsedRow, stage: Stage, tokenizer: Any, data: DataConfig, max_prompt_len: int) -> dict[str, Any]:
    """One row as `stage` renders it: its type, the rendered text pieces and token counts."""
    head: dict[str, Any] = {"source": row.where, "type": row.kind, "conversational": row.conversational}
    if stage == "sft":
        pieces = sft_pieces(row, tokenizer, data.train_last_turn_only, row.where)
        if data.train_on_prompt:
            pieces = [Piece(p.text, True) for p in pieces]
        ids, trained = encode_pieces(pieces, tokenizer)
        return {**head, "pieces": _pieces_json(pieces), "tokens": len(ids), "trained_tokens": sum(trained),
                "truncated": len(ids) > data.max_seq_len}
    if stage in ("reward", "dpo"):  # the same pairs, tokenized alike
        assert row.chosen is not None and row.rejected is not None
        prompt = render_prompt(row.prompt, tokenizer, row.tools, row.where)
        chosen = render_continuation(row.prompt, row.chosen, tokenizer, row.tools, row.where)
        rejected = render_continuation(row.prompt, row.rejected, tokenizer, row.tools, row.where)
        return {**head, "prompt": prompt, "chosen": chosen, "rejected": rejected,
                "prompt_tokens": len(encode_prompt(prompt, tokenizer)), "margin": row.margin}
    prompt_messages = row.generation_prompt
    assert prompt_messages is not None
    prompt = render_prompt(prompt_messages, tokenizer, row.tools, row.where)
    n = len(encode_prompt(prompt, tokenizer))
    return {**head, "prompt": prompt, "prompt_tokens": n, "dropped": n > max_prompt_len,
            "reward_fn_columns": sorted(row.fields)}


def inspect_data(stage: Stage, model: str, data: DataConfig, rows: int, max_prompt_len: int = 256,
                 seed: int = 0) -> Inspection:
    """The first `rows` rows of `stage`'s share of `data`, rendered with `model`'s tokenizer,
    and the counts of the whole share (every row is tokenized, as the stage does)."""
    tokenizer = load_tokenizer(model, chat_template=data.chat_template)
    # Capped at the model's positions as the stage caps it, so the counts are the stage's.
    data = dataclasses.replace(data, max_seq_len=fit_max_seq_len(data.max_seq_len, model, "--model"))
    result = Inspection(stage)

    def tokenize(parsed: list[ParsedRow]) -> tuple[list[Any], TokenizeStats]:
        if stage == "sft":
            out, stats = tokenize_sft(parsed, tokenizer, data.max_seq_len, data.train_on_prompt,
                                      data.train_last_turn_only)
        elif stage in ("reward", "dpo"):
            out, stats = tokenize_pairs(parsed, tokenizer, data.max_seq_len, stage=stage)
        else:
            out, stats = tokenize_prompts(parsed, tokenizer, max_prompt_len)
        kept = set(stats.kept_indices)
        result.rows = [{"row": i, "kept": i in kept, **describe_row(r, stage, tokenizer, data, max_prompt_len)}
                       for i, r in enumerate(parsed[:rows])]
        return out, stats

    stage_rows = load_stage_rows(data, stage, seed, tokenize, empty="no usable rows (see the counts above)",
                                 holdout=False)
    result.counts = stage_rows.stats
    return result


def format_plain(result: Inspection) -> str:
    """A reader's view: each row's rendered text with trained spans in ⟦ ⟧, then the counts."""
    lines = [f"rlhf {result.stage} rows as they are tokenized"
             + (f" ({TRAINED_OPEN}trained{TRAINED_CLOSE} spans marked)" if result.stage == "sft" else "")]
    for r in result.rows:
        facts = [r["type"] + (", conversational" if r["conversational"] else "")]
        if "tokens" in r:
            cut = ", truncated" if r["truncated"] else ""
            facts.append(f"{r['tokens']} tokens, {r['trained_tokens']} trained{cut}")
        if "prompt_tokens" in r:
            facts.append(f"prompt {r['prompt_tokens']} tokens")
        if not r["kept"]:
            facts.append("DROPPED (see the counts)")
        lines.append(f"--- row {r['row']} ({r['source']}): {'; '.join(facts)}")
        if "pieces" in r:
            lines.append("".join(f"{TRAINED_OPEN}{p['text']}{TRAINED_CLOSE}" if p["trained"] else p["text"]
                                 for p in r["pieces"]))
            continue
        lines.append(f"[prompt]\n{r['prompt']}")
        for key in ("chosen", "rejected"):
            if key in r:
                lines.append(f"[{key}]\n{r[key]}")
        if "reward_fn_columns" in r:
            lines.append(f"[reward-function columns] {', '.join(r['reward_fn_columns']) or 'none'}")
    lines.append("counts: " + ", ".join(f"{k} {v}" for k, v in result.counts.items()))
    return "\n".join(lines)


def format_json(result: Inspection) -> str:
    """One JSON object per shown row, then one {"counts": ...} object."""
    return "\n".join([*(json.dumps(r, ensure_ascii=False) for r in result.rows),
                      json.dumps({"stage": result.stage, "counts": result.counts})])


__all__ = ["Inspection", "describe_row", "format_json", "format_plain", "inspect_data"]
