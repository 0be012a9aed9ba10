"""The preference loss types' names and properties, without torch: the config reads them
(`rlhf --help` imports no torch); the losses themselves are rlhf/algorithms/preference.py."""

from __future__ import annotations

from typing import Literal

PreferenceLoss = Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "apo_zero"]

LOSS_PAPERS: dict[str, str] = {
    "sigmoid": "DPO, Rafailov et al. 2023, arXiv:2305.18290 (with --label-smoothing: cDPO, Mitchell 2023)",
    "ipo": "IPO, Azar et al. 2023, arXiv:2310.12036",
    "hinge": "SLiC-HF, Zhao et al. 2023, arXiv:2305.10425",
    "robust": "robust DPO, Chowdhury et al. 2024, arXiv:2403.00409",
    "simpo": "SimPO, Meng et al. 2024, arXiv:2405.14734 (no reference model)",
    "apo_zero": "APO-zero, D'Oosterlinck et al. 2024, arXiv:2408.06266",
}
"""Each loss type's paper, for --help and the docs."""

REFERENCE_FREE: frozenset[str] = frozenset({"simpo"})
"""Loss types that never read a reference model's log-probs."""

LABEL_SMOOTHED: frozenset[str] = frozenset({"sigmoid", "robust", "simpo"})
"""Loss types that --label-smoothing changes."""
