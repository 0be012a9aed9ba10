"""The supervised training loop shared by `rlhf sft` and `rlhf reward`, and the plumbing every stage
(PPO included) shares: `start_stage`, `open_run`, `resume_from_latest`, `finish_stage`.

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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
from torch import nn
from tqdm import tqdm

from rlhf.engine.checkpoint import Checkpointer, complete_checkpoints, saved_run_config
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.fsdp import local_parameter_count
from rlhf.engine.backends.registry import backend_for, select_backend
from rlhf.engine.phase_memory import PhaseMemory, record_baseline
from rlhf.engine.micro_batches import budget_partition, forward_tokens
from rlhf.engine.packing import log_packing, packing_unsupported_reason
from rlhf.engine.preemption import Preempted, agreed_stop, mark_stopped, requested_signal, resume_hint, signal_name
from rlhf.engine.batch_size import resolved_batch
from rlhf.engine.train_engine import TrainEngine
from rlhf.config import RunConfig, StageConfig, to_dict
from rlhf.data.batching import BatchPlan
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.models.checks import check_tokenizer_fits, fit_max_seq_len
from rlhf.models.loading import load_tokenizer
from rlhf.output_lock import release_output
from rlhf.outputs import (
    RESUME_SAFE_FIELDS, config_as_saved, is_done, mark_done, prepare_output, read_saved_config, read_summary,
    resume_config_changes, unmark_done, write_config, write_summary,
)
from rlhf.tracking import MetricsFile, Tracker

log = get_logger(__name__)

Batch = dict[str, torch.Tensor]
C = TypeVar("C", bound=RunConfig)
# (model, batch) -> (loss summed over units, units, extra metric sums)
LossFn = Callable[[nn.Module, Batch], tuple[torch.Tensor, float, dict[str, float]]]


@dataclass
class LoopResult:
    """What the loop leaves for the stage's summary."""

    global_step: int
    last_metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    train_seconds: float = 0.0


class RunFinished(SystemExit):
    """`--resume` on a finished run with nothing to add: every rank ends with exit code 0 and no
    file is touched. (e2e never meets it: it skips finished stages itself.)"""

    def __init__(self) -> None:
        super().__init__(0)


def start_stage(config: C, ctx: DistributedContext, stage: str, default_train_batch: int | None = None,
                max_micro: int | None = None) -> tuple[C, Path]:
    """Choose the device backend (tuned by the config's cpu:/cuda: sections), resolve the batch arithmetic,
    claim the output folder (rank 0) and seed: every stage's preamble. Returns the resolved config
    (`resolved_batch`: a new config, `config` unchanged; PPO passes its default minibatch) and the
    output folder; the stage goes on with that config alone, and nothing resolves it again.

    Every rank acts on rank 0's verdict on the folder (`claim_output`, which compares the resolved
    config with the resolved one the run saved), so a refused resume ends every rank with the same
    error line and a finished run ends every rank with RunFinished."""
    select_backend(ctx.device, config.cpu, config.cuda)
    config = replace(config, engine=resolved_batch(config.engine, ctx.world_size, default_train_batch, max_micro,
                                                   stage))
    record_baseline(ctx.device)  # mem_baseline_gb: the process before any model loads
    verdict: tuple[str, str] = ("train", "")
    if ctx.is_main:
        try:
            verdict = claim_output(config, stage)
        except UserError as exc:
            verdict = ("error", str(exc))
    kind, message = ctx.broadcast_object(verdict)  # type: ignore[misc]
    if kind != "train" and ctx.is_main:
        release_output(Path(config.output))
    if kind == "error":
        raise UserError(message)
    if kind == "finished":
        log.info("%s", message)
        if ctx.world_size > 1:
            ctx.shutdown()
        raise RunFinished()
    torch.manual_seed(config.engine.seed)
    return config, Path(config.output)


