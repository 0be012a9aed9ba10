"""Add LoRA adapters (peft) to a causal LM or a value model before it is sharded.

`apply_lora` injects peft `LoraLayer`s into the model in place (peft's `inject_adapter_in_model`:
the model keeps its class, so loading, FSDP2 wrapping, generation and export treat it as before)
and freezes everything but the adapters (and a value model's head, which is new and trained in
full). The engine side (reference = adapters off, merged rollout weights, merged or adapter
export) is `rlhf.engine.lora`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, inject_adapter_in_model
from safetensors.torch import save_file
from torch import nn

from rlhf.config import LoRAConfig
from rlhf.engine.layers import decoder_layers
from rlhf.errors import UserError

ALL_LINEAR = "all-linear"
VALUE_HEAD = "value_head"
"""The value model's head (rlhf.models.value_model.ValueModel): trained in full, never adapted."""


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"


def _projection_names(model: nn.Module) -> list[str]:
    """Leaf names of the linear projections inside the decoder layers (q_proj, ..., down_proj;
    GPT-2's Conv1D c_attn/c_proj/c_fc)."""
    names: set[str] = set()
    for layer in decoder_layers(model):
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear) or _is_conv1d(module):
                names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def resolve_target_modules(model: nn.Module, requested: list[str], flag: str = "--lora-target-modules") -> list[str]:
    """`requested` checked against the model: all-linear expands to every projection in the
    decoder layers; a name that matches no linear layer is a UserError listing the ones there are."""
    available = _projection_names(model)
    if requested == [ALL_LINEAR]:
        if not available:
            raise UserError(f"{flag}: the model has no linear layers inside its decoder layers to adapt")
        return available
    linear_names = {name for name, m in model.named_modules() if isinstance(m, nn.Linear) or _is_conv1d(m)}
    for target in requested:
        if not any(name == target or name.endswith("." + target) for name in linear_names):
            raise UserError(f"{flag}: no linear layer named {target!r} in the model; its decoder layers have "
                            f"{', '.join(available)} (or pass all-linear)")
    return list(requested)


def peft_config(model: nn.Module, config: LoRAConfig, base_model: str = "") -> LoraConfig:
    """The peft LoraConfig of `config` for `model` (what an exported adapter's config says).
    GPT-2's Conv1D projections store W transposed: peft's fan_in_fan_out says so."""
    targets = resolve_target_modules(model, config.lora_target_modules)
    conv1d = [_is_conv1d(m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in targets]
    return LoraConfig(
        r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
        target_modules=targets, bias="none", fan_in_fan_out=bool(conv1d) and all(conv1d),
        task_type="CAUSAL_LM", base_model_name_or_path=base_model or None,
    )


def apply_lora(model: nn.Module, config: LoRAConfig, seed: int = 0, base_model: str = "") -> nn.Module:
    """Inject rank-`config.lora_rank` adapters into `model` in place and freeze the rest (a value
    model's head stays trainable); returns the model. Adapter init (A random, B zero: the model
    starts exactly at its base) draws from a generator seeded with `seed`, so every rank of a
    job starts from the same adapters."""
    lora = peft_config(model, config, base_model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(lora, model, adapter_name="default")
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name or name.startswith(VALUE_HEAD + "."))
    model.rlhf_lora_config = lora  # type: ignore[attr-defined]  # read by the adapter export
    return model


def lora_summary(model: nn.Module) -> dict[str, int]:
    """Trainable and total parameter counts (logged at the start of a LoRA run)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"trainable_params": trainable, "total_params": sum(p.numel() for p in model.parameters())}


def save_adapter(directory: Path, lora: LoraConfig, adapter_weights: dict[str, torch.Tensor],
                 extra: dict[str, Any] | None = None) -> None:
    """Write an adapter folder as peft does (adapter_config.json + adapter_model.safetensors),
    loadable with `peft.PeftModel.from_pretrained(base_model, directory)`."""
    directory.mkdir(parents=True, exist_ok=True)
    lora.save_pretrained(str(directory))
    if extra:
        config_file = directory / "adapter_config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **extra}, indent=2, sort_keys=True))
    save_file({k: v.contiguous() for k, v in adapter_weights.items()}, str(directory / "adapter_model.safetensors"),
              metadata={"format": "pt"})
