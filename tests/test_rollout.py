"""Hybrid engine rollout mode: FSDP2 ZeRO-3 training shards -> tensor-parallel generation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO


@pytest.fixture(scope="module")
def peaky_model(tmp_path_factory) -> Path:
    """A tiny Llama whose next-token distributions are peaked, so greedy decoding is stable
    under the reduction-order differences of tensor parallelism."""
    from rlhf.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model("llama", tok, seed=0, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    path = tmp_path_factory.mktemp("peaky") / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def run_worker(model: Path, out: Path, nproc: int, tp: int, zero_stage: int = 3) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(REPO / "tests" / "rollout_worker.py"), "--model", str(model), "--out", str(out),
           "--tp", str(tp), "--zero-stage", str(zero_stage)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_zero3_shards_to_tp2_rollout_matches_world_size_one(peaky_model, tmp_path):
    single = run_worker(peaky_model, tmp_path / "one.json", nproc=1, tp=1)
    tp2 = run_worker(peaky_model, tmp_path / "two.json", nproc=2, tp=2)
    dp2 = run_worker(peaky_model, tmp_path / "dp2.json", nproc=2, tp=1)
    assert tp2["sequences"] == single["sequences"]
    assert dp2["sequences"] == single["sequences"]
    for run in (single, tp2, dp2):
        assert run["unchanged"], "training params changed in rollout mode"
        assert run["parity"] < 1e-4
        assert run["caught"], "corrupted rollout weights were not caught by the parity check"
        assert run["released"], "the rollout model's storage outlived rollout mode"
        assert run["reused"] and run["restored"], "the kept skeleton was rebuilt, or kept stale weights"
    assert any(any(row) for row in single["action_mask"])


def test_tp_coordinates_group_consecutive_ranks_and_check_the_world_size() -> None:
    from rlhf.engine.distributed import DistributedContext, TPCoordinates
    from rlhf.errors import UserError

    ctx = DistributedContext(rank=5, local_rank=1, world_size=8, device=torch.device("cpu"), backend="gloo")
    assert ctx.tp_coordinates(4) == TPCoordinates(size=4, group_index=1, rank_in_group=1, num_groups=2)
    assert ctx.tp_coordinates(2) == TPCoordinates(size=2, group_index=2, rank_in_group=1, num_groups=4)
    assert ctx.tp_coordinates(1) == TPCoordinates(size=1, group_index=5, rank_in_group=0, num_groups=8)
    for bad in (0, 3, 16):
        with pytest.raises(UserError, match=r"--inference-tp-size .* world size 8"):
            ctx.tp_coordinates(bad)
    with pytest.raises(UserError, match="--inference-tp-size"):  # the mesh asks the same place
        ctx.tp_mesh(3)


def test_sharding_plan_is_the_one_meaning_of_a_zero_stage() -> None:
    from rlhf.engine.sharding import ShardingPlan, sharding_plan

    assert sharding_plan(3) == ShardingPlan(3, "shard", reshard_after_forward=True, sync_grads_every_micro_step=True)
    for stage in (1, 2):
        assert sharding_plan(stage) == ShardingPlan(stage, "shard", False, False)
    assert sharding_plan(0) == ShardingPlan(0, "replicate", False, False)
    # A frozen model has nothing but params to shard: stage 0 shards them like stage 3.
    assert sharding_plan(0, trainable=False) == sharding_plan(3)
    assert sharding_plan(2, trainable=False) == sharding_plan(2)
    with pytest.raises(ValueError, match="ZeRO stage"):
        sharding_plan(4)