def claim_output(config: RunConfig, stage: str) -> tuple[str, str]:
    """Rank 0: create the output folder, or check a resumed one. ("train", "") to go on;
    ("finished", line) for a finished run that --resume has nothing to add to. Raises UserError
    for a changed config (outside RESUME_SAFE_FIELDS), or a finished run to extend that kept no
    checkpoint. Writes nothing but the folder itself, its lock, and DONE's removal when extending.

    The config is compared with the one saved inside the checkpoint the resume starts from, so
    a deleted or edited config.yaml changes nothing; config.yaml only when no checkpoint holds
    one (none yet, or an older version's)."""
    output = prepare_output(config.output, config.resume)
    if not config.resume:
        return "train", ""
    checkpointed = saved_run_config(output / "checkpoints")
    if checkpointed is None:
        saved, source = read_saved_config(output), "its config.yaml"
    else:
        saved, source = checkpointed[1], f"the config saved in {checkpointed[0].relative_to(output)}"
    changes = resume_config_changes(saved, config)
    if changes:
        safe = " ".join("--" + name.replace("_", "-") for name in RESUME_SAFE_FIELDS)
        raise UserError(
            f"--resume {output}: the config differs from {source}: {'; '.join(changes)}; resume with the "
            f"run's values or choose another --output (changeable on resume: {safe})"
        )
    if not is_done(output):
        return "train", ""
    # How long the finished run was: config.yaml, rewritten by each resume, knows an extension
    # that saved no checkpoint at its end; the checkpoint's config when config.yaml is gone.
    if not extends_training(saved if checkpointed is None else readable_config(output) or saved, output, config):
        return "finished", (f"rlhf {stage}: {output} is already finished (DONE); nothing to do, nothing changed. "
                            "To train further, --resume with a larger --max-steps or --epochs")
    if not complete_checkpoints(output / "checkpoints"):
        raise UserError(f"--resume {output}: the run is finished and kept no checkpoint to continue from (it ran "
                        "without --save-final-checkpoint or --save-interval); choose another --output")
    unmark_done(output)
    log.info("--resume: extending the finished run in %s", output)
    return "train", ""


def readable_config(output: Path) -> dict[str, Any]:
    """config.yaml as plain data; {} when it is missing or unreadable."""
    try:
        return read_saved_config(output)
    except UserError:
        return {}


def extends_training(saved: dict[str, Any], output: Path, config: RunConfig) -> bool:
    """Whether --resume asks a finished run for more steps than it took: a larger --max-steps than
    its max_steps (or than the steps its summary.json reports, for a run measured in epochs), or
    more --epochs when both count epochs."""
    old_max_steps = saved.get("max_steps", -1)
    if config.max_steps > 0:
        done_steps = old_max_steps if old_max_steps > 0 else finished_steps(output)
        return done_steps is not None and config.max_steps > done_steps
    return old_max_steps <= 0 and config.epochs > saved.get("epochs", config.epochs)


def finished_steps(output: Path) -> int | None:
    """The steps (PPO: iterations) a finished run's summary.json reports; None when unreadable."""
    try:
        summary = read_summary(output)
    except (OSError, ValueError):
        return None
    steps = summary.get("steps", summary.get("iterations"))
    return steps if isinstance(steps, int) else None


def open_run(config: RunConfig, ctx: DistributedContext, output: Path, stage: str) -> tuple[Tracker, Checkpointer]:
    """The resolved config written beside the outputs (rank 0), the stage's tracker and checkpointer."""
    if ctx.is_main:
        write_config(output, config)
    tracker = Tracker(output, stage, config.tracking, to_dict(config), ctx.is_main)
    return tracker, Checkpointer(output / "checkpoints", ctx, config.keep_checkpoints, config_as_saved(config))


def engine_summary(engine: TrainEngine) -> dict[str, Any]:
    """The summary.json fields every trained model reports: world size, sizes, skipped steps."""
    return {
        "skipped_steps": engine.skipped_steps,
        "world_size": engine.ctx.world_size,
        "parameters": sum(p.numel() for p in engine.model.parameters()),
        "local_parameters_rank0": local_parameter_count(engine.model),
    }


def finish_stage(ctx: DistributedContext, output: Path, tracker: Tracker, summary: dict[str, Any]) -> None:
    """summary.json, tracker summary, then DONE (last, atomically); every rank waits for it. The
    output folder's lock goes last."""
    if ctx.is_main:
        write_summary(output, summary)
        tracker.summary(summary)
        mark_done(output)
        if requested_signal() is not None:
            log.warning("%s received during the last step or the export: the run finished first (DONE)",
                        signal_name(requested_signal() or 0))
    tracker.finish()
    ctx.barrier()
    if ctx.is_main:
        release_output(output)


