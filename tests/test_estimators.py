"""The advantage-estimator registry (rlhf/algorithms/estimators.py) is the one table the config,
the advantage functions, the stages and docs/algorithms.md agree with."""

from __future__ import annotations

import re
import typing

import pytest

from rlhf.algorithms.advantages import whitens_advantages
from rlhf.algorithms.estimators import ESTIMATORS, AdvantageEstimator, Estimator, get_estimator
from rlhf.config import E2EConfig, PPOConfig, coerce, fields_by_name
from rlhf.errors import UserError
from stages.e2e import reward_functions
from tests.conftest import REPO

NAMES = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")

# name: (needs_critic, needs_groups, whitened, KL placement, loss aggregation), the defaults before the registry.
DEFAULTS = {
    "gae": (True, False, True, "reward", "token-mean"),
    "grpo": (False, True, False, "loss", "token-mean"),
    "dr_grpo": (False, True, False, "loss", "seq-mean-token-sum-norm"),
    "rloo": (False, True, False, "reward", "token-mean"),
    "reinforce_pp": (False, False, True, "reward", "token-mean"),
    "reinforce_pp_baseline": (False, True, True, "reward", "token-mean"),
}


def _ppo(name: str, **kwargs: typing.Any) -> PPOConfig:
    return PPOConfig(advantage_estimator=name, samples_per_prompt=4, **kwargs)


def test_the_literal_is_the_registry_keys_in_order():
    assert typing.get_origin(AdvantageEstimator) is typing.Literal
    assert typing.get_args(AdvantageEstimator) == tuple(ESTIMATORS) == NAMES
    assert all(isinstance(e, Estimator) and e.name == name for name, e in ESTIMATORS.items())


@pytest.mark.parametrize("cls", [PPOConfig, E2EConfig])
def test_the_config_field_takes_the_registry_names(cls):
    info = fields_by_name(cls)["advantage_estimator"]
    assert typing.get_args(info.base_type) == tuple(ESTIMATORS)
    for name in ESTIMATORS:
        assert coerce(name, info.type, "--advantage-estimator") == name
    with pytest.raises(UserError, match="is not one of gae, grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline"):
        coerce("ppo", info.type, "--advantage-estimator")


def test_an_unknown_name_is_a_value_error_naming_the_choices():
    assert get_estimator("rloo") is ESTIMATORS["rloo"]
    with pytest.raises(ValueError, match="expected one of gae, grpo, dr_grpo"):
        get_estimator("nope")


@pytest.mark.parametrize("name", NAMES)
def test_each_estimator_keeps_its_defaults(name):
    e = ESTIMATORS[name]
    assert (e.needs_critic, e.needs_groups, e.whitens_advantages, e.kl_placement, e.loss_aggregation) == DEFAULTS[name]


@pytest.mark.parametrize("name", NAMES)
def test_ppo_config_resolves_the_registry_defaults(name):
    e, config = ESTIMATORS[name], _ppo(name)
    config.validate()
    assert config.estimator is e
    assert config.critic_free is not e.needs_critic
    assert config.kl_in_loss is (e.kl_placement == "loss")
    assert config.kl_kind == ("k3" if e.kl_placement == "loss" else "k1")
    assert config.loss_aggregation_mode == e.loss_aggregation
    assert whitens_advantages(name) is e.whitens_advantages
    # Explicit flags still win over the estimator's defaults.
    assert _ppo(name, kl_placement="reward").kl_in_loss is False
    assert _ppo(name, kl_placement="loss").kl_in_loss is True
    assert _ppo(name, loss_aggregation="seq-mean-token-mean").loss_aggregation_mode == "seq-mean-token-mean"
    sequence = _ppo(name, importance_ratio="sequence").loss_aggregation_mode
    assert sequence == ("seq-mean-token-mean" if e.loss_aggregation == "token-mean" else e.loss_aggregation)


@pytest.mark.parametrize("name", [n for n, e in ESTIMATORS.items() if e.needs_groups])
def test_a_group_estimator_with_one_sample_per_prompt_is_one_error_line(name):
    config = PPOConfig(advantage_estimator=name, samples_per_prompt=1)
    with pytest.raises(UserError) as err:
        config.validate()
    message = str(err.value)
    assert "\n" not in message
    assert message == (f"config: samples_per_prompt: 1 must be >= 2 with advantage_estimator {name} "
                       "(it compares a prompt's samples)")


@pytest.mark.parametrize("name", [n for n, e in ESTIMATORS.items() if not e.needs_groups])
def test_an_estimator_without_groups_takes_one_sample_per_prompt(name):
    PPOConfig(advantage_estimator=name, samples_per_prompt=1).validate()


def test_e2e_rewards_a_critic_free_estimator_with_the_task_checker():
    for name, e in ESTIMATORS.items():
        assert reward_functions(E2EConfig(advantage_estimator=name)) == ([] if e.needs_critic else ["sort"])


def _algorithms_table() -> dict[str, list[str]]:
    text = (REPO / "docs" / "algorithms.md").read_text()
    section = text[text.index("## Advantage estimators"):text.index("## Losses")]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(\w+)`( \(default\))?", cells[0]) if line.startswith("|") else None
        if match:
            rows[match.group(1)] = cells[1:]
    return rows


def test_docs_algorithms_table_is_the_registry():
    rows = _algorithms_table()
    assert list(rows) == list(ESTIMATORS), "docs/algorithms.md's estimator table must list every registry entry"
    yes = {True: "yes", False: "no"}
    for name, e in ESTIMATORS.items():
        expected = [e.baseline, yes[e.needs_critic], yes[e.needs_groups], yes[e.whitens_advantages],
                    e.kl_placement, e.loss_aggregation, e.paper]
        assert rows[name] == expected, f"docs/algorithms.md's row of {name} differs from the registry"
