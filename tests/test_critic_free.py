"""The critic-free estimators end to end: GRPO/RLOO/REINFORCE++ build no critic, a user reward
function raises its score, groups spanning ranks match one rank, dynamic sampling, the rollout
layout helpers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from rlhf.cli import main
from rlhf.stages.rollouts import Rollouts, group_rows, iteration_slots, merge_rollouts, select_rows, unique_runs
from tests.conftest import one_and_two_rank_metrics, read_metrics, run_cli, write_jsonl

ANSWER_REWARD = '''
def contains_answer(prompt: str, response: str, answer: str) -> float:
    """1 when the response contains the row's answer."""
    return float(answer in response)


def answer_share(prompt: str, response: str, answer: str) -> float:
    """The share of the response's characters that are in the answer: a dense reward."""
    return sum(c in answer for c in response) / max(len(response), 1)
'''


@pytest.fixture(scope="module")
def answer_prompts(tmp_path_factory) -> Path:
    rng = random.Random(0)
    rows = [{"prompt": "".join(rng.choice("bcdefgh") for _ in range(rng.randint(3, 8))), "answer": rng.choice("ab")}
            for _ in range(256)]
    return write_jsonl(tmp_path_factory.mktemp("grpo") / "prompts.jsonl", rows)


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fn") / "answer_reward.py"
    path.write_text(ANSWER_REWARD)
    return path


def grpo_args(model: Path, data: Path, reward_file: Path, out: Path, *extra: str) -> list[str]:
    return ["ppo", "--actor", str(model), "--reward-fn", f"{reward_file}:contains_answer", "--data", str(data),
            "--output", str(out), "--generation-batch-size", "16", "--samples-per-prompt", "8",
            "--max-new-tokens", "8", "--lr", "1e-2", "--lr-scheduler", "constant", "--report-to", "none",
            "--optimizer-impl", "torch", "--micro-batch-size", "16", *extra]


@pytest.mark.usefixtures("one_thread")
def test_grpo_user_function_raises_score_without_a_critic(tiny_model_dirs, answer_prompts, reward_file, tmp_path):
    out = tmp_path / "grpo"
    main(grpo_args(tiny_model_dirs["llama"], answer_prompts, reward_file, out, "--advantage-estimator", "grpo",
                   "--max-steps", "20", "--kl-coef", "0.01"))
    rows = read_metrics(out)
    first = sum(r["score_mean"] for r in rows[:4]) / 4
    final = sum(r["score_mean"] for r in rows[-4:]) / 4
    assert final > first + 0.2, (first, final)
    assert not (out / "critic").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["advantage_estimator"] == "grpo" and summary["samples_per_prompt"] == 8
    assert all(r["critic_s"] == 0.0 for r in rows)
    assert "value_loss" not in summary and "critic_grad_norm" not in summary
    assert "reward/contains_answer" in summary and "kl_loss" in summary


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp", "reinforce_pp_baseline", "dr_grpo"])
@pytest.mark.usefixtures("one_thread")
def test_each_critic_free_estimator_runs(tiny_model_dirs, answer_prompts, reward_file, tmp_path, estimator):
    out = tmp_path / estimator
    main(grpo_args(tiny_model_dirs["llama"], answer_prompts, reward_file, out, "--advantage-estimator", estimator,
                   "--max-steps", "2"))
    rows = read_metrics(out)
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["policy_loss"])) for r in rows)
    assert not (out / "critic").exists()


@pytest.mark.usefixtures("one_thread")
def test_dapo_options_run(tiny_model_dirs, answer_prompts, reward_file, tmp_path):
    """Clip-higher, dynamic sampling, overlong penalty and GSPO's sequence ratio together."""
    out = tmp_path / "dapo"
    main(grpo_args(tiny_model_dirs["llama"], answer_prompts, reward_file, out, "--advantage-estimator", "grpo",
                   "--max-steps", "2", "--clip-range-low", "0.2", "--clip-range-high", "0.28", "--dynamic-sampling",
                   "--overlong-buffer", "4", "--importance-ratio", "sequence", "--kl-placement", "reward"))
    rows = read_metrics(out)
    assert all(1 <= r["dynamic_sampling_rounds"] <= 4 for r in rows)
    assert all(0.0 <= r["dynamic_sampling_kept_fraction"] <= 1.0 for r in rows)
    assert "kl_loss" not in rows[0]


@pytest.mark.usefixtures("one_thread")
def test_on_policy_update_skips_the_old_logprob_pass_and_matches_it(tiny_model_dirs, answer_prompts, reward_file,
                                                                    tmp_path):
    """One epoch, one minibatch, no KL in the reward: the old log-probs are the trained forward's own.
    --adaptive-kl at coefficient 0 (which stays 0) forces the separate pass; both runs must agree."""
    common = ["--advantage-estimator", "grpo", "--max-steps", "2", "--kl-placement", "reward", "--kl-coef", "0"]
    model = tiny_model_dirs["llama"]
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "bcd" * (i % 3 + 1), "answer": "abcdefghijklm"}
                                                     for i in range(64)])
    for name, extra in (("fast", ["--log-kl"]), ("slow", ["--adaptive-kl"])):
        args = grpo_args(model, data, reward_file, tmp_path / name, *common, *extra)
        args[args.index("--reward-fn") + 1] = f"{reward_file}:answer_share"
        main(args)
    fast, slow = read_metrics(tmp_path / "fast"), read_metrics(tmp_path / "slow")
    for a, b in zip(fast, slow):
        for key in ("score_mean", "kl", "policy_loss", "actor_grad_norm", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
    assert fast[0]["actor_grad_norm"] > 0 and fast[1]["kl"] > 0  # it learned: the policy moved from the reference


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_no_kl_term_runs_no_reference_and_trains_the_same(tiny_model_dirs, reward_file, tmp_path, log_records,
                                                         placement):
    """At --kl-coef 0 the reference model is neither built nor run (no kl logged, no reference FLOPs);
    --log-kl builds it to measure the KL, and the trained weights are the same either way."""
    from safetensors.torch import load_file

    common = ["--advantage-estimator", "grpo", "--max-steps", "2", "--kl-coef", "0", "--kl-placement", placement,
              "--ppo-epochs", "2", "--micro-batch-size", "8"]
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "bcd" * (i % 3 + 1), "answer": "abcdefghijklm"}
                                                     for i in range(64)])
    for name, extra in (("without", []), ("with", ["--log-kl"])):
        args = grpo_args(tiny_model_dirs["llama"], data, reward_file, tmp_path / name, *common, *extra)
        args[args.index("--reward-fn") + 1] = f"{reward_file}:answer_share"
        main(args)
    assert sum("the reference model is neither loaded nor run" in r.getMessage() for r in log_records) == 1
    without, logged = read_metrics(tmp_path / "without"), read_metrics(tmp_path / "with")
    assert all("kl" not in r and "kl_loss" not in r for r in without)
    assert logged[1]["kl"] != 0.0  # the policy moved from the reference, and --log-kl measured it
    assert without[0]["experience_gflop"] < logged[0]["experience_gflop"]
    for a, b in zip(without, logged):
        for key in ("score_mean", "policy_loss", "actor_grad_norm", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    weights = [load_file(str(tmp_path / name / "model" / "model.safetensors")) for name in ("without", "with")]
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        torch.testing.assert_close(weights[0][key], weights[1][key], rtol=0, atol=0, msg=key)


@pytest.mark.usefixtures("one_thread")
def test_shared_prompt_forward_matches_the_plain_one(tiny_model_dirs, answer_prompts, reward_file, tmp_path):
    """--share-prompt-forward (the default) runs each group's prompt once in the actor's training
    forward and the reference's; the run must match --no-share-prompt-forward."""
    model = tiny_model_dirs["qwen2"]  # tied embeddings
    common = ["--advantage-estimator", "grpo", "--max-steps", "2", "--ppo-epochs", "2", "--micro-batch-size", "8"]
    # --share-prompt-min-gflop 0: a tiny model's forwards share whatever they save (the path under test)
    main(grpo_args(model, answer_prompts, reward_file, tmp_path / "shared", *common, "--share-prompt-min-gflop", "0"))
    main(grpo_args(model, answer_prompts, reward_file, tmp_path / "plain", *common, "--no-share-prompt-forward"))
    shared, plain = read_metrics(tmp_path / "shared"), read_metrics(tmp_path / "plain")
    for a, b in zip(shared, plain):
        for key in ("score_mean", "kl", "kl_loss", "policy_loss", "actor_grad_norm", "entropy", "approx_kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), key


def test_group_estimator_needs_groups(tiny_model_dirs, answer_prompts, reward_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(grpo_args(tiny_model_dirs["llama"], answer_prompts, reward_file, tmp_path / "x", "--advantage-estimator",
                       "grpo", "--samples-per-prompt", "1"))
    assert exc.value.code != 0
    assert "samples_per_prompt" in capsys.readouterr().err


def test_critic_free_refuses_a_critic(tiny_model_dirs, answer_prompts, reward_file, tmp_path, capsys):
    model = tiny_model_dirs["llama"]
    with pytest.raises(SystemExit) as exc:
        main(grpo_args(model, answer_prompts, reward_file, tmp_path / "x", "--advantage-estimator", "rloo",
                       "--critic", str(model)))
    assert exc.value.code != 0
    assert "--critic" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.usefixtures("cpu_only")
def test_groups_spanning_ranks_match_one_rank(tiny_model_dirs, answer_prompts, reward_file, tmp_path):
    """Group of 8 over a TP-2 pair of ranks (4 samples each) vs the same 8 on one rank: the group
    baseline is computed over the global batch, so the first iteration is the same."""
    args = grpo_args(tiny_model_dirs["llama"], answer_prompts, reward_file, tmp_path / "unused",
                     "--advantage-estimator", "grpo", "--max-steps", "1", "--seed", "3")
    args = args[: args.index("--output")] + args[args.index("--output") + 2 :]
    for flag in ("--generation-batch-size", "--micro-batch-size"):
        i = args.index(flag)
        del args[i : i + 2]
    one, two = one_and_two_rank_metrics(args, tmp_path)
    # Token means over the global batch (the losses are micro-batch means, which group differently).
    for key in ("score_mean", "score_std", "response_length", "kl", "advantage_mean", "advantage_std"):
        assert two[key] == pytest.approx(one[key], abs=1e-4), key
    assert one["advantage_std"] > 0.1  # the group really had different scores


@pytest.mark.slow
@pytest.mark.usefixtures("cpu_only")
def test_dynamic_sampling_on_two_ranks(tiny_model_dirs, answer_prompts, reward_file, tmp_path):
    """Groups of 4 over two ranks of 2 rows each (tp 1: each rank samples its half of a group):
    the kept groups are gathered from both ranks and dealt out again."""
    out = tmp_path / "two"
    args = grpo_args(tiny_model_dirs["llama"], answer_prompts, reward_file, out, "--advantage-estimator", "grpo",
                     "--max-steps", "2", "--dynamic-sampling", "--seed", "1")
    args[args.index("--generation-batch-size") + 1] = "2"
    args[args.index("--samples-per-prompt") + 1] = "4"
    args[args.index("--micro-batch-size") + 1] = "2"
    done = run_cli(args, nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(out)
    assert len(rows) == 2 and all(1 <= r["dynamic_sampling_rounds"] <= 4 for r in rows)
    assert all(r["dynamic_sampling_kept_fraction"] in (0.0, 1.0) for r in rows)  # one group per iteration


# ------------------------------------------------------------------ the layout helpers


def make_rollouts(width: int, rows: int, tag: int) -> Rollouts:
    seq = torch.full((rows, width), tag)
    return Rollouts(seq, torch.ones(rows, width, dtype=torch.long), torch.zeros(rows, width, dtype=torch.bool),
                    torch.ones(rows, dtype=torch.bool), [[{"role": "user", "content": str(tag)}]] * rows,
                    [f"r{tag}"] * rows, [{"i": tag}] * rows, {}, raw_scores=torch.full((rows,), float(tag)),
                    scores=torch.full((rows,), float(tag)), components={"f": torch.full((rows,), float(tag))},
                    clipped=torch.zeros(rows, dtype=torch.bool))


def test_slots_and_runs() -> None:
    slots = iteration_slots([5, 2, 7], 3)
    assert slots == [5, 5, 5, 2, 2, 2, 7, 7, 7]
    # A TP group's share may cut a group: rows 2..6 are one sample of 5, three of 2, one of 7.
    assert unique_runs(slots[2:7]) == ([5, 2, 7], [1, 3, 1])
    assert group_rows([0, 2], 3) == [0, 1, 2, 6, 7, 8]


def test_merge_pads_narrow_prompts_left_and_select_keeps_order() -> None:
    merged = merge_rollouts([make_rollouts(4, 2, 1), make_rollouts(6, 1, 2)], pad_token_id=0)
    assert merged.sequences.shape == (3, 6)
    assert merged.sequences[0].tolist() == [0, 0, 1, 1, 1, 1]
    assert merged.attention_mask[0].tolist() == [0, 0, 1, 1, 1, 1]
    assert merged.fields == [{"i": 1}, {"i": 1}, {"i": 2}]
    picked = select_rows(merged, [2, 0])
    assert picked.scores.tolist() == [2.0, 1.0] and picked.responses == ["r2", "r1"]
    assert picked.components["f"].tolist() == [2.0, 1.0] and picked.clipped.shape == (2,)
