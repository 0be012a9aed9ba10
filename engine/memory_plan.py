"""A model of what the engine allocates, from a model config alone: the building blocks of `rlhf plan`.

    shape = model_shape(config, head="lm")                  # parameter shapes per FSDP2 unit (meta device)
    actor = TrainedModelMemory(shape, zero_stage=3, compute_bytes=2, world_size=8)
    actor.params, actor.adam, actor.gathered_root           # bytes per rank
    saved_activation_bytes(shape, tokens, compute_bytes)    # what autograd keeps in a forward

Each term is a count of tensors the code holds, not a fitted constant:
- Parameters: the model is built on the meta device (no weights) and split as FSDP2 wraps it, one
  unit per decoder layer plus the root (embeddings, final norm, heads). A sharded tensor holds
  ceil(dim0 / world) rows on every rank (FSDP2 pads the last shard). Trained models keep fp32
  params, fp32 gradients after the reduce and two fp32 Adam moments (the fused and the torch
  AdamW alike; torch's foreach step adds one fp32 temporary the size of the params). Frozen
  models keep their params in the compute dtype.
- Gathered params (FSDP2's unsharded copies, in the compute dtype): FSDP2 copies even on one rank.
  At ZeRO-3 each unit (the root too: apply_fsdp passes reshard_after_forward explicitly) is freed
  after its forward and gathered again in backward, so one layer (and the root, around the layers'
  forward and through the backward) is gathered at a time. With reshard_after_forward off (ZeRO
  0-2, and frozen models at ZeRO 1/2) every unit stays gathered after a forward until a backward
  reshards it: after a no-grad forward (rollout parity check, evaluation, critic values) a trained
  model is held whole until its next backward, and such a frozen model for good.
- Activations: the tensors Hugging Face's decoder layers save for backward, per token, counted
  per family from their forward code (`_SAVED`; tests/test_memory_plan.py checks each family
  against autograd's saved tensors). Dropout masks are not counted (PPO turns dropout off; the
  tiny and most recent models have none).
- Working sets (no-grad forwards, a layer's backward): the largest set of tensors alive inside
  one layer, about 2 hidden + 3 intermediate widths per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import AutoModel, AutoModelForCausalLM

from rlhf.engine.layers import decoder_layers

Head = Literal["lm", "value"]
Shape = tuple[int, ...]

COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = 4


def _first(config: Any, *names: str, default: int | None = None) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    if default is None:
        raise ValueError(f"model config has none of {names}")
    return default


@dataclass(frozen=True)
class ModelShape:
    """Parameter shapes by FSDP2 unit and the widths activations scale with."""

    model_type: str
    head: Head
    layer_shapes: tuple[tuple[Shape, ...], ...]
    """Each decoder layer's parameter shapes (one FSDP2 unit per layer)."""
    root_shapes: tuple[Shape, ...]
    """Parameters outside the layers: embeddings, final norm, LM or value head (the root unit)."""
    hidden: int
    q_dim: int
    kv_dim: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    activation: str
    fused_projections: tuple[Shape, ...] = ()
    """Per layer, the weights `FastLlamaDecoder` concatenates (q/k/v, gate/up); empty where it does not run."""

    @property
    def layers(self) -> int:
        return len(self.layer_shapes)

    @property
    def layer_params(self) -> list[int]:
        return [sum(math.prod(s) for s in layer) for layer in self.layer_shapes]

    @property
    def root_params(self) -> int:
        return sum(math.prod(s) for s in self.root_shapes)

    @property
    def params(self) -> int:
        return sum(self.layer_params) + self.root_params

    @property
    def largest_layer(self) -> int:
        return max(self.layer_params, default=0)


def sharded_numel(shapes: tuple[Shape, ...], world: int) -> int:
    """Elements one rank holds of `shapes` sharded on dim 0 over `world` ranks (FSDP2 pads every
    shard to ceil(dim0 / world) rows)."""
    return sum(math.ceil(s[0] / world) * math.prod(s[1:]) if s else 1 for s in shapes)


def _fused_projections(model: torch.nn.Module, layers: torch.nn.ModuleList) -> tuple[Shape, ...]:
    """Shapes of q/k/v and gate/up concatenated per layer by the fast decoder (Llama, Qwen2, Mistral)."""
    from rlhf.engine.fast_decode import fast_decode_unsupported_reason

    model.eval()
    if fast_decode_unsupported_reason(model) is not None:
        return ()
    attn, mlp = layers[0].self_attn, layers[0].mlp
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    fused = [(sum(m.out_features for m in qkv), attn.q_proj.in_features),
             (mlp.gate_proj.out_features + mlp.up_proj.out_features, mlp.gate_proj.in_features)]
    fused += [(sum(m.out_features for m in qkv),)] if attn.q_proj.bias is not None else []
    return tuple(fused)


