"""Frozen models (reference, reward) hold their weights in the compute dtype, with the same outputs."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf.engine.distributed import DistributedContext
from rlhf.engine.fsdp import apply_fsdp
from rlhf.engine.sharding import sharding_plan
from rlhf.engine.inference import FrozenModel, causal_lm_logprobs
from rlhf.models.tiny import build_char_tokenizer, build_tiny_model


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_frozen_weights_are_held_in_the_compute_dtype(dtype: str, torch_dtype: torch.dtype) -> None:
    ctx = DistributedContext.initialize()
    model = build_tiny_model("llama", build_char_tokenizer(), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    reference = apply_fsdp(copy.deepcopy(model).eval(), ctx, sharding_plan(3, trainable=False), dtype, False)
    frozen = FrozenModel(model, ctx, zero_stage=3, dtype=dtype, offload=False, micro_batch_size=2, name="ref")
    # One process, not offloaded: the frozen model is left unsharded (plain parameters).
    assert not any(hasattr(p, "to_local") for p in frozen.model.parameters())
    assert {p.dtype for p in frozen.model.parameters()} == {torch_dtype}
    ids = torch.randint(4, 90, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        expected = causal_lm_logprobs(reference, ids, mask)[0]
    assert torch.equal(frozen.logprobs(ids, mask), expected)