def stop_for_signal(ctx: DistributedContext, tracker: Tracker, stage: str, signum: int, step: int,
                    checkpoint: Path | None) -> NoReturn:
    """End the stage at the step boundary where every rank agreed to stop for `signum`
    (engine/preemption.py), after `checkpoint` of step `step` was saved (None: no step ran since
    the run started): one line on rank 0, the tracker closed, then `Preempted` on every rank (the
    CLI exits with 128 + signum)."""
    if ctx.is_main:
        saved = f"checkpoint {checkpoint}" if checkpoint is not None else "no step ran in this run; nothing new to save"
        log.warning("rlhf %s: stopped by %s at step %d; %s (%s)", stage, signal_name(signum), step, resume_hint(),
                    saved)
    tracker.finish()
    mark_stopped(signum)
    raise Preempted(signum)


def stage_tokenizer(config: StageConfig) -> tuple[Any, int]:
    """--model's tokenizer (with --chat-template), checked against the model, and --max-seq-len
    capped at the model's positions: what sft, reward and dpo tokenize their rows with."""
    tokenizer = load_tokenizer(config.model, chat_template=config.data.chat_template)
    check_tokenizer_fits(tokenizer, config.model, "--model")
    return tokenizer, fit_max_seq_len(config.data.max_seq_len, config.model, "--model")


def plan_total_steps(num_rows: int, config: StageConfig, world_size: int, num_eval: int = 0,
                     unit: str = "rows") -> tuple[BatchPlan, int]:
    """The batch plan and the number of optimizer steps this run will take (logged); `config` as
    start_stage resolved it."""
    e = config.engine
    assert e.grad_accum is not None, "plan_total_steps needs the config start_stage resolved"
    plan = BatchPlan(num_rows, e.micro_batch_size, e.grad_accum, world_size, 0, e.seed)
    if plan.steps_per_epoch == 0:
        raise UserError(
            f"{num_rows} training rows do not fill one global batch of {plan.global_batch_size} "
            "(micro_batch_size x grad_accum x world size); lower them or add data"
        )
    # As in the Hugging Face Trainer, max_steps > 0 overrides epochs (and may span several epochs).
    total = config.max_steps if config.max_steps > 0 else plan.steps_per_epoch * config.epochs
    log.info("%d train %s, %d eval %s, %d optimizer steps of %d %s", num_rows, unit, num_eval, unit, total,
             plan.global_batch_size, unit)
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
    engine: TrainEngine, rows: list[Any], collate: Callable[[list[Any]], Batch], loss_fn: LossFn,
    progress: str | None = None,
) -> dict[str, float]:
    """Unit-weighted mean loss and metric means over `rows`, reduced across ranks. With `progress`
    (the bar's label), a tqdm bar on rank 0 like the training bar: a full pass over a real model's
    training rows takes tens of seconds that would otherwise look like a hang."""
    engine.eval()
    sums: dict[str, float] = {"loss": 0.0}
    units = 0.0
    batches = evaluation_batches(len(rows), engine.config.micro_batch_size, engine.ctx)
    if progress is not None:
        rounds = math.ceil(math.ceil(len(rows) / engine.config.micro_batch_size) / engine.ctx.world_size)
        batches = tqdm(batches, total=rounds, desc=progress, disable=not engine.ctx.is_main, dynamic_ncols=True)
    for indices, weight in batches:
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


def resume_from_latest(
    config: RunConfig, ctx: DistributedContext, checkpointer: Checkpointer, engines: dict[str, TrainEngine],
    tracker: Tracker,
) -> dict[str, Any] | None:
    """With --resume, restore the newest checkpoint that loads (engines, optimizers, RNG;
    `Checkpointer.resume`) and return its loop state; None when starting fresh. Metrics and
    sample rows logged after the checkpoint's step (after step 0 when there is no checkpoint)
    are removed first, since those steps run again (nothing is logged twice)."""
    if not config.resume:
        return None
    resumed = checkpointer.resume(engines)
    if resumed is None:
        log.info("--resume: no complete checkpoint in %s, starting from scratch", checkpointer.root)
        drop_rows_after(tracker, 0, ctx)
        return None
    latest, loop_state = resumed
    # Checkpoints from before "step" was saved: the folder is named after the step (step_00000012).
    drop_rows_after(tracker, int(loop_state.get("step", latest.name.rsplit("_", 1)[-1])), ctx)
    return loop_state


