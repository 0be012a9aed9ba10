"""`rlhf ppo`: PPO on prompts with the hybrid engine.

    rlhf ppo --actor runs/sft/model --reward runs/rm/model --data prompts.jsonl --output runs/ppo
    rlhf ppo --actor runs/sft/model --reward-fn sort --data prompts.jsonl --output runs/ppo   # verifiable reward
    rlhf ppo ... --nproc-per-node 2 --zero-stage 3 --inference-tp-size 2

Reads top to bottom: `run` checks the config, claims the output folder and builds a `PPOTrainer`
(data, models, tracker, resume), whose `train` loop runs one iteration as named phases:

    generate_rollouts   rollout mode (tensor-parallel actor, static KV cache): responses to prompts
    make_experience     old/reference log-probs, critic values, reward scores -> KL-penalised
                        per-token rewards -> GAE -> whitened advantages
    update              ppo_epochs of clipped policy and value updates over minibatches
                        (+ entropy bonus, + PTX loss), then the actor's EMA and the KL controller
    log_iteration       metrics over all ranks, sample tables
    save_checkpoint     resume state (DCP) every --save-interval iterations (and at the end with
                        --save-final-checkpoint)

`finish` writes the final actor to <output>/model, the critic to <output>/critic (and the EMA
actor to <output>/model_ema), then summary.json and DONE.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from rlhf.algorithms.losses import sft_loss_sum
from rlhf.algorithms.ppo import (
    AdaptiveKLController, FixedKLController, explained_variance, masked_mean, policy_loss, value_loss,
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
from rlhf.engine.export import export_model, export_state_dict
from rlhf.engine.inference import FrozenModel, causal_lm_logprobs, micro_batch_slices
from rlhf.engine.logprobs import entropy_from_logits_chunked
from rlhf.engine.positions import position_ids_from_mask
from rlhf.engine.rollout import rollout_mode
from rlhf.engine.sampling import SamplingParams
from rlhf.engine.train_engine import TrainEngine
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.models.value_model import check_reward_model_dir, value_model_from, value_model_kind
from rlhf.seeding import derive_seed, seeded_permutation
from rlhf.stages.experience import Experience, build_experience, mean_kl_per_sequence, shaped_scores
from rlhf.stages.reward_sources import build_reward_source, warn_if_degenerate
from rlhf.stages.trainer import finish_stage, open_run, resume_from_latest, start_stage, wants_checkpoint

log = get_logger(__name__)

# Per-micro-batch metrics (averaged over micro-batches); the rest of `update`'s sums are per step.
PER_MICRO_METRICS = ("policy_loss", "value_loss", "clipfrac", "approx_kl", "value_clipfrac", "entropy", "ptx_loss")


# ------------------------------------------------------------------ the stage


def run(config: PPOConfig) -> dict[str, Any]:
    """Train the actor (and critic) with PPO; collective: every rank calls it. Returns the summary."""
    ctx = DistributedContext.initialize()
    check_config(config, ctx)
    output = start_stage(config, ctx, "ppo")
    check_batch_arithmetic(config, ctx)
    trainer = PPOTrainer(config, ctx, output)
    trainer.train()
    return trainer.finish()


def check_config(config: PPOConfig, ctx: DistributedContext) -> None:
    """Flags PPO cannot run without, the TP size, and the default minibatch (the whole experience)."""
    if not config.actor:
        raise UserError("--actor is required: the policy to train (e.g. the SFT stage's <output>/model)")
    if not config.reward and not config.reward_fn:
        raise UserError("--reward (a reward model folder) or --reward-fn TASK is required")
    if not (config.critic or config.reward):
        raise UserError("--critic is required with --reward-fn (a causal LM or value model folder, e.g. the SFT model)")
    check_model_folders(config)
    if config.ptx_data and config.ptx_coef <= 0:
        raise UserError("--ptx-data needs --ptx-coef > 0")
    ctx.tp_coordinates(config.inference_tp_size)
    if config.engine.train_batch_size is None and config.engine.grad_accum is None:
        config.engine.train_batch_size = config.generation_batch_size * ctx.world_size  # one minibatch per PPO epoch
        config.engine.micro_batch_size = min(config.engine.micro_batch_size, config.generation_batch_size)


def check_model_folders(config: PPOConfig) -> None:
    """--reward and --critic are read from config.json alone, before the actor (or anything) is
    loaded: a wrong folder fails in a second, not after minutes of loading models."""
    if config.reward:
        check_reward_model_dir(config.reward, "--reward")
    if config.critic and value_model_kind(config.critic) is None:
        raise UserError(f"--critic {config.critic}: no config.json; pass a value/reward model folder, a Hugging Face "
                        "*ForSequenceClassification folder or a causal LM folder (e.g. runs/sft/model)")
    if config.reward and not config.critic and not same_vocabulary(
            load_tokenizer(config.reward, "--reward"), load_tokenizer(config.actor, "--actor")):
        raise UserError(f"--reward {config.reward}: its tokenizer differs from the actor's, so it cannot be the "
                        "critic (the critic reads the actor's token ids); pass --critic (e.g. the --actor folder)")


def check_batch_arithmetic(config: PPOConfig, ctx: DistributedContext) -> None:
    """The global minibatch (--train-batch-size, resolved by start_stage) must divide the experience."""
    experience = config.generation_batch_size * ctx.world_size
    if experience % config.engine.train_batch_size:
        raise UserError(
            f"--train-batch-size {config.engine.train_batch_size} must divide the experience batch "
            f"generation_batch_size {config.generation_batch_size} x world size {ctx.world_size} = {experience}"
        )


# ------------------------------------------------------------------ setup helpers


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
    stats: dict[str, int]


def load_prompts(config: PPOConfig, tokenizer: Any) -> Prompts:
    """This stage's share of --data as generation prompts of at most --max-prompt-len tokens."""

    def tokenize(parsed: list[ParsedRow]) -> tuple[list[tuple[list[int], list[Message]]], TokenizeStats]:
        ids, stats = tokenize_prompts(parsed, tokenizer, config.max_prompt_len)
        return [(i, parsed[k].prompt) for i, k in zip(ids, stats.kept_indices)], stats

    rows = load_stage_rows(
        config.data, "ppo", config.engine.seed, tokenize, holdout=False,
        required="prompts (or any rows with a prompt) as json/jsonl/parquet/csv",
        empty=f"no prompts of at most {config.max_prompt_len} tokens",
    )
    return Prompts([ids for ids, _ in rows.train], [messages for _, messages in rows.train], rows.stats)