def model_shape(config: Any, head: Head = "lm") -> ModelShape:
    """The parameter shapes of the causal LM (`head` "lm") or of the value model (backbone plus a
    hidden -> 1 head with bias: reward model, critic) that `config` describes; built on the meta
    device, so no weight is read or allocated."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config) if head == "lm" else AutoModel.from_config(config)
    layers = decoder_layers(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = [tuple(p.shape) for p in model.parameters() if id(p) not in in_layers]
    text = config.get_text_config(decoder=True)
    hidden = _first(text, "hidden_size", "n_embd", "d_model")
    if head == "value":
        out = _first(text, "word_embed_proj_dim", "hidden_size", "n_embd", "d_model")
        root += [(1, out), (1,)]
    heads = _first(text, "num_attention_heads", "n_head")
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = _first(text, "num_key_value_heads", default=heads)
    return ModelShape(
        model_type=str(getattr(text, "model_type", "")), head=head,
        layer_shapes=tuple(tuple(tuple(p.shape) for p in layer.parameters()) for layer in layers),
        root_shapes=tuple(root), hidden=hidden, q_dim=heads * head_dim, kv_dim=kv_heads * head_dim,
        intermediate=_first(text, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden), heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, vocab=_first(text, "vocab_size"),
        activation=str(getattr(text, "hidden_act", None) or getattr(text, "activation_function", "")),
        fused_projections=_fused_projections(model, layers) if head == "lm" else (),
    )


# ------------------------------------------------------------------ activations


def _layer_saved(shape: ModelShape, c: int) -> int:
    """Bytes one decoder layer saves for backward per token (c: compute dtype bytes).

    Llama/Qwen2/Mistral: each RMSNorm keeps its fp32 input (the input itself in fp32), the
    normalised and the scaled output (2 x compute); attention keeps q and k after RoPE, v, and
    SDPA's output (also o_proj's input) plus its fp32 log-sum-exp per head; the MLP keeps gate,
    act(gate), up and their product; each norm an fp32 rsqrt.
    OPT: two LayerNorms (input, output, mean, rstd), q, k, v, the attention output, ReLU's output.
    GPT-2: two LayerNorms, the fused qkv output, the attention output, and gelu_new's five
    intermediates (x, tanh, 0.5x, 1 + tanh, the product; 2 for an activation torch fuses).
    """
    h, i = shape.hidden, shape.intermediate
    lse = FP32 * shape.heads
    if shape.model_type == "opt":
        return c * (8 * h + i + 4) + lse
    if shape.model_type == "gpt2":
        mlp = 5 if shape.activation == "gelu_new" else 2
        return c * (8 * h + mlp * i + 4) + lse
    return 2 * (FP32 + 2 * c) * h + c * (2 * shape.q_dim + 2 * shape.kv_dim + 4 * i) + FP32 * 2 + lse


def _final_saved(shape: ModelShape, c: int) -> int:
    """Bytes the final norm saves per token (its input is the last layer's output)."""
    if shape.model_type in ("opt", "gpt2"):
        return c * (2 * shape.hidden + 2)
    return (FP32 + 2 * c) * shape.hidden + FP32


def saved_activation_bytes(shape: ModelShape, tokens: int, compute_bytes: int, checkpointing: bool = False) -> int:
    """What autograd keeps after a training forward of `tokens` tokens through the decoder (the
    head's outputs are the caller's: logits or values). With activation checkpointing each layer
    keeps only its input (in the compute dtype)."""
    per_layer = compute_bytes * shape.hidden if checkpointing else _layer_saved(shape, compute_bytes)
    return tokens * (shape.layers * per_layer + _final_saved(shape, compute_bytes))


def layer_saved_bytes(shape: ModelShape, tokens: int, compute_bytes: int) -> int:
    """One layer's saved tensors: what a checkpointed layer recomputes in its backward."""
    return tokens * _layer_saved(shape, compute_bytes)


def working_set_bytes(shape: ModelShape, tokens: int, compute_bytes: int) -> int:
    """The tensors alive inside one layer at its widest point (the MLP: residual, normalised
    input, and three intermediate-wide tensors), for a no-grad forward or a layer's backward;
    fp32 norm temporaries in 16-bit."""
    upcast = FP32 * shape.hidden if compute_bytes != FP32 else 0
    return tokens * (compute_bytes * (2 * shape.hidden + 3 * shape.intermediate) + upcast)


# ------------------------------------------------------------------ models by role


@dataclass(frozen=True)
class TrainedModelMemory:
    """Bytes per rank of a model a TrainEngine trains (FSDP2 + AdamW), per ZeRO stage."""

    shape: ModelShape
    zero_stage: int
    compute_bytes: int
    world_size: int
    fused_adam: bool = True

    @property
    def shard_world(self) -> int:
        """Ranks a param is sharded over: the world, or 1 for ZeRO-0 (replicated)."""
        return 1 if self.zero_stage == 0 else self.world_size

    def _numel(self, shapes: tuple[Shape, ...]) -> int:
        return sharded_numel(shapes, self.shard_world)

    @property
    def params(self) -> int:
        """fp32 master params (FSDP2's sharded params; mixed precision casts a copy for compute)."""
        shapes = tuple(s for layer in self.shape.layer_shapes for s in layer) + self.shape.root_shapes
        return FP32 * self._numel(shapes)

    @property
    def adam(self) -> int:
        """exp_avg and exp_avg_sq, fp32, sharded like the params (allocated at the first step)."""
        return 2 * self.params

    @property
    def grads(self) -> int:
        """fp32 gradients after the reduce (sharded like the params); freed by each step."""
        return self.params

    @property
    def adam_temporary(self) -> int:
        """torch's foreach AdamW allocates sqrt(exp_avg_sq) for all params at once; the fused op none."""
        return 0 if self.fused_adam else self.params

    @property
    def gathered_root(self) -> int:
        return self.compute_bytes * self.shape.root_params

    @property
    def keeps_gathered(self) -> bool:
        """ZeRO 0-2: units stay gathered from a forward until the next backward."""
        return self.zero_stage != 3

    def gathered_layers(self) -> int:
        """Decoder layers gathered while one layer computes: that layer (plus the flat all-gather
        output on several ranks) at ZeRO-3, every layer otherwise."""
        c, largest = self.compute_bytes, self.shape.largest_layer
        if self.keeps_gathered:
            return c * sum(self.shape.layer_params)
        flat = largest if self.world_size > 1 else 0  # all-gather output before the copy-out
        return c * (largest + flat)

    def gathered_in_forward(self) -> int:
        """Gathered while a layer computes in a forward: the root (the layers run inside its
        forward) and the layer, or the whole model at ZeRO 0-2."""
        return self.gathered_root + self.gathered_layers()

    def gathered_after_forward(self) -> int:
        """What stays gathered after a forward until the next backward: nothing at ZeRO-3, the
        whole model otherwise (see the module docstring)."""
        return self.gathered_root + self.gathered_layers() if self.keeps_gathered else 0

    def accumulated_grads(self) -> int:
        """Grads held between the micro-batches of one step: sharded after each micro-batch's
        reduce (ZeRO-3), unsharded fp32 until the last one otherwise (no sync in between)."""
        return self.grads if self.zero_stage == 3 else FP32 * self.shape.params


@dataclass(frozen=True)
class FrozenModelMemory:
    """Bytes per rank of a FrozenModel (reference, reward model): compute-dtype params, sharded
    as ZeRO-3 for stage 0 (`sharding_plan(trainable=False)`), no grads, no optimizer."""

    shape: ModelShape
    zero_stage: int
    compute_bytes: int
    world_size: int

    @property
    def params(self) -> int:
        shapes = tuple(s for layer in self.shape.layer_shapes for s in layer) + self.shape.root_shapes
        return self.compute_bytes * sharded_numel(shapes, self.world_size)

    @property
    def gathered(self) -> int:
        """Gathered for good after the first forward: the whole model at ZeRO 1/2, else nothing."""
        if self.zero_stage not in (1, 2):
            return 0
        return self.compute_bytes * self.shape.params

    @property
    def forward_gathered(self) -> int:
        """Gathered during a forward at ZeRO-3: the root and one layer (plus the flat all-gather
        output on several ranks)."""
        if self.zero_stage in (1, 2):
            return 0
        flat = self.shape.largest_layer if self.world_size > 1 else 0
        return self.compute_bytes * (self.shape.root_params + self.shape.largest_layer + flat)


def inference_copy_bytes(shape: ModelShape, compute_bytes: int, tp_size: int = 1) -> int:
    """The rollout copy of the actor: the whole model in the compute dtype, its decoder layers'
    projections split over the TP group (norms are small and counted split too)."""
    return compute_bytes * (shape.root_params + math.ceil(sum(shape.layer_params) / tp_size))


def fused_weight_bytes(shape: ModelShape, compute_bytes: int) -> int:
    """The fast decoder's concatenated q/k/v and gate/up weights, for every layer."""
    return compute_bytes * shape.layers * sum(math.prod(s) for s in shape.fused_projections)


__all__ = [
    "COMPUTE_BYTES", "FrozenModelMemory", "ModelShape", "TrainedModelMemory", "fused_weight_bytes",
    "inference_copy_bytes", "layer_saved_bytes", "model_shape", "saved_activation_bytes", "sharded_numel",
    "working_set_bytes",
]
