"""`rlhf ppo` end to end: the score of an easy reward rises with bounded KL; 2 ranks with ZeRO-3
and a TP-2 rollout match world size 1 on the first iteration."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from rlhf.cli import main
from tests.conftest import one_and_two_rank_metrics, read_metrics, tiny_actor_and_reward, write_jsonl

LETTER_TASK = """
from rlhf.data.tasks import TASKS


class LetterA:
    '''Reward = share of 'a' characters in the response: trivially easy to raise.'''

    name = "letter_a"

    def score(self, prompt: str, response: str) -> float:
        return response.count("a") / max(len(response), 1)


TASKS["letter_a"] = LetterA
"""


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    rng = random.Random(0)
    rows = [{"prompt": "".join(rng.choice("bcdefgh") for _ in range(rng.randint(3, 8)))} for _ in range(256)]
    return write_jsonl(tmp_path_factory.mktemp("ppo") / "prompts.jsonl", rows)


@pytest.fixture(scope="module")
def letter_task(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "letter_task.py").write_text(LETTER_TASK)
    sys.path.insert(0, str(folder))
    import letter_task  # noqa: F401  (registers the task)

    return folder


def test_score_rises_while_kl_stays_bounded(tiny_model_dirs, prompts, letter_task, tmp_path):
    model = tiny_model_dirs["llama"]
    out = tmp_path / "ppo"
    # kl_coef 0.03, not 0.02: at 0.02 the max KL of this run crossed 20 on 5 of 11 random streams
    # (--seed 0..5, two seed derivations), so the test passed by the luck of the stream; at 0.03
    # seven streams all gave a score gain of 0.24-0.44 and a max KL of 8.9-13.7.
    main(["ppo", "--actor", str(model), "--critic", str(model), "--reward-fn", "letter_a", "--data", str(prompts),
          "--output", str(out), "--max-steps", "25", "--generation-batch-size", "16", "--max-new-tokens", "8",
          "--lr", "1e-2", "--critic-lr", "2e-3", "--kl-coef", "0.03", "--lr-scheduler", "constant",
          "--report-to", "none", "--optimizer-impl", "torch", "--micro-batch-size", "16"])
    rows = read_metrics(out)
    first = sum(r["score_mean"] for r in rows[:5]) / 5
    final = sum(r["score_mean"] for r in rows[-5:]) / 5
    assert final > first + 0.2, (first, final)
    # 8 tokens from a ~uniform 101-way policy: KL to the reference can reach ~8 x ln(101) = 37 when the
    # policy collapses; the penalty keeps it well below that.
    assert max(r["kl"] for r in rows) < 20.0
    # The rollout parity check: the first rollout, then every --rollout-parity-every (10) iterations.
    assert [i for i, r in enumerate(rows) if "rollout_parity_max_diff" in r] == [0, 10, 20]
    for name in ("model", "critic", "summary.json", "metrics.jsonl", "config.yaml", "DONE", "samples.jsonl"):
        assert (out / name).exists(), name
    summary = json.loads((out / "summary.json").read_text())
    for key in ("score_mean", "score_std", "reward_total", "kl", "entropy", "response_length", "clipfrac",
                "approx_kl", "policy_loss", "value_loss", "value_explained_variance", "generation_s",
                "training_s", "samples_per_s", "tokens_per_s"):
        assert key in summary, key


def test_two_ranks_zero3_tp2_match_world_size_one(tmp_path, prompts):
    actor, reward = tiny_actor_and_reward(tmp_path)
    args = ["ppo", "--actor", str(actor), "--reward", str(reward), "--data", str(prompts), "--max-steps", "1",
            "--max-new-tokens", "6", "--greedy", "--dtype", "fp32", "--zero-stage", "3", "--report-to", "none",
            "--optimizer-impl", "torch", "--lr", "1e-3", "--ppo-epochs", "2"]
    a, b = one_and_two_rank_metrics(args, tmp_path)
    for key in ("score_mean", "kl", "response_length", "reward_total", "value_loss", "policy_loss", "entropy"):
        assert b[key] == pytest.approx(a[key], abs=1e-5), key
    assert b["rollout_parity_max_diff"] < 1e-4


def test_resume_with_ema_ptx_and_adaptive_kl_continues_exactly(tiny_model_dirs, prompts, sft_data, letter_task,
                                                              tmp_path):
    """A run cut after iteration 2 and resumed logs the same iterations 3-4 as the uninterrupted one:
    the trainer's resume restores the engines, the adaptive KL coefficient and the actor's EMA."""
    import shutil

    import torch
    from safetensors.torch import load_file

    model = tiny_model_dirs["llama"]
    args = ["ppo", "--actor", str(model), "--reward-fn", "letter_a", "--critic", str(model),
            "--data", str(prompts), "--max-steps", "4", "--save-interval", "2", "--keep-checkpoints", "3",
            "--generation-batch-size", "8", "--micro-batch-size", "4", "--max-new-tokens", "6", "--lr", "1e-2",
            "--ema-decay", "0.5", "--ptx-data", str(sft_data), "--ptx-coef", "0.5", "--adaptive-kl",
            "--kl-target", "0.01", "--kl-horizon", "100", "--report-to", "none", "--optimizer-impl", "torch",
            "--lr-scheduler", "constant", "--sample-log-interval", "0"]
    full = tmp_path / "full"
    main([*args, "--output", str(full)])
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for name in ("model", "critic", "model_ema", "DONE", "summary.json"):
        path = cut / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    shutil.rmtree(cut / "checkpoints" / "step_00000004")
    (cut / "checkpoints" / "latest").write_text("step_00000002")
    main([*args, "--output", str(cut), "--resume"])
    a, b = read_metrics(full), read_metrics(cut)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for key in ("score_mean", "kl", "kl_coef", "policy_loss", "value_loss", "ptx_loss", "response_length"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], abs=1e-6), key
    assert a[-1]["kl_coef"] != a[0]["kl_coef"]  # adaptive KL moved, and resumed where it was
    assert a[-1]["ptx_loss"] > 0
    for name in ("model", "model_ema"):
        x, y = load_file(full / name / "model.safetensors"), load_file(cut / name / "model.safetensors")
        assert all(torch.equal(x[k], y[k]) for k in x), name
    ema, actor = load_file(full / "model_ema" / "model.safetensors"), load_file(full / "model" / "model.safetensors")
    assert any(not torch.equal(ema[k], actor[k]) for k in actor)  # the EMA lags the actor