def critic_values(critic: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The critic's values [B, T], with the positions generation gave the tokens."""
    return critic(sequences, attention_mask, position_ids=position_ids_from_mask(attention_mask))


@contextmanager
def timed(seconds: dict[str, float], key: str) -> Iterator[None]:
    """Store the wall time of the block in seconds[key]."""
    start = time.perf_counter()
    yield
    seconds[key] = time.perf_counter() - start


@dataclass
class Rollouts:
    """This rank's share of one iteration's generations."""

    sequences: torch.Tensor  # [B, T] prompt + response ids, left-padded prompts
    attention_mask: torch.Tensor  # [B, T]
    action_mask: torch.Tensor  # [B, T] response tokens
    ended_with_eos: torch.Tensor  # [B] bool
    prompts: list[list[Message]]  # each row's chat messages
    responses: list[str]  # each row's decoded response
    metrics: dict[str, float]  # rollout mode's (parity check, memory)
    clipped: torch.Tensor | None = None  # how many shaped scores --reward-clip cut (set by make_experience)


# ------------------------------------------------------------------ the trainer


class PPOTrainer:
    """Actor, critic, reference, reward source, KL controller and EMA, and the loop over them."""

    def __init__(self, config: PPOConfig, ctx: DistributedContext, output: Path) -> None:
        self.config, self.ctx, self.output = config, ctx, output
        self.seed = config.engine.seed
        self.tp = ctx.tp_coordinates(config.inference_tp_size)
        self.batch_per_rank = config.generation_batch_size
        self.tokenizer = load_tokenizer(config.actor, "--actor")
        self.load_data()
        self.total_iterations = config.max_steps if config.max_steps > 0 else self.plan.steps_per_epoch * config.epochs
        self.build_models()
        self.tracker, self.checkpointer = open_run(config, ctx, output, "ppo")
        self.start_iteration = self.resume()
        self.sampling = SamplingParams(
            max_new_tokens=config.max_new_tokens, min_new_tokens=config.min_new_tokens, do_sample=not config.greedy,
            temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
            eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
        )
        self.last_metrics: dict[str, float] = {}
        self.started = time.perf_counter()

    def load_data(self) -> None:
        """Prompts, the plan that deals them out per iteration, and the optional PTX rows."""
        config = self.config
        self.prompts = load_prompts(config, self.tokenizer)
        # A TP group generates its prompts together, so the plan's "ranks" are the TP groups: each
        # takes batch_per_rank x tp prompts of every iteration's global batch.
        self.plan = BatchPlan(len(self.prompts.ids), self.batch_per_rank * self.tp.size, 1, self.tp.num_groups,
                              self.tp.group_index, self.seed)
        if self.plan.steps_per_epoch == 0:
            raise UserError(f"{len(self.prompts.ids)} prompts do not fill one iteration of "
                            f"{self.plan.global_batch_size}; lower --generation-batch-size or add prompts")
        leftover = self.plan.num_rows % self.plan.global_batch_size
        if leftover:
            log.info("ppo: %d prompts do not fill an iteration and wait for the next epoch's shuffle", leftover)
        self.ptx_rows: list[dict] = []
        if config.ptx_data:
            self.ptx_rows, _ = tokenize_specs(
                config.ptx_data, lambda parsed: tokenize_sft(parsed, self.tokenizer, config.data.max_seq_len),
                "ptx data")

    def build_models(self) -> None:
        """Trained actor and critic (separate optimizers), frozen reference, reward source, KL, EMA."""
        config, ctx = self.config, self.ctx
        minibatches = self.plan.global_batch_size // config.engine.train_batch_size
        total_steps = self.total_iterations * config.ppo_epochs * minibatches
        self.actor = TrainEngine(disable_dropout(load_causal_lm(config.actor, "--actor")),
                                 engine_config_for(config, config.actor_zero_stage, None), ctx, total_steps, "actor")
        self.critic = TrainEngine(disable_dropout(value_model_from(config.critic or config.reward, flag="--critic")),
                                  engine_config_for(config, config.critic_zero_stage, config.critic_lr), ctx,
                                  total_steps, "critic")
        self.ref = FrozenModel(load_causal_lm(config.ref or config.actor, "--ref"), ctx, config.engine.zero_stage,
                               self.actor.dtype, config.offload_ref, config.engine.micro_batch_size, "ref")
        self.reward = build_reward_source(config, ctx, self.tokenizer, self.actor.dtype)
        self.kl_ctl = (AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon) if config.adaptive_kl
                       else FixedKLController(config.kl_coef))
        self.ema = ParameterEMA(self.actor.model, config.ema_decay) if config.ema_decay > 0 else None

    def resume(self) -> int:
        """With --resume, the trainer's resume (engines, RNG, metrics) plus the KL coefficient and
        the EMA; returns the iteration to start from."""
        state = resume_from_latest(self.config, self.ctx, self.checkpointer,
                                   {"actor": self.actor, "critic": self.critic}, self.tracker)
        if state is None:
            return 0
        self.kl_ctl.value = state["kl_coef"]
        if self.ema is not None and "ema" in state:
            self.ema.load_state_dict(state["ema"])
        return int(state["iteration"])

    # -------------------------------------------------------------- the loop

    def train(self) -> None:
        """One PPO iteration per step: rollouts -> experience -> update -> logging -> checkpoint."""
        bar = tqdm(total=self.total_iterations, initial=self.start_iteration, desc="ppo", disable=not self.ctx.is_main,
                   dynamic_ncols=True)
        self.started = time.perf_counter()
        for iteration in range(self.start_iteration, self.total_iterations):
            seconds: dict[str, float] = {}
            with timed(seconds, "generation_s"):
                rollouts = self.generate_rollouts(iteration)
            with timed(seconds, "experience_s"):
                exp = self.make_experience(rollouts)
            with timed(seconds, "training_s"):
                update_metrics = self.update(exp, iteration)
            if self.ema is not None:
                self.ema.update(self.actor.model)
            kl = self.update_kl_controller(exp)
            metrics = self.log_iteration(iteration, rollouts, exp, update_metrics, kl, seconds)
            if iteration == self.start_iteration:
                self.check_reward_spread(metrics)
            bar.update(1)
            bar.set_postfix(score=f"{metrics['score_mean']:.3f}", kl=f"{kl:.3f}")
            self.save_checkpoint(iteration + 1)
        bar.close()

    def generate_rollouts(self, iteration: int) -> Rollouts:
        """Responses to this iteration's prompts: the TP group generates its prompts together (same
        sampling seed on its ranks), then each rank keeps its --generation-batch-size rows."""
        epoch, step_in_epoch = divmod(iteration, self.plan.steps_per_epoch)
        (group_rows,) = self.plan.step_micro_batches(epoch, step_in_epoch)
        ids, mask = pad_left([self.prompts.ids[i] for i in group_rows], self.tokenizer.pad_token_id)
        gen = torch.Generator(device=self.ctx.device).manual_seed(
            derive_seed(self.seed, "rollout", iteration, self.tp.group_index))
        with rollout_mode(self.actor, self.tp.size, self.config.rollout_parity_tolerance) as rollout:
            out = rollout.generate(ids.to(self.ctx.device), mask.to(self.ctx.device), self.sampling, gen)
            rollout_metrics = dict(rollout.metrics)
        mine = slice(self.tp.rank_in_group * self.batch_per_rank, (self.tp.rank_in_group + 1) * self.batch_per_rank)
        sequences, action = out.sequences[mine], out.action_mask[mine]
        decoded = self.tokenizer.batch_decode([s[a] for s, a in zip(sequences, action)], skip_special_tokens=True)
        return Rollouts(sequences, out.attention_mask[mine], action, out.finished[mine],
                        [self.prompts.messages[i] for i in group_rows[mine]], [r.strip() for r in decoded],
                        rollout_metrics)

    @torch.no_grad()
    def score_rollouts(self, rollouts: Rollouts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Old (actor) and reference log-probs, critic values and raw reward scores, in micro-batches."""
        seq, attn = rollouts.sequences, rollouts.attention_mask
        slices = micro_batch_slices(len(seq), self.config.engine.micro_batch_size)
        self.actor.eval(), self.critic.eval()
        old_logprobs = torch.cat([causal_lm_logprobs(self.actor.model, seq[s], attn[s])[0] for s in slices])
        ref_logprobs = self.ref.logprobs(seq, attn)
        values = torch.cat([critic_values(self.critic.model, seq[s], attn[s]) for s in slices])
        raw_scores = self.reward.score(seq, attn, rollouts.prompts, rollouts.responses)  # chat messages, texts
        return old_logprobs, ref_logprobs, values, raw_scores

    def make_experience(self, rollouts: Rollouts) -> Experience:
        """Log-probs, values and scores -> KL-penalised rewards -> GAE advantages (whitened over all
        ranks). Counts the shaped scores that --reward-clip cuts into rollouts.metrics."""
        config = self.config
        old_logprobs, ref_logprobs, values, raw_scores = self.score_rollouts(rollouts)
        scores = shaped_scores(raw_scores, rollouts.ended_with_eos, self.reward.normalization,
                               config.missing_eos_penalty)
        rollouts.clipped = (scores.abs() > config.reward_clip).sum()
        return build_experience(
            rollouts.sequences, rollouts.attention_mask, rollouts.action_mask, old_logprobs, ref_logprobs, values,
            raw_scores, scores, self.kl_ctl.value, config.kl_estimator, config.reward_clip, config.gamma,
            config.lam, config.whiten_advantages, self.ctx.all_reduce_sum,
        )

    def update(self, exp: Experience, iteration: int) -> dict[str, float]:
        """ppo_epochs passes over the experience in minibatches (one optimizer step of actor and
        critic each), micro-batch by micro-batch; returns the mean losses over all ranks."""
        config, micro = self.config, self.config.engine.micro_batch_size
        per_rank_minibatch = config.engine.train_batch_size // self.ctx.world_size
        self.actor.train(), self.critic.train()
        sums: dict[str, float] = {}
        micro_steps = optimizer_steps = 0
        for ppo_epoch in range(config.ppo_epochs):
            order = seeded_permutation(len(exp), derive_seed(self.seed, "ppo_minibatches", iteration, ppo_epoch))
            perm = torch.tensor(order)
            for mb_start in range(0, len(exp), per_rank_minibatch):
                minibatch = perm[mb_start : mb_start + per_rank_minibatch]
                for s in micro_batch_slices(len(minibatch), micro):
                    part = exp.select(minibatch[s].to(self.ctx.device))
                    ptx_seed = derive_seed(self.seed, "ptx", iteration, micro_steps, self.ctx.rank)
                    step_metrics = self.micro_step(part, ptx_seed)
                    for k, v in step_metrics.items():
                        sums[k] = sums.get(k, 0.0) + v
                    micro_steps += 1
                actor_step, critic_step = self.actor.step(), self.critic.step()
                optimizer_steps += 1
                sums["actor_grad_norm"] = sums.get("actor_grad_norm", 0.0) + actor_step.grad_norm
                sums["critic_grad_norm"] = sums.get("critic_grad_norm", 0.0) + critic_step.grad_norm
        keys = sorted(sums)
        local = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        reduced = self.ctx.all_reduce_sum(local) / self.ctx.world_size
        return {k: v / max(micro_steps if k in PER_MICRO_METRICS else optimizer_steps, 1)
                for k, v in zip(keys, reduced.tolist())}

    def micro_step(self, exp: Experience, ptx_seed: int) -> dict[str, float]:
        """Forward/backward of one micro-batch through actor (policy loss) and critic (value loss)."""
        config, actor = self.config, self.actor
        logprobs, logits = causal_lm_logprobs(actor.model, exp.sequences, exp.attention_mask)
        p_loss, clipfrac, approx_kl = policy_loss(logprobs, exp.old_logprobs, exp.advantages, exp.action_mask,
                                                  config.clip_range)
        entropy = masked_mean(entropy_from_logits_chunked(logits[:, :-1]), exp.action_mask)
        loss = p_loss - config.entropy_coef * entropy if config.entropy_coef > 0 else p_loss
        ptx = torch.zeros(())
        if self.ptx_rows:
            ptx = self.ptx_loss(len(exp), ptx_seed, logits.device)
            loss = loss + config.ptx_coef * ptx
        actor.backward(loss)
        values = critic_values(self.critic.model, exp.sequences, exp.attention_mask)[:, :-1]
        v_loss, v_clipfrac = value_loss(values, exp.old_values, exp.returns, exp.action_mask, config.clip_range_value)
        self.critic.backward(v_loss)
        return {
            "policy_loss": float(p_loss.detach()), "value_loss": float(v_loss.detach()), "clipfrac": float(clipfrac),
            "approx_kl": float(approx_kl), "value_clipfrac": float(v_clipfrac), "entropy": float(entropy.detach()),
            "ptx_loss": float(ptx.detach()),
        }

    def ptx_loss(self, n: int, seed: int, device: torch.device) -> torch.Tensor:
        """InstructGPT's PPO-ptx term: the actor's token-mean LM loss on n seeded picks of --ptx-data."""
        picks = torch.randint(len(self.ptx_rows), (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        batch = collate_sft([self.ptx_rows[i] for i in picks], self.tokenizer.pad_token_id)
        logits = self.actor.model(input_ids=batch["input_ids"].to(device),
                                  attention_mask=batch["attention_mask"].to(device), use_cache=False).logits
        loss_sum, count = sft_loss_sum(logits, batch["labels"].to(device))
        return loss_sum / count.clamp(min=1)

    def update_kl_controller(self, exp: Experience) -> float:
        """Mean KL per sequence over all ranks, fed to the KL controller (adaptive KL moves its coefficient)."""
        kl = float(self.ctx.all_reduce_sum(mean_kl_per_sequence(exp).detach().double())) / self.ctx.world_size
        self.kl_ctl.update(kl, self.plan.global_batch_size)
        return kl

    # -------------------------------------------------------------- logging, checkpoints, outputs

    def log_iteration(self, iteration: int, rollouts: Rollouts, exp: Experience, update_metrics: dict[str, float],
                      kl: float, seconds: dict[str, float]) -> dict[str, float]:
        """Metrics of the iteration over all ranks to the tracker (and a sample table now and then)."""
        ctx, config, step = self.ctx, self.config, iteration + 1
        experience_global = self.plan.global_batch_size
        response_tokens = float(ctx.all_reduce_sum(exp.action_mask.sum().double()))
        eos = float(ctx.all_reduce_sum(rollouts.ended_with_eos.float().sum().double()))
        clipped = float(ctx.all_reduce_sum(rollouts.clipped.double())) if rollouts.clipped is not None else 0.0
        metrics = {**experience_metrics(exp, ctx), **update_metrics, **self.reward_source_metrics()}
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
            rows = [[p[-1]["content"], r, float(s)] for p, r, s in zip(rollouts.prompts[:4], rollouts.responses[:4],
                                                                       exp.scores[:4].tolist())]
            self.tracker.log_table("samples", ["prompt", "response", "score"], rows, step=step)
        return metrics

    def reward_source_metrics(self) -> dict[str, float]:
        """A re-tokenising reward source's count of this iteration's sequences cut to fit its
        max_len (summed over all ranks); the count restarts every iteration."""
        if getattr(self.reward, "tokenizer", None) is None:
            return {}
        truncated, self.reward.truncated = self.reward.truncated, 0
        return {"reward_retokenize_truncated": float(self.ctx.all_reduce_sum(
            torch.tensor(float(truncated), dtype=torch.float64)))}

    def check_reward_spread(self, metrics: dict[str, float]) -> None:
        """Without the reward stage's score_std to check at load (no summary.json, or normalisation
        off), check the spread of the first iteration's raw scores instead."""
        if self.config.reward and not self.config.reward_fn and self.reward.normalization is None:
            warn_if_degenerate(self.config.reward, metrics["score_std"], "the first iteration's rollouts")

    def save_checkpoint(self, step: int) -> None:
        """Resume state after `step` iterations, every --save-interval iterations (and at the end
        with --save-final-checkpoint)."""
        if not wants_checkpoint(self.config, step, step == self.total_iterations):
            return
        loop_state: dict[str, Any] = {"step": step, "iteration": step, "kl_coef": self.kl_ctl.value}
        if self.ema is not None:
            loop_state["ema"] = self.ema.state_dict()
        self.checkpointer.save(step, {"actor": self.actor, "critic": self.critic}, loop_state)

    def finish(self) -> dict[str, Any]:
        """Export actor, critic (and EMA actor), write summary.json and DONE; returns the summary."""
        ctx, output = self.ctx, self.output
        export_model(self.actor, output / "model", self.tokenizer)
        export_model(self.critic, output / "critic", self.tokenizer)
        if self.ema is not None:
            full = self.ema.full_state_dict(self.actor.model)
            export_state_dict(self.actor.model, ctx, full if ctx.is_main else {}, output / "model_ema", self.tokenizer)
        summary = {
            "stage": "ppo", "iterations": self.total_iterations, "world_size": ctx.world_size,
            "inference_tp_size": self.tp.size, "train_seconds": time.perf_counter() - self.started,
            "prompts": len(self.prompts.ids), "data": self.prompts.stats,
            **{k: v for k, v in self.last_metrics.items() if isinstance(v, (int, float))},
        }
        finish_stage(ctx, output, self.tracker, summary)
        return summary


def experience_metrics(exp: Experience, ctx: DistributedContext) -> dict[str, float]:
    """Score, reward, length and value statistics over the global experience batch."""
    mask = exp.action_mask
    lengths = mask.sum(-1).float()
    seq_reward = (exp.rewards * mask).sum(-1)
    local = torch.stack([
        exp.scores.sum(), (exp.scores ** 2).sum(), seq_reward.sum(), lengths.sum(),
        torch.tensor(float(len(exp)), device=exp.scores.device),
    ]).double()
    tot = ctx.all_reduce_sum(local)
    n = float(tot[4])
    score_mean = float(tot[0]) / n
    score_var = max(float(tot[1]) / n - score_mean ** 2, 0.0)
    return {
        "score_mean": score_mean, "score_std": score_var ** 0.5, "reward_total": float(tot[2]) / n,
        "response_length": float(tot[3]) / n,
        "value_explained_variance": float(explained_variance(exp.old_values, exp.returns, mask)),
    }
