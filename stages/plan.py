"""`rlhf plan`: peak memory per rank for each phase of a stage, predicted from configs alone.

    rlhf plan sft --model runs/base --micro-batch-size 8 --world-size 8 --dtype bf16
    rlhf plan ppo --config ppo.yaml --world-size 2           # the same flags and file as `rlhf ppo`
    rlhf plan ppo --actor tiny --reward tiny --world-size 1   # a built-in tiny model (tiny:<family>)

The stage's own config is resolved as the stage would resolve it (defaults < --deepspeed-config <
--config < flags), each model is built on the meta device from its config.json (no weights), and
each phase's peak is the largest of a few moments of that phase, each a sum of the tensors alive
then (rlhf.engine.memory_plan counts them): what the stage logs as `peak_mem_gb_<phase>`.

    sft, reward   train (forward + backward + optimizer step of a micro-batch), eval
    dpo           the same over pairs, with the frozen reference's params and its micro-batch
                  forward (none with LoRA, SimPO or --precompute-ref-logprobs, which frees it)
    ppo           generation (rollout copy, fused decode weights, KV cache), reward (reward model
                  forward), experience (reference log-probs, critic values), training (critic and
                  actor forward/backward, optimizer steps): stages/plan_ppo.py

LoRA (--lora-rank) is planned as the stages run it: adapters injected by peft on the meta model,
the base frozen, no reference copy in PPO. The steady state is predicted (from the second step or
iteration on: Adam's moments exist), not the model load. Sequence widths are the worst case: --seq-len
(default --max-seq-len) for sft/reward, --prompt-len (default --max-prompt-len) + --max-new-tokens
for ppo. On the CPU a prediction adds the process's fixed cost: its memory before any model loads
(measured in this process after importing the stage, or --baseline-gb) and `CPU_RUNTIME` (pages of
torch's kernels and MKL's buffers the first step touches; stages/plan_parts.py, with the other parts
every plan is built from). On a GPU it is torch's allocated memory
(the CUDA context and the caching allocator's slack come on top).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from rlhf.config import DPOConfig, RunConfig, StageConfig
from rlhf.engine.backends.registry import plan_backend
from rlhf.engine.sharding import resolve_dtype
from rlhf.engine.phase_memory import GIB, current_rss
from rlhf.engine.memory_plan import COMPUTE_BYTES, FP32, FrozenModelMemory, working_set_bytes
from rlhf.engine.batch_size import resolved_batch
from rlhf.errors import UserError
from rlhf.stages.plan_parts import (
    PhasePlan, Setting, lm_loss_bytes, load_model_config, peak_phase, shape_of, train_moments, trained,
)
from rlhf.stages.plan_ppo import plan_ppo

C = TypeVar("C", bound=RunConfig)


@dataclass
class MemoryPlan:
    """A stage's predicted per-rank peaks, phase by phase."""

    stage: str
    world_size: int
    device: str
    dtype: str
    baseline: int
    phases: list[PhasePlan]
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return self.baseline + max(p.total for p in self.phases)

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage, "world_size": self.world_size, "device": self.device, "dtype": self.dtype,
            "baseline_gb": self.baseline / GIB, "peak_gb": self.peak / GIB,
            "phases": {p.name: {"peak_gb": (self.baseline + p.total) / GIB, "above_baseline_gb": p.total / GIB,
                                "moment": p.moment, "components_gb": {k: v / GIB for k, v in p.components.items()},
                                "host_gb": sum(p.host.values()) / GIB,
                                "host_components_gb": {k: v / GIB for k, v in p.host.items()}}
                       for p in self.phases},
        }


