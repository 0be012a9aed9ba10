"""The advantage estimators: one table, `ESTIMATORS`, that everything else reads.

Each entry says what its estimator is (its baseline, its paper) and what it implies for a run:
whether a critic is loaded and trained, whether it needs groups (--samples-per-prompt >= 2),
whether its advantages are whitened over the batch, where its KL to the reference goes and how
its per-token losses are aggregated when those flags are `auto`. The config (`PPOConfig`), the
pure advantage functions (`rlhf.algorithms.advantages`) and the stages ask the table, never a
list of names; a new estimator is one entry here (and its math in `group_baseline_scores` when
its baseline is new). docs/algorithms.md shows the table.

This module imports nothing heavy: `rlhf.config` reads it at import.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

AdvantageEstimator = Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
"""The --advantage-estimator choices, as the config machinery reads them (a real Literal); equal to
`ESTIMATORS`' keys, in the same order (checked below, at import)."""

Baseline = Literal["critic", "group mean", "group mean, std-normalised", "leave-one-out", "global whitening"]
"""What a score is compared with: the critic's values (GAE), the mean of its prompt's samples (with
GRPO's division by their std), the mean of its prompt's other samples, or only the batch-wide
whitening of the returns."""

KLDefault = Literal["reward", "loss"]
"""Where the KL to the reference goes with --kl-placement auto: a per-token reward penalty or a
loss term."""

LossAggregationMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
"""How per-token losses become one (`rlhf.algorithms.ppo_math.policy_loss`)."""

GROUP_BASELINES: tuple[Baseline, ...] = ("group mean", "group mean, std-normalised", "leave-one-out")
"""The baselines computed from a prompt's other samples: their estimators need groups."""


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator and the defaults it implies.

    `loss_aggregation` is the --loss-aggregation auto picks with the token importance ratio;
    token-mean gives way to seq-mean-token-mean with --importance-ratio sequence (GSPO's).
    """

    name: str
    baseline: Baseline
    needs_critic: bool
    """GAE alone: the others load, train and save no critic."""
    needs_groups: bool
    """The baseline comes from the other samples of the same prompt: --samples-per-prompt >= 2."""
    whitens_advantages: bool
    """The token advantages are whitened over the batch (with --whiten-advantages, on by default)."""
    kl_placement: KLDefault
    loss_aggregation: LossAggregationMode
    paper: str

    def __post_init__(self) -> None:
        assert self.needs_groups == (self.baseline in GROUP_BASELINES), self.name
        assert self.needs_critic == (self.baseline == "critic"), self.name


ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    Estimator("gae", "critic", needs_critic=True, needs_groups=False, whitens_advantages=True,
              kl_placement="reward", loss_aggregation="token-mean", paper="Schulman et al. 2016/2017"),
    Estimator("grpo", "group mean, std-normalised", needs_critic=False, needs_groups=True, whitens_advantages=False,
              kl_placement="loss", loss_aggregation="token-mean", paper="Shao et al. 2024, DeepSeekMath"),
    Estimator("dr_grpo", "group mean", needs_critic=False, needs_groups=True, whitens_advantages=False,
              kl_placement="loss", loss_aggregation="seq-mean-token-sum-norm",
              paper='Liu et al. 2025, "Understanding R1-Zero-Like Training" (Dr. GRPO)'),
    Estimator("rloo", "leave-one-out", needs_critic=False, needs_groups=True, whitens_advantages=False,
              kl_placement="reward", loss_aggregation="token-mean",
              paper='Ahmadian et al. 2024, "Back to Basics" (RLOO)'),
    Estimator("reinforce_pp", "global whitening", needs_critic=False, needs_groups=False, whitens_advantages=True,
              kl_placement="reward", loss_aggregation="token-mean", paper="Hu 2025, REINFORCE++"),
    Estimator("reinforce_pp_baseline", "group mean", needs_critic=False, needs_groups=True, whitens_advantages=True,
              kl_placement="reward", loss_aggregation="token-mean", paper="Hu 2025, REINFORCE++"),
)}
"""Every advantage estimator by name, `gae` (PPO with a critic, the default) first."""

assert typing.get_args(AdvantageEstimator) == tuple(ESTIMATORS), "AdvantageEstimator must list ESTIMATORS' keys"


def get_estimator(name: str) -> Estimator:
    """The registry's entry for `name`; a ValueError naming the choices for an unknown one."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        expected = ", ".join(ESTIMATORS)
        raise ValueError(f"unknown advantage estimator {name!r}; expected one of {expected}") from None
