"""LoRA adapters (peft) inside the engine: the base model with adapters off, and merged weights.

A model trained with LoRA carries peft `LoraLayer`s in place of its target linear layers: the
frozen base weight under `<layer>.base_layer.weight`, the adapters under `<layer>.lora_A.default`
and `<layer>.lora_B.default`. The engine needs three things from them:

- `adapters_disabled(model)`: the base model, for PPO's reference log-probs without a second
  copy of the weights (the base weights are frozen, so this is exactly the starting model);
- `merged_parameters(model)`: every weight as the plain architecture names it, each target
  merged as W + scaling * B A (peft's own `get_delta_weight`), computed on the FSDP2 shards
  (DTensor ops) without gathering a whole weight: what rollout mode loads, once per switch;
- `merge_state_dict(model, state_dict)`: the same merge on a consolidated state dict, for export.

`AdaptersOffReference` is PPO's reference policy of a LoRA actor: the actor's own sharded model,
queried like a `FrozenModel` with its adapters off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.distributed.tensor import DTensor

from rlhf.engine.distributed import DistributedContext
from rlhf.engine.inference import FrozenModel

ADAPTER_MARKERS = (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B", ".lora_magnitude_vector")
"""Substrings that mark a parameter name as an adapter's, not the base model's."""


def lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
    """Module name -> LoraLayer for every adapted layer of `model` (empty without LoRA)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(module, LoraLayer) for module in model.modules())


def is_adapter_parameter(name: str) -> bool:
    return any(marker in name for marker in ADAPTER_MARKERS)


def base_name(name: str) -> str:
    """A parameter's name in the plain architecture: `q_proj.base_layer.weight` -> `q_proj.weight`."""
    return name.replace(".base_layer.", ".")


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block every LoraLayer computes its base layer only (peft's disable flag, set
    directly: peft's `enable_adapters(False)` would also clear the adapters' requires_grad)."""
    layers = list(lora_layers(model).values())
    previous = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, value in zip(layers, previous):
            layer._disable_adapters = value


def _delta(layer: LoraLayer) -> torch.Tensor | None:
    """Sum of the active adapters' W deltas of one layer (DTensors stay DTensors), or None."""
    if layer._disable_adapters:
        return None
    delta = None
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            d = layer.get_delta_weight(adapter)
            delta = d if delta is None else delta + d
    return delta


class MergedParameters(Mapping[str, torch.Tensor]):
    """Every parameter of a model by its plain-architecture name, each adapted weight merged
    (W + scaling * B A, peft's `get_delta_weight`) when it is looked up: a rollout load merges
    one weight at a time, never holding all merged weights at once. Without LoRA this is
    `named_parameters()`. The merge runs on whatever the params are (FSDP2 DTensor shards: the
    adapters' small B A product is redistributed, never a whole base weight)."""

    def __init__(self, model: nn.Module) -> None:
        self._params = {base_name(name): p for name, p in model.named_parameters() if not is_adapter_parameter(name)}
        self._layers = {f"{prefix}.weight": layer for prefix, layer in lora_layers(model).items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        layer = self._layers.get(name)
        delta = _delta(layer) if layer is not None else None
        if delta is None:
            return self._params[name]
        with torch.no_grad():
            weight = layer.get_base_layer().weight
            return weight + delta.to(weight.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def merged_parameters(model: nn.Module) -> MergedParameters:
    """`MergedParameters` of `model`: what rollout mode loads into its inference copy."""
    return MergedParameters(model)


@torch.no_grad()
def merged_export_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An export's on-disk name -> tensor map of a LoRA model (names as `state_dict` gives them,
    values the model's own params) -> the plain model's: adapters left out, each adapted weight
    replaced by its merge, on the shards, in the base weight's placement."""
    layers = lora_layers(model)
    adapter_ids = {id(p) for layer in layers.values() for n, p in layer.named_parameters()
                   if is_adapter_parameter("." + n)}
    merged: dict[int, torch.Tensor] = {}
    for layer in layers.values():
        delta = _delta(layer)
        if delta is None:
            continue
        weight = layer.get_base_layer().weight
        value = weight.detach() + delta.to(weight.dtype)
        if isinstance(weight, DTensor) and tuple(value.placements) != tuple(weight.placements):
            value = value.redistribute(weight.device_mesh, weight.placements)
        merged[id(weight)] = value
    return {base_name(name): merged.get(id(t), t) for name, t in tensors.items() if id(t) not in adapter_ids}


@torch.no_grad()
def merge_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A consolidated state dict of `model` (full tensors, adapter names) -> the plain model's,
    adapters merged: what a merged export writes. An empty dict (a rank other than the one that
    holds it) stays empty."""
    if not state_dict:
        return state_dict
    merged = {base_name(name): t for name, t in state_dict.items() if not is_adapter_parameter(name)}
    for prefix, layer in lora_layers(model).items():
        if layer._disable_adapters:
            continue
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            a = state_dict[f"{prefix}.lora_A.{adapter}.weight"].float()
            b = state_dict[f"{prefix}.lora_B.{adapter}.weight"].float()
            delta = (b @ a) * layer.scaling[adapter]
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.T
            weight = merged[f"{prefix}.weight"]
            merged[f"{prefix}.weight"] = (weight.float() + delta).to(weight.dtype)
    return merged


def adapter_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor],
                       extra_modules: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The adapters (and `extra_modules`' full weights, e.g. a value head) of a consolidated state
    dict, keyed as peft saves them (`base_model.model.<name>`, adapter name dropped)."""
    out = {}
    for name, tensor in state_dict.items():
        if is_adapter_parameter(name):
            out["base_model.model." + name.replace(".default.", ".")] = tensor
        elif any(name == m or name.startswith(m + ".") for m in extra_modules):
            out["base_model.model." + name] = tensor
    return out


class AdaptersOffReference(FrozenModel):
    """The reference policy of a LoRA actor: the actor's sharded model with its adapters off
    (its frozen base is exactly the starting model), answering `logprobs` as a FrozenModel
    does, with no second copy of the weights."""

    def __init__(self, actor_model: nn.Module, ctx: DistributedContext, micro_batch_size: int, name: str = "ref") -> None:
        if not has_lora(actor_model):
            raise ValueError("AdaptersOffReference needs a model with LoRA adapters")
        self._bind(actor_model, ctx, micro_batch_size, name)  # the actor's own shards: nothing is wrapped again

    @torch.no_grad()
    def logprobs(self, sequences: torch.Tensor, attention_mask: torch.Tensor, shared_prefix: int = 0,
                 response_start: int = 0, pack_budget: int = 0) -> torch.Tensor:
        """`FrozenModel.logprobs` of the base model (a peft model: never packed)."""
        with adapters_disabled(self.model):
            return super().logprobs(sequences, attention_mask, shared_prefix, response_start, pack_budget)
