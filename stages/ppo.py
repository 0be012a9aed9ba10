"""`rlhf ppo`: PPO and the critic-free estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++) on prompts.

    rlhf ppo --actor runs/sft/model --reward runs/rm/model --data prompts.jsonl --output runs/ppo
    rlhf ppo --actor runs/sft/model --reward-fn sort --critic runs/sft/model ...        # verifiable reward
    rlhf ppo --actor runs/sft/model --reward-fn my_rewards.py:exact_match --advantage-estimator grpo \
        --samples-per-prompt 8 ...                                                      # GRPO, no critic
    rlhf ppo ... --nproc-per-node 2 --zero-stage 3 --inference-tp-size 2

Reads top to bottom: `run` checks the config, claims the output folder and builds a `PPOTrainer`
(data, models, tracker, resume), whose `train` loop runs one iteration as named phases:

    collect_rollouts    rollout mode (tensor-parallel actor, static KV cache): --samples-per-prompt
                        responses to each prompt (prefilled once), scored by the reward sources
                        (+ missing-EOS / overlong penalties, clipped); with --dynamic-sampling, more
                        rounds until the batch holds only groups whose rewards differ (none in all
                        rounds stops the run); every group tied --max-zero-signal-iters times in a
                        row warns
    make_experience     old/reference log-probs (and critic values) -> per-token rewards (KL
                        penalty unless the KL is a loss term) -> advantages: GAE with a critic, or the
                        estimator's group baseline and returns without one; whitened over all ranks
    update              ppo_epochs of clipped policy (and value) updates over minibatches (+ KL
                        loss, entropy bonus, PTX loss), then the actor's EMA and the KL controller
    log_iteration       metrics over all ranks (per reward source, per phase), sample tables
    save_checkpoint     resume state (DCP) every --save-interval iterations (and at the end with
                        --save-final-checkpoint); after SIGTERM/SIGINT on any rank, a checkpoint and
                        a stop (engine/preemption.py)

`finish` writes the final actor to <output>/model, the critic to <output>/critic (GAE only) and the
EMA actor to <output>/model_ema, then summary.json and DONE. The rollout layout over ranks and
groups lives in rlhf.stages.rollouts, the math in rlhf.algorithms.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from rlhf.algorithms.advantages import group_baseline_scores, overlong_penalty, varied_groups
from rlhf.algorithms.losses import sft_loss_sum
from rlhf.algorithms.ppo import (
    AdaptiveKLController, FixedKLController, explained_variance, kl_estimate, kl_loss, masked_mean, policy_loss,
    value_loss,
)
from rlhf.config import PPOConfig
from rlhf.data.batching import BatchPlan, collate_sft, pad_left
from rlhf.data.stage_rows import load_stage_rows, tokenize_specs
from rlhf.data.formats import Message, ParsedRow
from rlhf.data.retokenize import same_vocabulary
from rlhf.data.tokenization import TokenizeStats, tokenize_prompts, tokenize_sft
from rlhf.engine.config import EngineConfig
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.ema import ParameterEMA
from rlhf.engine.export import export_state_dict
from rlhf.engine.sharding import COMPUTE_DTYPES
from rlhf.engine.generation import check_rollout_fits
from rlhf.engine.backends.registry import backend_for
from rlhf.engine.inference import FrozenModel, micro_batch_slices
from rlhf.engine.lora import AdaptersOffReference, merge_state_dict
from rlhf.engine.memory import PhaseMemory
from rlhf.engine.micro_batches import (
    column_span, forward_in_micro_batches, micro_batch_weights, token_budget_micro_batches,
)
from rlhf.engine.positions import position_ids_from_mask
from rlhf.engine.packing import (
    log_packing, packed_logprobs, packed_micro_batches, packed_values, packing_unsupported_reason, packs_fewer_tokens,
)
from rlhf.engine.preemption import agreed_stop
from rlhf.engine.prompt_sharing import (
    padded_forward_tokens, response_logprobs, response_prefix, shared_prompt_logprobs,
)
from rlhf.engine.rollout import default_parity_tolerance, rollout_mode
from rlhf.engine.sampling import SamplingParams
from rlhf.engine.train_engine import TrainEngine
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.models.checks import check_tokenizer_fits, fit_max_seq_len, max_positions
from rlhf.models.loading import deferred_causal_lm, load_tokenizer
from rlhf.models.lora import export_trained_model, with_lora
from rlhf.models.value_model import check_reward_model_dir, deferred_value_model_from, value_model_kind
from rlhf.seeding import derive_seed, seeded_permutation
from rlhf.stages.experience import Experience, LogprobDrift, build_experience, mean_kl_per_sequence, shaped_scores
from rlhf.reward_functions import RewardFunction, prompt_text
from rlhf.reward_batch import RewardTrainerState, SAMPLE_COLUMNS, trainer_state
from rlhf.stages.reward_sources import (
    REWARD_MODEL, build_reward_source, check_reward_sources, reward_metrics, rollout_batch, warn_if_degenerate,
)
from rlhf.stages.rollouts import (
    Rollouts, gather_rollouts, global_scores, group_rows, iteration_slots, merge_rollouts, select_rows, unique_runs,
)
from rlhf.stages.throughput import PHASES, IterationWork, iteration_flops, iteration_models
from rlhf.stages.trainer import (
    finish_stage, open_run, resume_from_latest, start_stage, stop_for_signal, wants_checkpoint,
)

log = get_logger(__name__)

# Per-micro-batch metrics (averaged over micro-batches); the rest of `update`'s sums are per step.
PER_MICRO_METRICS = ("policy_loss", "value_loss", "clipfrac", "approx_kl", "value_clipfrac", "entropy", "ptx_loss",
                     "kl_loss")


# ------------------------------------------------------------------ the stage


def run(config: PPOConfig) -> dict[str, Any]:
    """Train the actor (and critic) with PPO; collective: every rank calls it. Returns the summary."""
    ctx = DistributedContext.initialize()
    functions = check_config(config, ctx)
    config, output = start_stage(config, ctx, "ppo", **default_minibatch(config, ctx.world_size))  # resolved
    check_batch_arithmetic(config, ctx)
    trainer = PPOTrainer(config, ctx, output, functions)
    trainer.train()
    return trainer.finish()


def check_config(config: PPOConfig, ctx: DistributedContext) -> list[RewardFunction]:
    """Flags PPO cannot run without, the model folders and reward functions (loaded here, before
    any model) and the TP size. Returns the reward functions. (Whether a rollout fits the model is
    checked once the prompts are read; the batch arithmetic by start_stage, `default_minibatch`.)"""
    if not config.actor:
        raise UserError("--actor is required: the policy to train (e.g. the SFT stage's <output>/model)")
    if not config.reward and not config.reward_fn:
        raise UserError("--reward (a reward model folder) or --reward-fn (a task name or file.py:function) is required")
    if config.critic_free and config.critic:
        raise UserError(f"--critic {config.critic}: --advantage-estimator {config.advantage_estimator} trains no "
                        "critic; drop --critic (or use --advantage-estimator gae)")
    if not config.critic_free and not (config.critic or config.reward):
        raise UserError("--critic is required with --reward-fn (a causal LM or value model folder, e.g. the SFT model)")
    check_model_folders(config)
    functions = check_reward_sources(config)
    if config.ptx_data and config.ptx_coef <= 0:
        raise UserError("--ptx-data needs --ptx-coef > 0")
    ctx.tp_coordinates(config.inference_tp_size)
    return functions


def default_minibatch(config: PPOConfig, world_size: int) -> dict[str, int]:
    """PPO's default for the batch arithmetic (`rlhf.engine.batch_size.resolved_batch`'s
    default_train_batch and max_micro; start_stage and `rlhf plan` pass it): without
    --train-batch-size or --grad-accum the minibatch is the whole experience (one optimizer step per
    PPO epoch), in micro-batches of at most the rollout batch."""
    return {"default_train_batch": config.generation_batch_size * world_size,
            "max_micro": config.generation_batch_size}


def check_model_folders(config: PPOConfig) -> None:
    """--reward and --critic are read from config.json alone, before the actor (or anything) is
    loaded: a wrong folder fails in a second, not after minutes of loading models."""
    if config.reward:
        check_reward_model_dir(config.reward, "--reward")
    if config.critic and value_model_kind(config.critic) is None:
        raise UserError(f"--critic {config.critic}: no config.json; pass a value/reward model folder, a Hugging Face "
                        "*ForSequenceClassification folder or a causal LM folder (e.g. runs/sft/model)")
    if config.reward and not config.critic and not config.critic_free and not same_vocabulary(
            load_tokenizer(config.reward, "--reward"), load_tokenizer(config.actor, "--actor")):
        raise UserError(f"--reward {config.reward}: its tokenizer differs from the actor's, so it cannot be the "
                        "critic (the critic reads the actor's token ids); pass --critic (e.g. the --actor folder)")


def check_token_readers(config: PPOConfig, tokenizer: Any, sequence_len: int) -> None:
    """Every model that reads the actor's token ids (actor, ref, critic) has an embedding row for
    each id the actor's tokenizer gives, and the ref and critic have positions for rollouts of
    `sequence_len` tokens (the actor's are checked with its KV cache, `check_rollout_fits`); the
    --reward model is checked against its own tokenizer. One line each, before any weights are read."""
    check_tokenizer_fits(tokenizer, config.actor, "--actor")
    readers = {"--ref": config.ref if config.ref != config.actor else None,
               "--critic": None if config.critic_free else config.critic or config.reward}
    for flag, folder in readers.items():
        if not folder:
            continue
        check_tokenizer_fits(tokenizer, folder, flag, "the --actor tokenizer")
        positions = max_positions(folder)
        if positions is not None and sequence_len > positions:
            raise UserError(f"{flag} {folder}: rollouts of up to {sequence_len} tokens (prompt + --max-new-tokens) "
                            f"exceed its max_position_embeddings {positions}; lower --max-new-tokens or "
                            "--max-prompt-len")
    if config.reward:
        check_tokenizer_fits(load_tokenizer(config.reward, "--reward"), config.reward, "--reward")


def check_batch_arithmetic(config: PPOConfig, ctx: DistributedContext) -> None:
    """The experience must be whole prompt groups, and the global minibatch (--train-batch-size,
    resolved by start_stage) must divide it."""
    experience = config.generation_batch_size * ctx.world_size
    if experience % config.samples_per_prompt:
        raise UserError(
            f"--samples-per-prompt {config.samples_per_prompt} must divide the experience batch "
            f"generation_batch_size {config.generation_batch_size} x world size {ctx.world_size} = {experience} "
            "(each iteration samples whole groups)"
        )
    if experience % config.engine.train_batch_size:
        raise UserError(
            f"--train-batch-size {config.engine.train_batch_size} must divide the experience batch "
            f"generation_batch_size {config.generation_batch_size} x world size {ctx.world_size} = {experience}"
        )


# ------------------------------------------------------------------ setup helpers


@dataclass(frozen=True)
class MicroWeight:
    """A micro-batch's loss weights: for token-level means and for sequence-level means
    (`micro_batch_weights`; 1.0 each with micro-batches of a fixed number of rows)."""

    tokens: float
    rows: float


def disable_dropout(model: nn.Module) -> nn.Module:
    """PPO's ratio must compare the same function: no dropout in actor or critic (TRL does the same)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def engine_config_for(config: PPOConfig, zero_stage: int | None, lr: float | None) -> EngineConfig:
    """The shared engine config with the actor's or critic's own ZeRO stage and learning rate."""
    cfg = copy.deepcopy(config.engine)
    if zero_stage is not None:
        cfg.zero_stage = zero_stage
    if lr is not None:
        cfg.lr = lr
    return cfg


@dataclass
class Prompts:
    """Tokenized prompts plus their chat messages (a reward model with another tokenizer renders
    them again; rule-based rewards and sample tables read the last user turn)."""

    ids: list[list[int]]
    messages: list[list[Message]]
    fields: list[dict[str, Any]]
    stats: dict[str, int]
    conversational: list[bool]
    """Each prompt came as chat messages (TRL's conversational rows: its reward functions get messages)."""


def load_prompts(config: PPOConfig, tokenizer: Any) -> Prompts:
    """This stage's share of --data as generation prompts of at most --max-prompt-len tokens."""

    def tokenize(parsed: list[ParsedRow]) -> tuple[list[tuple[list[int], list[Message], dict, bool]], TokenizeStats]:
        ids, stats = tokenize_prompts(parsed, tokenizer, config.max_prompt_len)
        return [(i, parsed[k].generation_prompt, parsed[k].fields, parsed[k].conversational)
                for i, k in zip(ids, stats.kept_indices)], stats

    rows = load_stage_rows(
        config.data, "ppo", config.engine.seed, tokenize, holdout=False,
        required="prompts (or any rows with a prompt) as json/jsonl/parquet/csv",
        empty=f"no prompts of at most {config.max_prompt_len} tokens",
    )
    return Prompts([r[0] for r in rows.train], [r[1] for r in rows.train], [r[2] for r in rows.train], rows.stats,
                   [r[3] for r in rows.train])


def critic_values(critic: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The critic's values [B, T], with the positions generation gave the tokens."""
    return critic(sequences, attention_mask, position_ids=position_ids_from_mask(attention_mask))


@contextmanager
def timed(seconds: dict[str, float], key: str) -> Iterator[None]:
    """Add the wall time of the block to seconds[key]."""
    start = time.perf_counter()
    yield
    seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start


# ------------------------------------------------------------------ the trainer


def experience_response_start(shifted_action_mask: torch.Tensor) -> int:
    """The first response column of an experience's rows: its action mask is shifted (position t
    scores token t + 1), so its first response position is one less (0: no response column)."""
    shifted = response_prefix(shifted_action_mask)
    return shifted + 1 if shifted else 0


class PPOTrainer:
    """Actor (and critic), reference, reward sources, KL controller and EMA, and the loop over them."""

    def __init__(self, config: PPOConfig, ctx: DistributedContext, output: Path,
                 reward_functions: list[RewardFunction] | None = None) -> None:
        self.config, self.ctx, self.output = config, ctx, output
        self.reward_functions = reward_functions
        self.seed = config.engine.seed
        self.tp = ctx.tp_coordinates(config.inference_tp_size)
        self.batch_per_rank = config.generation_batch_size
        self.group_size = config.samples_per_prompt
        self.experience_size = config.generation_batch_size * ctx.world_size  # samples per iteration
        self.tokenizer = load_tokenizer(config.actor, "--actor", config.data.chat_template)
        self.load_data()
        # Before any model loads, with the longest prompt there is (not the --max-prompt-len cap).
        check_rollout_fits(config.actor, config.generation_batch_size * config.inference_tp_size,
                           max(map(len, self.prompts.ids)), config.max_new_tokens, config.engine.dtype, ctx.device,
                           config.inference_tp_size, "rlhf ppo")
        check_token_readers(config, self.tokenizer, max(map(len, self.prompts.ids)) + config.max_new_tokens)
        self.total_iterations = config.max_steps if config.max_steps > 0 else self.plan.steps_per_epoch * config.epochs
        self.build_models()
        self.tracker, self.checkpointer = open_run(config, ctx, output, "ppo")
        self.start_iteration = self.resume()
        self.sampling = SamplingParams(
            max_new_tokens=config.max_new_tokens, min_new_tokens=config.min_new_tokens, do_sample=not config.greedy,
            temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
            eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        self.last_metrics: dict[str, float] = {}
        self.memory = PhaseMemory(ctx.device)  # peak_mem_gb_<phase> per iteration (engine/memory.py)
        self.critic_seconds = 0.0
        self.policy_kl_sum = 0.0
        self.recompute_old_logprobs = config.recompute_old_logprobs
        halved = backend_for(ctx.device).rounds_kv_cache(config.kv_cache_dtype, COMPUTE_DTYPES[self.actor.dtype],
                                                         self.actor.model.config.model_type)
        default_tolerance = default_parity_tolerance(self.actor.dtype, halved)
        self.old_logprob_tolerance = (config.old_logprob_tolerance if config.old_logprob_tolerance is not None
                                      else default_tolerance)
        self.parity_tolerance = (config.rollout_parity_tolerance if config.rollout_parity_tolerance is not None
                                 else default_tolerance)
        self.old_logprob_drift = LogprobDrift()
        self.ran_old_logprob_forward = False
        self.optimizer_steps_this_iteration = 0
        self.tied_iterations = 0  # iterations in a row whose groups' rewards all tied (check_reward_signal)
        reward_model = self.reward.model_source
        self.kept_values: torch.Tensor | None = None
        self.flop_models = iteration_models(self.actor.model.config, self.critic.model.config if self.critic else None,
                                            reward_model.model.model.config if reward_model else None)
        self.started = time.perf_counter()

    def load_data(self) -> None:
        """Prompts, the plan that deals them out per iteration, and the optional PTX rows."""
        config = self.config
        self.prompts = load_prompts(config, self.tokenizer)
        # The plan deals out each iteration's global prompts (every rank reads the same list): the
        # experience batch of generation_batch_size x world samples is that many prompts' groups.
        prompts_per_iteration = self.batch_per_rank * self.ctx.world_size // self.group_size
        self.plan = BatchPlan(len(self.prompts.ids), prompts_per_iteration, 1, 1, 0, self.seed)
        if self.plan.steps_per_epoch == 0:
            raise UserError(f"{len(self.prompts.ids)} prompts do not fill one iteration of "
                            f"{self.plan.global_batch_size}; lower --generation-batch-size or add prompts")
        leftover = self.plan.num_rows % self.plan.global_batch_size
        if leftover:
            log.info("ppo: %d prompts do not fill an iteration and wait for the next epoch's shuffle", leftover)
        self.ptx_rows: list[dict] = []
        if config.ptx_data:
            max_seq_len = fit_max_seq_len(config.data.max_seq_len, config.actor, "--actor")
            self.ptx_rows, _ = tokenize_specs(
                config.ptx_data, lambda parsed: tokenize_sft(parsed, self.tokenizer, max_seq_len,
                                                             last_turn_only=config.data.train_last_turn_only),
                "ptx data")

    def build_models(self) -> None:
        """Trained actor and critic (none for the critic-free estimators; separate optimizers),
        frozen reference, reward sources, KL controller, EMA."""
        config, ctx = self.config, self.ctx
        minibatches = self.experience_size // config.engine.train_batch_size
        total_steps = self.total_iterations * config.ppo_epochs * minibatches
        # Every model is built on the meta device and each rank reads only its shards (sharded loading).
        actor, actor_weights = with_lora(*deferred_causal_lm(config.actor, "--actor"), config, config.actor, "actor")
        self.actor = TrainEngine(disable_dropout(actor), engine_config_for(config, config.actor_zero_stage, None), ctx,
                                 total_steps, "actor", actor_weights)
        self.critic: TrainEngine | None = None
        if not config.critic_free:
            critic_source = config.critic or config.reward
            critic, critic_weights = with_lora(*deferred_value_model_from(critic_source, flag="--critic"), config,
                                               critic_source, "critic")
            self.critic = TrainEngine(
                disable_dropout(critic), engine_config_for(config, config.critic_zero_stage, config.critic_lr), ctx,
                total_steps, "critic", critic_weights)
        self.engines = {"actor": self.actor, **({"critic": self.critic} if self.critic else {})}
        self.ref: FrozenModel
        if config.lora.lora_rank and config.ref in (None, config.actor):
            # The LoRA actor's frozen base is the reference: no second copy of the weights.
            self.ref = AdaptersOffReference(self.actor.model, ctx, config.engine.micro_batch_size)
        else:
            ref, ref_weights = deferred_causal_lm(config.ref or config.actor, "--ref")
            self.ref = FrozenModel(ref, ctx, config.engine.zero_stage, self.actor.dtype, config.offload_ref,
                                   config.engine.micro_batch_size, "ref", compile=config.engine.compile,
                                   weights=ref_weights)
        self.reward = build_reward_source(config, ctx, self.tokenizer, self.actor.dtype, self.reward_functions)
        if config.pack_sequences and config.max_tokens_per_micro_batch:
            log_packing(self.packing_reasons())
        self.kl_ctl = (AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon) if config.adaptive_kl
                       else FixedKLController(config.kl_coef))
        self.ema = ParameterEMA(self.actor.model, config.ema_decay) if config.ema_decay > 0 else None

    def packing_reasons(self) -> dict[str, str | None]:
        """Each model's reason its forwards never run packed (None: they can), for the log."""
        device = self.ctx.device
        reasons = {"actor": packing_unsupported_reason(self.actor.model, device)}
        if self.critic is not None:
            reasons["critic"] = packing_unsupported_reason(self.critic.model, device)
        reasons["ref"] = self.ref.packing_unsupported_reason()
        if self.reward.model_source is not None:
            reasons["reward"] = self.reward.model_source.model.packing_unsupported_reason()
        return reasons

    def resume(self) -> int:
        """With --resume, the trainer's resume (engines, RNG, metrics) plus the KL coefficient and
        the EMA; returns the iteration to start from."""
        state = resume_from_latest(self.config, self.ctx, self.checkpointer, self.engines, self.tracker)
        if state is None:
            return 0
        self.kl_ctl.value = state["kl_coef"]
        if self.ema is not None and "ema" in state:
            self.ema.load_state_dict(state["ema"])
        return int(state["iteration"])

    # -------------------------------------------------------------- the loop

    def train(self) -> None:
        """One iteration per step: rollouts (+ rewards) -> experience -> update -> logging -> checkpoint."""
        bar = tqdm(total=self.total_iterations, initial=self.start_iteration, desc="ppo", disable=not self.ctx.is_main,
                   dynamic_ncols=True)
        self.started = time.perf_counter()
        signum = agreed_stop(self.ctx) if self.start_iteration < self.total_iterations else None  # while loading
        if signum is not None:
            bar.close()
            stop_for_signal(self.ctx, self.tracker, "ppo", signum, self.start_iteration, None)
        for iteration in range(self.start_iteration, self.total_iterations):
            seconds: dict[str, float] = {}
            self.critic_seconds = self.policy_kl_sum = 0.0
            self.old_logprob_drift = LogprobDrift()
            rollouts = self.collect_rollouts(iteration, seconds)
            with timed(seconds, "experience_s"), self.memory.phase("experience"):
                exp = self.make_experience(rollouts)
            with timed(seconds, "training_s"), self.memory.phase("training"):
                update_metrics = self.update(exp, iteration)
                backend_for(self.ctx.device).after_step()  # the CPU's: heap pages later iterations would fault in
            if self.ema is not None:
                self.ema.update(self.actor.model)
            kl = self.update_kl_controller(exp)
            metrics = self.log_iteration(iteration, rollouts, exp, update_metrics, kl, seconds)
            if iteration == self.start_iteration:
                self.check_reward_spread(rollouts)
            bar.update(1)
            bar.set_postfix(score=f"{metrics['score_mean']:.3f}", kl=f"{kl:.3f}")
            # Every rank stops after the same iteration (one small all_reduce); after the last, the run finishes.
            last = iteration + 1 == self.total_iterations
            signum = None if last else agreed_stop(self.ctx)
            checkpoint = self.save_checkpoint(iteration + 1, stopping=signum is not None)
            if signum is not None:
                bar.close()
                stop_for_signal(self.ctx, self.tracker, "ppo", signum, iteration + 1, checkpoint)
        bar.close()

    def collect_rollouts(self, iteration: int, seconds: dict[str, float]) -> Rollouts:
        """This iteration's scored rollouts: one round of sampling, or with --dynamic-sampling as
        many rounds as it takes to fill the batch with groups whose rewards differ."""
        rollouts = self.sample_round(self.round_prompts(iteration, 0), iteration, 0, seconds)
        if self.config.dynamic_sampling:
            rollouts = self.dynamic_sampling(rollouts, iteration, seconds)
        self.check_reward_signal(iteration, rollouts)
        return rollouts

    def check_reward_signal(self, iteration: int, rollouts: Rollouts) -> None:
        """The share of groups whose scores all tie (`reward_tied_fraction`; a group estimator's
        groups are the prompts' samples, else the whole batch is one), and one warning when every
        group tied for --max-zero-signal-iters iterations in a row: the advantage is then 0 for
        every sample (GRPO) and training runs on with nothing to learn from the reward."""
        config = self.config
        size = self.group_size if config.estimator.needs_groups else self.experience_size
        scores = global_scores(rollouts.scores, self.ctx)
        varied = varied_groups(scores, size)
        rollouts.metrics["reward_tied_fraction"] = 1.0 - float(varied.float().mean())
        self.tied_iterations = 0 if bool(varied.any()) else self.tied_iterations + 1
        limit = config.max_zero_signal_iters
        if limit and self.tied_iterations == limit and self.ctx.is_main:
            groups = f"a prompt's {size} samples" if size == self.group_size else f"the batch's {size} samples"
            log.warning("ppo: iterations %d-%d: every group's rewards tied (a group: %s; scores %s), so the advantage "
                        "is 0 for every sample and the policy learns nothing from the reward (--max-zero-signal-iters "
                        "%d): the reward is constant or ignores the response; change the reward, or make samples "
                        "differ more (--samples-per-prompt %d, --temperature %g)", iteration + 2 - limit,
                        iteration + 1, groups, shown_values(scores), limit, self.group_size, config.temperature)

    def round_prompts(self, iteration: int, round_index: int) -> list[int]:
        """The iteration's global prompts (the plan's); a later dynamic-sampling round draws a seeded
        random batch of other prompts."""
        if round_index == 0:
            epoch, step_in_epoch = divmod(iteration, self.plan.steps_per_epoch)
            (rows,) = self.plan.step_micro_batches(epoch, step_in_epoch)
            return rows
        order = seeded_permutation(len(self.prompts.ids), derive_seed(self.seed, "refill", iteration, round_index))
        return order[: self.plan.global_batch_size]

    def sample_round(self, prompt_rows: list[int], iteration: int, round_index: int,
                     seconds: dict[str, float]) -> Rollouts:
        """Generate this rank's share of the prompts' groups and score them."""
        with timed(seconds, "generation_s"), self.memory.phase("generation"):
            rollouts = self.generate_rollouts(prompt_rows, iteration, round_index)
        with timed(seconds, "reward_s"), self.memory.phase("reward"):
            self.score_rewards(rollouts, self.reward_trainer_state(iteration))
        return rollouts

    def reward_trainer_state(self, iteration: int) -> RewardTrainerState:
        """The `trainer_state` TRL-style reward functions see while `iteration` is scored."""
        return trainer_state(iteration, self.total_iterations, self.plan.steps_per_epoch)

    def generate_rollouts(self, prompt_rows: list[int], iteration: int, round_index: int) -> Rollouts:
        """Responses to this rank's sample slots: the TP group generates its ranks' slots together
        (same sampling seed on its ranks), each unique prompt prefilled once for its samples; then
        each rank keeps its --generation-batch-size rows."""
        per_group = self.batch_per_rank * self.tp.size
        slots = iteration_slots(prompt_rows, self.group_size)
        group_slots = slots[self.tp.group_index * per_group : (self.tp.group_index + 1) * per_group]
        unique, counts = unique_runs(group_slots)
        ids, mask = pad_left([self.prompts.ids[i] for i in unique], self.tokenizer.pad_token_id)
        purpose = ("rollout", iteration) if round_index == 0 else ("rollout_round", iteration, round_index)
        gen = torch.Generator(device=self.ctx.device).manual_seed(
            derive_seed(self.seed, purpose[0], *purpose[1:], self.tp.group_index))
        repeats = torch.tensor(counts, dtype=torch.long, device=self.ctx.device)
        check = round_index == 0 and (iteration == self.start_iteration or iteration % self.config.rollout_parity_every == 0)
        with rollout_mode(self.actor, self.tp.size, self.parity_tolerance, check) as rollout:
            out = rollout.generate(ids.to(self.ctx.device), mask.to(self.ctx.device), self.sampling, gen,
                                   samples_per_prompt=repeats)
            rollout_metrics = dict(rollout.metrics)
        mine = slice(self.tp.rank_in_group * self.batch_per_rank, (self.tp.rank_in_group + 1) * self.batch_per_rank)
        rows = group_slots[mine]
        sequences, action = out.sequences[mine], out.action_mask[mine]
        decoded = self.tokenizer.batch_decode([s[a] for s, a in zip(sequences, action)], skip_special_tokens=True)
        return Rollouts(sequences, out.attention_mask[mine], action, out.finished[mine],
                        [self.prompts.messages[i] for i in rows], [r.strip() for r in decoded],
                        [self.prompts.fields[i] for i in rows], rollout_metrics, logprobs=out.logprobs[mine],
                        conversational=[self.prompts.conversational[i] for i in rows])

    def score_rewards(self, rollouts: Rollouts, state: RewardTrainerState | None = None) -> None:
        """The reward sources' scores, then the shaped score that enters the reward: missing-EOS
        and overlong penalties, clipped to --reward-clip (the clipped rows are counted). The
        functions' log_extra columns go with the rollouts (`extra`) to the sample table."""
        config = self.config
        shared = response_prefix(rollouts.action_mask) if self.shares_prompts else 0  # a group's prompt
        batch = rollout_batch(rollouts, state)
        raw = self.reward.score(rollouts.sequences, rollouts.attention_mask, batch, shared)
        rollouts.extra = batch.log.extra or None
        overlong = None
        if config.overlong_buffer > 0:
            overlong = overlong_penalty(rollouts.response_lengths, config.max_new_tokens, config.overlong_buffer,
                                        config.overlong_penalty).to(raw.device)
        scores = shaped_scores(raw, rollouts.ended_with_eos, config.missing_eos_penalty, overlong)
        rollouts.raw_scores, rollouts.components = raw, dict(self.reward.components)
        rollouts.clipped = scores.abs() > config.reward_clip
        rollouts.scores = scores.clamp(-config.reward_clip, config.reward_clip)

    def dynamic_sampling(self, first: Rollouts, iteration: int, seconds: dict[str, float]) -> Rollouts:
        """DAPO's dynamic sampling: keep the groups whose rewards differ (gathered from every rank),
        sample further rounds of other prompts until the batch's groups are filled (or
        --dynamic-sampling-rounds ran out: the first round's tied groups fill the rest), then
        every rank takes its slice of the kept rows again."""
        n = self.group_size
        wanted = self.plan.global_batch_size  # groups per iteration
        kept: list[Rollouts] = []
        tied: Rollouts | None = None
        n_kept = rounds = 0
        for round_index in range(self.config.dynamic_sampling_rounds):
            rollouts = first if round_index == 0 else self.sample_round(
                self.round_prompts(iteration, round_index), iteration, round_index, seconds)
            everyone = gather_rollouts(rollouts, self.ctx, self.tokenizer.pad_token_id)
            varied = varied_groups(everyone.scores, n).tolist()
            kept.append(select_rows(everyone, group_rows([g for g, v in enumerate(varied) if v], n)))
            if tied is None:
                tied = select_rows(everyone, group_rows([g for g, v in enumerate(varied) if not v], n))
            n_kept, rounds = n_kept + sum(varied), round_index + 1
            if n_kept >= wanted:
                break
        if n_kept == 0:  # on every rank alike (the scores are gathered)
            assert tied is not None
            raise UserError(f"--dynamic-sampling: iteration {iteration + 1} kept no group in {rounds} rounds (of "
                            f"{wanted} prompts x {n} samples each): every prompt's samples got the same reward (scores "
                            f"{shown_values(tied.scores)}), so every advantage would be 0; the reward is constant or "
                            "ignores the response: change the reward, raise --samples-per-prompt or --temperature, "
                            "or drop --dynamic-sampling")
        pool = merge_rollouts([*kept, tied], self.tokenizer.pad_token_id)
        mine = list(range(self.ctx.rank * self.batch_per_rank, (self.ctx.rank + 1) * self.batch_per_rank))
        result = select_rows(pool, mine)
        result.metrics.update(dynamic_sampling_rounds=float(rounds),
                              dynamic_sampling_kept_fraction=min(n_kept, wanted) / wanted)
        return result

    @property
    def on_policy_update(self) -> bool:
        """One pass over the experience in one minibatch with no KL in the reward: the policy that is
        trained is the one that generated, so the rollout policy's log-probs are the trained
        forward's own (detached) and their separate forward pass is skipped (as TRL's GRPO does
        with num_iterations 1)."""
        config = self.config
        no_reward_kl = config.kl_in_loss or (config.kl_coef == 0 and not config.adaptive_kl)
        return config.ppo_epochs == 1 and config.engine.train_batch_size == self.experience_size and no_reward_kl

    @torch.no_grad()
    def score_policy(self, rollouts: Rollouts) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Old (actor) log-probs (None for an on-policy update), reference log-probs and the
        critic's values (None without a critic), in micro-batches."""
        seq, attn = rollouts.sequences, rollouts.attention_mask
        micro = self.config.engine.micro_batch_size
        self.actor.eval()
        start, share = response_prefix(rollouts.action_mask), self.shares_prompts
        old_logprobs = None
        self.ran_old_logprob_forward = False
        if not self.on_policy_update:
            if self.recompute_old_logprobs or rollouts.logprobs is None:
                old_logprobs = forward_in_micro_batches(
                    lambda s, m, lo: self.policy_forward(s, m, max(start - lo, 0), share)[0], seq, attn, micro,
                    sort=not share)
                self.ran_old_logprob_forward = True
            else:  # generation's: column t + 1's token log-prob is position t's (as the forward's [B, T-1])
                old_logprobs = rollouts.logprobs[:, 1:] * rollouts.action_mask[:, 1:]
        ref_logprobs = self.ref.logprobs(seq, attn, start if share else 0, response_start=start,
                                         pack_budget=self.config.max_tokens_per_micro_batch
                                         if self.config.pack_sequences else 0)
        values = None
        if self.critic is not None:
            started = time.perf_counter()
            self.critic.eval()
            if self.keeps_critic_forward(len(seq)):
                values = self.kept_critic_forward(seq, attn)
            else:
                values = forward_in_micro_batches(
                    lambda s, m, lo: self.critic_forward(s, m, max(start - lo, 0) if share else 0), seq, attn, micro)
            self.critic_seconds += time.perf_counter() - started
        return old_logprobs, ref_logprobs, values

    def keeps_critic_forward(self, rows: int) -> bool:
        """One PPO epoch over one minibatch that is one micro-batch per rank: the critic is trained
        once, on exactly the batch whose values GAE needs, with the parameters that computed them,
        so the values forward is run with autograd on and its graph kept for the value loss: one
        critic forward per iteration fewer. The critic's update runs before the actor's, so the
        graph is freed before the actor's forward (peak memory as without it)."""
        config = self.config
        return (config.ppo_epochs == 1 and config.engine.train_batch_size == self.experience_size
                and config.engine.micro_batch_size >= rows and not config.max_tokens_per_micro_batch)

    def kept_critic_forward(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The critic's values [B, T] (detached) of the whole batch without its all-padding columns;
        the graph is kept in self.kept_values for `critic_micro_step`."""
        lo, hi = column_span(attention_mask)
        with torch.enable_grad():
            kept = critic_values(self.critic.model, sequences[:, lo:hi], attention_mask[:, lo:hi])
        self.kept_values = kept
        values = torch.zeros(sequences.shape, dtype=kept.dtype, device=kept.device)
        values[:, lo:hi] = kept.detach()
        return values

    @property
    def shares_prompts(self) -> bool:
        """The actor and reference forwards run each sampled group's prompt once (--share-prompt-forward
        with --samples-per-prompt > 1; see engine/prompt_sharing.py)."""
        return self.config.share_prompt_forward and self.group_size > 1

    def critic_forward(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
                       shared_prefix: int = 0) -> torch.Tensor:
        """The critic's values [B, T]; packed in one forward where `packs` says so (rows sharing
        their first `shared_prefix` columns running them once)."""
        if self.packs(self.critic.model, sequences, attention_mask, shared_prefix, padded_shares_prompt=False):
            return packed_values(self.critic.model, sequences, attention_mask, int(attention_mask.sum()),
                                 shared_prefix)
        return critic_values(self.critic.model, sequences, attention_mask)

    def policy_forward(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_start: int, share: bool,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The actor's log-probs [B, T-1] (and entropy) of the tokens from column response_start on
        (the LM head runs only there), each shared prompt run once when `share`; packed in one
        forward where `packs` says so."""
        if self.packs(self.actor.model, sequences, attention_mask, response_start if share else 0):
            return packed_logprobs(self.actor.model, sequences, attention_mask, response_start,
                                   int(attention_mask.sum()), with_entropy, shared_prefix=response_start if share else 0)
        if share:
            return shared_prompt_logprobs(self.actor.model, sequences, attention_mask, response_start, with_entropy)
        return response_logprobs(self.actor.model, sequences, attention_mask, response_start, with_entropy)

    def packs(self, model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
              shared_prefix: int = 0, padded_shares_prompt: bool = True) -> bool:
        """A trained model's (actor, critic) forward over these rows runs packed (--pack-sequences
        with a token budget): the model packs, each row's real tokens are one run, at most
        MAX_PACK_TOKENS of them (one forward, as the padded path: FSDP2 needs the same number on
        every rank), and fewer tokens than the padded forward. Packs run the rows' shared prompt
        (first `shared_prefix` columns) once per group; so does the padded forward where
        `padded_shares_prompt` (the actor's; the critic's padded forward runs every row whole)."""
        config = self.config
        if not (config.pack_sequences and config.max_tokens_per_micro_batch):
            return False
        padded = padded_forward_tokens(sequences, attention_mask, shared_prefix if padded_shares_prompt else 0)
        return packs_fewer_tokens(model, sequences, attention_mask, padded, shared_prefix)

    def baselined_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """This rank's scores after the estimator's group baseline, computed over the whole global
        batch (a group may span ranks)."""
        everyone = global_scores(scores, self.ctx).float()
        adjusted = group_baseline_scores(everyone, self.group_size, self.config.advantage_estimator)
        batch = scores.shape[0]
        return adjusted[self.ctx.rank * batch : (self.ctx.rank + 1) * batch].to(scores.dtype)

    def make_experience(self, rollouts: Rollouts) -> Experience:
        """Log-probs, values and scores -> rewards (KL penalty unless the KL is a loss term) ->
        advantages: GAE with the critic, else the group-baselined returns; whitened over all ranks
        for the estimators that whiten."""
        config = self.config
        old_logprobs, ref_logprobs, values = self.score_policy(rollouts)
        scores = self.baselined_scores(rollouts.scores) if config.critic_free else rollouts.scores
        return build_experience(
            rollouts.sequences, rollouts.attention_mask, rollouts.action_mask, old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs, values_full=values, raw_scores=rollouts.raw_scores, scores=scores,
            kl_coef=0.0 if config.kl_in_loss else self.kl_ctl.value, kl_kind=config.kl_kind, gamma=config.gamma,
            lam=config.lam, whiten_advantages=config.whiten_advantages and config.estimator.whitens_advantages,
            all_reduce=self.ctx.all_reduce_sum,
        )

    def update(self, exp: Experience, iteration: int) -> dict[str, float]:
        """ppo_epochs passes over the experience in minibatches (one optimizer step of the actor, and
        of the critic when there is one, each), micro-batch by micro-batch; returns the mean losses
        over all ranks."""
        config, micro = self.config, self.config.engine.micro_batch_size
        per_rank_minibatch = config.engine.train_batch_size // self.ctx.world_size
        for engine in self.engines.values():
            engine.train()
        sums: dict[str, float] = {}
        micro_steps = optimizer_steps = self.optimizer_steps_this_iteration = 0
        for ppo_epoch in range(config.ppo_epochs):
            order = seeded_permutation(len(exp), derive_seed(self.seed, "ppo_minibatches", iteration, ppo_epoch))
            perm = torch.tensor(order)
            for mb_start in range(0, len(exp), per_rank_minibatch):
                minibatch = perm[mb_start : mb_start + per_rank_minibatch].to(self.ctx.device)
                parts, weights = self.micro_batches(exp, minibatch, micro)
                for engine in self.engines.values():
                    engine.set_grad_accum(len(parts))
                for rows, weight in zip(parts, weights):
                    part = exp.select(rows).trimmed()
                    ptx_seed = derive_seed(self.seed, "ptx", iteration, micro_steps, self.ctx.rank)
                    for k, v in self.micro_step(part, ptx_seed, rows, weight).items():
                        sums[k] = sums.get(k, 0.0) + v
                    micro_steps += 1
                for name, engine in self.engines.items():
                    started = time.perf_counter()
                    step = engine.step()
                    sums[f"{name}_grad_norm"] = sums.get(f"{name}_grad_norm", 0.0) + step.grad_norm
                    if name == "critic":
                        self.critic_seconds += time.perf_counter() - started
                optimizer_steps = self.optimizer_steps_this_iteration = optimizer_steps + 1
        keys = sorted(sums)
        local = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        reduced = self.ctx.all_reduce_sum(local) / self.ctx.world_size
        return {k: v / max(micro_steps if k in PER_MICRO_METRICS else optimizer_steps, 1)
                for k, v in zip(keys, reduced.tolist())}

    def micro_batches(self, exp: Experience, minibatch: torch.Tensor,
                      micro: int) -> tuple[list[torch.Tensor], list[MicroWeight]]:
        """The minibatch's micro-batches (experience row indices) and their loss weights: rows of
        --micro-batch-size (weight 1: each micro-batch's mean counts the same), or with
        --max-tokens-per-micro-batch rows of similar length within the token budget (where the
        trained models' forwards run packed: the tokens they run, a sampled group's rows together),
        as many on every rank, each weighted by its share of the global minibatch's tokens and rows."""
        budget = self.config.max_tokens_per_micro_batch
        if not budget:
            parts = [minibatch[s] for s in micro_batch_slices(len(minibatch), micro)]
            return parts, [MicroWeight(1.0, 1.0)] * len(parts)
        mask = exp.attention_mask[minibatch]
        if self.config.pack_sequences and all(packing_unsupported_reason(engine.model, self.ctx.device) is None
                                              for engine in (self.actor, self.critic) if engine is not None):
            share = experience_response_start(exp.action_mask[minibatch]) if self.shares_prompts else 0
            cut = partial(packed_micro_batches, exp.sequences[minibatch], mask, budget, share)
        else:
            cut = partial(token_budget_micro_batches, mask, budget)
        count = int(self.ctx.all_reduce_max(torch.tensor(len(cut()))))
        parts = [minibatch[rows] for rows in cut(at_least=count)]
        tokens = [float(exp.action_mask[rows].sum()) for rows in parts]
        sizes = [float(len(rows)) for rows in parts]
        totals = self.ctx.all_reduce_sum(torch.tensor([sum(tokens), sum(sizes)], dtype=torch.float64)).tolist()
        world = self.ctx.world_size
        return parts, [MicroWeight(t, r) for t, r in zip(micro_batch_weights(tokens, totals[0], world),
                                                         micro_batch_weights(sizes, totals[1], world))]

    def micro_step(self, exp: Experience, ptx_seed: int, rows: torch.Tensor,
                   weight: MicroWeight = MicroWeight(1.0, 1.0)) -> dict[str, float]:
        """Forward/backward of one micro-batch through the actor (policy loss, KL loss term, entropy
        bonus, PTX) and the critic (value loss), each term's mean weighted as `weight` says."""
        # The critic first: a kept values graph (`keeps_critic_forward`) is freed before the actor's forward.
        metrics = self.critic_micro_step(exp, rows, weight.tokens) if self.critic is not None else {}
        config, actor = self.config, self.actor
        aggregation, normalizer = config.loss_aggregation_mode, float(config.max_new_tokens)
        start = experience_response_start(exp.action_mask)
        logprobs, entropy = self.policy_forward(exp.sequences, exp.attention_mask, start, self.shares_prompts,
                                                with_entropy=True)
        low, high = config.clip_bounds
        old_logprobs = exp.old_logprobs
        if old_logprobs is not None and self.optimizer_steps_this_iteration == 0:
            self.old_logprob_drift.add(logprobs.detach(), old_logprobs, exp.action_mask)
        if old_logprobs is None:  # on-policy: the rollout policy is this forward's (ratio 1, gradient kept)
            old_logprobs = logprobs.detach()
            kl = kl_estimate(old_logprobs, exp.ref_logprobs, config.kl_kind) * exp.action_mask
            self.policy_kl_sum += float(kl.sum())
        p_loss, clipfrac, approx_kl = policy_loss(logprobs, old_logprobs, exp.advantages, exp.action_mask, low,
                                                  high, aggregation=aggregation, normalizer=normalizer,
                                                  ratio_level=config.importance_ratio)
        per_sample = weight.tokens if aggregation == "token-mean" else weight.rows
        loss = per_sample * p_loss
        metrics.update(clipfrac=float(clipfrac), approx_kl=float(approx_kl))
        if config.kl_in_loss:
            kl_term = kl_loss(logprobs, exp.ref_logprobs, exp.action_mask, config.kl_kind, aggregation, normalizer)
            loss = loss + per_sample * self.kl_ctl.value * kl_term
            metrics["kl_loss"] = float(kl_term.detach())
        entropy = masked_mean(entropy, exp.action_mask)
        if config.entropy_coef > 0:
            loss = loss - weight.tokens * config.entropy_coef * entropy
        if self.ptx_rows:
            ptx = self.ptx_loss(len(exp), ptx_seed, logprobs.device)
            loss = loss + weight.rows * config.ptx_coef * ptx
            metrics["ptx_loss"] = float(ptx.detach())
        actor.backward(loss)
        metrics.update(policy_loss=float(p_loss.detach()), entropy=float(entropy.detach()))
        return metrics

    def critic_micro_step(self, exp: Experience, rows: torch.Tensor, weight: float = 1.0) -> dict[str, float]:
        """The critic's clipped value loss on one micro-batch (the experience's `rows`, trimmed),
        forward and backward; the forward is the experience pass's kept one when there is one."""
        started = time.perf_counter()
        kept, self.kept_values = self.kept_values, None
        if kept is not None and kept.shape[1] == exp.sequences.shape[1] and kept.shape[0] == len(rows):
            values = kept.index_select(0, rows.to(kept.device))[:, :-1]
        else:
            share = experience_response_start(exp.action_mask) if self.shares_prompts else 0
            values = self.critic_forward(exp.sequences, exp.attention_mask, share)[:, :-1]
        v_loss, v_clipfrac = value_loss(values, exp.old_values, exp.returns, exp.action_mask,
                                        self.config.clip_range_value)
        self.critic.backward(weight * v_loss)
        self.critic_seconds += time.perf_counter() - started
        return {"value_loss": float(v_loss.detach()), "value_clipfrac": float(v_clipfrac)}

    def ptx_loss(self, n: int, seed: int, device: torch.device) -> torch.Tensor:
        """InstructGPT's PPO-ptx term: the actor's token-mean LM loss on n seeded picks of --ptx-data."""
        picks = torch.randint(len(self.ptx_rows), (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        batch = collate_sft([self.ptx_rows[i] for i in picks], self.tokenizer.pad_token_id)
        logits = self.actor.model(input_ids=batch["input_ids"].to(device),
                                  attention_mask=batch["attention_mask"].to(device), use_cache=False).logits
        loss_sum, count = sft_loss_sum(logits, batch["labels"].to(device))
        return loss_sum / count.clamp(min=1)

    def update_kl_controller(self, exp: Experience) -> float:
        """Mean KL per sequence over all ranks (from the experience, or measured in an on-policy
        update), fed to the KL controller (adaptive KL moves its coefficient)."""
        if exp.old_logprobs is None:
            kl = float(self.ctx.all_reduce_sum(self.policy_kl_sum)) / self.experience_size
        else:
            kl = float(self.ctx.all_reduce_sum(mean_kl_per_sequence(exp).detach().double())) / self.ctx.world_size
        self.kl_ctl.update(kl, self.experience_size)
        return kl

    # -------------------------------------------------------------- logging, checkpoints, outputs

    def log_iteration(self, iteration: int, rollouts: Rollouts, exp: Experience, update_metrics: dict[str, float],
                      kl: float, seconds: dict[str, float]) -> dict[str, float]:
        """Metrics of the iteration over all ranks to the tracker (and a sample table now and then)."""
        ctx, config, step = self.ctx, self.config, iteration + 1
        experience_global = self.experience_size
        response_tokens = float(ctx.all_reduce_sum(exp.action_mask.sum().double()))
        eos = float(ctx.all_reduce_sum(rollouts.ended_with_eos.float().sum().double()))
        clipped = float(ctx.all_reduce_sum(rollouts.clipped.double().sum()))
        metrics = {**experience_metrics(exp, ctx, self.critic is not None), **update_metrics,
                   **self.reward_source_metrics(rollouts)}
        metrics.update(critic_s=self.critic_seconds, **self.phase_gflop(rollouts),
                       **self.old_logprob_metrics(exp), **self.memory.metrics(ctx.all_reduce_max))
        metrics.update(
            kl=kl, kl_coef=self.kl_ctl.value, **seconds, samples_per_s=experience_global / sum(seconds.values()),
            tokens_per_s=response_tokens / seconds["generation_s"], actor_lr=self.actor.scheduler.get_last_lr()[0],
            ended_with_eos=eos / experience_global, reward_clipped_fraction=clipped / experience_global,
            **rollouts.metrics,
        )
        self.last_metrics = metrics
        last = step == self.total_iterations
        if step % config.tracking.log_interval == 0 or last:
            self.tracker.log(metrics, step=step)
        if config.sample_log_interval > 0 and (iteration % config.sample_log_interval == 0 or last):
            extra = rollouts.extra or {}
            rows = [[prompt_text(p), r, float(s), *(extra[k][i] for k in extra)]
                    for i, (p, r, s) in enumerate(zip(rollouts.prompts[:4], rollouts.responses[:4],
                                                      exp.scores[:4].tolist()))]
            self.tracker.log_table("samples", [*SAMPLE_COLUMNS, *extra], rows, step=step)
        return metrics

    def phase_gflop(self, rollouts: Rollouts) -> dict[str, float]:
        """The iteration's model GFLOPs per phase over all ranks (`<phase>_gflop`, rlhf.stages.throughput)."""
        if self.flop_models is None:
            return {}
        responses = rollouts.response_lengths
        prompts = rollouts.attention_mask.sum(-1) - responses
        work = IterationWork(self.group_size, self.shares_prompts, self.ran_old_logprob_forward,
                             self.config.ppo_epochs, self.critic is not None and self.keeps_critic_forward(len(rollouts)))
        flops = iteration_flops(self.flop_models, work, prompts.tolist(), responses.tolist())
        total = self.ctx.all_reduce_sum(torch.tensor([flops[k] for k in PHASES], dtype=torch.float64))
        return {f"{k}_gflop": float(v) / 1e9 for k, v in zip(PHASES, total.tolist())}

    def old_logprob_metrics(self, exp: Experience) -> dict[str, float]:
        """old_logprob_diff_max/_mean when the experience held old log-probs (see LogprobDrift);
        generation's log-probs beyond --old-logprob-tolerance make PPO recompute them from the
        next iteration on."""
        if exp.old_logprobs is None:
            return {}
        drift = self.old_logprob_drift.global_metrics(self.ctx.all_reduce_sum, self.ctx.all_reduce_max)
        if not self.recompute_old_logprobs and not drift["old_logprob_diff_max"] <= self.old_logprob_tolerance:
            log.warning("ppo: generation's log-probs differ from the training forward's by up to %.3g (> "
                        "--old-logprob-tolerance %g); recomputing them with the actor from now on",
                        drift["old_logprob_diff_max"], self.old_logprob_tolerance)
            self.recompute_old_logprobs = True
        return {**drift, "old_logprobs_recomputed": float(self.ran_old_logprob_forward)}

    def reward_source_metrics(self, rollouts: Rollouts) -> dict[str, float]:
        """Each reward source's mean raw score over the samples it scored (`reward/<name>`) over all
        ranks, the functions' log_metric values (`reward_fn/<name>`, this iteration's mean), and a
        re-tokenising reward model's count of this iteration's sequences cut to fit its max_len
        (the counts restart every iteration; see `reward_metrics`)."""
        truncated = self.reward.take_truncated()
        return reward_metrics(rollouts.components or {}, self.reward.take_logged_metrics(), self.ctx,
                              self.reward.logs_metrics, truncated if self.reward.retokenizes else None)

    def check_reward_spread(self, rollouts: Rollouts) -> None:
        """Without the reward stage's score_std to check at load (no summary.json, or normalisation
        off), check the spread of the first iteration's reward-model scores instead."""
        if self.config.reward and self.reward.model_normalization is None and rollouts.components:
            raw = global_scores(rollouts.components[REWARD_MODEL], self.ctx)
            warn_if_degenerate(self.config.reward, float(raw.std(unbiased=False)), "the first iteration's rollouts")

    def save_checkpoint(self, step: int, stopping: bool = False) -> Path | None:
        """Resume state after `step` iterations, every --save-interval iterations (and at the end
        with --save-final-checkpoint), and when `stopping` for a signal; the checkpoint, if saved."""
        if not (stopping or wants_checkpoint(self.config, step, step == self.total_iterations)):
            return None
        loop_state: dict[str, Any] = {"step": step, "iteration": step, "kl_coef": self.kl_ctl.value}
        if self.ema is not None:
            loop_state["ema"] = self.ema.state_dict()
        return self.checkpointer.save(step, self.engines, loop_state)

    def finish(self) -> dict[str, Any]:
        """Export the actor, the critic if any (and the EMA actor), write summary.json and DONE;
        returns the summary."""
        ctx, output = self.ctx, self.output
        export_trained_model(self.actor, output / "model", self.tokenizer, self.config.lora)
        if self.critic is not None:
            export_trained_model(self.critic, output / "critic", self.tokenizer, self.config.lora)
        if self.ema is not None:
            full = merge_state_dict(self.actor.model, self.ema.full_state_dict(self.actor.model))
            export_state_dict(self.actor.model, ctx, full if ctx.is_main else {}, output / "model_ema", self.tokenizer)
        summary = {
            "stage": "ppo", "advantage_estimator": self.config.advantage_estimator,
            "samples_per_prompt": self.group_size, "iterations": self.total_iterations, "world_size": ctx.world_size,
            "inference_tp_size": self.tp.size, "train_seconds": time.perf_counter() - self.started,
            "prompts": len(self.prompts.ids), "data": self.prompts.stats,
            **{k: v for k, v in self.last_metrics.items() if isinstance(v, (int, float))},
        }
        finish_stage(ctx, output, self.tracker, summary)
        return summary


def shown_values(scores: torch.Tensor, most: int = 4) -> str:
    """The distinct values of `scores` for a message: '0, 1' (the first `most`, then '...')."""
    values = sorted(set(scores.tolist()))
    return ", ".join(f"{v:g}" for v in values[:most]) + (", ..." if len(values) > most else "")


def experience_metrics(exp: Experience, ctx: DistributedContext, has_critic: bool) -> dict[str, float]:
    """Score, reward, length (and value) statistics over the global experience batch."""
    mask = exp.action_mask
    lengths = mask.sum(-1).float()
    seq_reward = (exp.rewards * mask).sum(-1)
    advantages = exp.advantages.double() * mask
    local = torch.stack([
        exp.scores.double().sum(), (exp.scores.double() ** 2).sum(), seq_reward.double().sum(), lengths.double().sum(),
        torch.tensor(float(len(exp)), dtype=torch.float64, device=exp.scores.device), advantages.sum(),
        (advantages ** 2).sum(),
    ])
    tot = ctx.all_reduce_sum(local)
    n, tokens = float(tot[4]), max(float(tot[3]), 1.0)
    score_mean = float(tot[0]) / n
    score_var = max(float(tot[1]) / n - score_mean ** 2, 0.0)
    advantage_mean = float(tot[5]) / tokens
    metrics = {
        "score_mean": score_mean, "score_std": score_var ** 0.5, "reward_total": float(tot[2]) / n,
        "response_length": float(tot[3]) / n, "advantage_mean": advantage_mean,
        "advantage_std": max(float(tot[6]) / tokens - advantage_mean ** 2, 0.0) ** 0.5,
    }
    if has_critic:
        metrics["value_explained_variance"] = float(explained_variance(exp.old_values, exp.returns, mask))
    return metrics
