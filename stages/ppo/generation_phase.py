"""PPO's first phase: rollouts in rollout mode, scored by the reward sources (with dynamic sampling)."""

from __future__ import annotations

from typing import Any

import torch

from rlhf.algorithms.advantages import overlong_penalty, varied_groups
from rlhf.data.batching import pad_left
from rlhf.engine.prompt_sharing import response_prefix
from rlhf.engine.rollout import rollout_mode
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.reward_batch import RewardTrainerState, trainer_state
from rlhf.seeding import derive_seed, seeded_permutation
from rlhf.stages.experience import shaped_scores
from rlhf.stages.ppo.iteration_log import shown_values
from rlhf.stages.ppo.parts import timed
from rlhf.stages.reward_sources import rollout_batch
from rlhf.stages.tool_rollouts import ToolRollout
from rlhf.stages.rollouts import (
    Rollouts, gather_rollouts, global_scores, group_rows, iteration_slots, merge_rollouts, select_rows, unique_runs,
)

log = get_logger(__name__)


class GenerationPhase:
    """`collect_rollouts` and what it runs: the rollouts of one iteration, scored."""

    # The state these methods read is set up by PPOTrainer (stages/ppo/loop.py): config, ctx, actor,
    # critic, ref, reward, tokenizer, tracker, memory, ... (PPOTrainer.__init__ and build_models).

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
        each rank keeps its --generation-batch-size rows. With tools, the rollouts run turns
        (`generate_tool_rollouts`)."""
        if self.tool_setup is not None:
            return self.generate_tool_rollouts(prompt_rows, iteration, round_index)
        per_group = self.batch_per_rank * self.tp.size
        slots = iteration_slots(prompt_rows, self.group_size)
        group_slots = slots[self.tp.group_index * per_group : (self.tp.group_index + 1) * per_group]
        unique, counts = unique_runs(group_slots)
        ids, mask = pad_left([self.prompts.ids[i] for i in unique], self.tokenizer.pad_token_id)
        gen = self.rollout_generator(iteration, round_index)
        repeats = torch.tensor(counts, dtype=torch.long, device=self.ctx.device)
        check = round_index == 0 and (iteration == self.start_iteration or iteration % self.config.rollout_parity_every == 0)
        with rollout_mode(self.actor, self.tp.size, self.parity_tolerance, check) as rollout:
            out = rollout.generate(ids.to(self.ctx.device), mask.to(self.ctx.device), self.sampling, gen,
                                   samples_per_prompt=repeats)
            rollout_metrics = dict(rollout.metrics)
        mine = slice(self.tp.rank_in_group * self.batch_per_rank, (self.tp.rank_in_group + 1) * self.batch_per_rank)
        rows = group_slots[mine]
        sequences, action = out.sequences[mine], out.action_mask[mine]
        decoded = decode_responses(self.tokenizer, sequences, action, out.prompt_length)
        return Rollouts(sequences, out.attention_mask[mine], action, out.finished[mine],
                        [self.prompts.messages[i] for i in rows], decoded,
                        [self.prompts.fields[i] for i in rows], rollout_metrics, logprobs=out.logprobs[mine],
                        conversational=[self.prompts.conversational[i] for i in rows])

    def rollout_generator(self, iteration: int, round_index: int) -> torch.Generator:
        """The sampling stream of an iteration's round, the same on the ranks of a TP group."""
        purpose = ("rollout", iteration) if round_index == 0 else ("rollout_round", iteration, round_index)
        return torch.Generator(device=self.ctx.device).manual_seed(
            derive_seed(self.seed, purpose[0], *purpose[1:], self.tp.group_index))

    def generate_tool_rollouts(self, prompt_rows: list[int], iteration: int, round_index: int) -> Rollouts:
        """`generate_rollouts` with tools: each slot's prompt rendered with the tool schemas (after its
        environment's reset), a group's equal prompts prefilled once, then turns until every row
        answered without a call (stages/tool_rollouts.py); the trajectories go with the rollouts."""
        assert self.tool_setup is not None
        per_group = self.batch_per_rank * self.tp.size
        slots = iteration_slots(prompt_rows, self.group_size)
        group_slots = slots[self.tp.group_index * per_group : (self.tp.group_index + 1) * per_group]
        tools = ToolRollout(self.tool_setup, self.tokenizer, [self.prompts.messages[i] for i in group_slots],
                            [self.prompts.fields[i] for i in group_slots])
        unique, counts = unique_runs(tools.prompt_ids())
        ids, mask = pad_left(unique, self.tokenizer.pad_token_id)
        check = round_index == 0 and (iteration == self.start_iteration or iteration % self.config.rollout_parity_every == 0)
        with rollout_mode(self.actor, self.tp.size, self.parity_tolerance, check) as rollout:
            out = rollout.generate_turns(ids.to(self.ctx.device), mask.to(self.ctx.device), self.sampling,
                                         self.rollout_generator(iteration, round_index), tools.respond,
                                         torch.tensor(counts, dtype=torch.long, device=self.ctx.device))
            rollout_metrics = dict(rollout.metrics)
        mine = slice(self.tp.rank_in_group * self.batch_per_rank, (self.tp.rank_in_group + 1) * self.batch_per_rank)
        rows = group_slots[mine]
        rollout_metrics.update(tools.metrics(), tool_responses_cut=float(out.cut_appends))
        return Rollouts(out.sequences[mine], out.attention_mask[mine], out.action_mask[mine], out.finished[mine],
                        tools.prompts[mine], tools.responses[mine], [self.prompts.fields[i] for i in rows],
                        rollout_metrics, logprobs=out.logprobs[mine],
                        conversational=[self.prompts.conversational[i] for i in rows],
                        trajectories=tools.trajectories[mine],
                        environments=None if tools.environments is None else tools.environments[mine])

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


def decode_responses(tokenizer: Any, sequences: torch.Tensor, action_mask: torch.Tensor, prompt_length: int) -> list[str]:
    """Each row's response tokens (where `action_mask` holds, all from column `prompt_length` on)
    decoded without special tokens and stripped. The response columns move to the host once: a
    boolean index of each device row would read it back row by row."""
    ids, actions = sequences[:, prompt_length:].cpu(), action_mask[:, prompt_length:].cpu()
    decoded = tokenizer.batch_decode([row[keep] for row, keep in zip(ids, actions)], skip_special_tokens=True)
    return [text.strip() for text in decoded]
