"""Add LoRA adapters (peft) to a causal LM or a value model before it is sharded.

`apply_lora` injects peft `LoraLayer`s into the model in place (peft's `inject_adapter_in_model`:
the model keeps its class, so loading, FSDP2 wrapping, generation and export treat it as before)
and freezes everything but the adapters (and a value model's head, which is new and trained in
full). The engine side (reference = adapters off, merged rollout weights, merged or adapter
export) is `rlhf.engine.adapters`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, inject_adapter_in_model
from safetensors.torch import save_file
from torch import nn

from rlhf.config import LoRAConfig
from rlhf.engine.export import export_adapter, export_model
from rlhf.engine.fsdp import ShardLoader
from rlhf.engine.decoder_layers import decoder_layers
from rlhf.engine.adapters import base_name
from rlhf.engine.train_engine import TrainEngine
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.models.sharded_loading import SafetensorsShardLoader

log = get_logger(__name__)

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


def initial_adapters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Full starting values of every adapter parameter, as peft initialises them (A Kaiming-uniform
    with a = sqrt(5), B zero: the adapted model starts exactly at its base), drawn on the CPU from
    a generator seeded with `seed`, in parameter order: the same on every rank and whether the
    model is real or on the meta device."""
    generator = torch.Generator().manual_seed(seed)
    values: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if ".lora_A." in name:
            values[name] = nn.init.kaiming_uniform_(torch.empty(param.shape), a=math.sqrt(5), generator=generator)
        elif ".lora_B." in name:
            values[name] = torch.zeros(param.shape)
    return values


def _adapted_loader(model: nn.Module, weights: SafetensorsShardLoader,
                    adapters: dict[str, torch.Tensor]) -> SafetensorsShardLoader:
    """`weights`, planned for the plain model, for `model` with adapters: base weights under their
    new names (`q_proj.base_layer.weight` reads what `q_proj.weight` read), adapters filled with
    their starting values."""
    sources = {}
    for name, _ in model.named_parameters():
        plain = base_name(name)
        if name not in adapters and plain in weights.sources:
            sources[name] = weights.sources[plain]
    return SafetensorsShardLoader(weights.folder, sources, {**weights.fills, **adapters}, weights.where)


def apply_lora(model: nn.Module, config: LoRAConfig, seed: int = 0, base_model: str = "",
               weights: ShardLoader | None = None) -> tuple[nn.Module, ShardLoader | None]:
    """Inject rank-`config.lora_rank` adapters into `model` in place and freeze the rest (a value
    model's head stays trainable). A real model gets its adapters' starting values now; a model
    on the meta device (sharded loading) gets a loader that reads its base weights under their
    new names and fills the adapters (`initial_adapters`). Returns the model and its loader."""
    lora = peft_config(model, config, base_model)
    with torch.random.fork_rng(devices=[]):  # peft's own init draws are replaced below
        inject_adapter_in_model(lora, model, adapter_name="default")
    adapters = initial_adapters(model, seed)
    if weights is None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in adapters:
                    param.copy_(adapters[name])
    elif isinstance(weights, SafetensorsShardLoader):
        weights = _adapted_loader(model, weights, adapters)
    else:
        raise TypeError(f"apply_lora cannot re-plan a {type(weights).__name__}")
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name or name.startswith(VALUE_HEAD + "."))
    model.rlhf_lora_config = lora  # type: ignore[attr-defined]  # read by the adapter export
    return model, weights


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


def with_lora(model: nn.Module, weights: ShardLoader | None, config: Any, base_model: str,
              name: str = "model") -> tuple[nn.Module, ShardLoader | None]:
    """`model` with adapters when the stage config asks for them (`config.lora.lora_rank` > 0;
    adapter init seeded by `config.engine.seed`), else unchanged; logs what is trained."""
    if config.lora.lora_rank == 0:
        return model, weights
    model, weights = apply_lora(model, config.lora, seed=config.engine.seed, base_model=base_model, weights=weights)
    counts = lora_summary(model)
    log.info("%s: LoRA rank %d on %s: %d of %d parameters trained (%.2f%%)", name, config.lora.lora_rank,
             ", ".join(sorted(model.rlhf_lora_config.target_modules)), counts["trainable_params"], counts["total_params"],
             100 * counts["trainable_params"] / counts["total_params"])
    return model, weights


def export_trained_model(engine: TrainEngine, directory: Path, tokenizer: Any, config: LoRAConfig) -> None:
    """A stage's export of a trained model (collective): the merged model, a plain Hugging Face
    folder (default, and always without LoRA), or with `export_adapter` the adapter alone in peft's
    format (a value model's head saved with it, as peft's modules_to_save)."""
    if not (config.lora_rank and config.export_adapter):
        export_model(engine, directory, tokenizer)
        return
    lora = engine.model.rlhf_lora_config
    extra = {"modules_to_save": [VALUE_HEAD]} if hasattr(engine.model, VALUE_HEAD) else None

    def write(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
        save_adapter(folder, lora, tensors, extra)

    export_adapter(engine, directory, tokenizer, write)
