"""Tied input/output embeddings (Qwen2, SmolLM2, Llama-3.2, Gemma...) through every stage.

A tied model has one Parameter behind `embed_tokens` and `lm_head`: FSDP2 must shard it once,
rollout mode must re-tie it after `to_empty` (it used to crash with KeyError 'lm_head.weight'),
export must write it once (or twice with equal values), and resume must restore it. Tiny Llama
(tied here by option; Llama-3.2 and SmolLM2 tie) and Qwen2 (ties by default) run sft -> reward ->
ppo through the CLI, then resume, then a 2-rank TP-2 rollout.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rlhf.cli import main
from rlhf.data.tasks import SortTask
from rlhf.models.tiny import save_tiny_model, tiny_config
from tests.conftest import one_and_two_rank_metrics, read_metrics, train_losses, write_jsonl

FAMILIES = ["llama", "qwen2"]
FAST = ["--report-to", "none", "--optimizer-impl", "torch", "--dtype", "fp32", "--zero-stage", "3",
        "--lr-scheduler", "constant"]
PPO_ARGS = ["--max-new-tokens", "6", "--generation-batch-size", "4", "--micro-batch-size", "4", "--lr", "1e-3",
            "--ppo-epochs", "1", "--greedy"]


pytestmark = pytest.mark.usefixtures("one_thread", "cpu_only")


@pytest.fixture(scope="module")
def tied_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tied")
    return {family: save_tiny_model(root / family, family, hidden_size=32, num_layers=2, num_heads=4,
                                    num_kv_heads=2, tie_word_embeddings=True) for family in FAMILIES}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The built-in sort task: its checker is PPO's --reward-fn where no reward model is wanted."""
    root = tmp_path_factory.mktemp("tied-data")
    task, rng = SortTask(), random.Random(0)
    prompts = [task.sample_prompt(rng) for _ in range(64)]
    sft = [{"prompt": p, "response": task.correct_response(p)} for p in prompts]
    pairs = [{"prompt": p, "chosen": task.correct_response(p), "rejected": task.wrong_response(p, rng)} for p in prompts]
    return {"sft": write_jsonl(root / "sft.jsonl", sft), "pairs": write_jsonl(root / "pairs.jsonl", pairs),
            "prompts": write_jsonl(root / "prompts.jsonl", [{"prompt": p} for p in prompts])}


def assert_tied_export(folder: Path) -> torch.Tensor:
    """The folder says it ties, reloads tied, and stores one embedding (or two equal ones)."""
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
        if "lm_head.weight" in keys:
            assert torch.equal(f.get_tensor("lm_head.weight"), embed)
    return embed


def cut_back(run: Path, copy: Path, step: int) -> Path:
    """A copy of a finished run as if killed right after step `step`'s checkpoint."""
    shutil.copytree(run, copy)
    for name in ("model", "critic", "DONE", "summary.json"):
        path = copy / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    keep = f"step_{step:08d}"
    for ckpt in (copy / "checkpoints").glob("step_*"):
        if ckpt.name > keep:
            shutil.rmtree(ckpt)
    (copy / "checkpoints" / "latest").write_text(keep)
    return copy


