"""The supervised training loop shared by `rlhf sft` and `rlhf reward`.

A stage supplies its tokenized rows, a collate function (whose batches carry `num_units`, the
tokens or pairs the loss averages over) and a loss function that returns the
loss SUMMED over the micro-batch's units (tokens for SFT, pairs for reward) together with the unit
count. The loop normalises by the global unit count of the optimizer step (all micro-batches on all
ranks), so micro-batch 2 x accumulation 4 gives the same update as micro-batch 8, and N ranks the
same as one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from rlhf.engine.checkpoint import Checkpointer
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.train_engine import TrainEngine, resolve_batch_size
from rlhf.config import RunConfig, StageConfig
from rlhf.data.batching import BatchPlan
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.outputs import mark_done, prepare_output, write_summary
from rlhf.tracking import Tracker

log = get_logger(__name__)

Batch = dict[str, torch.Tensor]
# (model, batch) -> (loss summed over units, units, extra metric sums)
LossFn = Callable[[nn.Module, Batch], tuple[torch.Tensor, float, dict[str, float]]]


@dataclass
class LoopResult:
    """What the loop leaves for the stage's summary."""

    global_step: int
    last_metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    train_seconds: float = 0.0


def start_stage(config: RunConfig, ctx: DistributedContext, stage: str) -> Path:
    """Check the batch arithmetic, claim the output folder (rank 0) and seed: every stage's preamble."""
    resolve_batch_size(config.engine, ctx.world_size, stage)
    output = prepare_output(config.output, config.resume) if ctx.is_main else Path(config.output)
    ctx.barrier()
    torch.manual_seed(config.engine.seed)
    return output


def finish_stage(ctx: DistributedContext, output: Path, tracker: Tracker, summary: dict[str, Any]) -> None:
    """summary.json, tracker summary, then DONE (last, atomically); every rank waits for it."""
    if ctx.is_main:
        write_summary(output, summary)
        tracker.summary(summary)
        mark_done(output)
    tracker.finish()
    ctx.barrier()


def plan_total_steps(num_rows: int, config: StageConfig, world_size: int) -> tuple[BatchPlan, int]:
    """The batch plan and the number of optimizer steps this run will take."""
    e = config.engine
    plan = BatchPlan(num_rows, e.micro_batch_size, e.grad_accum or 1, world_size, 0, e.seed)
    if plan.steps_per_epoch == 0:
        raise UserError(
            f"{num_rows} training rows do not fill one global batch of {plan.global_batch_size} "
            "(micro_batch_size x grad_accum x world size); lower them or add data"
        )
    # As in the Hugging Face Trainer, max_steps > 0 overrides epochs (and may span several epochs).
    total = config.max_steps if config.max_steps > 0 else plan.steps_per_epoch * config.epochs
    return plan, total


def evaluation_batches(num_rows: int, micro_batch_size: int, ctx: DistributedContext) -> Iterator[tuple[list[int], float]]:
    """(row indices, weight) for this rank; every rank runs the same number of forwards (FSDP
    collectives), repeating a batch with weight 0 when it has run out of rows."""
    batches = [list(range(i, min(i + micro_batch_size, num_rows))) for i in range(0, num_rows, micro_batch_size)]
    rounds = math.ceil(len(batches) / ctx.world_size)
    for r in range(rounds):
        idx = r * ctx.world_size + ctx.rank
        yield (batches[idx], 1.0) if idx < len(batches) else (batches[0], 0.0)


@torch.no_grad()
def evaluate(
    engine: TrainEngine, rows: list[Any], collate: Callable[[list[Any]], Batch], loss_fn: LossFn
) -> dict[str, float]:
    """Unit-weighted mean loss and metric means over `rows`, reduced across ranks."""
    engine.eval()
    sums: dict[str, float] = {"loss": 0.0}
    units = 0.0
    for indices, weight in evaluation_batches(len(rows), engine.config.micro_batch_size, engine.ctx):
        batch = {k: v for k, v in collate([rows[i] for i in indices]).items() if k != "num_units"}
        loss_sum, n, extra = loss_fn(engine.model, batch)
        sums["loss"] += weight * float(loss_sum)
        units += weight * n
        for k, v in extra.items():
            sums[k] = sums.get(k, 0.0) + weight * v
    engine.train()
    keys = sorted(sums)
    totals = engine.ctx.all_reduce_sum(torch.tensor([sums[k] for k in keys] + [units], dtype=torch.float64))
    total_units = float(totals[-1])
    return {k: float(v) / max(total_units, 1.0) for k, v in zip(keys, totals[:-1])}


