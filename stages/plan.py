"""`rlhf plan`: peak memory per rank for each phase of a stage, predicted from configs alone.

    rlhf plan sft --model runs/base --micro-batch-size 8 --world-size 8 --dtype bf16
    rlhf plan ppo --config ppo.yaml --world-size 2           # the same flags and file as `rlhf ppo`
    rlhf plan ppo --actor tiny --reward tiny --world-size 1   # a built-in tiny model (tiny:<family>)

The stage's own config is resolved as the stage would resolve it (defaults < --deepspeed-config <
--config < flags), each model is built on the meta device from its config.json (no weights), and
each phase's peak is the largest of a few moments of that phase, each a sum of the tensors alive
then (rlhf.engine.memory_plan counts them): what the stage logs as `peak_mem_gb_<phase>`.

    sft, reward   train (forward + backward + optimizer step of a micro-batch), eval
    ppo           generation (rollout copy, fused decode weights, KV cache), reward (reward model
                  forward), experience (reference log-probs, critic values), training (critic and
                  actor forward/backward, optimizer steps): stages/plan_ppo.py

LoRA (--lora-rank) is planned as the stages run it: adapters injected by peft on the meta model,
the base frozen, no reference copy in PPO. The steady state is predicted (from the second step or
iteration on: Adam's moments exist), not the model load. Sequence widths are the worst case: --seq-len
(default --max-seq-len) for sft/reward, --prompt-len (default --max-prompt-len) + --max-new-tokens
for ppo. On the CPU a prediction adds the process's fixed cost: its memory before any model loads
(measured in this process after importing the stage, or --baseline-gb) and `CPU_RUNTIME` (pages of
torch's kernels and MKL's buffers the first step touches). On a GPU it is torch's allocated memory
(the CUDA context and the caching allocator's slack come on top).
"""

from __future__ import annotations

import copy
import functools
import importlib
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf.config import LoRAConfig, RunConfig, StageConfig
from rlhf.engine.cpu_matmul import resolve_cpu_matmul
from rlhf.engine.fsdp import resolve_dtype
from rlhf.engine.memory import GIB, current_rss
from rlhf.engine.memory_plan import (
    COMPUTE_BYTES, FP32, ModelShape, TrainedModelMemory, layer_saved_bytes, model_shape, saved_activation_bytes,
    working_set_bytes,
)
from rlhf.engine.logprobs import DEFAULT_CHUNK_BYTES
from rlhf.engine.train_engine import resolve_batch_size
from rlhf.errors import UserError

CPU_RUNTIME = int(0.045 * GIB)
"""Fixed CPU cost of a running stage beyond its pre-load RSS (taken after its imports) and its
tensors: code pages of torch's kernels and MKL's GEMM buffers the first step touches, allocator
bookkeeping. Measured after training steps of 10M, 32M and 110M-parameter Llama models (torch 2.13,
one process): 0.041, 0.043 and 0.051 GiB."""

Components = dict[str, int]


@dataclass
class PhasePlan:
    """One phase's predicted peak: the moment it happens and the tensors alive then (bytes per rank)."""

    name: str
    moment: str
    components: Components
    host: Components = field(default_factory=dict)
    """Components a GPU run keeps in host memory (ZeRO-Offload, --offload-ref/--offload-reward)."""

    @property
    def total(self) -> int:
        return sum(self.components.values())


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


def peak_phase(name: str, moments: dict[str, Components], s: Setting) -> PhasePlan:
    """The phase's peak: its largest moment on the device (zero components dropped; what a GPU
    run offloads counted apart, in host memory)."""

    def device_total(parts: Components) -> int:
        return sum(v for k, v in parts.items() if k not in s.host)

    moment, parts = max(moments.items(), key=lambda kv: device_total(kv[1]))
    return PhasePlan(name, moment, {k: v for k, v in parts.items() if v and k not in s.host},
                     {k: v for k, v in parts.items() if v and k in s.host})


# ------------------------------------------------------------------ model configs


def load_model_config(spec: str, flag: str) -> Any:
    """A model's config from a folder, a config.json file, a hub name, or `tiny` / `tiny:<family>`
    (the built-in tiny model of `rlhf e2e`); no weights are read."""
    from transformers import AutoConfig

    if not spec:
        raise UserError(f"{flag} is required: a model folder, its config.json, or tiny[:<family>]")
    if spec == "tiny" or spec.startswith("tiny:"):
        from rlhf.models.tiny import FAMILIES, build_char_tokenizer, tiny_config

        family = spec.partition(":")[2] or "llama"
        if family not in FAMILIES:
            raise UserError(f"{flag} {spec}: unknown tiny family {family!r}; use one of {', '.join(FAMILIES)}")
        return tiny_config(family, vocab_size=len(build_char_tokenizer()))
    try:
        return AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as exc:
        raise UserError(f"{flag} {spec}: no readable config.json ({' '.join(str(exc).split())[:200]}); pass a model "
                        "folder, its config.json or tiny[:<family>]") from None


