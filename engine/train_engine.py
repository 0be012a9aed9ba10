"""Train mode of the hybrid engine: one trainable model with its optimizer, schedule and scaling.

Usage in a stage (DeepSpeed-style boundaries, but the engine owns them):

    engine = TrainEngine(model, config.engine, ctx, total_steps=...)
    for micro_batch in batches:
        loss = loss_fn(engine.model(**micro_batch))
        engine.backward(loss)               # divides by grad_accum, applies the fp16 loss scale
        if engine.is_accumulation_boundary:
            result = engine.step()          # unscale, overflow check, clip, optimizer + LR step

`loss` is the micro-batch loss normalised so that the mean over grad_accum micro-batches and over
data-parallel ranks is the global-batch loss (see `global_normalizer`).

Non-finite training: a NaN/inf loss poisons its gradients (see `backward`), so one test of the
global gradient norm decides on every rank alike whether a step is skipped. With fp16 the loss
scaler absorbs overflows as DeepSpeed does; a skip it cannot absorb (and every skip without fp16)
counts towards `max_skipped_steps` in a row, after which `NonFiniteTrainingError` stops the run
before anything is exported. An optimizer step that makes a parameter non-finite stops it at once:
the weights cannot be restored, and no checkpoint or model may hold them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from rlhf.engine.distributed import DistributedContext
from rlhf.engine.fsdp import ShardLoader, apply_fsdp
from rlhf.engine.sharding import resolve_dtype, sharding_plan, wraps_in_fsdp
from rlhf.engine.fused_adam import FusedAdamW, total_norm
from rlhf.engine.loss_scale import LossScaler
from rlhf.engine.optim import build_optimizer, build_scheduler
from rlhf.engine.config import EngineConfig
from rlhf.errors import UserError
from rlhf.logging import get_logger

log = get_logger(__name__)

ADVICE = ("lower --lr (or --weight-decay), clip gradients with --grad-clip 1.0, train in bf16 or fp32 rather than "
          "fp16, or check the data")


class NonFiniteTrainingError(UserError):
    """Training produced NaN/inf that skipping steps cannot repair: the run stops with one line,
    exports no model, writes no DONE, and leaves its checkpoints as they were."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _finite_on_one_device(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Every element of `tensors` (one device) finite. The inf-norm (each tensor's largest
    |value|) cannot overflow, and NaN propagates through it. On the CPU, where torch's abs-max is
    ~10x slower than its 2-norm, a finite 2-norm answers first (NaN and inf propagate into it
    too); only a non-finite one, possibly the overflow of large finite values, needs the inf-norm."""
    if tensors[0].device.type == "cpu" and bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors))).all()):
        return torch.tensor(True)
    return torch.isfinite(torch.stack(torch._foreach_norm(tensors, ord=float("inf")))).all()


def all_finite(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool tensor on the tensors' device: every element finite (no host sync off the CPU)."""
    tensors = [t.detach() for t in tensors if t.numel() > 0 and not t.is_meta]
    if not tensors:
        return torch.tensor(True)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    flags = [_finite_on_one_device(ts) for ts in by_device.values()]
    return flags[0] if len(flags) == 1 else torch.stack([f.cpu() for f in flags]).all()


def first_non_finite(named: Iterable[tuple[str, Any]]) -> str | None:
    """The name of the first tensor holding a NaN/inf (non-tensors are skipped), or None."""
    named = [(n, t) for n, t in named if torch.is_tensor(t) and t.is_floating_point()]
    if bool(all_finite(_local(t) for _, t in named)):
        return None
    return next(n for n, t in named if not bool(all_finite([_local(t)])))


@dataclass
class StepResult:
    """What one optimizer step did."""

    stepped: bool
    """False when the step was skipped (fp16 overflow, or a non-finite loss or gradient norm)."""
    grad_norm: float
    lr: float
    loss_scale: float | None


