"""The batch arithmetic, resolved once (rlhf.engine.batch_size.resolved_batch): pure, with one error
line per conflict, PPO's default minibatch passed in, and the same resolution in `rlhf plan` and in
start_stage (whose resolved config a resume compares with the resolved one the run saved)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from rlhf.config import PPOConfig, SFTConfig
from rlhf.engine.batch_size import is_resolved, resolved_batch
from rlhf.engine.config import EngineConfig
from rlhf.engine.distributed import DistributedContext
from rlhf.errors import UserError
from rlhf.output_lock import release_output
from rlhf.outputs import config_as_saved, resume_config_changes, write_config
from rlhf.stages.plan import plan_config
from rlhf.stages.ppo import default_minibatch
from rlhf.stages.trainer import start_stage


def sizes(config: EngineConfig) -> tuple[int | None, int | None, int | None]:
    return config.micro_batch_size, config.grad_accum, config.train_batch_size


@pytest.mark.parametrize("given, dp, want", [
    (dict(micro_batch_size=4, train_batch_size=32), 2, (4, 4, 32)),  # grad_accum derived
    (dict(micro_batch_size=4, grad_accum=3), 2, (4, 3, 24)),  # train_batch_size derived
    (dict(micro_batch_size=4), 3, (4, 1, 12)),  # neither: one micro-batch per rank
    (dict(micro_batch_size=2, grad_accum=2, train_batch_size=8), 2, (2, 2, 8)),  # both, and they agree
])
def test_resolution_is_pure(given, dp, want):
    config = EngineConfig(**given, lr=3e-4)
    before = copy.deepcopy(config)
    resolved = resolved_batch(config, dp)
    assert sizes(resolved) == want and is_resolved(resolved)
    assert config == before and resolved is not config  # the input is left as it was
    assert dataclasses.replace(resolved, micro_batch_size=config.micro_batch_size, grad_accum=config.grad_accum,
                               train_batch_size=config.train_batch_size) == config  # nothing else changed
    assert resolved_batch(resolved, dp) == resolved  # resolving a resolved config changes nothing


@pytest.mark.parametrize("given, where, message", [
    (dict(micro_batch_size=4, grad_accum=2, train_batch_size=30), "sft",
     "sft: train_batch_size 30 != micro_batch_size 4 x grad_accum 2 x data-parallel size 2 = 16; make them agree "
     "(or leave one of train_batch_size / grad_accum unset)"),
    (dict(micro_batch_size=4, train_batch_size=30), "plan",
     "plan: train_batch_size 30 is not divisible by micro_batch_size 4 x data-parallel size 2; change "
     "train_batch_size or micro_batch_size"),
])
def test_conflicts_fail_with_one_line(given, where, message):
    config = EngineConfig(**given)
    before = copy.deepcopy(config)
    with pytest.raises(UserError) as raised:
        resolved_batch(config, 2, where=where)
    assert str(raised.value) == message
    assert config == before


@pytest.mark.parametrize("flags, world, want", [
    (dict(micro_batch_size=16), 2, (8, 1, 16)),  # the whole experience, micro-batches of at most a rollout batch
    (dict(micro_batch_size=4), 2, (4, 2, 16)),
    (dict(micro_batch_size=16, grad_accum=2), 2, (16, 2, 64)),  # --grad-accum: no default, micro kept
    (dict(micro_batch_size=4, train_batch_size=8), 2, (4, 1, 8)),  # --train-batch-size: no default
])
def test_ppo_default_minibatch(flags, world, want):
    config = PPOConfig(generation_batch_size=8, engine=EngineConfig(**flags))
    before = copy.deepcopy(config)
    assert default_minibatch(config, world) == {"default_train_batch": 8 * world, "max_micro": 8}
    resolved = resolved_batch(config.engine, world, **default_minibatch(config, world), where="ppo")
    assert sizes(resolved) == want
    planned = plan_config("ppo", config, world)  # `rlhf plan ppo` resolves it the same way
    assert planned.engine == resolved and planned.generation_batch_size == 8
    assert config == before


def test_ppo_default_keeps_the_batch_rule():
    """A rollout batch the micro-batch does not divide fails as an explicit --train-batch-size would."""
    config = PPOConfig(generation_batch_size=6, engine=EngineConfig(micro_batch_size=4))
    with pytest.raises(UserError, match="ppo: train_batch_size 6 is not divisible by micro_batch_size 4 x "
                                        "data-parallel size 1"):
        resolved_batch(config.engine, 1, **default_minibatch(config, 1), where="ppo")


def test_plan_resolves_as_the_stage_does():
    config = SFTConfig(engine=EngineConfig(micro_batch_size=2, train_batch_size=16))
    planned = plan_config("sft", config, 4)
    assert sizes(planned.engine) == (2, 2, 16) and config.engine.grad_accum is None


def test_start_stage_returns_the_resolved_config_and_a_resume_compares_resolved(tmp_path: Path):
    ctx = DistributedContext.initialize()
    out = tmp_path / "run"
    config = PPOConfig(output=str(out), generation_batch_size=8, engine=EngineConfig(micro_batch_size=16))
    before = copy.deepcopy(config)
    resolved, output = start_stage(config, ctx, "ppo", **default_minibatch(config, ctx.world_size))
    try:
        assert output == out and config == before
        assert sizes(resolved.engine) == (8, 1, 8 * ctx.world_size)
        write_config(output, resolved)  # as open_run saves it: the resolved values
    finally:
        release_output(output)
    saved = config_as_saved(resolved)
    assert saved["engine"]["grad_accum"] == 1 and saved["engine"]["train_batch_size"] == 8 * ctx.world_size
    assert resume_config_changes(saved, config)  # the unresolved config would differ from the saved one ...
    again = dataclasses.replace(config, resume=True)
    resumed, _ = start_stage(again, ctx, "ppo", **default_minibatch(again, ctx.world_size))  # ... the resolved not
    release_output(output)
    assert resumed.engine == resolved.engine and not resume_config_changes(saved, resumed)


def test_train_engine_reads_the_resolved_config_and_changes_nothing():
    from torch import nn

    from rlhf.engine.train_engine import TrainEngine

    ctx = DistributedContext.initialize()
    with pytest.raises(ValueError, match="resolve the config first"):
        TrainEngine(nn.Linear(2, 2), EngineConfig(dtype="fp32", micro_batch_size=2, train_batch_size=8), ctx, 1)
    config = resolved_batch(EngineConfig(dtype="fp32", optimizer_impl="torch", micro_batch_size=2,
                                         train_batch_size=4 * ctx.world_size), ctx.world_size)
    before = copy.deepcopy(config)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(2, 2)])
    engine = TrainEngine(model, config, ctx, total_steps=1)
    assert engine.grad_accum == 2 and engine.config == before
