"""ValueModel on all five tiny families: loading from a causal LM, save/load, scoring positions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM

from rlhf.errors import UserError
from rlhf.engine import positions
from rlhf.engine.decoder_layers import decoder_layers
from rlhf.models.tiny import FAMILIES, build_char_tokenizer, save_tiny_model
from rlhf.models.value_model import (
    ValueModel,
    last_token_index,
    load_value_model,
    position_ids_from_mask,
)

TEXTS = ["Human: hi", "Human: a longer question?"]


@pytest.fixture(scope="module")
def lm_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: save_tiny_model(root / family, family, seed=3) for family in FAMILIES}


def _with_random_head(model: ValueModel, seed: int = 0) -> ValueModel:
    """A non-zero head, so scores differ between positions and sequences."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.value_head.weight.copy_(torch.randn(model.value_head.weight.shape, generator=gen))
        model.value_head.bias.fill_(0.5)
    return model.eval()


def _batch(padding_side: str) -> dict[str, torch.Tensor]:
    tokenizer = build_char_tokenizer()
    tokenizer.padding_side = padding_side
    return dict(tokenizer(TEXTS, return_tensors="pt", padding=True))


def _expected_layers(family: str, model: nn.Module) -> nn.Module:
    if family == "gpt2":
        return model.transformer.h
    if family == "opt":
        return model.model.decoder.layers
    return model.model.layers


@pytest.mark.parametrize("family", FAMILIES)
def test_from_causal_lm_dir_backbone_equals_causal_lm(family: str, lm_dirs: dict[str, Path]) -> None:
    lm = AutoModelForCausalLM.from_pretrained(lm_dirs[family])
    model = ValueModel.from_causal_lm_dir(lm_dirs[family])
    expected = lm.base_model.state_dict()
    got = model.backbone.state_dict()
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
    assert model.value_head.weight.shape == (1, lm.config.hidden_size)
    # Zero-initialised head: every value is 0 before training.
    batch = _batch("right")
    assert model.eval()(**batch).abs().max().item() == 0.0
    # The decoder-layer helper finds the same blocks in the causal LM, the bare model and the ValueModel.
    assert decoder_layers(lm) is _expected_layers(family, lm)
    assert decoder_layers(model) is decoder_layers(model.backbone)
    assert len(decoder_layers(model)) == lm.config.num_hidden_layers


