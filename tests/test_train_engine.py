"""TrainEngine on one process: FSDP2 only where it has work (`wraps_in_fsdp`).

In fp32 on one process, not offloaded, the trained model stays plain: FSDP2 would only copy the
weights into its all-gather buffers and the gradients through its reduce-scatter buffers. The
plain engine must train exactly like the FSDP2-wrapped one, and their checkpoints must load
into each other (a resume on another world size goes through the same DCP resharding).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import rlhf.engine.train_engine as train_engine
from rlhf.engine.config import EngineConfig
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.fsdp import local_shard
from rlhf.engine.sharding import wraps_in_fsdp
from rlhf.engine.train_engine import TrainEngine
from rlhf.models.loading import load_causal_lm


@pytest.fixture(scope="module")
def ctx(one_thread: None) -> DistributedContext:
    return DistributedContext.initialize()


def make_engine(model_dir: Path, ctx: DistributedContext, **overrides: object) -> TrainEngine:
    settings = dict(zero_stage=3, dtype="fp32", micro_batch_size=2, grad_accum=2, optimizer_impl="torch", lr=1e-2,
                    grad_clip=0.5)
    settings.update(overrides)
    return TrainEngine(load_causal_lm(str(model_dir)), EngineConfig(**settings), ctx, total_steps=10, name="actor")


def fsdp_engine(model_dir: Path, ctx: DistributedContext, monkeypatch: pytest.MonkeyPatch) -> TrainEngine:
    """The same engine with FSDP2 forced on (the wrapping every multi-process run gets)."""
    with monkeypatch.context() as patch:
        patch.setattr(train_engine, "wraps_in_fsdp", lambda *args, **kwargs: True)
        return make_engine(model_dir, ctx)


def train(engine: TrainEngine, steps: int = 2) -> list[float]:
    """`steps` optimizer steps of 2 micro-batches each on fixed batches; their gradient norms."""
    norms = []
    for step in range(steps):
        for micro in range(2):
            ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(10 * step + micro))
            loss = engine.model(input_ids=ids, labels=ids, use_cache=False).loss
            engine.backward(loss)
        norms.append(engine.step().grad_norm)
    return norms


def whole(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in engine.model.named_parameters()}


def test_fsdp_is_applied_only_where_it_has_work() -> None:
    assert not wraps_in_fsdp(1, offload=False, dtype="fp32", trainable=True)
    assert wraps_in_fsdp(1, offload=False, dtype="bf16", trainable=True)  # fp32 master weights, 16-bit compute
    assert wraps_in_fsdp(1, offload=True, dtype="fp32", trainable=True)
    assert wraps_in_fsdp(2, offload=False, dtype="fp32", trainable=True)
    assert not wraps_in_fsdp(1, offload=False, dtype="bf16", trainable=False)  # frozen: held in bf16 already
    assert wraps_in_fsdp(2, offload=False, dtype="bf16", trainable=False)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_one_process_fp32_engine_is_plain_and_trains_like_fsdp2(family, tiny_model_dirs, ctx, monkeypatch):
    model = tiny_model_dirs[family]
    plain, wrapped = make_engine(model, ctx), fsdp_engine(model, ctx, monkeypatch)
    assert not isinstance(plain.model, FSDPModule)
    assert not any(isinstance(p, DTensor) for p in plain.model.parameters())
    assert isinstance(wrapped.model, FSDPModule) and all(isinstance(p, DTensor) for p in wrapped.model.parameters())
    norms_plain, norms_wrapped = train(plain), train(wrapped)
    assert norms_plain == pytest.approx(norms_wrapped, rel=1e-6)
    got, want = whole(plain), whole(wrapped)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_plain_and_fsdp2_checkpoints_load_into_each_other(tiny_model_dirs, ctx, monkeypatch, tmp_path):
    """Model and optimizer state saved by one kind load into the other: after one more step both
    hold what the saving engine holds after that step."""
    model = tiny_model_dirs["llama"]
    for save_plain in (True, False):
        source = make_engine(model, ctx) if save_plain else fsdp_engine(model, ctx, monkeypatch)
        train(source, steps=1)
        folder = tmp_path / f"plain{save_plain}"
        dcp.save(source.sharded_state(), checkpoint_id=folder)
        target = fsdp_engine(model, ctx, monkeypatch) if save_plain else make_engine(model, ctx)
        state = target.sharded_state()
        dcp.load(state, checkpoint_id=folder)
        target.load_sharded_state(state)
        assert all(torch.equal(local_shard(p)[0], local_shard(q)[0])
                   for p, q in zip(source.model.parameters(), target.model.parameters()))
        train(source, steps=1)
        train(target, steps=1)  # the optimizer's moments came along: the next step agrees too
        got, want = whole(target), whole(source)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