def shape_of(spec: str, flag: str, head: str, lora: LoRAConfig | None = None,
             fused_layers: bool = False) -> ModelShape:
    """The parameter shapes of the model `spec` names (`load_model_config`), as an LM or a value
    model, with the stage's LoRA adapters when `lora` has a rank (injected as the stage does);
    `fused_layers`: the run's layers take the fused layer ops (Setting.fused_layers)."""
    adapt = None
    if lora is not None and lora.lora_rank:
        from rlhf.models.lora import apply_lora

        adapt = functools.partial(apply_lora, config=lora)
    return model_shape(load_model_config(spec, flag), head, adapt, fused_layers)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Setting:
    """What every phase needs besides the models: compute bytes, world size and the device."""

    dtype: str
    compute: int
    world: int
    device: str
    fused_adam: bool
    host: frozenset[str] = frozenset()
    """Components held in host memory on a GPU (offload); on the CPU everything is one memory."""
    fused_layers: bool = False
    """Llama-family layers run the fused layer ops: --fused-layers without --compile, float32 on a CPU."""
    offload: bool = False
    """--offload: the trained models stay in FSDP2 (CPUOffloadPolicy) even on one process."""
    packed_decode: bool = False
    """The fast decoder's fused CPU step packs a copy of the weights: --cpu-matmul resolving to
    oneDNN (auto on AMD CPUs), float32 on a CPU (engine/fast_decode.py)."""

    @property
    def runtime(self) -> int:
        return CPU_RUNTIME if self.device == "cpu" else 0


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
    fused_layers = config.engine.fused_layers and not config.engine.compile and device == "cpu" and dtype == "fp32"
    packed_decode = device == "cpu" and dtype == "fp32" and resolve_cpu_matmul(config.engine.cpu_matmul) == "onednn"
    return Setting(dtype, COMPUTE_BYTES[dtype], world, device, config.engine.optimizer_impl != "torch",
                   frozenset(host), fused_layers, config.engine.offload, packed_decode)


def trained(shape: ModelShape, zero: int, s: Setting) -> TrainedModelMemory:
    """The memory terms of a model a TrainEngine trains in setting `s`."""
    return TrainedModelMemory(shape, zero, s.compute, s.world, s.fused_adam, s.offload)


# ------------------------------------------------------------------ heads


def lm_loss_bytes(tokens: int, vocab: int, c: int) -> tuple[int, int]:
    """(forward peak, backward peak) of `sft_loss_sum` over [rows, T, V] logits: the logits, the
    shifted copy (the slice is not contiguous) and its fp32 copy in 16-bit, cross_entropy's
    fp32 log-softmax (saved); backward: that, the NLL gradient and log-softmax's input gradient."""
    logits = tokens * vocab
    upcast = FP32 * logits if c != FP32 else 0
    return logits * (2 * c + FP32) + upcast, 3 * FP32 * logits