def setting_of(config: RunConfig, world: int, device: str) -> Setting:
    """The compute dtype (auto: bf16 on a GPU; one that lacks it is not planned for) and, on a
    GPU, what ZeRO-Offload and --offload-ref/--offload-reward keep in host memory."""
    dtype = config.engine.dtype
    if dtype == "auto":
        dtype = "bf16" if device == "cuda" else resolve_dtype(dtype, torch.device(device))
    host: set[str] = set()
    if device == "cuda" and config.engine.offload:
        host |= {f"{who} {what}" for who in ("model", "actor", "critic") for what in ("params", "adam", "grads", "ema")}
        host |= {"adam", "adam temporary", "critic grads"}
    if device == "cuda" and getattr(config, "offload_ref", False):
        host.add("ref params")
    if device == "cuda" and getattr(config, "offload_reward", False):
        host.add("reward params")
    return Setting(dtype, COMPUTE_BYTES[dtype], world, device, config.engine.optimizer_impl != "torch",
                   frozenset(host), config.engine.offload, plan_backend(device, config.cpu, config.cuda),
                   config.engine.compile)


# ------------------------------------------------------------------ sft and reward


def supervised_shapes(config: StageConfig, stage: str, world: int, seq_len: int | None) -> tuple[int, int, int]:
    """(tokens per training micro-batch, evaluation micro-batch, micro-batches per step) of sft/reward/dpo:
    micro_batch_size rows (pairs: twice as many sequences) of the padded width, a training
    micro-batch cut to --max-tokens-per-micro-batch when set; `config` resolved (`plan_config`)."""
    engine = config.engine
    assert engine.grad_accum is not None, "supervised_shapes needs the config plan_config resolved"
    rows = engine.micro_batch_size * (2 if stage in ("reward", "dpo") else 1)  # a pair is two sequences
    eval_tokens = rows * (seq_len or config.data.max_seq_len)
    tokens = min(eval_tokens, config.max_tokens_per_micro_batch or eval_tokens)
    return tokens, eval_tokens, engine.grad_accum


def plan_supervised(config: StageConfig, stage: str, s: Setting, seq_len: int | None) -> list[PhasePlan]:
    """sft (a causal LM and its loss over the whole sequence), reward (a value model on pairs) or
    dpo (a causal LM on pairs, with its frozen reference: `reference_memory`)."""
    head_kind = "value" if stage == "reward" else "lm"
    shape = shape_of(config.model, "--model", head_kind, config.lora, s.fuses_layers)
    m = trained(shape, config.engine.zero_stage, s)
    if seq_len is None:  # --max-seq-len, capped at the model's positions as the stage caps it
        positions = getattr(load_model_config(config.model, "--model").get_text_config(decoder=True),
                            "max_position_embeddings", None)
        seq_len = min(config.data.max_seq_len, positions) if isinstance(positions, int) else None
    tokens, eval_tokens, accum = supervised_shapes(config, stage, s.world, seq_len)
    values = 2 * FP32 * tokens  # values [rows, T] and their fp32 copy
    head = lm_loss_bytes(tokens, shape.vocab, s.compute) if head_kind == "lm" else (values, values)
    base = {"model params": m.params, "adam": m.adam, "runtime": s.runtime}
    ref = reference_memory(config, s) if isinstance(config, DPOConfig) else None
    if ref is not None:
        base["ref params"] = ref.params + ref.gathered
    moments = train_moments(m, tokens, head, config.engine.gradient_checkpointing, accum, base, "model")
    if ref is not None:  # its log-probs of a micro-batch, before the policy's forward
        moments["ref forward"] = {**base, "ref gathered": ref.forward_gathered,
                                  "ref working set": working_set_bytes(ref.shape, tokens, s.compute),
                                  "ref head": lm_loss_bytes(tokens, shape.vocab, s.compute)[0]}
    phases = [peak_phase("train", moments, s)]
    if config.data.eval_split > 0 or config.data.eval_data or config.data.data_test_split:
        eval_values = 2 * FP32 * eval_tokens
        logits = s.compute * eval_tokens * shape.vocab if head_kind == "lm" else eval_values
        loss = lm_loss_bytes(eval_tokens, shape.vocab, s.compute)[0] if head_kind == "lm" else eval_values
        phases.append(peak_phase("eval", {
            "forward": {**base, "model gathered": m.gathered_in_forward(),
                        "working set": working_set_bytes(shape, eval_tokens, s.compute), "logits": logits},
            "loss": {**base, "model gathered": m.gathered_after_forward(), "head": loss}}, s))
    return phases


