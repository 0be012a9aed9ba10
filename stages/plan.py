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
                  actor forward/backward, optimizer steps)

The steady state is predicted (from the second step or iteration on: Adam's moments exist, frozen
models' roots are gathered), not the model load. Sequence widths are the worst case: --seq-len
(default --max-seq-len) for sft/reward, --prompt-len (default --max-prompt-len) + --max-new-tokens
for ppo. On the CPU a prediction adds the process's fixed cost: its memory before any model loads
(measured in this process after importing the stage, or --baseline-gb) and `CPU_RUNTIME` (pages of
torch's kernels and MKL's buffers the first step touches). On a GPU it is torch's allocated memory
(the CUDA context and the caching allocator's slack come on top).
"""

from __future__ import annotations

import copy
import importlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf.config import PPOConfig, RunConfig, StageConfig
from rlhf.engine.fsdp import resolve_dtype
from rlhf.engine.kv_cache import kv_cache_bytes
from rlhf.engine.memory import GIB, current_rss
from rlhf.engine.memory_plan import (
    COMPUTE_BYTES, FP32, FrozenModelMemory, ModelShape, TrainedModelMemory, fused_weight_bytes, inference_copy_bytes,
    layer_saved_bytes, model_shape, saved_activation_bytes, working_set_bytes,
)
from rlhf.engine.logprobs import DEFAULT_CHUNK_BYTES
from rlhf.engine.train_engine import resolve_batch_size
from rlhf.errors import UserError

CPU_RUNTIME = int(0.045 * GIB)
"""Fixed CPU cost after the first training step beyond the pre-load RSS: code pages of torch's
kernels, MKL's GEMM buffers and allocator bookkeeping (measured 0.079-0.088 GiB for 10-110M
parameter Llama models, torch 2.13, one process)."""

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


def shape_of(spec: str, flag: str, head: str) -> ModelShape:
    return model_shape(load_model_config(spec, flag), head)  # type: ignore[arg-type]


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
    return Setting(dtype, COMPUTE_BYTES[dtype], world, device, config.engine.optimizer_impl != "torch",
                   frozenset(host))


def trained(shape: ModelShape, zero: int, s: Setting) -> TrainedModelMemory:
    return TrainedModelMemory(shape, zero, s.compute, s.world, s.fused_adam)


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
    logits, fp32 chunk temporaries (a few per chunk with the entropy), and in training the
    logits' gradient from each term."""
    logits = c * rows * vocab
    chunk = _chunk(rows, vocab) * (5 if entropy else 2)
    if not train:
        return logits + chunk
    grads = (2 if entropy else 1) * logits
    return logits + grads + chunk


# ------------------------------------------------------------------ sft and reward


def supervised_shapes(config: StageConfig, stage: str, world: int, seq_len: int | None) -> tuple[int, int, int]:
    """(tokens per micro-batch, rows per micro-batch, micro-batches per step) of sft/reward."""
    engine = copy.deepcopy(config.engine)
    resolve_batch_size(engine, world, "plan")
    width = seq_len or config.data.max_seq_len
    rows = engine.micro_batch_size * (2 if stage == "reward" else 1)  # a pair is two sequences
    tokens = rows * width
    if config.max_tokens_per_micro_batch:
        tokens = min(tokens, config.max_tokens_per_micro_batch)
    return tokens, max(1, tokens // width), engine.grad_accum or 1


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
                              f"{prefix} root grad": c * shape.root_params, "layer working set": layer_work},
        "optimizer step": {**base, f"{prefix} grads": m.grads, "adam temporary": m.adam_temporary},
    }


