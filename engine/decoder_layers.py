"""Find the stack of transformer blocks of a model, the unit of FSDP wrapping and checkpointing.

The engine shards each decoder layer as its own FSDP2 unit and applies activation
checkpointing per layer; this module is the one place that knows where each family keeps them.
"""

from __future__ import annotations

from torch import nn

# Paths of the block list relative to the base model (the `base_model_prefix` submodule of a
# Hugging Face *ForCausalLM, or the bare *Model itself):
# Llama / Qwen2 / Mistral (and most recent families) `layers`, OPT `decoder.layers`, GPT-2 `h`.
KNOWN_LAYER_PATHS: tuple[str, ...] = ("layers", "decoder.layers", "h")


def _base_model(model: nn.Module) -> nn.Module:
    """Strip the ValueModel wrapper (`backbone`) and the causal-LM head wrapper (`base_model`)."""
    root = getattr(model, "backbone", model)
    base = getattr(root, "base_model", root)  # PreTrainedModel.base_model; itself for a bare *Model
    return base if isinstance(base, nn.Module) else root


def _get_path(module: nn.Module, path: str) -> nn.Module | None:
    for name in path.split("."):
        module = getattr(module, name, None)  # type: ignore[assignment]
        if module is None:
            return None
    return module


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The nn.ModuleList of transformer blocks of a causal LM, a bare HF model or a ValueModel.

    Known layouts are looked up by path (see KNOWN_LAYER_PATHS); any other model falls back to
    its nn.ModuleList holding the most parameters. Raises ValueError if it has none.
    """
    base = _base_model(model)
    for path in KNOWN_LAYER_PATHS:
        found = _get_path(base, path)
        if isinstance(found, nn.ModuleList) and len(found) > 0:
            return found
    candidates = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not candidates:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of layers to wrap")
    return max(candidates, key=_num_params)