def reference_memory(config: DPOConfig, s: Setting) -> FrozenModelMemory | None:
    """The DPO reference as the stage holds it in training: a frozen copy of --ref (default --model)
    at --zero-stage, or none (LoRA: the policy with its adapters off; SimPO; precomputed log-probs,
    after which the copy is freed)."""
    if not config.needs_reference or config.precompute_ref_logprobs:
        return None
    if config.lora.lora_rank and config.ref in (None, config.model):
        return None
    shape = shape_of(config.ref or config.model, "--ref", "lm", fuses_layers=s.fuses_layers)
    return FrozenModelMemory(shape, config.engine.zero_stage, s.compute, s.world)


# ------------------------------------------------------------------ the command


def plan_config(stage: str, config: C, world_size: int) -> C:
    """`config` with its batch arithmetic resolved as `rlhf <stage>` resolves it at its start
    (start_stage: `resolved_batch`, PPO with its default minibatch); a new config, `config` unchanged."""
    defaults: dict[str, int] = {}
    if stage == "ppo":
        # The PPO stage's modules load when PPO is planned only: `rlhf plan sft` measures its CPU baseline
        # (`measured_baseline`) after importing its own stage, which a loaded PPO stage would inflate.
        from rlhf.stages.ppo import default_minibatch

        defaults = default_minibatch(config, world_size)  # type: ignore[arg-type]
    return dataclasses.replace(config, engine=resolved_batch(config.engine, world_size, **defaults, where="plan"))


def measured_baseline(stage: str) -> int:
    """This process's RSS after importing the stage's modules: about what the stage holds before
    it loads a model (torch, transformers, datasets; a stage adds its data and tokenizer)."""
    importlib.import_module(f"rlhf.stages.{stage}")
    return current_rss() or 0


def plan_stage(stage: str, config: RunConfig, world_size: int, device: str = "cpu", seq_len: int | None = None,
               prompt_len: int | None = None, baseline_gb: float | None = None) -> MemoryPlan:
    """The predicted per-rank peak of each phase of `rlhf <stage>` with `config` on `world_size` ranks."""
    if world_size < 1:
        raise UserError(f"--world-size {world_size} must be >= 1")
    config = plan_config(stage, config, world_size)
    s = setting_of(config, world_size, device)
    if stage == "ppo":
        phases = plan_ppo(config, s, prompt_len)  # type: ignore[arg-type]
    else:
        phases = plan_supervised(config, stage, s, seq_len)  # type: ignore[arg-type]
    if baseline_gb is not None:
        baseline = int(baseline_gb * GIB)
    else:
        baseline = measured_baseline(stage) if device == "cpu" else 0
    notes = [] if s.fused_adam else ["torch AdamW: one fp32 params-sized temporary in the step"]
    if device == "cuda":
        notes.append("GPU: torch's allocated memory; the CUDA context and the caching allocator's slack come on top")
    return MemoryPlan(stage, world_size, device, s.dtype, baseline, phases, notes)


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table: one block per phase, its components largest first (GiB per rank)."""
    lines = [f"rlhf plan {plan.stage}: world size {plan.world_size}, {plan.device}, {plan.dtype}; GiB per rank "
             f"(baseline {plan.baseline / GIB:.3f}: the process before any model loads)"]
    for phase in plan.phases:
        lines.append(f"  {phase.name:<11} {(plan.baseline + phase.total) / GIB:8.3f} total  "
                     f"{phase.total / GIB:8.3f} above baseline   at: {phase.moment}")
        for name, value in sorted(phase.components.items(), key=lambda kv: -kv[1]):
            lines.append(f"      {name:<30} {value / GIB:8.3f}")
        for name, value in sorted(phase.host.items(), key=lambda kv: -kv[1]):
            lines.append(f"      {name + ' (host)':<30} {value / GIB:8.3f}")
    lines.append(f"  peak        {plan.peak / GIB:8.3f}")
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


__all__ = ["MemoryPlan", "format_plan", "plan_config", "plan_stage", "plan_supervised", "setting_of"]
