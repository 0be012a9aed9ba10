"""PPO's third phase: ppo_epochs of clipped policy (and value) updates over minibatches, then the KL controller.

A micro-step reads nothing back to the host: its metrics stay device tensors, summed over the
iteration's micro-steps and read once, after the last optimizer step, in one all-reduce
(`UpdateMetrics`). The host reads that remain per micro-batch are the layout's (the columns a
micro-batch trims to and where its responses start), taken before its micro-step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from functools import partial

import torch

from rlhf.algorithms.losses import sft_loss_sum
from rlhf.algorithms.ppo_math import (
    kl_estimate, kl_loss, masked_mean, policy_loss, rollout_is_correction, rollout_is_ratio, value_loss,
)
from rlhf.data.batching import collate_sft
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.inference import micro_batch_slices
from rlhf.engine.micro_batches import micro_batch_weights, token_budget_micro_batches
from rlhf.engine.packing import packed_micro_batches, packing_unsupported_reason
from rlhf.seeding import derive_seed, seeded_permutation
from rlhf.stages.experience import Experience, mean_kl_per_sequence
from rlhf.stages.ppo.parts import MicroWeight, experience_response_start

# Per-micro-batch metrics (averaged over micro-batches); the rest of `update`'s sums are per step.
PER_MICRO_METRICS = ("policy_loss", "value_loss", "clipfrac", "approx_kl", "value_clipfrac", "entropy", "ptx_loss",
                     "kl_loss")
# The rollout importance weights' token sums (`rollout_is_sums`): ratios of them are logged, not means over steps.
ROLLOUT_IS_SUMS = ("rollout_is_ratio_sum", "rollout_is_capped", "rollout_is_tokens")
# Kept as the maximum over micro-steps and ranks, not summed.
MAX_METRICS = ("rollout_is_ratio_max",)


class UpdateMetrics:
    """An update's metrics while it runs: device tensors summed (or, for MAX_METRICS, maxed) over
    micro-steps with no host read, host floats (the engines' grad norms) summed beside them."""

    def __init__(self) -> None:
        self.device_sums: dict[str, torch.Tensor] = {}
        self.host_sums: dict[str, float] = {}
        self.maxima: dict[str, torch.Tensor] = {}

    def add(self, values: Mapping[str, torch.Tensor | float]) -> None:
        for key, value in values.items():
            if key in MAX_METRICS:
                held = self.maxima.get(key)
                self.maxima[key] = value.detach() if held is None else torch.maximum(held, value.detach())
            elif torch.is_tensor(value):
                value = value.detach().to(torch.float64)
                self.device_sums[key] = value if key not in self.device_sums else self.device_sums[key] + value
            else:
                self.host_sums[key] = self.host_sums.get(key, 0.0) + value

    def all_reduced(self, ctx: DistributedContext) -> tuple[dict[str, float], dict[str, float]]:
        """(sums over every rank, maxima over every rank) in one all-reduce and one host read: each
        rank writes its maxima into a slot of its own, so the sum of the slots holds every rank's."""
        device_keys, host_keys, max_keys = sorted(self.device_sums), sorted(self.host_sums), sorted(self.maxima)
        slots = torch.zeros(ctx.world_size, len(max_keys), dtype=torch.float64, device=ctx.device)
        if max_keys:
            slots[ctx.rank] = torch.stack([self.maxima[k].to(ctx.device, torch.float64) for k in max_keys])
        parts = [torch.stack([self.device_sums[k].to(ctx.device) for k in device_keys])] if device_keys else []
        parts.append(torch.tensor([self.host_sums[k] for k in host_keys], dtype=torch.float64, device=ctx.device))
        parts.append(slots.flatten())
        total = ctx.all_reduce_sum(torch.cat(parts)).tolist()
        sums = dict(zip(device_keys + host_keys, total))
        rank_maxima = [total[len(sums) + r * len(max_keys):len(sums) + (r + 1) * len(max_keys)]
                       for r in range(ctx.world_size)]
        return sums, {k: max(row[i] for row in rank_maxima) for i, k in enumerate(max_keys)}


class UpdatePhase:
    """`update` and its micro-steps (policy, value, KL, entropy and PTX losses)."""

    # The state these methods read is set up by PPOTrainer (stages/ppo/loop.py): config, ctx, actor,
    # critic, ref, reward, tokenizer, tracker, memory, ... (PPOTrainer.__init__ and build_models).

    def update(self, exp: Experience, iteration: int) -> dict[str, float]:
        """ppo_epochs passes over the experience in minibatches (one optimizer step of the actor, and
        of the critic when there is one, each), micro-batch by micro-batch; returns the mean losses
        over all ranks (and the rollout importance weights' statistics, `rollout_is_metrics`)."""
        config, micro = self.config, self.config.engine.micro_batch_size
        per_rank_minibatch = config.engine.train_batch_size // self.ctx.world_size
        for engine in self.engines.values():
            engine.train()
        metrics = UpdateMetrics()
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
                    start = experience_response_start(part.action_mask)  # the layout's host read, before the step
                    metrics.add(self.micro_step(part, ptx_seed, rows, weight, start))
                    micro_steps += 1
                for name, engine in self.engines.items():
                    started = time.perf_counter()
                    step = engine.step()
                    metrics.add({f"{name}_grad_norm": step.grad_norm})
                    if name == "critic":
                        self.critic_seconds += time.perf_counter() - started
                optimizer_steps = self.optimizer_steps_this_iteration = optimizer_steps + 1
        sums, maxima = metrics.all_reduced(self.ctx)
        world = self.ctx.world_size
        means = {k: v / world / max(micro_steps if k in PER_MICRO_METRICS else optimizer_steps, 1)
                 for k, v in sums.items() if k not in ROLLOUT_IS_SUMS}
        return {**means, **self.rollout_is_metrics(sums, maxima)}

    def rollout_is_metrics(self, sums: Mapping[str, float], maxima: Mapping[str, float]) -> dict[str, float]:
        """rollout_is_ratio_mean/_max over every rank's response tokens and the share of them the cap
        truncated (rollout_is_truncated_fraction) or masked (rollout_is_masked_fraction); {} when
        --rollout-is is off."""
        if "rollout_is_tokens" not in sums:
            return {}
        tokens = max(sums["rollout_is_tokens"], 1.0)
        share = "rollout_is_truncated_fraction" if self.rollout_is == "truncate" else "rollout_is_masked_fraction"
        return {"rollout_is_ratio_mean": sums["rollout_is_ratio_sum"] / tokens,
                "rollout_is_ratio_max": maxima["rollout_is_ratio_max"], share: sums["rollout_is_capped"] / tokens}

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
                   weight: MicroWeight = MicroWeight(1.0, 1.0), start: int | None = None) -> dict[str, torch.Tensor]:
        """Forward/backward of one micro-batch through the actor (policy loss, KL loss term, entropy
        bonus, PTX) and the critic (value loss), each term's mean weighted as `weight` says; its
        responses start at column `start` (None: found here, a host read). Returns the metrics as
        device tensors (nothing is read back to the host)."""
        # The critic first: a kept values graph (`keeps_critic_forward`) is freed before the actor's forward.
        start = experience_response_start(exp.action_mask) if start is None else start
        metrics = self.critic_micro_step(exp, rows, weight.tokens, start) if self.critic is not None else {}
        config, actor = self.config, self.actor
        aggregation, normalizer = config.loss_aggregation_mode, float(config.max_new_tokens)
        logprobs, entropy = self.policy_forward(exp.sequences, exp.attention_mask, start, self.shares_prompts,
                                                with_entropy=True)
        low, high = config.clip_bounds
        old_logprobs = exp.old_logprobs
        if old_logprobs is not None and self.optimizer_steps_this_iteration == 0:
            self.old_logprob_drift.add(logprobs.detach(), old_logprobs, exp.action_mask)
        if old_logprobs is None:  # on-policy: the rollout policy is this forward's (ratio 1, gradient kept)
            old_logprobs = logprobs.detach()
            if exp.ref_logprobs is not None:
                kl = kl_estimate(old_logprobs, exp.ref_logprobs, config.kl_kind) * exp.action_mask
                self.policy_kl_sum = self.policy_kl_sum + kl.sum().double()
        loss_mask, token_weights = exp.action_mask, None
        if self.rollout_is != "off" and exp.rollout_logprobs is not None:
            ratio = rollout_is_ratio(old_logprobs, exp.rollout_logprobs, exp.action_mask)
            token_weights, loss_mask, capped = rollout_is_correction(ratio, exp.action_mask, self.rollout_is,
                                                                     config.rollout_is_cap)
            metrics.update(rollout_is_sums(ratio, capped, exp.action_mask))
        p_loss, clipfrac, approx_kl = policy_loss(logprobs, old_logprobs, exp.advantages, loss_mask, low,
                                                  high, aggregation=aggregation, normalizer=normalizer,
                                                  ratio_level=config.importance_ratio, token_weights=token_weights)
        per_sample = weight.tokens if aggregation == "token-mean" else weight.rows
        loss = per_sample * p_loss
        metrics.update(clipfrac=clipfrac, approx_kl=approx_kl)
        if config.kl_in_loss and exp.ref_logprobs is not None:
            kl_term = kl_loss(logprobs, exp.ref_logprobs, exp.action_mask, config.kl_kind, aggregation, normalizer)
            loss = loss + per_sample * self.kl_ctl.value * kl_term
            metrics["kl_loss"] = kl_term.detach()
        entropy = masked_mean(entropy, exp.action_mask)
        if config.entropy_coef > 0:
            loss = loss - weight.tokens * config.entropy_coef * entropy
        if self.ptx_rows:
            ptx = self.ptx_loss(len(exp), ptx_seed, logprobs.device)
            loss = loss + weight.rows * config.ptx_coef * ptx
            metrics["ptx_loss"] = ptx.detach()
        actor.backward(loss)
        metrics.update(policy_loss=p_loss.detach(), entropy=entropy.detach())
        return metrics

    def critic_micro_step(self, exp: Experience, rows: torch.Tensor, weight: float = 1.0,
                          start: int | None = None) -> dict[str, torch.Tensor]:
        """The critic's clipped value loss on one micro-batch (the experience's `rows`, trimmed; its
        responses from column `start`), forward and backward; the forward is the experience pass's
        kept one when there is one. Returns the metrics as device tensors."""
        started = time.perf_counter()
        kept, self.kept_values = self.kept_values, None
        if kept is not None and kept.shape[1] == exp.sequences.shape[1] and kept.shape[0] == len(rows):
            values = kept.index_select(0, rows.to(kept.device))[:, :-1]
        else:
            if start is None:
                start = experience_response_start(exp.action_mask)
            share = start if self.shares_prompts else 0
            values = self.critic_forward(exp.sequences, exp.attention_mask, share)[:, :-1]
        v_loss, v_clipfrac = value_loss(values, exp.old_values, exp.returns, exp.action_mask,
                                        self.config.clip_range_value)
        self.critic.backward(weight * v_loss)
        self.critic_seconds += time.perf_counter() - started
        return {"value_loss": v_loss.detach(), "value_clipfrac": v_clipfrac}

    def ptx_loss(self, n: int, seed: int, device: torch.device) -> torch.Tensor:
        """InstructGPT's PPO-ptx term: the actor's token-mean LM loss on n seeded picks of --ptx-data."""
        picks = torch.randint(len(self.ptx_rows), (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        batch = collate_sft([self.ptx_rows[i] for i in picks], self.tokenizer.pad_token_id)
        logits = self.actor.model(input_ids=batch["input_ids"].to(device),
                                  attention_mask=batch["attention_mask"].to(device), use_cache=False).logits
        loss_sum, count = sft_loss_sum(logits, batch["labels"].to(device))
        return loss_sum / count.clamp(min=1)

    def update_kl_controller(self, exp: Experience) -> float | None:
        """Mean KL per sequence over all ranks (from the experience, or measured in an on-policy
        update), fed to the KL controller (adaptive KL moves its coefficient); None without a reference."""
        if exp.ref_logprobs is None:
            return None
        if exp.old_logprobs is None:
            kl = float(self.ctx.all_reduce_sum(self.policy_kl_sum)) / self.experience_size
        else:
            kl = float(self.ctx.all_reduce_sum(mean_kl_per_sequence(exp).detach().double())) / self.ctx.world_size
        self.kl_ctl.update(kl, self.experience_size)
        return kl


def rollout_is_sums(ratio: torch.Tensor, capped: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """One micro-batch's rollout importance weights as device sums (ROLLOUT_IS_SUMS) and their maximum
    over its response tokens (`UpdateMetrics` adds them up; `rollout_is_metrics` divides)."""
    mask = mask.bool()
    return {"rollout_is_ratio_sum": (ratio.double() * mask).sum(), "rollout_is_capped": capped.double().sum(),
            "rollout_is_tokens": mask.double().sum(),
            "rollout_is_ratio_max": torch.where(mask, ratio, 0.0).amax().double() if mask.numel() else
            ratio.new_zeros((), dtype=torch.float64)}
