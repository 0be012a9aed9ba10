"""Hugging Face sequence classifiers as reward models, and our reward models in Hugging Face.

A reward model trained elsewhere (`AutoModelForSequenceClassification`, num_labels 1) loads
through `load_value_model` with its `score` head kept and scores exactly as transformers does;
ours is written in that layout, so transformers loads it and scores the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rlhf.errors import UserError
from rlhf.models.tiny import build_char_tokenizer, tiny_config
from rlhf.models.value_model import ValueModel, check_reward_model_dir, load_value_model, value_model_from


def _classifier_dir(tmp_path: Path, family: str, num_labels: int = 1) -> Path:
    tok = build_char_tokenizer()
    config = tiny_config(family, vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config.num_labels = num_labels
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    path = tmp_path / f"{family}-cls{num_labels}"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _batch(padding: str = "left") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 90, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    pads = slice(0, 3) if padding == "left" else slice(6, 9)
    mask[1, pads] = 0
    ids[1, pads] = 0  # the pad id: transformers finds the last real token from the ids
    return {"input_ids": ids, "attention_mask": mask}


# GPT-2's learned absolute positions shift under left padding in transformers (it passes no
# position ids); ours count real tokens only, so it is compared on right padding.
@pytest.mark.parametrize("family,padding", [("llama", "left"), ("qwen2", "left"), ("gpt2", "right")])
def test_hf_classifier_scores_the_same_through_our_loader(tmp_path: Path, family: str, padding: str) -> None:
    path = _classifier_dir(tmp_path, family)
    hf = AutoModelForSequenceClassification.from_pretrained(path).eval()
    ours = load_value_model(path).eval()
    batch = _batch(padding)
    with torch.no_grad():
        expected = hf(**batch).logits.squeeze(-1)
        got = ours.score(**batch)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # As the critic's starting point (value_model_from), the trained head is kept too.
    critic = value_model_from(path, flag="--critic")
    torch.testing.assert_close(critic.value_head.weight, hf.score.weight)


def test_our_reward_model_loads_in_transformers(tmp_path: Path, tiny_model_dirs: dict[str, Path]) -> None:
    model = ValueModel.from_causal_lm_dir(tiny_model_dirs["llama"], head_init_std=0.5).eval()
    model.save_pretrained(tmp_path / "rm")
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification"
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(hf(**batch).logits.squeeze(-1), model.score(**batch), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(load_value_model(tmp_path / "rm").score(**batch), model.score(**batch))


def test_a_critic_bias_survives_the_round_trip(tmp_path: Path, tiny_model_dirs: dict[str, Path]) -> None:
    model = ValueModel.from_causal_lm_dir(tiny_model_dirs["qwen2"])
    with torch.no_grad():
        model.value_head.bias.fill_(1.5)
    model.save_pretrained(tmp_path / "critic")
    assert load_value_model(tmp_path / "critic").value_head.bias.item() == 1.5


def test_reward_folder_checks_name_the_problem(tmp_path: Path, tiny_model_dirs: dict[str, Path]) -> None:
    with pytest.raises(UserError, match="2 labels"):
        check_reward_model_dir(_classifier_dir(tmp_path, "llama", num_labels=2))
    with pytest.raises(UserError, match="causal LM"):
        check_reward_model_dir(tiny_model_dirs["llama"])
    with pytest.raises(UserError, match="no config.json"):
        check_reward_model_dir(tmp_path)
