"""`rlhf plan ppo`: the four phases of one PPO iteration (stages/plan.py has the command and
sft/reward, stages/plan_parts.py the parts every plan is built from).

    generation   rollout mode: the actor's inference copy, the fast decoder's fused weights, the KV
                 cache (group sampling: prefilled once, then copied to the samples), prefill and
                 sampling; the parity check's train-mode forward; with LoRA the merge of the weights
    reward       the frozen reward model's micro-batch forwards (nothing with reward functions)
    experience   reference log-probs over the response positions (a LoRA actor with its adapters
                 off), the critic's values (kept with their graph when the update is one micro-batch)
    training     per micro-batch the critic's forward/backward, then the actor's (policy log-probs
                 and entropy, + PTX); then both optimizer steps

Every phase holds the trained models (params, Adam, the EMA) and the frozen ones; a ZeRO 0-2 actor
stays gathered from the parity check until its first backward. Rows and widths follow `rlhf ppo`:
its default minibatch (`rlhf.stages.ppo.default_minibatch`, resolved by `rlhf.stages.plan.plan_config`),
prompt sharing in groups (engine/prompt_sharing.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from rlhf.config import PPOConfig
from rlhf.engine.kv_cache import kv_cache_bytes
from rlhf.engine.memory_plan import (
    FP32, FrozenModelMemory, ModelShape, TrainedModelMemory, inference_copy_bytes,
    saved_activation_bytes, working_set_bytes,
)
from rlhf.stages.plan_parts import (
    Components, PhasePlan, Setting, lm_loss_bytes, peak_phase, selective_logprob_bytes, shape_of, train_moments,
    trained,
)


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
    """As `rlhf ppo` runs them; `config` with its batch arithmetic resolved (`plan_config`: PPO's
    default minibatch included, as start_stage resolves it)."""
    engine = config.engine
    assert engine.train_batch_size is not None, "ppo_shapes needs the config plan_config resolved"
    gen, tp = config.generation_batch_size, config.inference_tp_size
    per_rank_minibatch = engine.train_batch_size // world
    micro = min(engine.micro_batch_size, per_rank_minibatch)
    keeps = (config.ppo_epochs == 1 and engine.train_batch_size == gen * world
             and engine.micro_batch_size >= gen and not config.max_tokens_per_micro_batch)
    group = config.samples_per_prompt
    # A TP group's slots may start inside a group: one prompt more than whole groups then.
    unique = math.ceil(gen * tp / group) + (1 if (gen * tp) % group else 0)
    return PPOShapes(gen_rows=gen * tp, unique=unique, prompt=prompt_len or config.max_prompt_len,
                     new=config.max_new_tokens, rows=gen, micro=micro,
                     accum=math.ceil(per_rank_minibatch / micro), keeps_critic=keeps and not config.critic_free,
                     group=config.samples_per_prompt if config.share_prompt_forward else 1)


@dataclass(frozen=True)
class PPOModels:
    """The models of a PPO run by role (no critic for the critic-free estimators, no reward model
    with reward functions only)."""

    actor: TrainedModelMemory
    critic: TrainedModelMemory | None
    ref: FrozenModelMemory | None  # None: no KL term (no reference), or a LoRA actor with its adapters off is it
    reward: FrozenModelMemory | None


def ppo_models(config: PPOConfig, s: Setting) -> PPOModels:
    """As PPOTrainer builds them: actor and critic at their own ZeRO stages (with LoRA adapters,
    no dropout in PPO), the reference (--ref, default the actor; none without a KL term, or for a
    LoRA actor, whose base is the reference) and the reward model frozen at --zero-stage."""
    zero = config.engine.zero_stage
    lora = dataclasses.replace(config.lora, lora_dropout=0.0)
    actor = shape_of(config.actor, "--actor", "lm", lora, s.fuses_layers)
    ref = None
    if config.needs_reference and not (lora.lora_rank and config.ref in (None, config.actor)):
        ref_shape = shape_of(config.ref or config.actor, "--ref", "lm", fuses_layers=s.fuses_layers)
        ref = FrozenModelMemory(ref_shape, zero, s.compute, s.world)
    critic = None
    if not config.critic_free:
        critic_shape = shape_of(config.critic or config.reward, "--critic", "value", lora, s.fuses_layers)
        critic = trained(critic_shape, config.critic_zero_stage if config.critic_zero_stage is not None else zero, s)
    reward = None
    if config.reward:
        reward_shape = shape_of(config.reward, "--reward", "value", fuses_layers=s.fuses_layers)
        reward = FrozenModelMemory(reward_shape, zero, s.compute, s.world)
    actor_zero = config.actor_zero_stage if config.actor_zero_stage is not None else zero
    return PPOModels(trained(actor, actor_zero, s), critic, ref, reward)


def ppo_base(config: PPOConfig, models: PPOModels, s: Setting) -> Components:
    """What every PPO phase holds in the steady state: trained models with their Adam moments (and
    the EMA), frozen models (whole at ZeRO 1/2 after their first forward)."""
    a, c, ref, rm = models.actor, models.critic, models.ref, models.reward
    return {
        "actor params": a.params, "actor adam": a.adam, "actor ema": a.params if config.ema_decay > 0 else 0,
        "critic params": c.params if c else 0, "critic adam": c.adam if c else 0,
        "ref params": (ref.params + ref.gathered) if ref else 0, "reward params": (rm.params + rm.gathered) if rm else 0,
        "runtime": s.runtime,
    }


def generation_phase(models: PPOModels, shapes: PPOShapes, tp: int, s: Setting, base: Components) -> PhasePlan:
    """Rollout mode: the actor's inference copy, the fast decoder's fused (and packed) weights and KV
    cache (its own buffers, or the HF path's), prefill and sampling; then the parity check's train-mode
    forward (ZeRO 0-2 leave the actor gathered after it)."""
    shape, c, actor = models.actor.shape, s.compute, models.actor
    dtype = torch.float32 if c == FP32 else torch.bfloat16
    cache = kv_cache_bytes(_text_config(shape), shapes.gen_rows, shapes.width, dtype, tp)
    unique_layer = kv_cache_bytes(_text_config(shape), shapes.unique, shapes.width, dtype, tp) // max(shape.layers, 1)
    copy_ = inference_copy_bytes(shape, c, tp)
    # The fast decoder's copies of the weights (tp=1, a model it runs): the backend's layouts.
    copies = s.backend.decode_weight_copies(shape, c) if tp == 1 and shape.fused_projections else {}
    held = {**base, "rollout copy": copy_}
    decode = {**held, **copies, "kv cache": cache + unique_layer,
              "prefill working set": working_set_bytes(shape, shapes.unique * shapes.prompt, c),
              "logits": FP32 * shape.vocab * shapes.gen_rows * 4 + c * shape.vocab * shapes.unique,
              "rollouts": shapes.gen_rows * shapes.width * 24}
    parity = {**held, "actor gathered": actor.gathered_in_forward(),
              "working set": working_set_bytes(shape, 2 * shapes.width, c)}
    # LoRA: every adapted weight merged (W + s B A, fp32 shards) at once before the copy.
    load = {**held, "merged weights": actor.merged_weights}
    return peak_phase("generation", {"decode": decode, "parity check": parity, "weights load": load}, s)


def _text_config(shape: ModelShape) -> Any:
    """A minimal config for `kv_cache_bytes` from a shape."""
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
    """Reference log-probs over response positions (with a KL term), then the critic's values (kept
    with their graph for the update when it is one micro-batch: `keeps_critic_forward`)."""
    micro = min(config.engine.micro_batch_size, shapes.rows)
    micro_tokens = micro * shapes.width
    vocab = models.actor.shape.vocab
    logits = selective_logprob_bytes(micro * (shapes.new + 1), vocab, s.compute, False, False)
    shared = shapes.group > 1  # the tail's logits, then their copy behind the prompt's last
    ref_tokens = shapes.forward_tokens(micro, True)
    ref_logits = logits + (s.compute * micro * shapes.new * vocab if shared else 0)
    actor = models.actor
    moments: dict[str, Components] = {"no reference forward": dict(held)}
    if models.ref is not None:
        moments = frozen_moments(models.ref, ref_tokens, ref_logits, s, held, "ref")
    elif config.needs_reference:  # a LoRA actor with its adapters off
        moments = {"ref forward (actor, adapters off)": {
            **held, "actor gathered": actor.gathered_in_forward(),
            "ref working set": working_set_bytes(actor.shape, ref_tokens, s.compute)},
            "ref head": {**held, "ref head": ref_logits}}
    if config.recomputes_old_logprobs(s.dtype):  # by dtype when unset (16-bit: recomputed)
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
    """generation, reward, experience and training of one PPO iteration (steady state); `config`
    resolved (`rlhf.stages.plan.plan_config`). After the parity check a ZeRO 0-2 actor stays
    gathered until its first backward (training)."""
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


__all__ = ["PPOModels", "PPOShapes", "plan_ppo", "ppo_models", "ppo_shapes"]
