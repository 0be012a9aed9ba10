"""`rlhf ppo`: PPO and the critic-free estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++) on prompts.

    rlhf ppo --actor runs/sft/model --reward runs/rm/model --data prompts.jsonl --output runs/ppo
    rlhf ppo --actor runs/sft/model --reward-fn sort --critic runs/sft/model ...        # verifiable reward
    rlhf ppo --actor runs/sft/model --reward-fn my_rewards.py:exact_match --advantage-estimator grpo \
        --samples-per-prompt 8 ...                                                      # GRPO, no critic
    rlhf ppo ... --nproc-per-node 2 --zero-stage 3 --inference-tp-size 2

Reads top to bottom: `run` checks the config (checks.py), claims the output folder and builds a `PPOTrainer` (loop.py)
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

from typing import Any

from rlhf.config import PPOConfig
from rlhf.engine.backends.registry import select_backend
from rlhf.engine.distributed import DistributedContext
from rlhf.stages.ppo.checks import check_batch_arithmetic, check_config, default_minibatch
from rlhf.stages.ppo.loop import PPOTrainer
from rlhf.stages.trainer import start_stage


def run(config: PPOConfig) -> dict[str, Any]:
    """Train the actor (and critic) with PPO; collective: every rank calls it. Returns the summary."""
    ctx = DistributedContext.initialize()
    select_backend(ctx.device, config.cpu, config.cuda)  # before check_config allocates: malloc tuning starts early
    functions, tools = check_config(config, ctx)
    config, output = start_stage(config, ctx, "ppo", **default_minibatch(config, ctx.world_size))  # resolved
    check_batch_arithmetic(config, ctx)
    trainer = PPOTrainer(config, ctx, output, functions, tools)
    trainer.train()
    return trainer.finish()


__all__ = ["PPOTrainer", "check_config", "default_minibatch", "run"]