@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_load_value_model_is_exact(family: str, lm_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = _with_random_head(ValueModel.from_causal_lm_dir(lm_dirs[family]))
    batch = _batch("right")
    with torch.no_grad():
        before = model.score(**batch)
    model.save_pretrained(tmp_path / "rm")

    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert config["rlhf_model_type"] == "value"
    assert config["rlhf_value_head_shape"] == [1, model.config.hidden_size]

    loaded = load_value_model(tmp_path / "rm").eval()
    with torch.no_grad():
        after = loaded.score(**batch)
    assert torch.equal(before, after)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    assert not hasattr(loaded.config, "rlhf_model_type")  # marker stays in the file only
    # The backbone keeps its causal-LM names on disk, so plain HF loading reads it too.
    plain = AutoModel.from_pretrained(tmp_path / "rm")
    assert torch.equal(plain.state_dict()[next(iter(plain.state_dict()))], next(iter(model.backbone.state_dict().values())))


@pytest.mark.parametrize("family", FAMILIES)
def test_score_uses_last_real_token_under_any_padding(family: str, lm_dirs: dict[str, Path]) -> None:
    model = _with_random_head(ValueModel.from_causal_lm_dir(lm_dirs[family]), seed=1)
    tokenizer = build_char_tokenizer()
    with torch.no_grad():
        alone = torch.cat([model.score(**tokenizer([text], return_tensors="pt")) for text in TEXTS])
        right, left = _batch("right"), _batch("left")
        right_scores = model.score(**right)
        left_scores = model.score(**left)
        right_values = model(**right)
    lengths = [len(tokenizer(text)["input_ids"]) for text in TEXTS]
    assert lengths[0] < lengths[1]  # the first row is padded
    # Right padding: the score is the value at position length - 1, not at the last column.
    assert torch.equal(right_scores, right_values[torch.arange(2), torch.tensor(lengths) - 1])
    torch.testing.assert_close(right_scores, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(left_scores, alone, rtol=1e-5, atol=1e-5)
    assert right_scores[0].item() != pytest.approx(right_values[0, -1].item())


def test_last_token_index_reads_the_mask_not_pad_ids() -> None:
    # A leading BOS that shares the pad id (0) and an explicit left/right padding mix.
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 4, 0]
    assert position_ids_from_mask(mask).tolist() == [[0, 1, 2, 0, 0], [0, 0, 0, 1, 2], [0, 0, 0, 0, 0]]
    # One implementation: the value model's helpers are the engine's (generation uses them too).
    assert (last_token_index, position_ids_from_mask) == (positions.last_token_index, positions.position_ids_from_mask)
    with pytest.raises(ValueError, match="1 row.* all zeros"):
        last_token_index(torch.tensor([[1, 0], [0, 0]]))


def test_score_with_leading_token_equal_to_pad_id(lm_dirs: dict[str, Path]) -> None:
    model = _with_random_head(ValueModel.from_causal_lm_dir(lm_dirs["gpt2"]))
    input_ids = torch.tensor([[0, 5, 6, 0, 0]])  # starts with a real token whose id is the pad id
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    with torch.no_grad():
        assert torch.equal(model.score(input_ids, mask), model(input_ids, mask)[:, 2])
        with pytest.raises(ValueError, match="all zeros"):
            model.score(input_ids, torch.zeros_like(mask))


def test_bf16_round_trip_keeps_dtype(lm_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = _with_random_head(ValueModel.from_causal_lm_dir(lm_dirs["llama"], dtype=torch.bfloat16))
    assert model.value_head.weight.dtype == torch.bfloat16
    model.save_pretrained(tmp_path / "rm")
    loaded = load_value_model(tmp_path / "rm").eval()
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    batch = _batch("right")
    with torch.no_grad():
        scores = loaded.score(**batch)
        assert scores.dtype == torch.float32
        assert torch.equal(scores, model.score(**batch))


def test_save_pretrained_with_a_given_state_dict(lm_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = ValueModel.from_causal_lm_dir(lm_dirs["qwen2"])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["value_head.bias"] = torch.tensor([2.0])
    model.save_pretrained(tmp_path / "rm", state_dict=state)
    loaded = load_value_model(tmp_path / "rm")
    assert loaded.value_head.bias.item() == 2.0
    assert model.value_head.bias.item() == 0.0  # the live module is untouched
    with pytest.raises(KeyError, match="lm_head"):
        model.save_pretrained(tmp_path / "bad", state_dict={**state, "lm_head.weight": torch.zeros(1)})


def test_user_errors(lm_dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a value/reward model"):
        load_value_model(lm_dirs["llama"])
    with pytest.raises(UserError, match="no config.json"):
        load_value_model(tmp_path)
    with pytest.raises(UserError, match="no config.json"):
        ValueModel.from_causal_lm_dir(tmp_path / "missing")


def test_decoder_layers_fallback_picks_largest_module_list() -> None:
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(2, 2)])
            self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    model = Custom()
    assert decoder_layers(model) is model.blocks
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        decoder_layers(nn.Linear(2, 2))


def test_gradients_reach_head_and_backbone(lm_dirs: dict[str, Path]) -> None:
    model = ValueModel.from_causal_lm_dir(lm_dirs["mistral"])
    batch = _batch("right")
    model.score(**batch).sum().backward()
    # Zero head: d(score)/d(hidden) = w = 0, so only the head learns on the first step.
    assert model.value_head.weight.grad is not None and model.value_head.weight.grad.abs().sum() > 0
    assert model.value_head.bias.grad is not None and model.value_head.bias.grad.item() == 2.0
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in model.backbone.parameters())
    model.zero_grad()
    _with_random_head(model).score(**batch).sum().backward()
    assert all(p.grad is not None for p in decoder_layers(model)[0].parameters())