def run_training(
    stage: str,
    config: StageConfig,
    ctx: DistributedContext,
    engine: TrainEngine,
    tracker: Tracker,
    checkpointer: Checkpointer,
    plan: BatchPlan,
    total_steps: int,
    rows: list[Any],
    collate: Callable[[list[Any]], Batch],
    loss_fn: LossFn,
    eval_fn: Callable[[], dict[str, float]] | None,
) -> LoopResult:
    """Train `engine` on `rows` for `total_steps` optimizer steps, with eval, checkpoints, resume."""
    plan = BatchPlan(plan.num_rows, plan.micro_batch_size, plan.grad_accum, ctx.world_size, ctx.rank, plan.seed)
    scale = plan.grad_accum * ctx.world_size
    start_epoch, start_step = 0, 0
    latest = checkpointer.latest() if config.resume else None
    if latest is not None:
        loop_state = checkpointer.load(latest, {stage: engine})
        start_epoch, start_step = loop_state["epoch"], loop_state["next_step_in_epoch"]
        replayed = tracker.metrics.truncate_after(engine.global_step) if ctx.is_main else 0
        if replayed:
            log.info("resume: %d metrics rows after step %d removed; those steps run again", replayed, engine.global_step)
    elif config.resume:
        log.info("--resume: no checkpoint in %s, starting from scratch", checkpointer.root)
    result = LoopResult(global_step=engine.global_step)
    engine.train()
    bar = tqdm(total=total_steps, initial=engine.global_step, desc=stage, disable=not ctx.is_main, dynamic_ncols=True)
    started = time.perf_counter()
    epoch = start_epoch
    while engine.global_step < total_steps:
        for step_in_epoch, micro_batches in plan.iterate(epoch, start_step if epoch == start_epoch else 0):
            t0 = time.perf_counter()
            batches = [collate([rows[i] for i in mb]) for mb in micro_batches]
            sums: dict[str, float] = {"loss": 0.0}
            # Normalise by the units (tokens or pairs) of the whole global batch, known up front.
            global_units = float(ctx.all_reduce_sum(sum(float(b["num_units"]) for b in batches)))
            units_seen = 0.0
            tokens = 0
            for b in batches:
                b = {k: v for k, v in b.items() if k != "num_units"}
                loss_sum, n, extra = loss_fn(engine.model, b)
                engine.backward(loss_sum * scale / max(global_units, 1.0))
                sums["loss"] += float(loss_sum.detach())
                units_seen += n
                tokens += int(b["attention_mask"].sum())
                for k, v in extra.items():
                    sums[k] = sums.get(k, 0.0) + v
            step = engine.step()
            keys = sorted(sums)
            totals = ctx.all_reduce_sum(torch.tensor([sums[k] for k in keys] + [units_seen, tokens], dtype=torch.float64))
            n_units = max(float(totals[-2]), 1.0)
            elapsed = time.perf_counter() - t0
            metrics = {k: float(v) / n_units for k, v in zip(keys, totals[:-2])}
            metrics.update(lr=step.lr, grad_norm=step.grad_norm, epoch=epoch, tokens_per_s=float(totals[-1]) / elapsed,
                           step_seconds=elapsed)
            if step.loss_scale is not None:
                metrics["loss_scale"] = step.loss_scale
            if not step.stepped:
                metrics["skipped_steps"] = engine.skipped_steps
            gs = engine.global_step
            result.last_metrics = metrics
            if gs % config.tracking.log_interval == 0 or gs == total_steps:
                tracker.log(metrics, step=gs)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{step.lr:.2e}")
            if eval_fn is not None and config.eval_interval > 0 and gs % config.eval_interval == 0 and gs < total_steps:
                ev = eval_fn()
                tracker.log({f"eval_{k}": v for k, v in ev.items()}, step=gs)
            done = gs >= total_steps
            if done or (config.save_interval > 0 and gs % config.save_interval == 0):
                next_epoch, next_step = (epoch, step_in_epoch + 1)
                if next_step >= plan.steps_per_epoch:
                    next_epoch, next_step = epoch + 1, 0
                checkpointer.save(gs, {stage: engine}, {"epoch": next_epoch, "next_step_in_epoch": next_step})
            if done:
                break
        epoch += 1
    bar.close()
    result.global_step = engine.global_step
    result.train_seconds = time.perf_counter() - started
    if eval_fn is not None:
        result.eval_metrics = eval_fn()
        tracker.log({f"eval_{k}": v for k, v in result.eval_metrics.items()}, step=engine.global_step)
    return result
