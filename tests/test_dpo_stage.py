"""`rlhf dpo`: the shared-prompt forward equals two forwards, it learns a preference, 2 ranks equal
one, resume equals an uninterrupted run, precomputed reference log-probs, LoRA, SimPO, packing and
bad input.

Tiny Llama models built from configs, CPU only. The in-process runs share one 1-rank gloo group;
the 2-rank run is a torchrun subprocess.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from rlhf.cli import cli, main
from rlhf.config import DPOConfig, leaf_fields
from rlhf.data.batching import collate_preference
from rlhf.data.tasks import SortTask, build_preference_rows
from rlhf.engine.inference import causal_lm_logprobs
from rlhf.models.loading import load_tokenizer
from rlhf.models.tiny import save_tiny_model
from rlhf.stages.dpo import ForwardPlan, pair_logps, policy_logprobs
from rlhf.stages.reward import load_pair_rows

# --share-prompt-min-gflop 0: a tiny model's forwards share every pair's prompt (the path under test).
COMMON = ["--report-to", "none", "--optimizer-impl", "torch", "--dtype", "fp32", "--zero-stage", "3",
          "--share-prompt-min-gflop", "0"]
TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")

pytestmark = pytest.mark.usefixtures("one_thread", "cpu_only")


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(args: list[str]) -> dict[str, Any]:
    """`rlhf dpo ARGS` in this process; returns summary.json."""
    main(["dpo", *args, *COMMON])
    out = Path(args[args.index("--output") + 1])
    assert (out / "DONE").is_file()
    return json.loads((out / "summary.json").read_text())


def _train_rows(output: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def _train_metrics(output: Path, key: str) -> list[float]:
    return [r[key] for r in _train_rows(output)]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("dpo") / "base", "llama", seed=0,
                           hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def sort_pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    task = SortTask(min_len=3, max_len=5, alphabet="abcdefgh", mistakes=("swap", "unsorted", "repeat"))
    return _write_jsonl(tmp_path_factory.mktemp("data") / "sort_pairs.jsonl", build_preference_rows(task, 400, seed=0))


def _few(sort_pairs: Path, tmp_path: Path, n: int) -> Path:
    return _write_jsonl(tmp_path / "pairs.jsonl", [json.loads(line) for line in sort_pairs.read_text().splitlines()[:n]])


# ---------------------------------------------------------------- the forward


def _two_forward_logps(model: torch.nn.Module, rows: list[dict]) -> torch.Tensor:
    """The plain reference: each chosen and each rejected sequence alone through the model, its
    response tokens' log-probs summed ([2B]: chosen then rejected)."""
    sums = []
    for key in ("chosen_ids", "rejected_ids"):
        for row in rows:
            ids = torch.tensor([row[key]])
            logprobs, _ = causal_lm_logprobs(model, ids, torch.ones_like(ids))
            sums.append(logprobs[0, row["prompt_len"] - 1 :].sum())
    return torch.stack(sums)


def test_shared_prompt_forward_equals_two_forwards(base_model: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(5, 40, (n,), generator=generator).tolist()

    # Prompts of 1, 4 and 7 tokens, responses of unequal lengths (one response a single token).
    rows = []
    for prompt_len, chosen_len, rejected_len in ((4, 3, 5), (7, 1, 2), (1, 6, 3)):
        prompt = ids(prompt_len)
        rows.append({"prompt_len": prompt_len, "chosen_ids": prompt + ids(chosen_len),
                     "rejected_ids": prompt + ids(rejected_len)})
    batch = collate_preference(rows, pad_token_id=0)
    assert int(batch["response_start"]) == 7 and batch["input_ids"].shape == (6, 13)
    expected = _two_forward_logps(model, rows)
    grads = {}
    for share in (True, False):
        model.zero_grad()
        logps = pair_logps(policy_logprobs(model, batch, ForwardPlan(share, False)), batch["attention_mask"], 7)
        got = torch.cat([logps.chosen, logps.rejected])
        assert got.tolist() == pytest.approx(expected.tolist(), abs=2e-5), share
        assert logps.chosen_tokens.tolist() == [3, 1, 6] and logps.rejected_tokens.tolist() == [5, 2, 3]
        (got * torch.arange(1.0, 7.0)).sum().backward()
        grads[share] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert torch.allclose(grads[True], grads[False], atol=1e-5)


# ---------------------------------------------------------------- the stage


def test_learns_the_preference_with_trl_metrics(base_model: Path, sort_pairs: Path, tmp_path: Path) -> None:
    out = tmp_path / "dpo"
    summary = _run(["--model", str(base_model), "--data", str(sort_pairs), "--output", str(out),
                    "--eval-split", "0.2", "--micro-batch-size", "16", "--max-steps", "40", "--lr", "5e-3",
                    "--warmup-steps", "4", "--beta", "0.5"])
    assert summary["stage"] == "dpo" and summary["reference"].startswith("a frozen copy of")
    assert summary["train_rows"] == 320 and summary["eval_rows"] == 80
    rows = _train_rows(out)
    assert len(rows) == 40 and all(set(TRL_METRICS) <= row.keys() for row in rows)
    # Step 1: the policy is the reference, so every implicit reward is 0 and the loss log 2.
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[0]["rewards/chosen"] == pytest.approx(0.0, abs=1e-6) and rows[0]["rewards/accuracies"] == 0.0
    assert summary["eval_rewards/accuracies"] >= 0.9, summary
    assert summary["eval_rewards/margins"] > 0.5 and summary["eval_loss"] < 0.5 * math.log(2)

    # The exported folder is a plain HF causal LM whose margins over the reference are the summary's.
    model = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32).eval()
    config = DPOConfig(model=str(base_model), output=str(out))
    config.data.data, config.data.eval_split = [str(sort_pairs)], 0.2
    _, eval_rows, _ = load_pair_rows(config, load_tokenizer(str(out / "model")), 256, stage="dpo")
    with torch.no_grad():
        policy, ref = _two_forward_logps(model, eval_rows), _two_forward_logps(base, eval_rows)
    n = len(eval_rows)
    margins = 0.5 * ((policy[:n] - ref[:n]) - (policy[n:] - ref[n:]))
    assert margins.mean().item() == pytest.approx(summary["eval_rewards/margins"], abs=1e-3)


