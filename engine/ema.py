"""Exponential moving average of a (possibly FSDP2-sharded) model's parameters.

DeepSpeed-Chat keeps an EMA of the PPO actor (decay 0.992) and exports it beside the actor: it is
often the better policy. Each rank averages only its local shards (DTensor `to_local()`), so
the EMA costs one copy of this rank's shard and no communication until export.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (the parameter itself when it is not a DTensor)."""
    return p.detach().to_local() if isinstance(p, DTensor) else p.detach()


class ParameterEMA:
    """ema <- decay * ema + (1 - decay) * param, per parameter, on this rank's shards.

    `state_dict` / `load_state_dict` hold the local shards (for a per-rank resume checkpoint);
    `full_state_dict` gathers full tensors for export (a collective call on sharded models).
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] = {n: _local(p).clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the average one step towards `model`'s current parameters."""
        for name, p in model.named_parameters():
            self.shadow[name].mul_(self.decay).add_(_local(p), alpha=1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.shadow) ^ set(state)
        if missing:
            raise ValueError(f"EMA state does not match the model's parameters: {sorted(missing)[:5]}")
        self.shadow = {n: state[n].to(self.shadow[n].device, self.shadow[n].dtype) for n in self.shadow}

    @torch.no_grad()
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full (unsharded) CPU tensors of the average, named as `model`'s parameters.

        Collective when `model` is sharded: every rank must call it (each gathers every tensor).
        """
        full = {}
        for name, p in model.named_parameters():
            shard = self.shadow[name]
            if isinstance(p, DTensor):
                shard = DTensor.from_local(shard, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
            full[name] = shard.cpu()
        return full


__all__ = ["ParameterEMA"]
