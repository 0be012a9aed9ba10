"""ParameterEMA against a plain Python loop: on a plain module, and on a 2-rank FSDP2-sharded one
(uneven shards) where the gathered average must equal the loop over full tensors."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rlhf.engine.distributed import exit_rank
from rlhf.engine.ema import ParameterEMA

DECAY = 0.9
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7))


def _perturb(model: nn.Module, step: int) -> None:
    """A deterministic parameter change per step (what an optimizer step would do)."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.1 * (step + 1) * (i + 1))


def _reference(steps: int) -> dict[str, torch.Tensor]:
    """The average by hand: ema = decay * ema + (1 - decay) * param after each step."""
    model = _model()
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(steps):
        _perturb(model, step)
        for n, p in model.named_parameters():
            ema[n] = DECAY * ema[n] + (1 - DECAY) * p.detach()
    return ema


def test_plain_module_matches_reference_loop() -> None:
    model = _model()
    ema = ParameterEMA(model, DECAY)
    for step in range(STEPS):
        _perturb(model, step)
        ema.update(model)
    want = _reference(STEPS)
    got = ema.full_state_dict(model)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    # state round trip (what a resume checkpoint stores)
    fresh = ParameterEMA(_model(), DECAY)
    fresh.load_state_dict({k: v.clone() for k, v in ema.state_dict().items()})
    for name in want:
        torch.testing.assert_close(fresh.state_dict()[name], want[name])
    with pytest.raises(ValueError, match="decay"):
        ParameterEMA(model, 1.0)
    with pytest.raises(ValueError, match="does not match"):
        fresh.load_state_dict({"nope": torch.zeros(1)})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded_worker(rank: int, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _model()
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        assert all(isinstance(p, DTensor) for p in model.parameters())
        ema = ParameterEMA(model, DECAY)
        # Local shards only: rank 1 holds 1 of the first layer's 3 rows.
        assert ema.state_dict()["0.weight"].shape[0] == (2 if rank == 0 else 1)
        for step in range(STEPS):
            _perturb(model, step)
            ema.update(model)
        got = ema.full_state_dict(model)
        for name, want in _reference(STEPS).items():
            torch.testing.assert_close(got[name], want)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_rank()  # as the CLI ends a rank: no interpreter finalization (exit_rank says why)


def test_fsdp2_sharded_two_ranks_match_reference_loop() -> None:
    mp.spawn(_sharded_worker, args=(_free_port(),), nprocs=2, join=True)