def test_two_ranks_match_one_rank(base_model: Path, sort_pairs: Path, tmp_path: Path) -> None:
    data = _few(sort_pairs, tmp_path, 48)
    args = ["--model", str(base_model), "--data", str(data), "--eval-split", "0.25", "--max-steps", "4",
            "--lr", "1e-2", "--lr-scheduler", "constant"]
    two = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLHF_FORCE_CPU": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "rlhf",
         "dpo", *args, "--output", str(two), "--micro-batch-size", "4", *COMMON],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary_two = json.loads((two / "summary.json").read_text())
    summary_one = _run([*args, "--output", str(tmp_path / "one"), "--micro-batch-size", "4", "--grad-accum", "2"])
    assert summary_two["world_size"] == 2 and summary_one["world_size"] == 1
    losses_two, losses_one = _train_metrics(two, "loss"), _train_metrics(tmp_path / "one", "loss")
    assert len(losses_one) == 4 and max(losses_one) - min(losses_one) > 1e-2
    assert losses_two == pytest.approx(losses_one, abs=1e-5)
    for key in TRL_METRICS:
        assert _train_metrics(two, key) == pytest.approx(_train_metrics(tmp_path / "one", key), abs=1e-4), key
    assert summary_two["eval_loss"] == pytest.approx(summary_one["eval_loss"], abs=1e-4)
    assert summary_two["local_parameters_rank0"] < summary_two["parameters"]  # ZeRO-3 sharded the policy


def test_resume_equals_the_uninterrupted_run(base_model: Path, sort_pairs: Path, tmp_path: Path) -> None:
    data = _few(sort_pairs, tmp_path, 64)
    args = ["--model", str(base_model), "--data", str(data), "--micro-batch-size", "8", "--lr", "1e-2",
            "--lr-scheduler", "constant", "--save-final-checkpoint"]
    _run([*args, "--output", str(tmp_path / "a"), "--max-steps", "4"])
    _run([*args, "--output", str(tmp_path / "b"), "--max-steps", "2"])
    _run([*args, "--output", str(tmp_path / "b"), "--max-steps", "4", "--resume"])
    assert _train_metrics(tmp_path / "b", "step") == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", *TRL_METRICS):
        assert _train_metrics(tmp_path / "b", key) == _train_metrics(tmp_path / "a", key), key
    assert (tmp_path / "b" / "model" / "model.safetensors").read_bytes() == \
        (tmp_path / "a" / "model" / "model.safetensors").read_bytes()


def test_precomputed_reference_logprobs_train_the_same(base_model: Path, sort_pairs: Path, tmp_path: Path) -> None:
    data = _few(sort_pairs, tmp_path, 64)
    args = ["--model", str(base_model), "--data", str(data), "--micro-batch-size", "8", "--max-steps", "4",
            "--lr", "1e-2", "--eval-split", "0.25"]
    live = _run([*args, "--output", str(tmp_path / "live")])
    pre = _run([*args, "--output", str(tmp_path / "pre"), "--precompute-ref-logprobs"])
    assert pre["reference"].startswith("precomputed from a frozen copy")
    assert _train_metrics(tmp_path / "pre", "loss") == pytest.approx(_train_metrics(tmp_path / "live", "loss"), abs=1e-6)
    assert pre["eval_loss"] == pytest.approx(live["eval_loss"], abs=1e-6)


