"""Tiny models and a local character tokenizer, built from configs with nothing downloaded.

Used by tests, benchmarks and the built-in offline default. Five decoder-only families are
covered so that family-specific code paths (GQA, learned positions, OPT's offset embeddings,
GPT-2's Conv1D) are all exercised.
"""

from __future__ import annotations

import string
from pathlib import Path

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

FAMILIES: tuple[str, ...] = ("llama", "qwen2", "mistral", "opt", "gpt2")

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


def tiny_config(
    family: str,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_positions: int = 512,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
) -> PretrainedConfig:
    """A small config of the given family; GQA (num_kv_heads < num_heads) where the family has it."""
    ffn = intermediate_size or 2 * hidden_size
    ids = dict(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    if family == "llama":
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=ffn,
            num_hidden_layers=num_layers, num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
            tie_word_embeddings=False, **ids,
        )
    if family == "qwen2":
        return Qwen2Config(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=ffn,
            num_hidden_layers=num_layers, num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
            tie_word_embeddings=True, **ids,
        )
    if family == "mistral":
        return MistralConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=ffn,
            num_hidden_layers=num_layers, num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
            sliding_window=None, tie_word_embeddings=False, **ids,
        )
    if family == "opt":
        return OPTConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, ffn_dim=ffn,
            num_hidden_layers=num_layers, num_attention_heads=num_heads,
            max_position_embeddings=max_positions, word_embed_proj_dim=hidden_size,
            do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0, **ids,
        )
    if family == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size, n_embd=hidden_size, n_layer=num_layers, n_head=num_heads,
            n_positions=max_positions, n_inner=ffn, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, **ids,
        )
    raise ValueError(f"unknown model family {family!r}; expected one of {', '.join(FAMILIES)}")


def build_tiny_model(
    family: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0, **config_kwargs: int
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
    **config_kwargs: int,
) -> Path:
    """Build a tiny model + tokenizer and save both in Hugging Face format to `directory`."""
    directory = Path(directory)
    tokenizer = build_char_tokenizer(add_bos=add_bos)
    model = build_tiny_model(family, tokenizer, seed=seed, **config_kwargs)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