def drop_rows_after(tracker: Tracker, step: int, ctx: DistributedContext) -> None:
    """Rank 0: remove metrics.jsonl and samples.jsonl rows logged after `step`; they run again."""
    if not ctx.is_main:
        return
    for rows in (tracker.metrics, MetricsFile(tracker.metrics.path.with_name("samples.jsonl"))):
        dropped = rows.truncate_after(step)
        if dropped:
            log.info("resume: %d %s rows after step %d removed; those steps run again", dropped, rows.path.name, step)


RowLengths = Callable[[Any], list[int]]
"""The lengths of the sequences a row collates to (an SFT example: one; a preference pair: two)."""


def budget_micro_batches(rows: list[Any], row_lengths: RowLengths, budget: int,
                         ctx: DistributedContext, packed: bool = False) -> list[list[Any]]:
    """This rank's rows of a step regrouped by length (longest first) into micro-batches of at
    most `budget` padded tokens (sequences x the longest), or with `packed` (the loss runs packed
    forwards where that is fewer tokens) of what their forward runs (`forward_tokens`), as many as
    the rank that needs the most (every rank runs the same number of forwards)."""
    lengths = [row_lengths(r) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: -max(lengths[i]))

    def cost(items: list[int]) -> int:
        padded = sum(len(lengths[i]) for i in items) * max(max(lengths[i]) for i in items)
        return forward_tokens(sum(sum(lengths[i]) for i in items), padded, packed)

    count = int(ctx.all_reduce_max(torch.tensor(len(budget_partition(order, cost, budget)))))
    return [[rows[i] for i in part] for part in budget_partition(order, cost, budget, count)]


def train_step(
    engine: TrainEngine, ctx: DistributedContext, micro_batches: list[list[Any]], collate: Callable[[list[Any]], Batch],
    loss_fn: LossFn, epoch: int, *, budget: int = 0, row_lengths: RowLengths | None = None, packed: bool = False,
) -> dict[str, float]:
    """One optimizer step over this rank's micro-batches (rows; regrouped by `budget_micro_batches`
    when `budget` > 0, `packed`: by what the loss's packed forwards run); the step's metrics,
    reduced over ranks."""
    t0 = time.perf_counter()
    if budget and row_lengths is not None:
        micro_batches = budget_micro_batches([r for rows in micro_batches for r in rows], row_lengths, budget, ctx,
                                             packed)
    engine.set_grad_accum(len(micro_batches))
    batches = [collate(rows) for rows in micro_batches]
    scale = len(micro_batches) * ctx.world_size
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
    return metrics


def wants_checkpoint(config: RunConfig, step: int, last: bool) -> bool:
    """A resume checkpoint after `step`: every --save-interval steps, and after the last step only
    with --save-final-checkpoint (a finished stage is marked DONE and never resumed from it)."""
    if last and config.save_final_checkpoint:
        return True
    return config.save_interval > 0 and step % config.save_interval == 0


def next_position(plan: BatchPlan, epoch: int, step_in_epoch: int) -> dict[str, int]:
    """Where training continues after `step_in_epoch` of `epoch` (saved in the loop state)."""
    if step_in_epoch + 1 >= plan.steps_per_epoch:
        return {"epoch": epoch + 1, "next_step_in_epoch": 0}
    return {"epoch": epoch, "next_step_in_epoch": step_in_epoch + 1}