def test_tiny_config_ties_on_request() -> None:
    for family in ("llama", "qwen2", "mistral", "opt", "gpt2"):
        assert tiny_config(family, 50, tie_word_embeddings=True).tie_word_embeddings is True
        assert tiny_config(family, 50, tie_word_embeddings=False).tie_word_embeddings is False
    # Family defaults are kept: Llama and Mistral untied, Qwen2 / OPT / GPT-2 tied.
    assert [tiny_config(f, 50).tie_word_embeddings for f in ("llama", "qwen2", "mistral", "opt", "gpt2")] == [
        False, True, False, True, True]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_stage_keeps_embeddings_tied(family: str, tied_models, data, tmp_path: Path) -> None:
    base = tied_models[family]
    base_embed = assert_tied_export(base)
    sft, rm, ppo = tmp_path / "sft", tmp_path / "rm", tmp_path / "ppo"
    main(["sft", "--model", str(base), "--data", str(data["sft"]), "--output", str(sft), "--max-steps", "4",
          "--micro-batch-size", "8", "--lr", "3e-3", *FAST])
    sft_embed = assert_tied_export(sft / "model")
    assert not torch.equal(sft_embed, base_embed), "SFT did not train the shared embedding"
    main(["reward", "--model", str(sft / "model"), "--data", str(data["pairs"]), "--output", str(rm),
          "--max-steps", "3", "--micro-batch-size", "8", "--lr", "1e-3", *FAST])
    assert (rm / "DONE").is_file()
    main(["ppo", "--actor", str(sft / "model"), "--reward", str(rm / "model"), "--data", str(data["prompts"]),
          "--output", str(ppo), "--max-steps", "2", "--rollout-parity-every", "1", *PPO_ARGS, *FAST])
    rows = read_metrics(ppo)  # the second rollout's parity: the updated shared embedding reached the copy tied
    assert len(rows) == 2 and all(r["rollout_parity_max_diff"] < 1e-4 for r in rows)
    ppo_embed = assert_tied_export(ppo / "model")
    assert not torch.equal(ppo_embed, sft_embed), "PPO did not train the shared embedding"
    assert (ppo / "critic").is_dir() and (ppo / "DONE").is_file()


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_resume_on_a_tied_model_continues_exactly(family: str, tied_models, data, tmp_path: Path) -> None:
    args = ["--model", str(tied_models[family]), "--data", str(data["sft"]), "--max-steps", "4",
            "--micro-batch-size", "8", "--lr", "3e-3", "--save-interval", "2", "--keep-checkpoints", "2", *FAST]
    main(["sft", *args, "--output", str(tmp_path / "full")])
    cut = cut_back(tmp_path / "full", tmp_path / "cut", step=2)
    main(["sft", *args, "--output", str(cut), "--resume"])
    assert train_losses(cut) == pytest.approx(train_losses(tmp_path / "full"), abs=1e-6)
    resumed, full = assert_tied_export(cut / "model"), assert_tied_export(tmp_path / "full" / "model")
    assert torch.allclose(resumed, full, atol=1e-6)


def test_ppo_resume_on_a_tied_model_continues_exactly(tied_models, data, tmp_path: Path) -> None:
    args = ["--actor", str(tied_models["qwen2"]), "--critic", str(tied_models["qwen2"]), "--reward-fn", "sort",
            "--data", str(data["prompts"]), "--max-steps", "2", "--save-interval", "1", *PPO_ARGS, *FAST]
    main(["ppo", *args, "--output", str(tmp_path / "full")])
    cut = cut_back(tmp_path / "full", tmp_path / "cut", step=1)
    main(["ppo", *args, "--output", str(cut), "--resume"])
    full_rows, cut_rows = read_metrics(tmp_path / "full"), read_metrics(cut)
    assert [r["step"] for r in cut_rows][-1] == 2
    for key in ("score_mean", "kl", "policy_loss", "value_loss", "entropy"):
        assert cut_rows[-1][key] == pytest.approx(full_rows[-1][key], abs=1e-5), key
    assert torch.allclose(assert_tied_export(cut / "model"), assert_tied_export(tmp_path / "full" / "model"), atol=1e-6)


# One family in the default suite (~16 s: two subprocesses), the other marked slow.
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", pytest.param("llama", marks=pytest.mark.slow)])
def test_two_rank_tp2_rollout_on_a_tied_model_matches_one_rank(family: str, tied_models, data, tmp_path: Path) -> None:
    args = ["ppo", "--actor", str(tied_models[family]), "--critic", str(tied_models[family]), "--reward-fn", "sort",
            "--data", str(data["prompts"]), "--max-steps", "1", "--max-new-tokens", "6", "--greedy", "--lr", "1e-3",
            "--ppo-epochs", "1", "--kv-cache-dtype", "model", *FAST]
    # The model's KV cache on both sides: the tensor-parallel rollout runs the Hugging Face forward,
    # whose cache is the model's dtype, where one rank's fast decoder would default to float16.
    a, b = one_and_two_rank_metrics(args, tmp_path)
    for key in ("score_mean", "kl", "response_length", "policy_loss", "value_loss", "entropy"):
        assert b[key] == pytest.approx(a[key], abs=1e-5), key
    assert b["rollout_parity_max_diff"] < 1e-4
    assert_tied_export(tmp_path / "two" / "model")