def plan_supervised(config: StageConfig, stage: str, s: Setting, seq_len: int | None) -> list[PhasePlan]:
    """sft (a causal LM and its loss over the whole sequence) or reward (a value model on pairs)."""
    head_kind = "lm" if stage == "sft" else "value"
    shape = shape_of(config.model, "--model", head_kind)
    m = trained(shape, config.engine.zero_stage, s)
    tokens, rows, accum = supervised_shapes(config, stage, s.world, seq_len)
    values = 2 * FP32 * tokens  # values [rows, T] and their fp32 copy
    head = lm_loss_bytes(tokens, shape.vocab, s.compute) if head_kind == "lm" else (values, values)
    base = {"model params": m.params, "adam": m.adam, "runtime": s.runtime}
    phases = [peak_phase("train", train_moments(m, tokens, head, config.engine.gradient_checkpointing, accum, base,
                                                "model"), s)]
    if config.data.eval_split > 0 or config.data.eval_data:  # micro_batch_size rows, no token budget
        eval_tokens = config.engine.micro_batch_size * (tokens // rows) * (2 if stage == "reward" else 1)
        values = 2 * FP32 * eval_tokens
        logits = s.compute * eval_tokens * shape.vocab if head_kind == "lm" else values
        loss = lm_loss_bytes(eval_tokens, shape.vocab, s.compute)[0] if head_kind == "lm" else values
        phases.append(peak_phase("eval", {
            "forward": {**base, "model gathered": m.gathered_in_forward(),
                        "working set": working_set_bytes(shape, eval_tokens, s.compute), "logits": logits},
            "loss": {**base, "model gathered": m.gathered_after_forward(), "head": loss}}, s))
    return phases


# ------------------------------------------------------------------ ppo


@dataclass(frozen=True)
class PPOShapes:
    """Rows and widths of one PPO iteration on one rank."""

    gen_rows: int  # rows a TP group generates (generation_batch_size x tp)
    unique: int  # prompts prefilled once for their group
    prompt: int
    new: int
    rows: int  # this rank's experience rows
    micro: int  # rows per training micro-batch
    accum: int  # micro-batches per optimizer step
    keeps_critic: bool
    group: int  # rows sharing one prompt forward (1: none; engine/prompt_sharing.py)

    @property
    def width(self) -> int:
        return self.prompt + self.new

    def forward_tokens(self, rows: int, shares: bool) -> int:
        """Tokens a forward over `rows` rows runs: each group's prompt once when it is shared."""
        if not shares or self.group == 1:
            return rows * self.width
        return math.ceil(rows / self.group) * self.prompt + rows * self.new

    def shared_kv_bytes(self, shape: ModelShape, rows: int, c: int, shares: bool) -> int:
        """With a shared prompt each row's attention keeps the prompt's keys and values copied to
        it (saved for backward in training)."""
        if not shares or self.group == 1:
            return 0
        return shape.layers * rows * self.prompt * 2 * shape.kv_dim * c


def ppo_shapes(config: PPOConfig, world: int, prompt_len: int | None) -> PPOShapes:
    """As `rlhf ppo` resolves them (`rlhf.stages.ppo.resolve_minibatch`, then the engine's batch rule)."""
    from rlhf.stages.ppo import resolve_minibatch

    config = copy.deepcopy(config)
    resolve_minibatch(config, world)
    resolve_batch_size(config.engine, world, "plan")
    gen, tp = config.generation_batch_size, config.inference_tp_size
    per_rank_minibatch = config.engine.train_batch_size // world
    micro = min(config.engine.micro_batch_size, per_rank_minibatch)
    keeps = (config.ppo_epochs == 1 and config.engine.train_batch_size == gen * world
             and config.engine.micro_batch_size >= gen and not config.max_tokens_per_micro_batch)
    return PPOShapes(gen_rows=gen * tp, unique=math.ceil(gen * tp / config.samples_per_prompt) + 1
                     if config.samples_per_prompt > 1 else gen * tp, prompt=prompt_len or config.max_prompt_len,
                     new=config.max_new_tokens, rows=gen, micro=micro,
                     accum=math.ceil(per_rank_minibatch / micro), keeps_critic=keeps and not config.critic_free,
                     group=config.samples_per_prompt if config.share_prompt_forward else 1)


@dataclass(frozen=True)
class PPOModels:
    actor: TrainedModelMemory
    critic: TrainedModelMemory | None
    ref: FrozenModelMemory
    reward: FrozenModelMemory | None


def ppo_models(config: PPOConfig, s: Setting) -> PPOModels:
    zero = config.engine.zero_stage
    actor = shape_of(config.actor, "--actor", "lm")
    ref = actor if not config.ref else shape_of(config.ref, "--ref", "lm")
    critic = None
    if not config.critic_free:
        critic_shape = shape_of(config.critic or config.reward, "--critic", "value")
        critic = trained(critic_shape, config.critic_zero_stage if config.critic_zero_stage is not None else zero, s)
    reward = None
    if config.reward:
        reward = FrozenModelMemory(shape_of(config.reward, "--reward", "value"), zero, s.compute, s.world)
    actor_zero = config.actor_zero_stage if config.actor_zero_stage is not None else zero
    return PPOModels(trained(actor, actor_zero, s), critic, FrozenModelMemory(ref, zero, s.compute, s.world), reward)


def ppo_base(config: PPOConfig, models: PPOModels, s: Setting) -> Components:
    """What every PPO phase holds in the steady state: trained models with their Adam moments (and
    the EMA), frozen models with their gathered roots (FSDP2 never reshards them)."""
    a, c, ref, rm = models.actor, models.critic, models.ref, models.reward
    return {
        "actor params": a.params, "actor adam": a.adam, "actor ema": a.params if config.ema_decay > 0 else 0,
        "critic params": c.params if c else 0, "critic adam": c.adam if c else 0,
        "ref params": ref.params + ref.gathered, "reward params": (rm.params + rm.gathered) if rm else 0,
        "runtime": s.runtime,
    }


def generation_phase(models: PPOModels, shapes: PPOShapes, tp: int, s: Setting, base: Components) -> PhasePlan:
    """Rollout mode: the actor's inference copy, the fast decoder's fused weights and KV cache
    (its own buffers, or the HF path's), prefill and sampling; then the parity check's train-mode
    forward (ZeRO 0-2 leave the actor gathered after it)."""
    shape, c, actor = models.actor.shape, s.compute, models.actor
    dtype = torch.float32 if c == FP32 else torch.bfloat16
    cache = kv_cache_bytes(_text_config(shape), shapes.gen_rows, shapes.width, dtype, tp)
    unique_layer = kv_cache_bytes(_text_config(shape), shapes.unique, shapes.width, dtype, tp) // max(shape.layers, 1)
    copy_ = inference_copy_bytes(shape, c, tp)
    fused = fused_weight_bytes(shape, c) if tp == 1 else 0
    held = {**base, "rollout copy": copy_}
    decode = {**held, "fused weights": fused, "kv cache": cache + unique_layer,
              "prefill working set": working_set_bytes(shape, shapes.unique * shapes.prompt, c),
              "logits": FP32 * shape.vocab * shapes.gen_rows * 4 + c * shape.vocab * shapes.unique,
              "rollouts": shapes.gen_rows * shapes.width * 24}
    parity = {**held, "actor gathered": actor.gathered_in_forward(),
              "working set": working_set_bytes(shape, 2 * shapes.width, c)}
    return peak_phase("generation", {"decode": decode, "parity check": parity}, s)


def _text_config(shape: ModelShape) -> Any:
    """A minimal config for `kv_cache_bytes` from a shape."""
    from transformers import PretrainedConfig

    return PretrainedConfig(num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                            head_dim=shape.head_dim, hidden_size=shape.hidden, num_hidden_layers=shape.layers)


def frozen_moments(m: FrozenModelMemory, tokens: int, logits: int, s: Setting, held: Components,
                   name: str) -> dict[str, Components]:
    """A frozen model's micro-batch forward: a layer computing (root and layer gathered at
    ZeRO-3), then its head's output (`logits`: log-prob temporaries or scores) after the root."""
    return {f"{name} forward": {**held, f"{name} gathered": m.forward_gathered,
                                f"{name} working set": working_set_bytes(m.shape, tokens, s.compute)},
            f"{name} head": {**held, f"{name} head": logits}}


def experience_phase(config: PPOConfig, models: PPOModels, shapes: PPOShapes, s: Setting,
                     held: Components) -> PhasePlan:
    """Reference log-probs over response positions, then the critic's values (kept with their graph
    for the update when it is one micro-batch: `keeps_critic_forward`)."""
    micro = min(config.engine.micro_batch_size, shapes.rows)
    micro_tokens = micro * shapes.width
    vocab = models.actor.shape.vocab
    logits = selective_logprob_bytes(micro * (shapes.new + 1), vocab, s.compute, False, False)
    shared = shapes.group > 1  # the tail's logits, then their copy behind the prompt's last
    moments = frozen_moments(models.ref, shapes.forward_tokens(micro, True),
                             logits + (s.compute * micro * shapes.new * vocab if shared else 0), s, held, "ref")
    actor = models.actor
    if config.recompute_old_logprobs:
        moments["old log-probs"] = {**held, "actor gathered": actor.gathered_in_forward(),
                                    "working set": working_set_bytes(actor.shape, micro_tokens, s.compute),
                                    "logits": logits}
    critic = models.critic
    if critic is not None:
        if shapes.keeps_critic:
            work = {"critic activations": saved_activation_bytes(critic.shape, shapes.rows * shapes.width, s.compute)}
        else:
            work = {"critic working set": working_set_bytes(critic.shape, micro_tokens, s.compute)}
        moments["critic values"] = {**held, "critic gathered": critic.gathered_in_forward(), **work}
    return peak_phase("experience", moments, s)


def training_phase(config: PPOConfig, models: PPOModels, shapes: PPOShapes, s: Setting,
                   held: Components) -> PhasePlan:
    """Per micro-batch the critic's forward/backward, then the actor's (policy log-probs and
    entropy over the response positions, + PTX); then both optimizer steps."""
    actor, critic = models.actor, models.critic
    tokens = shapes.micro * shapes.width
    checkpointing = config.engine.gradient_checkpointing
    shares = not checkpointing  # transformers' checkpointed layers drop the cache: plain forward
    moments: dict[str, Components] = {}
    critic_grads = 0
    if critic is not None:
        values = 2 * FP32 * tokens
        for name, parts in train_moments(critic, tokens, (values, values), checkpointing, shapes.accum, held,
                                         "critic").items():
            moments[f"critic {name}"] = parts
        critic_grads = critic.grads if critic.zero_stage == 3 else critic.accumulated_grads()
    response = shapes.micro * (shapes.new + 1)
    head = selective_logprob_bytes(response, actor.shape.vocab, s.compute, True, True)
    if shares and shapes.group > 1:
        head += s.compute * shapes.micro * shapes.new * actor.shape.vocab  # the tail's logits before the copy
    ptx_tokens = 0
    if config.ptx_data:
        ptx_tokens = shapes.micro * config.data.max_seq_len
        head += max(lm_loss_bytes(ptx_tokens, actor.shape.vocab, s.compute))
    actor_held = {**held, "critic grads": critic_grads,
                  "shared prompt keys/values": shapes.shared_kv_bytes(actor.shape, shapes.micro, s.compute, shares)}
    actor_tokens = shapes.forward_tokens(shapes.micro, shares) + ptx_tokens
    for name, parts in train_moments(actor, actor_tokens, (head, head), checkpointing, shapes.accum,
                                     actor_held, "actor").items():
        if name == "optimizer step":
            parts = {**parts, "critic grads": critic.grads if critic else 0,
                     "adam temporary": max(actor.adam_temporary, critic.adam_temporary if critic else 0)}
        moments[f"actor {name}"] = parts
    return peak_phase("training", moments, s)


def plan_ppo(config: PPOConfig, s: Setting, prompt_len: int | None) -> list[PhasePlan]:
    """generation, reward, experience and training of one PPO iteration (steady state). After the
    parity check a ZeRO 0-2 actor stays gathered until its first backward (training)."""
    models = ppo_models(config, s)
    shapes = ppo_shapes(config, s.world, prompt_len)
    base = ppo_base(config, models, s)
    held = {**base, "actor gathered": models.actor.gathered_after_forward()}
    phases = [generation_phase(models, shapes, config.inference_tp_size, s, base)]
    reward: dict[str, Components] = {"reward functions": held}
    if models.reward is not None:
        micro = min(config.engine.micro_batch_size, shapes.rows)
        reward = frozen_moments(models.reward, micro * shapes.width, 2 * FP32 * micro * shapes.width, s, held,
                                "reward")
    phases.append(peak_phase("reward", reward, s))
    phases.append(experience_phase(config, models, shapes, s, held))
    phases.append(training_phase(config, models, shapes, s, held))
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


__all__ = ["CPU_RUNTIME", "MemoryPlan", "PhasePlan", "format_plan", "load_model_config", "plan_stage"]