def run_training(
    stage: str,
    config: StageConfig,
    ctx: DistributedContext,
    engine: TrainEngine,
    *,
    tracker: Tracker,
    checkpointer: Checkpointer,
    plan: BatchPlan,
    total_steps: int,
    rows: list[Any],
    collate: Callable[[list[Any]], Batch],
    loss_fn: LossFn,
    eval_fn: Callable[[], dict[str, float]] | None,
    row_lengths: RowLengths | None = None,
) -> LoopResult:
    """Train `engine` on `rows` for `total_steps` optimizer steps, with eval, checkpoints, resume."""
    plan = replace(plan, world_size=ctx.world_size, rank=ctx.rank)
    loop_state = resume_from_latest(config, ctx, checkpointer, {stage: engine}, tracker)
    start_epoch, start_step = (loop_state["epoch"], loop_state["next_step_in_epoch"]) if loop_state else (0, 0)
    # The checkpoint's last step metrics: the summary's train loss when no step is left to run.
    result = LoopResult(global_step=engine.global_step, last_metrics=dict((loop_state or {}).get("metrics", {})))
    engine.train()
    bar = tqdm(total=total_steps, initial=engine.global_step, desc=stage, disable=not ctx.is_main, dynamic_ncols=True)
    memory = PhaseMemory(ctx.device)  # peak_mem_gb_train / _eval (engine/phase_memory.py)
    started = time.perf_counter()
    # elapsed_s: training wall time (evaluation excluded), carried across a resume.
    elapsed_before = float(result.last_metrics.get("elapsed_s", 0.0))
    eval_seconds = 0.0
    epoch = start_epoch
    # The losses pack their forwards where that runs fewer tokens (sft, reward with --pack-sequences).
    packed = config.pack_sequences and packing_unsupported_reason(engine.model, ctx.device) is None
    if config.pack_sequences and config.max_tokens_per_micro_batch:
        log_packing({stage: packing_unsupported_reason(engine.model, ctx.device)})
    signum = agreed_stop(ctx) if engine.global_step < total_steps else None  # a signal while loading
    if signum is not None:
        bar.close()
        stop_for_signal(ctx, tracker, stage, signum, engine.global_step, None)
    while engine.global_step < total_steps:
        for step_in_epoch, micro_batches in plan.iterate(epoch, start_step if epoch == start_epoch else 0):
            step_rows = [[rows[i] for i in mb] for mb in micro_batches]
            with memory.phase("train"):
                metrics = train_step(engine, ctx, step_rows, collate, loss_fn, epoch,
                                     budget=config.max_tokens_per_micro_batch, row_lengths=row_lengths,
                                     packed=packed)
            metrics.update(memory.metrics(ctx.all_reduce_max))
            backend_for(ctx.device).after_step()  # the CPU's: the heap pages later steps would fault in one by one
            metrics["elapsed_s"] = elapsed_before + time.perf_counter() - started - eval_seconds
            gs = engine.global_step
            result.last_metrics = metrics
            if gs % config.tracking.log_interval == 0 or gs == total_steps:
                tracker.log(metrics, step=gs)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}")
            if eval_fn is not None and config.eval_interval > 0 and gs % config.eval_interval == 0 and gs < total_steps:
                eval_seconds += logged_evaluation(eval_fn, memory, tracker, ctx, gs)[1]
            done = gs >= total_steps
            # Every rank stops after the same step (one small all_reduce); after the last, the run finishes.
            signum = None if done else agreed_stop(ctx)
            checkpoint = None
            if wants_checkpoint(config, gs, done) or signum is not None:
                checkpoint = checkpointer.save(gs, {stage: engine}, {"step": gs, "metrics": metrics,
                                                                     **next_position(plan, epoch, step_in_epoch)})
            if signum is not None:
                bar.close()
                stop_for_signal(ctx, tracker, stage, signum, gs, checkpoint)
            if done:
                break
        epoch += 1
    bar.close()
    result.global_step = engine.global_step
    result.train_seconds = time.perf_counter() - started
    if eval_fn is not None:
        result.eval_metrics = logged_evaluation(eval_fn, memory, tracker, ctx, engine.global_step)[0]
    return result


def logged_evaluation(eval_fn: Callable[[], dict[str, float]], memory: PhaseMemory, tracker: Tracker,
                      ctx: DistributedContext, step: int) -> tuple[dict[str, float], float]:
    """Run `eval_fn` as the eval phase, log its metrics as eval_* with the phase's memory; returns
    the metrics and the seconds it took."""
    started = time.perf_counter()
    with memory.phase("eval"):
        metrics = eval_fn()
    tracker.log({**{f"eval_{k}": v for k, v in metrics.items()}, **memory.metrics(ctx.all_reduce_max)}, step=step)
    return metrics, time.perf_counter() - started
