"""`rlhf dpo`: offline preference optimisation (DPO and its family) of a causal LM on preference pairs.

    rlhf dpo --model runs/sft/model --data pairs.jsonl --output runs/dpo
    rlhf dpo --model runs/sft/model --data pairs.jsonl --output runs/dpo --loss-type ipo --beta 0.5
    rlhf dpo --config dpo.yaml --lora-rank 16 --precompute-ref-logprobs --nproc-per-node 2

No reward model and no rollouts: the policy learns from the pairs directly, against a frozen
reference (the loss family and its formulas: rlhf/algorithms/preference.py). The reference is a
frozen copy of --ref (default --model) in the compute dtype, or with LoRA the policy itself with
its adapters off (no second copy); SimPO reads none. `--precompute-ref-logprobs` computes its
log-probs of every pair once before training and then frees it.

A pair's chosen and rejected responses share their prompt: a micro-batch holds its pairs as 2B
rows [left-padded prompt | response | padding] (`collate_preference`), so each prompt runs once for
both responses (engine/prompt_sharing.py; with --max-tokens-per-micro-batch and
--pack-sequences, packed as [prompt | chosen | rejected]: engine/packing.py).

Reads top to bottom: config -> distributed setup -> data -> policy + engine, reference ->
(precomputed reference log-probs) -> training loop (TRL's metrics rewards/chosen,
rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected; eval_* on
held-out pairs) -> export of <output>/model (Hugging Face format) -> summary.json -> DONE.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from rlhf.algorithms.preference import PairLogps, preference_loss, preference_metric_sums
from rlhf.config import DPOConfig
from rlhf.data.batching import collate_preference
from rlhf.engine.adapters import AdaptersOffReference
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.inference import FrozenModel
from rlhf.engine.packing import packed_logprobs, packs_fewer_tokens
from rlhf.engine.prompt_sharing import (
    padded_forward_tokens, response_logprobs, shared_prompt_logprobs, sharing_pays,
)
from rlhf.engine.train_engine import TrainEngine
from rlhf.logging import get_logger
from rlhf.models.loading import deferred_causal_lm, disable_dropout
from rlhf.models.lora import export_trained_model, with_lora
from rlhf.stages.trainer import (
    Batch, engine_summary, evaluate, evaluation_batches, finish_stage, open_run, plan_total_steps, run_training,
    stage_tokenizer, start_stage,
)
from rlhf.stages.reward import load_pair_rows

log = get_logger(__name__)


def response_positions(attention_mask: torch.Tensor, response_start: int) -> torch.Tensor:
    """[2B, T-1] bool: the log-prob positions that score a real response token (position t scores
    column t + 1, a response column from response_start on)."""
    columns = torch.arange(1, attention_mask.shape[1], device=attention_mask.device)
    return attention_mask[:, 1:].bool() & (columns >= response_start)[None, :]


def pair_logps(logprobs: torch.Tensor, attention_mask: torch.Tensor, response_start: int) -> PairLogps:
    """Each response's summed log-probs and token count from per-position log-probs [2B, T-1] of
    the chosen rows then the rejected rows."""
    scored = response_positions(attention_mask, response_start)
    sums = logprobs.float().masked_fill(~scored, 0.0).sum(dim=1)
    tokens = scored.sum(dim=1)
    n = sums.shape[0] // 2
    return PairLogps(sums[:n], sums[n:], tokens[:n], tokens[n:])


@dataclass(frozen=True)
class ForwardPlan:
    """How a micro-batch's forwards run: each pair's prompt once (`share`; the policy's and the
    reference's forwards) and the policy's forward packed (`packed`)."""

    share: bool
    packed: bool


def forward_plan(model: nn.Module, batch: Batch, config: DPOConfig, ctx: DistributedContext, pack: bool,
                 parameters: int) -> ForwardPlan:
    """Share the prompts where --share-prompt-forward asks and that saves at least
    --share-prompt-min-gflop (`sharing_pays`: a model of `parameters`), pack where `pack` and that runs
    fewer tokens. Every rank takes the same forward count: a shared forward is two FSDP2 forwards,
    a packed or plain one one, and sharded ranks must run as many."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    start = int(batch["response_start"])
    saved = padded_forward_tokens(ids, mask, 0) - padded_forward_tokens(ids, mask, start)
    share = ctx.all_agree(config.share_prompt_forward and sharing_pays(parameters, saved, config.share_prompt_min_gflop))
    prefix = start if share else 0
    packed = pack and packs_fewer_tokens(model, ids, mask, padded_forward_tokens(ids, mask, prefix), prefix)
    if share:
        packed = ctx.all_agree(packed)
    return ForwardPlan(share, packed)


def policy_logprobs(model: nn.Module, batch: Batch, plan: ForwardPlan) -> torch.Tensor:
    """The policy's log-probs [2B, T-1] of the response tokens (the LM head runs only there), as
    `plan` says: one packed forward, each pair's prompt once, or one plain forward."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    start = int(batch["response_start"])
    if plan.packed:
        return packed_logprobs(model, ids, mask, start, int(mask.sum()), shared_prefix=start if plan.share else 0)[0]
    if plan.share:
        return shared_prompt_logprobs(model, ids, mask, start)[0]
    return response_logprobs(model, ids, mask, start)[0]


def reference_logps(reference: FrozenModel, batch: Batch, share: bool, pack_budget: int) -> PairLogps:
    """The frozen reference's summed response log-probs of the batch's pairs (no grad)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    start = int(batch["response_start"])
    logprobs = reference.logprobs(ids, mask, shared_prefix=start if share else 0, response_start=start,
                                  pack_budget=pack_budget)
    return pair_logps(logprobs, mask, start)


def precomputed_logps(batch: Batch, policy: PairLogps) -> PairLogps:
    """The batch's precomputed reference log-probs (`ref_logps`, chosen rows then rejected rows)."""
    ref = batch["ref_logps"].to(policy.chosen.device)
    n = ref.shape[0] // 2
    return PairLogps(ref[:n], ref[n:], policy.chosen_tokens, policy.rejected_tokens)


def dpo_loss(model: nn.Module, batch: Batch, *, config: DPOConfig, ctx: DistributedContext,
             reference: FrozenModel | None, pack: bool, parameters: int) -> tuple[torch.Tensor, float, dict[str, float]]:
    """The preference loss SUMMED over the batch's pairs, the pair count, and TRL's pair metrics as
    sums (`preference_metric_sums`). The reference's log-probs come precomputed from the batch, from
    `reference`, or not at all (SimPO). `parameters`: the policy's, for `forward_plan`."""
    # Inputs go to the compute device explicitly: with offload the params live on the CPU.
    batch = {k: v.to(ctx.device) for k, v in batch.items()}
    start = int(batch["response_start"])
    plan = forward_plan(model, batch, config, ctx, pack, parameters)
    policy = pair_logps(policy_logprobs(model, batch, plan), batch["attention_mask"], start)
    ref = None
    if "ref_logps" in batch:
        ref = precomputed_logps(batch, policy)
    elif reference is not None:
        budget = int(batch["attention_mask"].sum()) if pack else 0
        ref = reference_logps(reference, batch, plan.share, budget)
    result = preference_loss(policy, ref, config.loss_type, config.beta, config.label_smoothing, config.simpo_gamma,
                             config.rpo_alpha)
    return result.losses.sum(), float(result.losses.shape[0]), preference_metric_sums(result, policy)


def build_reference(config: DPOConfig, ctx: DistributedContext, engine: TrainEngine) -> tuple[FrozenModel | None, str]:
    """The frozen reference (None for SimPO) and how it is held, for the log and the summary. It
    answers a whole micro-batch in one forward (micro-batches of every step's rows at most), so
    sharded ranks run as many forwards."""
    if not config.needs_reference:
        return None, "none (reference-free loss)"
    rows = 2 * config.engine.micro_batch_size * (config.engine.grad_accum or 1)
    if config.lora.lora_rank and config.ref in (None, config.model):
        return AdaptersOffReference(engine.model, ctx, rows), "the policy with its LoRA adapters off"
    source = config.ref or config.model
    model, weights = deferred_causal_lm(source, "--ref")
    return (FrozenModel(model, ctx, config.engine.zero_stage, engine.dtype, config.offload_ref, rows, "ref",
                        compile=config.engine.compile, weights=weights),
            f"a frozen copy of {source} ({engine.dtype})")


@torch.no_grad()
def precompute_reference(reference: FrozenModel, rows: list[dict], collate: Any, config: DPOConfig,
                         ctx: DistributedContext) -> None:
    """Each row's reference log-probs `ref_logps` (chosen, rejected), the rows shared out over the
    ranks in micro-batches and summed so that every rank holds all of them."""
    values = torch.zeros(len(rows), 2, dtype=torch.float64, device=ctx.device)
    for indices, weight in evaluation_batches(len(rows), config.engine.micro_batch_size, ctx):
        batch = {k: v.to(ctx.device) for k, v in collate([rows[i] for i in indices]).items()}
        logps = reference_logps(reference, batch, config.share_prompt_forward, 0)
        if weight:
            values[indices, 0] = logps.chosen.double()
            values[indices, 1] = logps.rejected.double()
    for row, (chosen, rejected) in zip(rows, ctx.all_reduce_sum(values).tolist()):
        row["ref_logps"] = (chosen, rejected)


def run(config: DPOConfig) -> dict[str, Any]:
    """Train the policy on preference pairs and export it (collective: every rank calls it); returns the summary."""
    ctx = DistributedContext.initialize()
    config, output = start_stage(config, ctx, "dpo")  # the batch arithmetic resolved

    tokenizer, max_seq_len = stage_tokenizer(config)
    train_rows, eval_rows, data_stats = load_pair_rows(config, tokenizer, max_seq_len, stage="dpo")
    plan, total_steps = plan_total_steps(len(train_rows), config, ctx.world_size, len(eval_rows), unit="pairs")

    model, weights = deferred_causal_lm(config.model)  # on meta: each rank reads only its shards
    if config.disable_dropout:
        disable_dropout(model)  # before LoRA: an explicit --lora-dropout stays
    model, weights = with_lora(model, weights, config, config.model, "dpo")
    engine = TrainEngine(model, config.engine, ctx, total_steps, name="policy", weights=weights)
    reference, held = build_reference(config, ctx, engine)
    log.info("dpo: loss %s, beta %g; reference: %s", config.loss_type, config.beta, held)

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        return collate_preference(rows, tokenizer.pad_token_id)

    if reference is not None and config.precompute_ref_logprobs:
        precompute_reference(reference, train_rows + eval_rows, collate, config, ctx)
        log.info("dpo: reference log-probs of %d pairs precomputed; the reference model is freed",
                 len(train_rows) + len(eval_rows))
        held, reference = f"precomputed from {held}", None
        gc.collect()

    tracker, checkpointer = open_run(config, ctx, output, "dpo")
    pack = bool(config.pack_sequences and config.max_tokens_per_micro_batch)
    parameters = sum(p.numel() for p in engine.model.parameters())
    loss_fn = partial(dpo_loss, config=config, ctx=ctx, reference=reference, pack=pack, parameters=parameters)

    def eval_fn() -> dict[str, float]:
        return evaluate(engine, eval_rows, collate, loss_fn)

    result = run_training(
        "dpo", config, ctx, engine, tracker=tracker, checkpointer=checkpointer, plan=plan, total_steps=total_steps,
        rows=train_rows, collate=collate, loss_fn=loss_fn, eval_fn=eval_fn if eval_rows else None,
        row_lengths=lambda row: [len(row["chosen_ids"]), len(row["rejected_ids"])],
    )
    export_trained_model(engine, output / "model", tokenizer, config.lora)

    summary = {
        "stage": "dpo",
        "loss_type": config.loss_type,
        "beta": config.beta,
        "reference": held,
        "steps": result.global_step,
        "train_loss": result.last_metrics.get("loss"),
        **{f"train_{k}": v for k, v in result.last_metrics.items() if k.startswith(("rewards/", "logps/"))},
        "train_seconds": result.train_seconds,
        "train_rows": len(train_rows),
        "eval_rows": len(eval_rows),
        **{f"eval_{k}": v for k, v in result.eval_metrics.items()},
        "data": data_stats,
        **engine_summary(engine),
    }
    finish_stage(ctx, output, tracker, summary)
    return summary
