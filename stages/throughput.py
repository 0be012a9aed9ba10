"""The model FLOPs of one RL iteration, per phase, from its real token counts.

`rlhf ppo` logs them every iteration (`<phase>_gflop`, summed over ranks) beside the phase's
seconds, so achieved FLOP/s per phase, and how far a run is from the compute bound
(`scripts/bench_ppo.py`'s compute_bound_fraction), follow from metrics.jsonl alone. The counting
rules (real tokens only, causal attention pairs, LM head where a logit is read, backward = 2x
forward) are engine/flops.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlhf.engine.flops import (
    TransformerShape, decode_flops, forward_flops, prefill_flops, training_flops,
)

PHASES = ("prefill", "decode", "reward", "experience", "training")


@dataclass(frozen=True)
class IterationModels:
    """The shapes of the models an iteration runs (None: that model is absent)."""

    actor: TransformerShape
    critic: TransformerShape | None
    reward: TransformerShape | None
    """The reward model (None when only reward functions score; a re-tokenising reward model is
    counted on the actor's token counts, an approximation)."""


@dataclass(frozen=True)
class IterationWork:
    """What the iteration ran, beyond its token counts."""

    samples_per_prompt: int
    shared_prompt: bool
    """The actor and reference forwards run each group's prompt once."""
    old_logprob_forward: bool
    """The experience pass ran the actor for the rollout log-probs (else they came from
    generation, or the update was on-policy)."""
    ppo_epochs: int
    critic_forward_kept: bool = False
    """The experience pass's critic forward was the training forward (its graph kept): the
    training phase ran the critic's backward only."""
    reference_forward: bool = True
    """The experience pass ran the reference model (not without a KL term)."""


def iteration_models(actor: Any, critic: Any | None, reward: Any | None) -> IterationModels | None:
    """From the models' configs; None (no FLOP metrics) when one of them is not a decoder whose
    sizes engine/flops.py can read."""
    try:
        return IterationModels(TransformerShape.from_config(actor),
                               TransformerShape.from_config(critic) if critic is not None else None,
                               TransformerShape.from_config(reward) if reward is not None else None)
    except (ValueError, TypeError):
        return None


def iteration_flops(models: IterationModels, work: IterationWork, prompt_lens: Sequence[int],
                    response_lens: Sequence[int]) -> dict[str, int]:
    """FLOPs of each phase in PHASES for these rows (this rank's)."""
    shared = work.samples_per_prompt if work.shared_prompt else 1
    actor_forward = forward_flops(models.actor, prompt_lens, response_lens, "lm", shared)
    flops = {
        "prefill": prefill_flops(models.actor, prompt_lens, work.samples_per_prompt),
        "decode": decode_flops(models.actor, prompt_lens, response_lens),
        # The experience pass runs the reference (the actor's architecture) when a KL term needs it.
        "reward": 0, "experience": actor_forward if work.reference_forward else 0, "training": work.ppo_epochs * training_flops(actor_forward),
    }
    if models.reward is not None:
        flops["reward"] = forward_flops(models.reward, prompt_lens, response_lens, "value")
    if work.old_logprob_forward:
        flops["experience"] += actor_forward
    if models.critic is not None:
        critic_forward = forward_flops(models.critic, prompt_lens, response_lens, "value")
        flops["experience"] += critic_forward
        flops["training"] += work.ppo_epochs * training_flops(critic_forward) - (
            critic_forward if work.critic_forward_kept else 0)
    return flops


__all__ = ["PHASES", "IterationModels", "IterationWork", "iteration_flops", "iteration_models"]
