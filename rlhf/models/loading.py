"""Load tokenizers and causal LMs from local folders or hub names, with clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast,
)

from rlhf.errors import UserError, path_in_traceback
from rlhf.models.checks import check_finite
from rlhf.models.sharded_loading import (
    local_checkpoint, parameters_on_meta, plan_shard_loading, renamed_by_transformers, with_or_without_prefix,
)

if TYPE_CHECKING:
    from rlhf.engine.fsdp import ShardLoader

_GENERIC_TOKENIZER_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}
# Files one of which every saved tokenizer has (fast, SentencePiece, BPE, WordPiece, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.tiktoken", "merges.txt")


def _check_tokenizer_files(name_or_path: str, flag: str) -> None:
    """A local folder without tokenizer files fails here, naming what is missing: transformers
    would instead try to build a slow tokenizer and ask to install sentencepiece."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{flag} {name_or_path}: folder has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, "
                        "...); save the tokenizer into it (tokenizer.save_pretrained) or copy it from the base model")


def check_model_files(name_or_path: str, flag: str = "--model") -> None:
    """A local model folder holds config.json and tokenizer files (a hub name is left to the hub):
    the checks `load_tokenizer` makes, for a command to run before it writes anything."""
    _check_source(name_or_path, flag)
    _check_tokenizer_files(name_or_path, flag)


def _load_failure(flag: str, name_or_path: str, what: str, exc: Exception) -> UserError:
    """One line for a model folder transformers cannot read; a truncated or corrupt weights file
    (safetensors names no file) is named with the fix."""
    message = " ".join(str(exc).split())[:400] or type(exc).__name__
    if type(exc).__name__ == "SafetensorError":
        weights = path_in_traceback(exc, (".safetensors",)) or f"{name_or_path}/*.safetensors"
        return UserError(f"{flag} {name_or_path}: {weights} is truncated or corrupt ({message}); copy or export "
                         "the model folder again")
    return UserError(f"{flag} {name_or_path}: could not load {what} ({message})")


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


def load_tokenizer(name_or_path: str, flag: str = "--model", chat_template: str | None = None) -> Any:
    """The model's tokenizer; a folder that names a generic fast tokenizer gets exactly that class.
    `chat_template`: a Jinja file whose template replaces the tokenizer's (--chat-template); the
    tokenizer saved with a stage's model carries it.

    (AutoTokenizer would otherwise pick the model family's tokenizer class, whose own
    pre-tokenizer can disagree with a custom tokenizer.json.)
    """
    _check_source(name_or_path, flag)
    _check_tokenizer_files(name_or_path, flag)
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
    except (OSError, ValueError) as exc:
        raise _load_failure(flag, name_or_path, "a tokenizer", exc) from None
    if tokenizer.pad_token is None:
        # Decoder-only models often ship without a pad token; EOS is the usual stand-in.
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(path: str) -> str:
    """The text of a --chat-template file, checked to be a Jinja template."""
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--chat-template {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"--chat-template {path} line {exc.lineno}: not a valid Jinja template ({exc.message})") from None
    if "messages" not in text:
        raise UserError(f"--chat-template {path}: the template never reads `messages`; it is not a chat template")
    return text


def load_causal_lm(name_or_path: str, flag: str = "--model") -> PreTrainedModel:
    """A causal LM in fp32 (master weights; compute precision comes from the engine); a NaN or
    infinite weight is one UserError naming the tensor (rlhf/models/checks.py)."""
    _check_source(name_or_path, flag)
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype="float32")
    except (OSError, ValueError, SafetensorError) as exc:
        raise _load_failure(flag, name_or_path, "a causal LM", exc) from None
    except RuntimeError as exc:
        if "mismatched_sizes" not in str(exc) and "size mismatch" not in str(exc):
            raise  # out of memory and the like: the CLI's handler says what to do
        raise UserError(f"{flag} {name_or_path}: its weights do not match the shapes in its config.json; restore the "
                        "config.json the weights were saved with") from None
    if getattr(model.config, "rlhf_model_type", None) == "value":
        raise UserError(f"{flag} {name_or_path}: is a reward/value model, not a causal LM")
    check_finite(model.named_parameters(), f"{flag} {name_or_path}")
    return model


def deferred_causal_lm(name_or_path: str, flag: str = "--model") -> tuple[PreTrainedModel, ShardLoader | None]:
    """The causal LM an engine trains or runs (fp32 master weights), for sharded loading: built on
    the meta device with a loader of each rank's shards when `name_or_path` is a local folder with
    safetensors weights (rlhf/models/sharded_loading.py); otherwise loaded in full by
    `load_causal_lm`, with no loader. Either way the pair goes to TrainEngine / FrozenModel."""
    _check_source(name_or_path, flag)
    folder = Path(name_or_path).expanduser()
    try:
        checkpoint = local_checkpoint(folder, f"{flag} {name_or_path}")
        config = AutoConfig.from_pretrained(name_or_path) if checkpoint is not None else None
    except (OSError, ValueError, SafetensorError) as exc:
        raise _load_failure(flag, name_or_path, "a causal LM", exc) from None
    if config is not None and getattr(config, "rlhf_model_type", None) == "value":
        raise UserError(f"{flag} {name_or_path}: is a reward/value model, not a causal LM")
    if checkpoint is None or config is None or getattr(config, "quantization_config", None) is not None:
        return load_causal_lm(name_or_path, flag), None
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if renamed_by_transformers(model, checkpoint):
        return load_causal_lm(name_or_path, flag), None
    model.eval()  # as from_pretrained returns it
    if model.can_generate() and (folder / "generation_config.json").is_file():
        try:
            model.generation_config = GenerationConfig.from_pretrained(folder)
        except (OSError, ValueError) as exc:
            raise _load_failure(flag, name_or_path, "its generation_config.json", exc) from None
    weights = plan_shard_loading(model, checkpoint, folder, f"{flag} {name_or_path}",
                                 with_or_without_prefix(model.base_model_prefix),
                                 ignored=tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()))
    return model, weights


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Every dropout layer of `model` set to p = 0, as TRL's `disable_dropout_in_model`: a reward
    model's scores (and PPO's ratio) then compare the same function in training and evaluation."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model
