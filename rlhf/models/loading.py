"""Load tokenizers and causal LMs from local folders or hub names, with clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

from rlhf.errors import UserError

_GENERIC_TOKENIZER_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def _check_source(name_or_path: str, flag: str) -> None:
    path = Path(name_or_path).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        raise UserError(f"{flag} {name_or_path}: is a GGUF file; convert it once with "
                        f"`rlhf models get --gguf {name_or_path} --output DIR` and pass DIR")
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{flag} {name_or_path}: is a file; point it at a Hugging Face model folder")
        if not (path / "config.json").is_file():
            raise UserError(f"{flag} {name_or_path}: folder has no config.json; point it at a Hugging Face model folder")
    elif name_or_path.startswith((".", "/", "~")):
        raise UserError(f"{flag} {name_or_path}: folder not found")
    if not name_or_path:
        raise UserError(f"{flag} is required")


def load_tokenizer(name_or_path: str, flag: str = "--model") -> Any:
    """The model's tokenizer; a folder that names a generic fast tokenizer gets exactly that class.

    (AutoTokenizer would otherwise pick the model family's tokenizer class, whose own
    pre-tokenizer can disagree with a custom tokenizer.json.)
    """
    _check_source(name_or_path, flag)
    try:
        config_file = Path(name_or_path) / "tokenizer_config.json"
        if config_file.is_file():
            tok_class = json.loads(config_file.read_text()).get("tokenizer_class")
            if tok_class in _GENERIC_TOKENIZER_CLASSES:
                tokenizer = PreTrainedTokenizerFast.from_pretrained(name_or_path)
            else:
                tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except OSError as exc:
        raise UserError(f"{flag} {name_or_path}: could not load a tokenizer ({str(exc).splitlines()[0]})") from None
    if tokenizer.pad_token is None:
        # Decoder-only models often ship without a pad token; EOS is the usual stand-in.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(name_or_path: str, flag: str = "--model") -> PreTrainedModel:
    """A causal LM in fp32 (master weights; compute precision comes from the engine)."""
    _check_source(name_or_path, flag)
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype="float32")
    except (OSError, ValueError) as exc:
        raise UserError(f"{flag} {name_or_path}: could not load a causal LM ({str(exc).splitlines()[0]})") from None
    if getattr(model.config, "rlhf_model_type", None) == "value":
        raise UserError(f"{flag} {name_or_path}: is a reward/value model, not a causal LM")
    return model
