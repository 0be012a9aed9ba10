"""Config precedence, validation, LR schedules and the fp16 loss scaler."""

from __future__ import annotations

import math

import pytest

from rlhf.cli import build_config
from rlhf.config import EngineConfig, SFTConfig, apply_mapping, field_docs, leaf_fields
from rlhf.engine.loss_scale import LossScaler
from rlhf.engine.optim import lr_lambda
from rlhf.errors import UserError


def test_every_field_has_a_docstring():
    for info in leaf_fields(SFTConfig):
        assert info.doc, f"{info.section}.{info.name} has no docstring"


def test_precedence_defaults_file_flags(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("engine:\n  lr: 0.001\n  zero_stage: 2\nmax_steps: 5\ndata: [a.jsonl]\n")
    cfg = build_config(SFTConfig, {"config_file": str(cfg_file), "lr": 0.5, "data": ()})
    assert cfg.engine.lr == 0.5 and cfg.engine.zero_stage == 2 and cfg.max_steps == 5
    assert cfg.data.data == ["a.jsonl"] and cfg.engine.micro_batch_size == EngineConfig().micro_batch_size


@pytest.mark.parametrize("mapping, message", [
    ({"lr": "fast"}, "c.yaml: lr: expected float"),
    ({"engine": {"nope": 1}}, "unknown key 'engine.nope'"),
    ({"dtype": "fp8"}, "dtype: 'fp8' is not one of"),
    ({"wat": 1}, "unknown key 'wat'"),
])
def test_config_errors_name_the_file_and_field(mapping, message):
    with pytest.raises(UserError, match=message):
        apply_mapping(SFTConfig(), mapping, "c.yaml")


def test_lr_schedules_by_hand():
    cos = lr_lambda("cosine", total_steps=12, warmup_steps=2, warmup_start_ratio=0.0, min_lr_ratio=0.1)
    assert [cos(0), cos(1), cos(2)] == pytest.approx([0.0, 0.5, 1.0])
    assert cos(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos(12) == pytest.approx(0.1) and cos(50) == pytest.approx(0.1)
    lin = lr_lambda("linear", total_steps=10, warmup_steps=0, warmup_start_ratio=0.0, min_lr_ratio=0.0)
    assert [lin(0), lin(5), lin(10)] == pytest.approx([1.0, 0.5, 0.0])
    const = lr_lambda("constant", total_steps=10, warmup_steps=4, warmup_start_ratio=0.5, min_lr_ratio=0.0)
    assert [const(0), const(2), const(4), const(9)] == pytest.approx([0.5, 0.75, 1.0, 1.0])


def test_dynamic_loss_scaler_follows_deepspeed():
    s = LossScaler.from_config(0, initial_scale_power=4, loss_scale_window=2, hysteresis=2, min_loss_scale=2)
    assert s.scale == 16
    s.update(overflow=True)   # first overflow absorbed by hysteresis
    assert s.scale == 16
    s.update(overflow=True)   # second halves
    assert s.scale == 8
    s.update(overflow=True)
    assert s.scale == 4
    s.update(overflow=False)  # 1 step since the overflow
    assert s.scale == 4
    s.update(overflow=False)  # window of 2 clean steps: doubles
    assert s.scale == 8
    for _ in range(6):
        s.update(overflow=True)
    assert s.scale == 2       # floored at min_loss_scale
    static = LossScaler.from_config(128, 16, 2, 2, 1)
    static.update(True)
    assert static.scale == 128


def test_field_docs_reads_attribute_docstrings():
    assert "ZeRO stage" in field_docs(EngineConfig)["zero_stage"]
