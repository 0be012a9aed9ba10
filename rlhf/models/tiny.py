"""Tiny models and a local character tokenizer, built from configs with nothing downloaded.

Used by tests, benchmarks and the built-in offline default. Five decoder-only families are
covered so that family-specific code paths (GQA, learned positions, OPT's offset embeddings,
GPT-2's Conv1D) are all exercised.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from rlhf.engine.fileio import honour_umask

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)

# Human/Assistant dialog format (as in Anthropic HH and DeepSpeed-Chat), as a chat template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if not loop.first and message['role'] != 'assistant' %}{{ '\\n\\n' }}{% endif %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}Human: {{ message['content'] }}\n\n"
    "{% elif message['role'] == 'assistant' %}Assistant: {{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def build_char_tokenizer(add_bos: bool = True) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII plus <pad>, <s>, </s>, <unk> (~100 ids).

    With `add_bos` every encoded text starts with <s>, like Llama's tokenizer, so code that
    must skip a leading BOS is exercised.
    """
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@dataclass(frozen=True)
class FamilySpec:
    """How one family's config spells the shared tiny-model knobs.

    `fields` maps each knob of `tiny_config` to the config fields that take its value (OPT's
    embedding projection must equal its hidden size); a family without a field for a knob (no
    `num_kv_heads` in OPT or GPT-2: no GQA) ignores it. `fixed` switches off what would make a
    tiny test model nondeterministic or unusual (dropout, sliding windows).
    """

    config_class: type[PretrainedConfig]
    fields: dict[str, tuple[str, ...]]
    ties_embeddings: bool
    """The family's own default for tie_word_embeddings (Qwen2, OPT and GPT-2 tie; Llama and Mistral not)."""
    fixed: dict[str, Any] = field(default_factory=dict)


_STANDARD_FIELDS: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size",), "intermediate_size": ("intermediate_size",),
    "num_layers": ("num_hidden_layers",), "num_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads",), "max_positions": ("max_position_embeddings",),
}

FAMILY_SPECS: dict[str, FamilySpec] = {
    "llama": FamilySpec(LlamaConfig, _STANDARD_FIELDS, ties_embeddings=False),
    "qwen2": FamilySpec(Qwen2Config, _STANDARD_FIELDS, ties_embeddings=True),
    "mistral": FamilySpec(MistralConfig, _STANDARD_FIELDS, ties_embeddings=False, fixed={"sliding_window": None}),
    "opt": FamilySpec(
        OPTConfig,
        {"hidden_size": ("hidden_size", "word_embed_proj_dim"), "intermediate_size": ("ffn_dim",),
         "num_layers": ("num_hidden_layers",), "num_heads": ("num_attention_heads",),
         "max_positions": ("max_position_embeddings",)},
        ties_embeddings=True, fixed={"do_layer_norm_before": True, "dropout": 0.0, "attention_dropout": 0.0},
    ),
    "gpt2": FamilySpec(
        GPT2Config,
        {"hidden_size": ("n_embd",), "intermediate_size": ("n_inner",), "num_layers": ("n_layer",),
         "num_heads": ("n_head",), "max_positions": ("n_positions",)},
        ties_embeddings=True, fixed={"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    ),
}

FAMILIES: tuple[str, ...] = tuple(FAMILY_SPECS)


def tiny_config(
    family: str,
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_positions: int = 512,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    tie_word_embeddings: bool | None = None,
) -> PretrainedConfig:
    """A small config of the given family; GQA (num_kv_heads < num_heads) where the family has it.

    `tie_word_embeddings` None keeps the family's own default (see FAMILY_SPECS); True or False
    forces it, so tied and untied variants of one family can both be tested.
    """
    spec = FAMILY_SPECS.get(family)
    if spec is None:
        raise ValueError(f"unknown model family {family!r}; expected one of {', '.join(FAMILIES)}")
    knobs = dict(hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
                 num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, max_positions=max_positions)
    values = {name: knobs[knob] for knob, names in spec.fields.items() for name in names}
    tie = spec.ties_embeddings if tie_word_embeddings is None else tie_word_embeddings
    return spec.config_class(
        vocab_size=vocab_size, pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        tie_word_embeddings=tie, **values, **spec.fixed,
    )


def build_tiny_model(
    family: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0, **config_kwargs: Any
) -> PreTrainedModel:
    """A randomly initialised tiny causal LM of `family` sized to `tokenizer`'s vocabulary."""
    config = tiny_config(
        family,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **config_kwargs,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny_model(
    directory: str | Path, family: str = "llama", seed: int = 0, add_bos: bool = True,
    **config_kwargs: Any,
) -> Path:
    """Build a tiny model + tokenizer and save both in Hugging Face format to `directory`."""
    directory = Path(directory)
    tokenizer = build_char_tokenizer(add_bos=add_bos)
    model = build_tiny_model(family, tokenizer, seed=seed, **config_kwargs)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    honour_umask(directory)  # safetensors writes model.safetensors 0600
    return directory
