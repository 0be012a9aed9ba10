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

from rlhf.engine.checkpoint import Checkpointer
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.export import export_model
from rlhf.engine.fsdp import local_parameter_count
from rlhf.engine.train_engine import TrainEngine
from rlhf.algorithms.losses import sft_loss_sum
from rlhf.config import SFTConfig, to_dict
from rlhf.data.batching import collate_sft
from rlhf.data.formats import parse_row
from rlhf.data.sources import eval_holdout, load_rows, stage_share
from rlhf.data.tokenization import tokenize_sft
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.outputs import write_config
from rlhf.tracking import Tracker
from rlhf.stages.trainer import evaluate, finish_stage, plan_total_steps, run_training, start_stage

log = get_logger(__name__)


def sft_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, dict[str, float]]:
    """Summed next-token loss over response tokens, and how many tokens it covers."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    loss_sum, n = sft_loss_sum(logits, batch["labels"].to(logits.device))
    return loss_sum, float(n), {}


def load_sft_rows(config: SFTConfig, tokenizer: Any) -> tuple[list[dict], list[dict], dict[str, int]]:
    """Tokenized (train, eval) rows of this stage's share of every --data source."""
    if not config.data.data:
        raise UserError("--data is required: one or more json/jsonl/parquet/csv files, saved folders or hub names")
    raw = [row for spec in config.data.data for row in load_rows(spec)]
    raw = stage_share(raw, config.data.data_split, "sft", config.engine.seed)
    parsed = [parse_row(r) for r in raw]
    rows, stats = tokenize_sft(parsed, tokenizer, config.data.max_seq_len, config.data.train_on_prompt)
    stats.log("sft data")
    if not rows:
        raise UserError(f"--data {' '.join(config.data.data)}: no usable SFT rows (see the counts above)")
    if config.data.eval_data:
        eval_parsed = [parse_row(r) for spec in config.data.eval_data for r in load_rows(spec)]
        held_out, eval_stats = tokenize_sft(eval_parsed, tokenizer, config.data.max_seq_len, config.data.train_on_prompt)
        eval_stats.log("sft eval data")
        return rows, held_out, stats.as_dict()
    train, held_out = eval_holdout(rows, config.data.eval_split, config.engine.seed)
    return train, held_out, stats.as_dict()


def run(config: SFTConfig) -> dict[str, Any]:
    ctx = DistributedContext.initialize()
    output = start_stage(config, ctx, "sft")

    tokenizer = load_tokenizer(config.model)
    train_rows, eval_rows, data_stats = load_sft_rows(config, tokenizer)
    plan, total_steps = plan_total_steps(len(train_rows), config, ctx.world_size)
    log.info("sft: %d train rows, %d eval rows, %d optimizer steps of %d rows",
             len(train_rows), len(eval_rows), total_steps, plan.global_batch_size)

    model = load_causal_lm(config.model)
    engine = TrainEngine(model, config.engine, ctx, total_steps, name="actor")
    if ctx.is_main:
        write_config(output, config)
    tracker = Tracker(output, "sft", config.tracking, to_dict(config), ctx.is_main)
    checkpointer = Checkpointer(output / "checkpoints", ctx, config.keep_checkpoints)

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        return collate_sft(rows, tokenizer.pad_token_id)

    def eval_fn() -> dict[str, float]:
        metrics = evaluate(engine, eval_rows, collate, sft_loss)
        metrics["perplexity"] = math.exp(min(metrics["loss"], 50.0))
        return metrics

    result = run_training(
        "sft", config, ctx, engine, tracker, checkpointer, plan, total_steps, train_rows, collate,
        sft_loss, eval_fn if eval_rows else None,
    )
    export_model(engine, output / "model", tokenizer)

    summary = {
        "stage": "sft",
        "steps": result.global_step,
        "train_loss": result.last_metrics.get("loss"),
        "train_seconds": result.train_seconds,
        "train_rows": len(train_rows),
        "eval_rows": len(eval_rows),
        "data": data_stats,
        "skipped_steps": engine.skipped_steps,
        "world_size": ctx.world_size,
        "parameters": sum(p.numel() for p in engine.model.parameters()),
        "local_parameters_rank0": local_parameter_count(engine.model),
        **({"eval_loss": result.eval_metrics["loss"], "eval_perplexity": result.eval_metrics["perplexity"]}
           if result.eval_metrics else {}),
    }
    finish_stage(ctx, output, tracker, summary)
    return summary