def _chunk(rows: int, vocab: int) -> int:
    """fp32 bytes of one chunk of engine/logprobs.py (rows of about DEFAULT_CHUNK_BYTES)."""
    return FP32 * vocab * min(rows, max(1, DEFAULT_CHUNK_BYTES // (FP32 * vocab)))


def selective_logprob_bytes(rows: int, vocab: int, c: int, train: bool, entropy: bool) -> int:
    """Peak of response log-probs (and entropy) over [rows, V] logits (engine/logprobs.py): the
    logits and the forward's fp32 chunk temporaries (a few per chunk with the entropy); in
    training the larger of that and the backward's: the logits' gradient from each term, with
    the temporaries of one chunk of the entropy's backward (log p, p, their product). Measured
    on a 1-chunk [520, 8192] head: 6.3-6.4x the logits, forward and backward alike."""
    logits = c * rows * vocab
    chunk = _chunk(rows, vocab)
    forward = logits + chunk * (5 if entropy else 2)
    if not train:
        return forward
    grads = (2 if entropy else 1) * logits
    return max(forward, logits + grads + chunk * (3 if entropy else 1))


# ------------------------------------------------------------------ sft and reward


def supervised_shapes(config: StageConfig, stage: str, world: int, seq_len: int | None) -> tuple[int, int, int]:
    """(tokens per training micro-batch, evaluation micro-batch, micro-batches per step) of sft/reward:
    micro_batch_size rows (pairs: twice as many sequences) of the padded width, a training
    micro-batch cut to --max-tokens-per-micro-batch when set."""
    engine = copy.deepcopy(config.engine)
    resolve_batch_size(engine, world, "plan")
    rows = engine.micro_batch_size * (2 if stage == "reward" else 1)  # a pair is two sequences
    eval_tokens = rows * (seq_len or config.data.max_seq_len)
    tokens = min(eval_tokens, config.max_tokens_per_micro_batch or eval_tokens)
    return tokens, eval_tokens, engine.grad_accum or 1


def train_moments(m: TrainedModelMemory, tokens: int, head: tuple[int, int], checkpointing: bool, accum: int,
                  base: Components, prefix: str) -> dict[str, Components]:
    """The moments of one micro-batch's forward/backward and the optimizer step of trained model m.
    `head`: (forward, backward) peak bytes of its output head (logits or values), which run after
    the root's forward ends (ZeRO-3: all resharded) and before the gradient reaches it."""
    c, shape = m.compute_bytes, m.shape
    held = {**base, "accumulated grads": m.accumulated_grads() if accum > 1 else 0,
            f"{prefix} gathered": m.gathered_after_forward(),
            f"{prefix} activations": saved_activation_bytes(shape, tokens, c, checkpointing)}
    layer_work = working_set_bytes(shape, tokens, c) + (layer_saved_bytes(shape, tokens, c) if checkpointing else 0)
    backward_gathered = 0 if m.keeps_gathered else m.gathered_in_forward()
    return {
        "forward (head)": {**held, "head": head[0]},
        "backward (head)": {**held, "head": head[1]},
        "backward (layers)": {**held, f"{prefix} gathered for backward": backward_gathered,
                              f"{prefix} root grad": m.root_grad, "layer working set": layer_work},
        "optimizer step": {**base, f"{prefix} grads": m.grads, "adam temporary": m.adam_temporary},
    }


def plan_supervised(config: StageConfig, stage: str, s: Setting, seq_len: int | None) -> list[PhasePlan]:
    """sft (a causal LM and its loss over the whole sequence) or reward (a value model on pairs)."""
    head_kind = "lm" if stage == "sft" else "value"
    shape = shape_of(config.model, "--model", head_kind, config.lora, s.fused_layers)
    m = trained(shape, config.engine.zero_stage, s)
    if seq_len is None:  # --max-seq-len, capped at the model's positions as the stage caps it
        positions = getattr(load_model_config(config.model, "--model").get_text_config(decoder=True),
                            "max_position_embeddings", None)
        seq_len = min(config.data.max_seq_len, positions) if isinstance(positions, int) else None
    tokens, eval_tokens, accum = supervised_shapes(config, stage, s.world, seq_len)
    values = 2 * FP32 * tokens  # values [rows, T] and their fp32 copy
    head = lm_loss_bytes(tokens, shape.vocab, s.compute) if head_kind == "lm" else (values, values)
    base = {"model params": m.params, "adam": m.adam, "runtime": s.runtime}
    phases = [peak_phase("train", train_moments(m, tokens, head, config.engine.gradient_checkpointing, accum, base,
                                                "model"), s)]
    if config.data.eval_split > 0 or config.data.eval_data or config.data.data_test_split:
        eval_values = 2 * FP32 * eval_tokens
        logits = s.compute * eval_tokens * shape.vocab if head_kind == "lm" else eval_values
        loss = lm_loss_bytes(eval_tokens, shape.vocab, s.compute)[0] if head_kind == "lm" else eval_values
        phases.append(peak_phase("eval", {
            "forward": {**base, "model gathered": m.gathered_in_forward(),
                        "working set": working_set_bytes(shape, eval_tokens, s.compute), "logits": logits},
            "loss": {**base, "model gathered": m.gathered_after_forward(), "head": loss}}, s))
    return phases


# ------------------------------------------------------------------ the command


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
    s = setting_of(config, world_size, device)
    if stage == "ppo":
        from rlhf.stages.plan_ppo import plan_ppo

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


__all__ = [
    "CPU_RUNTIME", "Components", "MemoryPlan", "PhasePlan", "Setting", "format_plan", "load_model_config",
    "peak_phase", "plan_stage", "shape_of", "train_moments",
]
