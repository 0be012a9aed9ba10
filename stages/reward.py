"""`rlhf reward`: train a reward model on preference pairs.

    rlhf reward --model runs/sft/model --data pairs.jsonl --output runs/rm --eval-split 0.1
    rlhf reward --config rm.yaml --deepspeed-config ds_config.json --nproc-per-node 2

The model is a causal LM's backbone plus a linear value head (`rlhf.models.ValueModel`); a
sequence's score is the head's value at its last real token. Training minimises the
Bradley-Terry loss -log sigmoid(score_chosen - score_rejected - margin) over the pairs.

Reads top to bottom: config -> distributed setup -> data -> model + engine -> training loop ->
held-out evaluation and the score statistics of the training set -> export of <output>/model
(Hugging Face format, loadable with `rlhf.models.load_value_model`, the PPO critic's starting
point) -> summary.json -> DONE.

summary.json holds `eval_accuracy`, `chosen_mean`, `rejected_mean` (on the held-out pairs, or on
the training pairs with `eval_on_train: true` when there is no --eval-split) and `score_mean`,
`score_std` over every chosen and rejected response of the training set, measured after
training: PPO normalises rewards with them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from rlhf.algorithms.losses import pairwise_reward_loss
from rlhf.config import RewardConfig, StageConfig
from rlhf.data.batching import collate_pairs
from rlhf.data.stage_rows import load_stage_rows
from rlhf.data.formats import ParsedRow
from rlhf.data.tokenization import TokenizeStats, tokenize_pairs
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.micro_batches import padded_tokens
from rlhf.engine.packing import packed_scores, packs_fewer_tokens
from rlhf.engine.train_engine import TrainEngine
from rlhf.logging import get_logger
from rlhf.models.loading import disable_dropout
from rlhf.models.lora import export_trained_model, with_lora
from rlhf.models.value_model import deferred_value_model_from
from rlhf.stages.trainer import (
    engine_summary, evaluate, finish_stage, open_run, plan_total_steps, run_training, stage_tokenizer,
    start_stage,
)
from rlhf.tracking import Tracker

log = get_logger(__name__)

# The count of pairs dropped because chosen == rejected (tokenize_pairs' name for it), reported
# in summary.json even when zero.
EQUAL_PAIRS_KEY = "dropped_chosen_equals_rejected"


def reward_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device, moments: bool = False, pack: bool = False,
    center_coef: float = 0.0,
) -> tuple[torch.Tensor, float, dict[str, float]]:
    """Pairwise loss SUMMED over the batch's pairs, the pair count, and metric sums.

    `batch` holds the chosen sequences then the rejected ones (`collate_pairs`). The metric sums
    are `accuracy` (pairs ranked right), `chosen_score` and `rejected_score`, plus `score_sq`
    (sum of squared scores of both responses) when `moments` is set, for the score std. With
    `pack` the scores come from one packed forward over the sequences' real tokens
    (engine/packing.py) where the model packs, they hold at most MAX_PACK_TOKENS real tokens and
    that is fewer than the padded forward's. `center_coef`: --center-rewards-coef's term
    (`pairwise_reward_loss`).
    """
    # Inputs go to the compute device explicitly: with offload the params live on the CPU.
    batch = {k: v.to(device) for k, v in batch.items()}
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if pack and packs_fewer_tokens(model, ids, mask, padded_tokens(mask)):
        scores = packed_scores(model, ids, mask, int(mask.sum()))
    else:
        scores = model.score(ids, mask)
    n = scores.shape[0] // 2
    chosen, rejected = scores[:n], scores[n:]
    loss, _ = pairwise_reward_loss(chosen, rejected, batch["margin"], center_coef)
    sums = {
        # Counted, not mean x n: a float32 mean times n is not an integer (0.97499999 for 39 of 40).
        "accuracy": float((chosen > rejected).sum()),
        "chosen_score": float(chosen.detach().sum()),
        "rejected_score": float(rejected.detach().sum()),
    }
    if moments:
        sums["score_sq"] = float((chosen.detach().double() ** 2 + rejected.detach().double() ** 2).sum())
    return loss * n, float(n), sums


def score_statistics(metrics: dict[str, float]) -> dict[str, float]:
    """Mean and (population) std of all 2N scores from per-pair means of `reward_loss(moments=True)`."""
    mean = (metrics["chosen_score"] + metrics["rejected_score"]) / 2.0
    variance = max(metrics["score_sq"] / 2.0 - mean * mean, 0.0)
    return {"score_mean": mean, "score_std": math.sqrt(variance)}


def load_pair_rows(config: StageConfig, tokenizer: Any, max_seq_len: int | None = None,
                   stage: str = "reward") -> tuple[list[dict], list[dict], dict[str, int]]:
    """Tokenized (train, eval) pairs of `stage`'s share of every --data source (reward, dpo), each
    sequence cut at `max_seq_len` (default --max-seq-len), and the counts."""
    def tokenize(parsed: list[ParsedRow]) -> tuple[list[dict], TokenizeStats]:
        return tokenize_pairs(parsed, tokenizer, max_seq_len or config.data.max_seq_len, stage=stage)

    rows = load_stage_rows(
        config.data, stage, config.engine.seed, tokenize,
        empty="no usable preference pairs (see the counts above); rows need prompt/chosen/rejected, "
              "chosen/rejected dialogs or chat messages, with chosen != rejected",
    )
    rows.stats.setdefault(EQUAL_PAIRS_KEY, 0)
    return rows.train, rows.eval, rows.stats


def final_evaluation(
    engine: TrainEngine, train_rows: list[dict], held_out: dict[str, float] | None,
    collate: Callable[[list[dict]], dict[str, torch.Tensor]], tracker: Tracker, pack: bool,
) -> dict[str, Any]:
    """One pass over the training pairs after training: the score statistics PPO normalises
    rewards with, and the evaluation metrics too when no pairs were held out (`held_out` None).
    `pack`: scores from packed forwards (`reward_loss`)."""
    train_pass = evaluate(engine, train_rows, collate,
                          partial(reward_loss, device=engine.ctx.device, moments=True, pack=pack),
                          progress="reward: score statistics")
    stats = score_statistics(train_pass)
    eval_on_train = held_out is None
    final = train_pass if held_out is None else held_out
    if eval_on_train:
        log.info("reward: no --eval-split, so the eval metrics are measured on the training pairs")
    evaluation = {
        "eval_on_train": eval_on_train,
        "eval_loss": final["loss"],
        "eval_accuracy": final["accuracy"],
        "chosen_mean": final["chosen_score"],
        "rejected_mean": final["rejected_score"],
        **stats,
    }
    # run_training has logged the held-out eval_* metrics already; add what only this pass measured.
    logged = {**stats, **({f"eval_{k}": v for k, v in train_pass.items() if k != "score_sq"} if eval_on_train else {})}
    tracker.log(logged, step=engine.global_step)
    log.info("reward: eval accuracy %.4f, chosen %.4f, rejected %.4f; training scores mean %.4f std %.4f",
             evaluation["eval_accuracy"], evaluation["chosen_mean"], evaluation["rejected_mean"],
             stats["score_mean"], stats["score_std"])
    return evaluation


def run(config: RewardConfig) -> dict[str, Any]:
    """Train, evaluate and export a reward model (collective: every rank calls it); returns the summary."""
    ctx = DistributedContext.initialize()
    config, output = start_stage(config, ctx, "reward")  # the batch arithmetic resolved

    tokenizer, max_seq_len = stage_tokenizer(config)
    train_rows, eval_rows, data_stats = load_pair_rows(config, tokenizer, max_seq_len)
    plan, total_steps = plan_total_steps(len(train_rows), config, ctx.world_size, len(eval_rows), unit="pairs")

    model, weights = deferred_value_model_from(config.model, config.value_head_init_std)  # on meta: sharded loading
    if config.disable_dropout:
        disable_dropout(model)  # before LoRA: an explicit --lora-dropout stays
    model, weights = with_lora(model, weights, config, config.model, "reward")  # the value head trains in full
    # The pairwise loss depends on score differences only, so the head's bias gets a zero gradient
    # in exact arithmetic; trained, Adam would turn float noise in that gradient into lr-sized
    # random steps (a drifting score offset). It is kept fixed, as DeepSpeed-Chat's bias-free head.
    model.value_head.bias.requires_grad_(False)
    engine = TrainEngine(model, config.engine, ctx, total_steps, name="reward", weights=weights)
    tracker, checkpointer = open_run(config, ctx, output, "reward")

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        return collate_pairs(rows, tokenizer.pad_token_id)

    pack = bool(config.pack_sequences and config.max_tokens_per_micro_batch)
    loss_fn = partial(reward_loss, device=ctx.device, pack=pack, center_coef=config.center_rewards_coef)

    def eval_fn() -> dict[str, float]:
        return evaluate(engine, eval_rows, collate, loss_fn)

    result = run_training(
        "reward", config, ctx, engine, tracker=tracker, checkpointer=checkpointer, plan=plan, total_steps=total_steps,
        rows=train_rows, collate=collate, loss_fn=loss_fn, eval_fn=eval_fn if eval_rows else None,
        row_lengths=lambda row: [len(row["chosen_ids"]), len(row["rejected_ids"])],
    )

    evaluation = final_evaluation(engine, train_rows, result.eval_metrics if eval_rows else None, collate, tracker,
                                  pack)
    export_trained_model(engine, output / "model", tokenizer, config.lora)

    summary = {
        "stage": "reward",
        "steps": result.global_step,
        "train_loss": result.last_metrics.get("loss"),
        "train_accuracy": result.last_metrics.get("accuracy"),
        "train_seconds": result.train_seconds,
        "train_rows": len(train_rows),
        "eval_rows": len(eval_rows),
        **evaluation,
        "data": data_stats,
        EQUAL_PAIRS_KEY: data_stats[EQUAL_PAIRS_KEY],
        **engine_summary(engine),
    }
    finish_stage(ctx, output, tracker, summary)
    return summary