class TrainEngine:
    """One model in train mode: FSDP2-wrapped (plain on one process in fp32: `wraps_in_fsdp`), with
    AdamW, LR schedule, accumulation, clipping."""

    def __init__(
        self, model: nn.Module, config: EngineConfig, ctx: DistributedContext, total_steps: int,
        name: str = "model", weights: ShardLoader | None = None,
    ) -> None:
        """`model` is whole on every rank, or on the meta device with `weights` to fill this rank's
        shards once it is sharded (sharded loading: no rank ever holds the whole model). `config`
        as the stage resolved it (rlhf.engine.batch_size.resolved_batch): read, never changed."""
        if config.grad_accum is None and config.train_batch_size is not None:
            raise ValueError(f"{name}: train_batch_size {config.train_batch_size} with grad_accum unset: resolve the "
                             "config first (rlhf.engine.batch_size.resolved_batch)")
        self.config = config
        self.ctx = ctx
        self.name = name
        self.dtype = resolve_dtype(config.dtype, ctx.device)
        if self.dtype == "fp16" and ctx.device.type == "cpu":
            log.warning("%s: fp16 on CPU is slow and only meant for testing", name)
        self.grad_accum: int = config.grad_accum or 1
        self.plan = sharding_plan(config.zero_stage, trainable=True)
        self.model = apply_fsdp(model, ctx, self.plan, self.dtype, config.offload,
                                gradient_checkpointing=config.gradient_checkpointing, compile=config.compile,
                                weights=weights,
                                shard=wraps_in_fsdp(ctx.world_size, config.offload, self.dtype, trainable=True))
        # Checked on each rank's shards (a model loaded shard by shard is whole nowhere), the first bad
        # name shared so that every rank raises alike; not again when the loader checked what it read
        # (`checks_finite`: the app's safetensors loader, whose error names the folder).
        checked = getattr(weights, "checks_finite", False)
        local_bad = None if checked else first_non_finite(self.model.named_parameters())
        bad = None if checked else next((b for b in ctx.all_gather_object(local_bad) if b is not None), None)
        if bad is not None:
            raise UserError(f"{name}: the model to train holds NaN/inf weights (first: {bad}), as a diverged run "
                            "leaves them; start from another model or retrain this one")
        self.optimizer = build_optimizer(self.model, config, torch.device("cpu") if config.offload else ctx.device)
        self.scheduler = build_scheduler(self.optimizer, config, total_steps)
        self.scaler = (
            LossScaler.from_config(
                config.loss_scale, config.initial_scale_power, config.loss_scale_window,
                config.hysteresis, config.min_loss_scale,
            )
            if self.dtype == "fp16"
            else None
        )
        self.micro_step = 0
        self.pending_micro_steps = 0  # backward passes since the last optimizer step
        self.global_step = 0
        self.skipped_steps = 0
        self.zero_gradient_streak = 0
        self.warned_zero_gradient = False
        self.consecutive_skipped = 0
        """Skipped steps in a row that the loss scaler could not absorb (see `_count_skip`)."""
        self._all_true = torch.ones((), dtype=torch.bool, device=ctx.device)
        self._loss_finite = self._all_true
        """This rank's micro-batch losses since the last step were all finite (read only on a skip)."""

    # ------------------------------------------------------------------ train loop

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    @property
    def is_accumulation_boundary(self) -> bool:
        """True right after the backward of the last micro-batch of an optimizer step."""
        return self.pending_micro_steps > 0 and self.pending_micro_steps % self.grad_accum == 0

    def _set_gradient_sync(self) -> None:
        # When grads are reduced is the sharding plan's call (see ShardingPlan).
        last = (self.pending_micro_steps + 1) % self.grad_accum == 0
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(self.plan.sync_grads_every_micro_step or last)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss, scaled for accumulation (and fp16 loss scaling).

        A NaN/inf loss is multiplied by NaN (a finite one by exactly 1.0, which changes no bit), so
        its gradients are NaN even where the loss's own gradient would be finite (a NaN added as a
        constant): the global gradient norm then carries the verdict to every rank, with no host
        sync here and no extra collective in `step`."""
        self._set_gradient_sync()
        finite = torch.isfinite(loss.detach().float())
        self._loss_finite = self._loss_finite & finite
        scaled = loss.float() / self.grad_accum * torch.where(finite, 1.0, float("nan"))
        if self.scaler is not None:
            scaled = scaled * self.scaler.scale
        scaled.backward()
        self.micro_step += 1
        self.pending_micro_steps += 1

    def set_grad_accum(self, micro_batches: int) -> None:
        """Accumulate the next optimizer step over this many micro-batches (a stage whose
        micro-batches follow a token budget has as many as its rows need, the same on every rank);
        only between optimizer steps."""
        if self.pending_micro_steps:
            raise RuntimeError(f"{self.name}: set_grad_accum with {self.pending_micro_steps} micro-batches pending")
        if micro_batches < 1:
            raise ValueError(f"{self.name}: grad_accum must be >= 1, got {micro_batches}")
        self.grad_accum = micro_batches

    def _local_grads(self) -> list[torch.Tensor]:
        grads = []
        for p in self.model.parameters():
            if p.grad is not None:
                g = p.grad
                grads.append(g.to_local() if hasattr(g, "to_local") else g)
        return grads

    def _clip_gradients(self, params: list[torch.Tensor]) -> tuple[float, float]:
        """Clip to --grad-clip (when > 0): (the total gradient norm, the clipping coefficient still
        to apply: 1.0 where the gradients are already scaled). On one process the local gradients
        are the whole ones, so the norm (fused_adam.total_norm: one parallel pass on the CPU) and
        the scaling run over plain tensors (torch's DTensor path costs ~40 ms a step in dispatch for
        a 39-tensor model on a CPU), and a FusedAdamW takes the coefficient into its step (its CPU
        kernels multiply each gradient as they read it: the same product as torch's in-place
        scaling, without a pass of its own)."""
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        if self.ctx.world_size == 1:
            grads = self._local_grads()
            norm = total_norm(grads)
            if not grads or max_norm == float("inf"):
                return float(norm), 1.0
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's clip_grads_with_norm_ coefficient
            if isinstance(self.optimizer, FusedAdamW) and math.isfinite(scale := float(coef)):
                return float(norm), scale
            torch._foreach_mul_(grads, coef)
            return float(norm), 1.0
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm), 1.0

    ZERO_GRADIENT_WARN_AFTER = 3

    def _warn_if_nothing_learned(self, grad_norm: float) -> None:
        """Warn (once) after ZERO_GRADIENT_WARN_AFTER steps in a row with a gradient norm of exactly
        0: nothing is being learned. A collapsed model (too high an --lr leaves finite weights and a
        constant output) looks like this, and so do RL batches whose rewards never differ."""
        self.zero_gradient_streak = self.zero_gradient_streak + 1 if grad_norm == 0.0 else 0
        if self.zero_gradient_streak == self.ZERO_GRADIENT_WARN_AFTER and not self.warned_zero_gradient:
            self.warned_zero_gradient = True
            log.warning("%s: gradient norm exactly 0 for %d steps in a row (step %d): nothing is learned; "
                        "a collapsed model (lower --lr) or, in RL, rewards that never differ within a batch or group",
                        self.name, self.ZERO_GRADIENT_WARN_AFTER, self.global_step)

    def step(self) -> StepResult:
        """Optimizer step at an accumulation boundary: unscale, overflow check, clip, step, schedule."""
        if not self.is_accumulation_boundary:
            raise RuntimeError("TrainEngine.step() called before the accumulation boundary")
        lr = self.scheduler.get_last_lr()[0]
        scale = self.scaler.scale if self.scaler is not None else None
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.scaler is not None:
            grads = self._local_grads()
            if grads:
                torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        grad_norm, grad_scale = self._clip_gradients(params)
        overflow = not math.isfinite(grad_norm)
        counted = overflow and (self.scaler is None or self.scaler.exhausted)
        if self.scaler is not None:
            self.scaler.update(overflow)
        if not overflow:
            if grad_scale != 1.0:
                self.optimizer.step(grad_scale=grad_scale)
            else:
                self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending_micro_steps = 0
        self.global_step += 1
        if overflow:
            self._count_skip(grad_norm, counted)
        else:
            self.consecutive_skipped = 0
            self._check_parameters(lr)
            self._warn_if_nothing_learned(grad_norm)
        self._loss_finite = self._all_true
        return StepResult(stepped=not overflow, grad_norm=grad_norm, lr=lr, loss_scale=scale)

    def _count_skip(self, grad_norm: float, counted: bool) -> None:
        """Log a skipped step; stop after max_skipped_steps in a row that the scaler could not absorb."""
        self.skipped_steps += 1
        self.consecutive_skipped += int(counted)
        cause = "gradient norm" if bool(self._loss_finite) else "loss (so every gradient)"
        limit = self.config.max_skipped_steps
        log.warning("%s: step %d skipped, the %s is %s (%d skipped in a row, --max-skipped-steps %d)",
                    self.name, self.global_step, cause, grad_norm, self.consecutive_skipped, limit)
        if limit > 0 and self.consecutive_skipped >= limit:
            floor = " even at --min-loss-scale" if self.scaler is not None and self.scaler.dynamic else ""
            raise NonFiniteTrainingError(
                f"{self.name}: training stopped at step {self.global_step}: {self.consecutive_skipped} optimizer steps "
                f"in a row were skipped because the loss or the gradients were NaN/inf{floor} "
                f"(--max-skipped-steps {limit}); no model is written, checkpoints already saved are kept; {ADVICE}"
            )

    def _check_parameters(self, lr: float) -> None:
        """Stop when the optimizer step just taken made a parameter NaN/inf (a step that cannot be
        skipped any more). Every rank reads the same verdict (a max over ranks of each one's shards).
        On one process, where the step checked what it wrote (FusedAdamW's CPU kernels: every
        param it updated; the others did not change), its verdict is taken as it is."""
        stepped_finite = getattr(self.optimizer, "step_finite", None)
        if self.ctx.world_size == 1 and stepped_finite is not None:
            bad = torch.tensor(not stepped_finite)
        else:
            bad = ~all_finite(_local(p) for p in self.model.parameters())
        if self.ctx.world_size > 1:
            bad = self.ctx.all_reduce_max(bad.to(torch.int32))
        if bool(bad):
            raise NonFiniteTrainingError(
                f"{self.name}: training stopped at step {self.global_step}: the optimizer step (lr {lr:g}) made "
                f"parameters NaN/inf; no model is written, checkpoints already saved are kept; {ADVICE}"
            )

    # ------------------------------------------------------------------ state

    def sharded_state(self) -> dict[str, Any]:
        """Model and optimizer state as sharded DTensors, for torch.distributed.checkpoint."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def host_state(self) -> dict[str, Any]:
        """Small non-tensor state saved per rank: schedule, loss scale, step counters."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "micro_step": self.micro_step,
            "global_step": self.global_step,
            "skipped_steps": self.skipped_steps,
            "consecutive_skipped": self.consecutive_skipped,
        }

    def load_host_state(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.micro_step = state["micro_step"]
        self.global_step = state["global_step"]
        self.skipped_steps = state["skipped_steps"]
        self.consecutive_skipped = state.get("consecutive_skipped", 0)  # absent in older checkpoints

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated (unsharded) model state on CPU; full on rank 0, empty elsewhere."""
        return get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
