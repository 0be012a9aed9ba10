"""PPO's held-out evaluation: the held-out prompts answered greedily in rollout mode and scored by the
eval reward functions, before the first iteration, every --eval-interval iterations and after the last."""

from __future__ import annotations

import time

import torch

from rlhf.data.batching import pad_left
from rlhf.engine.rollout import rollout_mode
from rlhf.engine.sampling import SamplingParams
from rlhf.logging import get_logger
from rlhf.reward_batch import RewardBatch, prompt_text
from rlhf.reward_functions import RewardFunction, Score
from rlhf.stages.ppo.generation_phase import decode_responses
from rlhf.stages.tool_rollouts import ToolRollout, response_ids
from rlhf.stages.ppo.parts import Prompts

log = get_logger(__name__)

EVAL_SAMPLES_SHOWN = 4
"""Held-out answers per evaluation written to the `eval_samples` table (samples.jsonl, W&B)."""


class EvaluationPhase:
    """`evaluate_held_out` and when it runs."""

    # Set up by PPOTrainer (stages/ppo/loop.py): config, ctx, tp, actor, tokenizer, tracker, parity_tolerance,
    # eval_prompts (Prompts | None) and eval_functions (the loaded --eval-reward-fn, else --reward-fn, functions).
    eval_prompts: Prompts | None
    eval_functions: list[RewardFunction]

    @property
    def evaluates(self) -> bool:
        return self.eval_prompts is not None and bool(self.eval_functions)

    def eval_due(self, step: int) -> bool:
        """Evaluate after `step` iterations (0: before the first)? With --eval-interval N: at 0, every N
        and at the end; with 0: only at the end."""
        if not self.evaluates:
            return False
        interval = self.config.eval_interval
        return step == self.total_iterations or (interval > 0 and step % interval == 0)

    @torch.no_grad()
    def evaluate_held_out(self, step: int) -> dict[str, float]:
        """eval/<function> (its mean score over the held-out prompts that it scored), eval_reward (their
        sum) and eval_s, over all ranks: each TP group answers its share of the prompts greedily."""
        assert self.eval_prompts is not None
        started = time.perf_counter()
        prompts, tp = self.eval_prompts, self.tp
        mine = list(range(tp.group_index, len(prompts.ids), tp.num_groups))
        params = SamplingParams(
            max_new_tokens=self.config.eval_max_new_tokens or self.config.max_new_tokens, do_sample=False,
            eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
            kv_cache_dtype=self.config.kv_cache_dtype)
        batch = self.config.generation_batch_size * tp.size
        responses: list[str] = []
        completion_ids: list[list[int]] = []
        with rollout_mode(self.actor, tp.size, self.parity_tolerance, check_parity=False) as rollout:
            for start in range(0, len(mine), batch):
                rows = mine[start : start + batch]
                if self.tool_setup is not None:  # answered in turns, with the tools
                    tools = ToolRollout(self.tool_setup, self.tokenizer, [prompts.messages[i] for i in rows],
                                        [prompts.fields[i] for i in rows])
                    ids, mask = pad_left(tools.prompt_ids(), self.tokenizer.pad_token_id)
                    out = rollout.generate_turns(ids.to(self.ctx.device), mask.to(self.ctx.device), params, None,
                                                 tools.respond)
                    responses += tools.responses
                    completion_ids += response_ids(out)
                    continue
                ids, mask = pad_left([prompts.ids[i] for i in rows], self.tokenizer.pad_token_id)
                out = rollout.generate(ids.to(self.ctx.device), mask.to(self.ctx.device), params)
                responses += decode_responses(self.tokenizer, out.sequences, out.action_mask, out.prompt_length)
                completion_ids += response_ids(out)
        scores = self.score_held_out(step, mine, responses, completion_ids) if tp.rank_in_group == 0 else {}
        metrics = self.reduce_eval_scores(scores)
        metrics["eval_s"] = time.perf_counter() - started
        if tp.rank_in_group == 0 and self.ctx.rank == 0:
            self.log_eval_samples(step, mine, responses, scores)
        return metrics

    def score_held_out(self, step: int, rows: list[int], responses: list[str],
                       completion_ids: list[list[int]]) -> dict[str, list[Score]]:
        """Each eval function's scores of this TP group's answers."""
        assert self.eval_prompts is not None
        prompts = self.eval_prompts
        batch = RewardBatch([prompts.messages[i] for i in rows], responses, [prompts.fields[i] for i in rows],
                            [prompts.conversational[i] for i in rows], completion_ids,
                            self.reward_trainer_state(max(step - 1, 0)))
        return {fn.name: fn(batch) if rows else [] for fn in self.eval_functions}

    def reduce_eval_scores(self, scores: dict[str, list[Score]]) -> dict[str, float]:
        """Sums and counts of every function's scores over all ranks (one all-reduce; ranks other than
        a TP group's first add zeros), as means."""
        names = [fn.name for fn in self.eval_functions]
        local = []
        for name in names:
            values = [float(v) for v in scores.get(name, []) if v is not None]
            local += [sum(values), float(len(values))]
        totals = self.ctx.all_reduce_sum(torch.tensor(local, dtype=torch.float64)).tolist()
        metrics = {f"eval/{name}": totals[2 * k] / totals[2 * k + 1] if totals[2 * k + 1] else float("nan")
                   for k, name in enumerate(names)}
        metrics["eval_reward"] = sum(metrics.values())
        return metrics

    def log_eval_samples(self, step: int, rows: list[int], responses: list[str],
                         scores: dict[str, list[Score]]) -> None:
        """The first held-out answers with their scores, as the `eval_samples` table."""
        assert self.eval_prompts is not None
        names = list(scores)
        table = [[prompt_text(self.eval_prompts.messages[i]), response, *(scores[n][k] for n in names)]
                 for k, (i, response) in enumerate(zip(rows[:EVAL_SAMPLES_SHOWN], responses))]
        self.tracker.log_table("eval_samples", ["prompt", "response", *names], table, step=step)

    def log_initial_eval(self) -> None:
        """The held-out scores of the starting model, logged as step 0 (not again after a resume)."""
        if self.start_iteration == 0 and self.evaluates and self.config.eval_interval > 0:
            metrics = self.evaluate_held_out(0)
            log.info("ppo: held-out before training: %s", format_eval(metrics))
            self.tracker.log(metrics, step=0)


def format_eval(metrics: dict[str, float]) -> str:
    """'eval/larger_number 0.562 (128 prompts in 3.1 s)'-like text of an evaluation's metrics."""
    parts = [f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/")]
    return ", ".join(parts) + f" ({metrics.get('eval_s', 0.0):.1f} s)"
