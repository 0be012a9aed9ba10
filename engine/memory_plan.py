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
  models keep their params in the compute dtype. With LoRA (peft adapters, the base frozen) only
  the adapters (and a value head) have gradients and Adam state, and rollout mode merges every
  adapted weight into a fresh fp32 shard at once before loading the inference copy.
- Gathered params (FSDP2's unsharded copies, in the compute dtype): FSDP2 copies even on one rank.
  At ZeRO-3 each unit (the root too: apply_fsdp passes reshard_after_forward explicitly) is freed
  after its forward and gathered again in backward, so one layer (and the root, around the layers'
  forward and through the backward) is gathered at a time. With reshard_after_forward off (ZeRO
  0-2, and frozen models at ZeRO 1/2) every unit stays gathered after a forward until a backward
  reshards it: after a no-grad forward (rollout parity check, evaluation, critic values) a trained
  model is held whole until its next backward, and such a frozen model for good.
- Activations: the tensors Hugging Face's decoder layers save for backward, per token, counted
  per family from their forward code (`_SAVED`; tests/test_memory_plan.py checks each family
  against autograd's saved tensors). The models' own dropout is not counted (PPO turns dropout
  off; the tiny and most recent models have none); LoRA's adapter dropout is.
- Working sets (no-grad forwards, a layer's backward): the largest set of tensors alive inside
  one layer, about 2 hidden + 3 intermediate widths per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModel, AutoModelForCausalLM

from rlhf.engine.flops import Head, first_config_value
from rlhf.engine.sharding import wraps_in_fsdp
from rlhf.engine.fast_decode import fast_decode_unsupported_reason
from rlhf.engine.decoder_layers import decoder_layers

Shape = tuple[int, ...]

COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = 4


def _first(config: Any, *names: str, default: int | None = None) -> int:
    return int(first_config_value(config, *names, default=default))


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
    trainable_shapes: tuple[Shape, ...] | None = None
    """The parameters that train (LoRA: the adapters, and a value head); None: all of them."""
    root_trainable: int | None = None
    """Trainable elements of the root unit (LoRA: the value head only); None: all of it."""
    adapted_shapes: tuple[Shape, ...] = ()
    """LoRA: the base weights with adapters (merged into fresh tensors at each rollout switch)."""
    adapter_saved: int = 0
    """LoRA: elements each layer's adapters save per token: A's rank-wide output; with dropout,
    also the dropped input and its noise (input-sized) per adapted projection."""
    adapter_dropout: bool = False
    """LoRA with dropout: A keeps the dropped input, so a frozen projection's own input is no
    longer kept (Llama-style: the two norms' outputs and the MLP product)."""
    first_inputs: int = 0
    """LoRA with dropout: the widths of the first layer's projections that read its input (whose
    dropout keeps no noise: frozen embeddings give it no gradient)."""
    frozen_base: bool = False
    """LoRA: norms and the LM head are frozen, so autograd keeps fewer of their inputs."""
    fused_layer_ops: bool = False
    """The layers run a backend's fused layer ops (`Backend.fuses_layers`: the CPU's, for Llama-family
    models in float32): each RMSNorm keeps only its input and rstd, the MLP its gate and up (not act(gate))."""

    @property
    def fuses_layers(self) -> bool:
        return self.fused_layer_ops

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

    @property
    def all_shapes(self) -> tuple[Shape, ...]:
        return tuple(s for layer in self.layer_shapes for s in layer) + self.root_shapes

    @property
    def trainable(self) -> tuple[Shape, ...]:
        return self.all_shapes if self.trainable_shapes is None else self.trainable_shapes

    @property
    def root_trainable_params(self) -> int:
        return self.root_params if self.root_trainable is None else self.root_trainable


def sharded_numel(shapes: tuple[Shape, ...], world: int) -> int:
    """Elements one rank holds of `shapes` sharded on dim 0 over `world` ranks (FSDP2 pads every
    shard to ceil(dim0 / world) rows)."""
    return sum(math.ceil(s[0] / world) * math.prod(s[1:]) if s else 1 for s in shapes)


def _fused_projections(model: torch.nn.Module, layers: torch.nn.ModuleList) -> tuple[Shape, ...]:
    """Shapes of q/k/v and gate/up concatenated per layer by the fast decoder (Llama, Qwen2, Mistral)."""
    model.eval()
    if fast_decode_unsupported_reason(model) is not None:
        return ()
    attn, mlp = layers[0].self_attn, layers[0].mlp
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    fused = [(sum(m.out_features for m in qkv), attn.q_proj.in_features),
             (mlp.gate_proj.out_features + mlp.up_proj.out_features, mlp.gate_proj.in_features)]
    fused += [(sum(m.out_features for m in qkv),)] if attn.q_proj.bias is not None else []
    return tuple(fused)


def _adapter_terms(model: torch.nn.Module, head_shapes: list[Shape]) -> dict[str, Any]:
    """ModelShape's LoRA fields of a model whose adapters are in place (peft's LoraLayers): what
    trains (the adapters, and a value head), the adapted base weights, and what the adapters of
    one layer save per token."""
    from peft.tuners.lora import LoraLayer

    adapted = [m for m in model.modules() if isinstance(m, LoraLayer)]
    per_layer = max(len(decoder_layers(model)), 1)
    rank = sum(m.r["default"] for m in adapted) // per_layer
    dropout = any(not isinstance(m.lora_dropout["default"], torch.nn.Identity) for m in adapted)
    inputs = 2 * sum(m.in_features for m in adapted) // per_layer if dropout else 0
    first = decoder_layers(model)[0]
    reads_input = ("q_proj", "k_proj", "v_proj", "c_attn")  # the projections fed by the layer's first norm
    first_inputs = sum(m.in_features for name, m in first.named_modules()
                       if isinstance(m, LoraLayer) and name.rsplit(".", 1)[-1] in reads_input) if dropout else 0
    return {
        "trainable_shapes": tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad) + tuple(head_shapes),
        "root_trainable": sum(math.prod(s) for s in head_shapes),
        "adapted_shapes": tuple(tuple(m.get_base_layer().weight.shape) for m in adapted),
        "adapter_saved": rank + inputs, "adapter_dropout": dropout, "first_inputs": first_inputs,
        "frozen_base": True,
    }


def model_shape(config: Any, head: Head = "lm", adapt: Callable[[torch.nn.Module], Any] | None = None,
                fused_layer_ops: bool = False) -> ModelShape:
    """The parameter shapes of the causal LM (`head` "lm") or of the value model (backbone plus a
    hidden -> 1 head with bias: reward model, critic) that `config` describes; built on the meta
    device, so no weight is read or allocated. `adapt` changes the model in place first (the
    app's LoRA injection: peft adapters, base frozen); `fused_layer_ops`: the layers will run a backend's
    fused layer ops (see ModelShape.fused_layer_ops)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config) if head == "lm" else AutoModel.from_config(config)
    fused = _fused_projections(model, decoder_layers(model)) if head == "lm" else ()  # the rollout copy is plain
    text = config.get_text_config(decoder=True)
    hidden = _first(text, "hidden_size", "n_embd", "d_model")
    head_shapes: list[Shape] = []
    if head == "value":
        head_shapes = [(1, _first(text, "word_embed_proj_dim", "hidden_size", "n_embd", "d_model")), (1,)]
    lora = {}
    if adapt is not None:
        adapt(model)
        lora = _adapter_terms(model, head_shapes)
    layers = decoder_layers(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = [tuple(p.shape) for p in model.parameters() if id(p) not in in_layers] + head_shapes
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
        fused_projections=fused, fused_layer_ops=fused_layer_ops, **lora,
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
    LoRA adapters (peft) add A's rank-wide output per adapted projection (its input is the base
    projection's, already saved); with dropout, the dropped input and the noise instead of the
    inputs only frozen projections read.
    """
    h, i = shape.hidden, shape.intermediate
    lse = FP32 * shape.heads
    adapters = c * shape.adapter_saved
    dropout = shape.adapter_dropout  # then the inputs only frozen projections read are not kept:
    if shape.model_type == "opt":  # the two LayerNorm outputs
        return c * (8 * h + i + 4) + lse + adapters - (c * 2 * h if dropout else 0)
    if shape.model_type == "gpt2":  # the LayerNorm outputs and the MLP product
        mlp = 5 if shape.activation == "gelu_new" else 2
        return c * (8 * h + mlp * i + 4) + lse + adapters - (c * (2 * h + i) if dropout else 0)
    fused = shape.fuses_layers  # the fused norm keeps its input; its output is the projections' input
    norm = (FP32 + (1 if shape.frozen_base or fused else 2) * c) * h  # a frozen weight's multiply keeps nothing
    unread = c * (2 * h + i) if dropout else 0  # the norms' outputs and the MLP product
    mlp = 3 if fused else 4
    stats = 2 * lse if fused else lse  # the fused attention keeps each row's score max and 1 / sum
    return 2 * norm + c * (2 * shape.q_dim + 2 * shape.kv_dim + mlp * i) + FP32 * 2 + stats + adapters - unread


def _final_saved(shape: ModelShape, c: int) -> int:
    """Bytes the final norm saves per token (its input is the last layer's output), and its output,
    which a trained head keeps (a LoRA model's LM head is frozen; a value head trains)."""
    head_input = 0 if shape.frozen_base and shape.head == "lm" else c * shape.hidden
    if shape.model_type in ("opt", "gpt2"):
        return c * (shape.hidden + 2) + head_input
    normalised = 0 if shape.frozen_base or shape.fuses_layers else c * shape.hidden
    return FP32 * shape.hidden + normalised + head_input + FP32


def saved_activation_bytes(shape: ModelShape, tokens: int, compute_bytes: int, checkpointing: bool = False) -> int:
    """What autograd keeps after a training forward of `tokens` tokens through the decoder (the
    head's outputs are the caller's: logits or values). With activation checkpointing each layer
    keeps only its input (in the compute dtype)."""
    per_layer = compute_bytes * shape.hidden if checkpointing else _layer_saved(shape, compute_bytes)
    return tokens * (shape.layers * per_layer + _final_saved(shape, compute_bytes) - _frozen_input(shape, compute_bytes,
                                                                                                   checkpointing))


def _frozen_input(shape: ModelShape, c: int, checkpointing: bool) -> int:
    """What the first layer does not save when the embeddings are frozen (LoRA): its input needs
    no gradient, so its first norm keeps neither the input nor its statistics."""
    if not shape.frozen_base or checkpointing:
        return 0
    noise = c * shape.first_inputs  # its adapters' dropout keeps no noise either
    if shape.model_type in ("opt", "gpt2"):
        return c * (shape.hidden + 2) + noise
    return FP32 * (shape.hidden + 1) + noise


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
    offload: bool = False

    @property
    def shard_world(self) -> int:
        """Ranks a param is sharded over: the world, or 1 for ZeRO-0 (replicated)."""
        return 1 if self.zero_stage == 0 else self.world_size

    @property
    def plain(self) -> bool:
        """One process in fp32, not offloaded: the engine leaves the model plain
        (`fsdp.wraps_in_fsdp`), so nothing is ever gathered and gradients accumulate in place."""
        dtype = "fp32" if self.compute_bytes == FP32 else "16-bit"  # all the rule asks of the dtype
        return not wraps_in_fsdp(self.world_size, self.offload, dtype, trainable=True)

    def _numel(self, shapes: tuple[Shape, ...]) -> int:
        return sharded_numel(shapes, self.shard_world)

    @property
    def params(self) -> int:
        """fp32 master params (FSDP2's sharded params; mixed precision casts a copy for compute);
        with LoRA the frozen base too."""
        return FP32 * self._numel(self.shape.all_shapes)

    @property
    def grads(self) -> int:
        """fp32 gradients of the trained params after the reduce (sharded like the params); freed
        by each step."""
        return FP32 * self._numel(self.shape.trainable)

    @property
    def adam(self) -> int:
        """exp_avg and exp_avg_sq of the trained params, fp32, sharded (allocated at the first step)."""
        return 2 * self.grads

    @property
    def adam_temporary(self) -> int:
        """torch's foreach AdamW allocates sqrt(exp_avg_sq) for all params at once; the fused op none."""
        return 0 if self.fused_adam else self.grads

    @property
    def root_grad(self) -> int:
        """The root's unsharded gradients (compute dtype), from the head's backward to the last unit's."""
        return 0 if self.plain else self.compute_bytes * self.shape.root_trainable_params

    @property
    def merged_weights(self) -> int:
        """LoRA: the merged copies of the adapted weights (fp32 shards) rollout mode builds at once."""
        return FP32 * self._numel(self.shape.adapted_shapes)

    @property
    def gathered_root(self) -> int:
        return 0 if self.plain else self.compute_bytes * self.shape.root_params

    @property
    def keeps_gathered(self) -> bool:
        """ZeRO 0-2: units stay gathered from a forward until the next backward."""
        return self.zero_stage != 3

    def gathered_layers(self) -> int:
        """Decoder layers gathered while one layer computes: that layer (plus the flat all-gather
        output on several ranks) at ZeRO-3, every layer otherwise."""
        c, largest = self.compute_bytes, self.shape.largest_layer
        if self.plain:
            return 0
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
        return self.grads if self.zero_stage == 3 else FP32 * sum(math.prod(s) for s in self.shape.trainable)


@dataclass(frozen=True)
class FrozenModelMemory:
    """Bytes per rank of a FrozenModel (reference, reward model): compute-dtype params, sharded
    as ZeRO-3 for stage 0 (`sharding_plan(trainable=False)`), no grads, no optimizer. On one
    process it is left unsharded (not offloaded; the plan does not model offload): nothing is
    ever gathered."""

    shape: ModelShape
    zero_stage: int
    compute_bytes: int
    world_size: int

    @property
    def params(self) -> int:
        return self.compute_bytes * sharded_numel(self.shape.all_shapes, self.world_size)

    @property
    def plain(self) -> bool:
        """Left unsharded (`fsdp.wraps_in_fsdp`; the plan does not model a frozen model's offload)."""
        return not wraps_in_fsdp(self.world_size, offload=False, dtype="fp32", trainable=False)

    @property
    def gathered(self) -> int:
        """Gathered for good after the first forward: the whole model at ZeRO 1/2, else nothing."""
        if self.zero_stage not in (1, 2) or self.plain:
            return 0
        return self.compute_bytes * self.shape.params

    @property
    def forward_gathered(self) -> int:
        """Gathered during a forward at ZeRO-3 (sharded: several ranks): the root and one layer,
        plus the flat all-gather output."""
        if self.zero_stage in (1, 2) or self.plain:
            return 0
        return self.compute_bytes * (self.shape.root_params + 2 * self.shape.largest_layer)


def inference_copy_bytes(shape: ModelShape, compute_bytes: int, tp_size: int = 1) -> int:
    """The rollout copy of the actor: the whole model in the compute dtype, its decoder layers'
    projections split over the TP group (norms are small and counted split too)."""
    return compute_bytes * (shape.root_params + math.ceil(sum(shape.layer_params) / tp_size))


def fused_weight_bytes(shape: ModelShape, compute_bytes: int) -> int:
    """The fast decoder's concatenated q/k/v and gate/up weights, for every layer."""
    return compute_bytes * shape.layers * sum(math.prod(s) for s in shape.fused_projections)


__all__ = [
    "COMPUTE_BYTES", "FrozenModelMemory", "ModelShape", "TrainedModelMemory", "fused_weight_bytes",
    "inference_copy_bytes", "layer_saved_bytes", "model_shape", "saved_activation_bytes",
    "sharded_numel", "working_set_bytes",
]
