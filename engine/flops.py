"""Model FLOPs of a decoder-only transformer, counted from its config and real token counts.

    shape = TransformerShape.from_config(model.config)
    forward_flops(shape, prompt_lens, response_lens)              # teacher-forced forward, padding excluded
    generation_flops(shape, prompt_lens, response_lens, group)    # prefill once per prompt + one step per token

What is counted is the work the algorithm needs, as the MFU convention counts it (PaLM, appendix
B): 2 FLOPs per multiply-add of every linear layer for every real token, the attention products
(QK^T and AV) over the causal pairs of real tokens, and the LM head only where a logit is used
(the positions that score a response token). Padding, masked attention pairs, elementwise ops
and the head of positions nobody reads are not counted, so a run that computes them shows up
as a lower fraction of the compute bound. A backward costs twice its forward. As in MFU, every
real token counts through every layer whatever an implementation leaves out: the fast prefill
(engine/fast_decode.py) runs only the keys and values of its last layer before the last position
(~1% of a PPO iteration's count on a 4-layer tiny Llama), which is counted all the same.

Supports the config fields of the Llama, Qwen2, Mistral, OPT and GPT-2 families.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

Head = Literal["lm", "value"]


def first_config_value(config: Any, *names: str, default: Any = None) -> Any:
    """The first of `names` a model config sets (families name the same width differently:
    n_embd, hidden_size, ...), else `default`; ValueError when neither exists."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is None:
        raise ValueError(f"model config has none of {names}")
    return default


@dataclass(frozen=True)
class TransformerShape:
    """The sizes that set a decoder's matmul work."""

    layers: int
    hidden: int
    q_dim: int
    """heads x head_dim: the width of queries (and of the attention output)."""
    kv_dim: int
    """kv_heads x head_dim (GQA: narrower than q_dim)."""
    intermediate: int
    gated_mlp: bool
    """SwiGLU-style MLP (gate, up, down) rather than two projections."""
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> TransformerShape:
        """From a Hugging Face config (a value model's backbone config works too)."""
        config = getattr(config, "text_config", None) or config
        hidden = first_config_value(config, "hidden_size", "n_embd", "d_model")
        heads = first_config_value(config, "num_attention_heads", "n_head")
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        model_type = getattr(config, "model_type", "")
        gated = model_type not in ("gpt2", "opt")
        intermediate = first_config_value(config, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden)
        return cls(layers=first_config_value(config, "num_hidden_layers", "n_layer"), hidden=hidden, q_dim=heads * head_dim,
                   kv_dim=kv_heads * head_dim, intermediate=intermediate, gated_mlp=gated,
                   vocab=first_config_value(config, "vocab_size"))

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of one layer's linears: q, k, v, o, then the MLP's."""
        h, i = self.hidden, self.intermediate
        attention = [(h, self.q_dim), (h, self.kv_dim), (h, self.kv_dim), (self.q_dim, h)]
        mlp = [(h, i), (h, i), (i, h)] if self.gated_mlp else [(h, i), (i, h)]
        return attention + mlp

    @property
    def layer_linear_flops(self) -> int:
        """FLOPs of one token through one layer's linears."""
        return 2 * sum(a * b for a, b in self.linear_shapes())

    def head_flops(self, head: Head) -> int:
        """FLOPs of one position through the output head (a value head is one output)."""
        return 2 * self.hidden * (self.vocab if head == "lm" else 1)


def _pairs(start: int, end: int) -> int:
    """Causal (query, key) pairs of the queries at positions start..end-1 (keys 0..query)."""
    return (end * (end + 1) - start * (start + 1)) // 2


def _span_flops(shape: TransformerShape, start: int, end: int) -> int:
    """Tokens start..end-1 of a row through every layer, attending to everything before them."""
    tokens = end - start
    attention = 4 * shape.q_dim * _pairs(start, end)  # QK^T and AV, 2 FLOPs per multiply-add each
    return shape.layers * (tokens * shape.layer_linear_flops + attention)


def forward_flops(shape: TransformerShape, prompt_lens: Sequence[int], response_lens: Sequence[int],
                  head: Head = "lm", shared_prompt_rows: int = 1) -> int:
    """One teacher-forced forward over rows of prompt + response real tokens.

    head "lm": logits at the positions that score the response (response_len per row); "value":
    a value per response position (critic) or one per row (reward model: the difference is a
    1-wide head, noise). With `shared_prompt_rows` = N > 1, each run of N consecutive rows shares
    its prompt, which runs once (`engine/prompt_sharing.py`).
    """
    total = 0
    for row, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        total += _span_flops(shape, p, p + r) + r * shape.head_flops(head)
        if row % shared_prompt_rows == 0:
            total += _span_flops(shape, 0, p)
    return total


def prefill_flops(shape: TransformerShape, prompt_lens: Sequence[int], samples_per_prompt: int = 1) -> int:
    """Each prompt's prefill, once per group of `samples_per_prompt` rows (its last position's logits)."""
    return sum(_span_flops(shape, 0, p) + shape.head_flops("lm")
               for row, p in enumerate(prompt_lens) if row % samples_per_prompt == 0)


def decode_flops(shape: TransformerShape, prompt_lens: Sequence[int], response_lens: Sequence[int]) -> int:
    """One decode step per sampled token after the first (each token but the last is fed back,
    attending to the KV cache), with its logits."""
    total = 0
    for p, r in zip(prompt_lens, response_lens, strict=True):
        fed = max(r - 1, 0)
        total += _span_flops(shape, p, p + fed) + fed * shape.head_flops("lm")
    return total


def generation_flops(shape: TransformerShape, prompt_lens: Sequence[int], response_lens: Sequence[int],
                     samples_per_prompt: int = 1) -> int:
    """Sampling response_len tokens after each prompt with a KV cache: the prompt's prefill once
    per group of `samples_per_prompt` rows, then one decode step per further token."""
    return prefill_flops(shape, prompt_lens, samples_per_prompt) + decode_flops(shape, prompt_lens, response_lens)


def training_flops(forward: int) -> int:
    """Forward plus backward (input and weight gradients: twice the forward)."""
    return 3 * forward


__all__ = ["TransformerShape", "decode_flops", "forward_flops", "generation_flops", "prefill_flops", "training_flops"]
