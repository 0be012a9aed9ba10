"""`rlhf sft`: supervised fine-tuning of a causal LM on demonstrations.

    rlhf sft --model path/to/base --data demos.jsonl --output runs/sft
    rlhf sft --config sft.yaml --deepspeed-config ds_config.json --nproc-per-node 2

Reads top to bottom: config -> distributed setup -> data -> model + engine -> training loop ->
export of <output>/model (Hugging Face format) -> summary.json -> DONE.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rlhf.algorithms.losses import IGNORE_INDEX, sft_loss_sum
from rlhf.config import SFTConfig
from rlhf.data.batching import collate_sft
from rlhf.data.formats import ParsedRow
from rlhf.data.stage_rows import load_stage_rows
from rlhf.data.tokenization import TokenizeStats, tokenize_sft
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.micro_batches import padded_tokens
from rlhf.engine.packing import packed_logprobs, packs_fewer_tokens
from rlhf.engine.train_engine import TrainEngine
from rlhf.logging import get_logger
from rlhf.models.loading import deferred_causal_lm
from rlhf.models.lora import export_trained_model, with_lora
from rlhf.stages.trainer import (
    engine_summary, evaluate, finish_stage, open_run, plan_total_steps, run_training, stage_tokenizer,
    start_stage,
)

log = get_logger(__name__)


def sft_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, dict[str, float]]:
    """Summed next-token loss over response tokens, and how many tokens it covers."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    loss_sum, n = sft_loss_sum(logits, batch["labels"].to(logits.device))
    return loss_sum, float(n), {}


def packed_sft_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, dict[str, float]]:
    """`sft_loss` from one packed forward over the rows' real tokens (engine/packing.py) where the
    model packs, the rows hold at most MAX_PACK_TOKENS real tokens and that is fewer than the
    padded forward's; else `sft_loss`."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    labels = batch["labels"].to(ids.device)
    scored = labels != IGNORE_INDEX
    scored[:, 0] = False  # the first column is nobody's next token
    if not packs_fewer_tokens(model, ids, mask, padded_tokens(mask)) or not torch.equal(labels[scored], ids[scored]):
        return sft_loss(model, batch)
    logprobs, _ = packed_logprobs(model, ids, mask, 0, int(mask.sum()), columns=scored)
    target = scored[:, 1:]  # position t scores column t + 1
    return -logprobs[target].sum(), float(target.sum()), {}


def load_sft_rows(config: SFTConfig, tokenizer: Any,
                  max_seq_len: int | None = None) -> tuple[list[dict], list[dict], dict[str, int]]:
    """Tokenized (train, eval) rows of this stage's share of every --data source, cut at
    `max_seq_len` (default --max-seq-len)."""
    def tokenize(parsed: list[ParsedRow]) -> tuple[list[dict], TokenizeStats]:
        return tokenize_sft(parsed, tokenizer, max_seq_len or config.data.max_seq_len, config.data.train_on_prompt,
                            config.data.train_last_turn_only)

    rows = load_stage_rows(config.data, "sft", config.engine.seed, tokenize,
                           empty="no usable SFT rows (see the counts above)")
    return rows.train, rows.eval, rows.stats


def run(config: SFTConfig) -> dict[str, Any]:
    """Fine-tune and export the model (collective: every rank calls it); returns the summary."""
    ctx = DistributedContext.initialize()
    config, output = start_stage(config, ctx, "sft")  # the batch arithmetic resolved

    tokenizer, max_seq_len = stage_tokenizer(config)
    train_rows, eval_rows, data_stats = load_sft_rows(config, tokenizer, max_seq_len)
    plan, total_steps = plan_total_steps(len(train_rows), config, ctx.world_size, len(eval_rows))
    model, weights = deferred_causal_lm(config.model)  # on meta: each rank reads only its shards
    model, weights = with_lora(model, weights, config, config.model, "sft")
    engine = TrainEngine(model, config.engine, ctx, total_steps, name="actor", weights=weights)
    tracker, checkpointer = open_run(config, ctx, output, "sft")

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        return collate_sft(rows, tokenizer.pad_token_id)

    def eval_fn() -> dict[str, float]:
        metrics = evaluate(engine, eval_rows, collate, sft_loss)
        metrics["perplexity"] = math.exp(min(metrics["loss"], 50.0))
        return metrics

    loss_fn = packed_sft_loss if config.pack_sequences and config.max_tokens_per_micro_batch else sft_loss
    result = run_training(
        "sft", config, ctx, engine, tracker=tracker, checkpointer=checkpointer, plan=plan, total_steps=total_steps,
        rows=train_rows, collate=collate, loss_fn=loss_fn, eval_fn=eval_fn if eval_rows else None,
        row_lengths=lambda row: [len(row["input_ids"])],
    )
    export_trained_model(engine, output / "model", tokenizer, config.lora)

    summary = {
        "stage": "sft",
        "steps": result.global_step,
        "train_loss": result.last_metrics.get("loss"),
        "train_seconds": result.train_seconds,
        "train_rows": len(train_rows),
        "eval_rows": len(eval_rows),
        "data": data_stats,
        **engine_summary(engine),
        **({"eval_loss": result.eval_metrics["loss"], "eval_perplexity": result.eval_metrics["perplexity"]}
           if result.eval_metrics else {}),
    }
    finish_stage(ctx, output, tracker, summary)
    return summary