def test_lora_reference_is_the_policy_with_adapters_off(base_model: Path, sort_pairs: Path, tmp_path: Path) -> None:
    data = _few(sort_pairs, tmp_path, 64)
    out = tmp_path / "lora"
    summary = _run(["--model", str(base_model), "--data", str(data), "--output", str(out), "--micro-batch-size", "8",
                    "--max-steps", "6", "--lr", "2e-2", "--lora-rank", "4", "--lora-target-modules", "all-linear"])
    assert summary["reference"] == "the policy with its LoRA adapters off"
    losses = _train_metrics(out, "loss")
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6) and losses[-1] < losses[0]
    assert summary["parameters"] > 0
    AutoModelForCausalLM.from_pretrained(out / "model")  # merged: a plain HF folder


def test_simpo_loads_no_reference(base_model: Path, sort_pairs: Path, tmp_path: Path, log_records: list) -> None:
    data = _few(sort_pairs, tmp_path, 32)
    summary = _run(["--model", str(base_model), "--data", str(data), "--output", str(tmp_path / "simpo"),
                    "--micro-batch-size", "8", "--max-steps", "3", "--loss-type", "simpo", "--beta", "2.0"])
    assert summary["reference"] == "none (reference-free loss)" and summary["loss_type"] == "simpo"
    assert not any("--ref" in r.getMessage() and "loaded" in r.getMessage() for r in log_records)
    # SimPO's rewards are beta x average log-prob, negative from the first step.
    assert _train_metrics(tmp_path / "simpo", "rewards/chosen")[0] < 0


def test_packed_forwards_train_the_same(base_model: Path, sort_pairs: Path, tmp_path: Path,
                                        log_records: list) -> None:
    data = _few(sort_pairs, tmp_path, 32)
    args = ["--model", str(base_model), "--data", str(data), "--micro-batch-size", "8", "--max-steps", "3",
            "--lr", "1e-2"]
    padded = _run([*args, "--output", str(tmp_path / "padded")])
    packed = _run([*args, "--output", str(tmp_path / "packed"), "--max-tokens-per-micro-batch", "4096"])
    assert any("packed forwards" in r.getMessage() and "dpo yes" in r.getMessage() for r in log_records)
    assert _train_metrics(tmp_path / "packed", "loss") == pytest.approx(_train_metrics(tmp_path / "padded", "loss"),
                                                                        abs=1e-5)
    assert packed["train_rewards/margins"] == pytest.approx(padded["train_rewards/margins"], abs=1e-4)


def test_bad_input_is_one_line(base_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = _write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "a"}] * 4)
    for extra, message in (
        ([], "prompts.jsonl row 0: a prompt-only row; rlhf dpo trains on preference pairs"),
        (["--loss-type", "hinge", "--label-smoothing", "0.1"], "label_smoothing 0.1 does not change loss_type hinge"),
        (["--label-smoothing", "0.5"], "0.5 must be"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["dpo", "--model", str(base_model), "--data", str(data), "--output", str(tmp_path / "o"), *extra,
                  *COMMON])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and message in err[-1], err[-1]
    assert not (tmp_path / "o" / "DONE").exists()


def test_help_explains_every_flag_and_names_the_papers() -> None:
    result = CliRunner().invoke(cli, ["dpo", "--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for info in leaf_fields(DPOConfig):
        flag = "--" + info.name.replace("_", "-")
        assert flag in text, flag
        assert info.doc and " ".join(info.doc.split())[:40] in text, flag
    for paper in ("2305.18290", "2310.12036", "2305.10425", "2403.00409", "2405.14734", "2408.06266"):
        assert paper in text, paper


def test_prompts_are_shared_only_where_that_saves_compute(base_model: Path) -> None:
    from types import SimpleNamespace

    from rlhf.stages.dpo import forward_plan

    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    rows = [{"prompt_len": 20, "chosen_ids": list(range(5, 25)) + [30, 31], "rejected_ids": list(range(5, 25)) + [32]}]
    batch = collate_preference(rows * 4, pad_token_id=0)
    ctx = SimpleNamespace(world_size=1, all_agree=lambda flag: flag)
    parameters = sum(p.numel() for p in model.parameters())  # ~30k: sharing 80 prompt tokens saves ~5 MFLOP
    default = DPOConfig()
    assert not forward_plan(model, batch, default, ctx, False, parameters).share  # type: ignore[arg-type]
    always = DPOConfig(share_prompt_min_gflop=0.0)
    assert forward_plan(model, batch, always, ctx, False, parameters).share  # type: ignore[arg-type]
    assert forward_plan(model, batch, default, ctx, False, 10**9).share  # type: ignore[arg-type]  # a 1B model
    never = DPOConfig(share_prompt_forward=False, share_prompt_min_gflop=0.0)
    assert not forward_plan(model, batch, never, ctx, False, 10**9).share  # type: ignore[arg-type]
