"""PPO's second phase: old and reference log-probs, the critic's values, rewards and advantages."""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

from rlhf.algorithms.advantages import group_baseline_scores
from rlhf.engine.micro_batches import column_span, forward_in_micro_batches
from rlhf.engine.packing import packed_logprobs, packed_values, packs_fewer_tokens
from rlhf.engine.prompt_sharing import (
    padded_forward_tokens, response_logprobs, response_prefix, shared_prompt_logprobs, sharing_pays,
)
from rlhf.logging import get_logger
from rlhf.stages.experience import Experience, build_experience
from rlhf.stages.ppo.parts import critic_values
from rlhf.stages.rollouts import Rollouts, global_scores

log = get_logger(__name__)


class ExperiencePhase:
    """`make_experience` and the forwards it runs over the rollouts."""

    # The state these methods read is set up by PPOTrainer (stages/ppo/loop.py): config, ctx, actor,
    # critic, ref, reward, tokenizer, tracker, memory, ... (PPOTrainer.__init__ and build_models).

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
    def score_policy(self, rollouts: Rollouts) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Old (actor) log-probs (None for an on-policy update), reference log-probs (None without a
        reference model) and the critic's values (None without a critic), in micro-batches."""
        seq, attn = rollouts.sequences, rollouts.attention_mask
        micro = self.config.engine.micro_batch_size
        start, share = response_prefix(rollouts.action_mask), self.shares_prompts
        old_logprobs = None
        self.ran_old_logprob_forward = False
        if not self.on_policy_update:
            self.actor.eval()  # only where its forward runs: an on-policy update's experience needs none
            if self.recompute_old_logprobs or self.rollout_is != "off" or rollouts.logprobs is None:
                old_logprobs = forward_in_micro_batches(
                    lambda s, m, lo: self.policy_forward(s, m, max(start - lo, 0), share)[0], seq, attn, micro,
                    sort=not share)
                self.ran_old_logprob_forward = True
            else:  # generation's: column t + 1's token log-prob is position t's (as the forward's [B, T-1])
                old_logprobs = rollouts.logprobs[:, 1:] * rollouts.action_mask[:, 1:]
        ref_logprobs = None
        if self.ref is not None:
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

    @functools.cached_property
    def shares_prompts(self) -> bool:
        """The actor and reference forwards run each sampled group's prompt once (--share-prompt-forward
        with --samples-per-prompt > 1; see engine/prompt_sharing.py), where a micro-batch's forward
        saves at least --share-prompt-min-gflop at the data's mean prompt length (the same on every rank)."""
        config = self.config
        if not (config.share_prompt_forward and self.group_size > 1):
            return False
        rows = config.engine.micro_batch_size
        mean_prompt = sum(map(len, self.prompts.ids)) / len(self.prompts.ids)
        saved = int(rows * mean_prompt * (1 - 1 / min(self.group_size, rows)))
        parameters = sum(p.numel() for p in self.actor.model.parameters())
        pays = sharing_pays(parameters, saved, config.share_prompt_min_gflop)
        if not pays:
            log.info("ppo: each row runs its prompt (a shared prompt would save %.3f GFLOP a forward of %d rows, "
                     "under --share-prompt-min-gflop %g)", 2e-9 * parameters * saved, rows, config.share_prompt_min_gflop)
        return pays

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
        rollout_logprobs = None  # generation's, aligned as the forward's, for the rollout importance weights
        if self.rollout_is != "off" and rollouts.logprobs is not None:
            rollout_logprobs = rollouts.logprobs[:, 1:] * rollouts.action_mask[:, 1:]
        return build_experience(
            rollouts.sequences, rollouts.attention_mask, rollouts.action_mask, old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs, values_full=values, raw_scores=rollouts.raw_scores, scores=scores,
            kl_coef=0.0 if config.kl_in_loss else self.kl_ctl.value, kl_kind=config.kl_kind, gamma=config.gamma,
            lam=config.lam, whiten_advantages=config.whiten_advantages and config.estimator.whitens_advantages,
            all_reduce=self.ctx.all_reduce_sum, rollout_logprobs=rollout_logprobs,
        )
