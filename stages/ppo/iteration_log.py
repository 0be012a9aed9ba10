"""PPO's fourth phase: an iteration's metrics over all ranks (per reward source, per phase) and sample tables."""

from __future__ import annotations

import torch

from rlhf.algorithms.ppo_math import explained_variance
from rlhf.engine.distributed import DistributedContext
from rlhf.logging import get_logger
from rlhf.reward_batch import SAMPLE_COLUMNS
from rlhf.stages.tool_rollouts import trajectory_text
from rlhf.reward_functions import prompt_text
from rlhf.stages.experience import Experience
from rlhf.stages.reward_sources import REWARD_MODEL, reward_metrics, warn_if_degenerate
from rlhf.stages.rollouts import Rollouts, global_scores
from rlhf.stages.throughput import IterationWork, PHASES, iteration_flops

log = get_logger(__name__)


class IterationLog:
    """`log_iteration` and the metrics it gathers."""

    # The state these methods read is set up by PPOTrainer (stages/ppo/loop.py): config, ctx, actor,
    # critic, ref, reward, tokenizer, tracker, memory, ... (PPOTrainer.__init__ and build_models).

    def log_iteration(self, iteration: int, rollouts: Rollouts, exp: Experience, update_metrics: dict[str, float],
                      kl: float | None, seconds: dict[str, float]) -> dict[str, float]:
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
            kl_coef=self.kl_ctl.value, **({} if kl is None else {"kl": kl}), **seconds,
            samples_per_s=experience_global / sum(seconds.values()),
            tokens_per_s=response_tokens / seconds["generation_s"], actor_lr=self.actor.scheduler.get_last_lr()[0],
            ended_with_eos=eos / experience_global, reward_clipped_fraction=clipped / experience_global,
            **rollouts.metrics,
        )
        metrics.update(self.tool_metrics(rollouts))
        self.last_metrics = metrics
        last = step == self.total_iterations
        if step % config.tracking.log_interval == 0 or last or "eval_reward" in metrics:  # never drop an evaluation
            self.tracker.log(metrics, step=step)
        if config.sample_log_interval > 0 and (iteration % config.sample_log_interval == 0 or last):
            extra = dict(rollouts.extra or {})
            if rollouts.trajectories is not None:  # a tool rollout's turns, calls and results
                extra.setdefault("trajectory", [trajectory_text(t) for t in rollouts.trajectories])
            rows = [[prompt_text(p), r, float(s), *(extra[k][i] for k in extra)]
                    for i, (p, r, s) in enumerate(zip(rollouts.prompts[:4], rollouts.responses[:4],
                                                      exp.scores[:4].tolist()))]
            self.tracker.log_table("samples", [*SAMPLE_COLUMNS, *extra], rows, step=step)
        return metrics

    def tool_metrics(self, rollouts: Rollouts) -> dict[str, float]:
        """A tool rollout's counts (tool_calls, tool_calls_<status>, tool_turns, ...) summed over all
        ranks (a TP group's ranks ran the same calls: counted once); {} without tools."""
        names = sorted(k for k in rollouts.metrics if k.startswith("tool_"))
        if not names:
            return {}
        local = torch.tensor([rollouts.metrics[k] for k in names], dtype=torch.float64)
        totals = self.ctx.all_reduce_sum(local) / self.tp.size
        return dict(zip(names, totals.tolist()))

    def phase_gflop(self, rollouts: Rollouts) -> dict[str, float]:
        """The iteration's model GFLOPs per phase over all ranks (`<phase>_gflop`, rlhf.stages.throughput)."""
        if self.flop_models is None:
            return {}
        responses = rollouts.response_lengths
        prompts = rollouts.attention_mask.sum(-1) - responses
        work = IterationWork(self.group_size, self.shares_prompts, self.ran_old_logprob_forward,
                             self.config.ppo_epochs, self.critic is not None and self.keeps_critic_forward(len(rollouts)),
                             reference_forward=self.ref is not None)
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
