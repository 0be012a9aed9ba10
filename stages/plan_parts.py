"""The parts every `rlhf plan` is built from: the setting of a run, a phase's peak, the models'
shapes from their configs (no weights), the output heads' bytes and a trained model's moments.
stages/plan.py plans sft and reward and has the command; stages/plan_ppo.py plans PPO."""

from __future__ import annotations

from collections.abc import Callable

import functools
from dataclasses import dataclass, field
from typing import Any

from transformers import AutoConfig

from rlhf.config import LoRAConfig
from rlhf.engine.backends.base import Backend
from rlhf.engine.logprobs import DEFAULT_CHUNK_BYTES
from rlhf.engine.phase_memory import GIB
from rlhf.engine.memory_plan import (
    FP32, ModelShape, TrainedModelMemory, layer_saved_bytes, model_shape, saved_activation_bytes, working_set_bytes,
)
from rlhf.errors import UserError
from rlhf.models.lora import apply_lora
from rlhf.models.tiny import FAMILIES, build_char_tokenizer, tiny_config

CPU_RUNTIME = int(0.045 * GIB)
"""Fixed CPU cost of a running stage beyond its pre-load RSS (taken after its imports) and its
tensors: code pages of torch's kernels and MKL's GEMM buffers the first step touches, allocator
bookkeeping. Measured after training steps of 10M, 32M and 110M-parameter Llama models (torch 2.13,
one process): 0.041, 0.043 and 0.051 GiB."""

Components = dict[str, int]


@dataclass
class PhasePlan:
    """One phase's predicted peak: the moment it happens and the tensors alive then (bytes per rank)."""

    name: str
    moment: str
    components: Components
    host: Components = field(default_factory=dict)
    """Components a GPU run keeps in host memory (ZeRO-Offload, --offload-ref/--offload-reward)."""

    @property
    def total(self) -> int:
        return sum(self.components.values())


def peak_phase(name: str, moments: dict[str, Components], s: Setting) -> PhasePlan:
    """The phase's peak: its largest moment on the device (zero components dropped; what a GPU
    run offloads counted apart, in host memory)."""

    def device_total(parts: Components) -> int:
        return sum(v for k, v in parts.items() if k not in s.host)

    moment, parts = max(moments.items(), key=lambda kv: device_total(kv[1]))
    return PhasePlan(name, moment, {k: v for k, v in parts.items() if v and k not in s.host},
                     {k: v for k, v in parts.items() if v and k in s.host})


# ------------------------------------------------------------------ model configs


def load_model_config(spec: str, flag: str) -> Any:
    """A model's config from a folder, a config.json file, a hub name, or `tiny` / `tiny:<family>`
    (the built-in tiny model of `rlhf e2e`); no weights are read."""
    if not spec:
        raise UserError(f"{flag} is required: a model folder, its config.json, or tiny[:<family>]")
    if spec == "tiny" or spec.startswith("tiny:"):
        family = spec.partition(":")[2] or "llama"
        if family not in FAMILIES:
            raise UserError(f"{flag} {spec}: unknown tiny family {family!r}; use one of {', '.join(FAMILIES)}")
        return tiny_config(family, vocab_size=len(build_char_tokenizer()))
    try:
        return AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as exc:
        raise UserError(f"{flag} {spec}: no readable config.json ({' '.join(str(exc).split())[:200]}); pass a model "
                        "folder, its config.json or tiny[:<family>]") from None


def shape_of(spec: str, flag: str, head: str, lora: LoRAConfig | None = None,
             fuses_layers: Callable[[str], bool] | None = None) -> ModelShape:
    """The parameter shapes of the model `spec` names (`load_model_config`), as an LM or a value
    model, with the stage's LoRA adapters when `lora` has a rank (injected as the stage does);
    `fuses_layers(model_type)`: whether the run's layers take fused layer ops (Setting.fuses_layers)."""
    adapt = None
    if lora is not None and lora.lora_rank:
        adapt = functools.partial(apply_lora, config=lora)
    config = load_model_config(spec, flag)
    fused = fuses_layers is not None and fuses_layers(str(getattr(config, "model_type", "")))
    return model_shape(config, head, adapt, fused)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Setting:
    """What every phase needs besides the models: compute bytes, world size and the device."""

    dtype: str
    compute: int
    world: int
    device: str
    fused_adam: bool
    host: frozenset[str] = frozenset()
    """Components held in host memory on a GPU (offload); on the CPU everything is one memory."""
    offload: bool = False
    """--offload: the trained models stay in FSDP2 (CPUOffloadPolicy) even on one process."""
    backend: Backend = field(default_factory=Backend)
    """The device backend the run would choose (`plan_backend`: its fused layers, its decode weight copies)."""
    compile: bool = False
    """--compile: layers compiled, not swapped for a backend's fused ones."""

    @property
    def runtime(self) -> int:
        return CPU_RUNTIME if self.device == "cpu" else 0

    def fuses_layers(self, model_type: str) -> bool:
        """A model of `model_type` runs the backend's fused layer ops in this setting (fewer saved activations)."""
        return self.backend.fuses_layers(model_type, self.dtype, self.compile)


def trained(shape: ModelShape, zero: int, s: Setting) -> TrainedModelMemory:
    """The memory terms of a model a TrainEngine trains in setting `s`."""
    return TrainedModelMemory(shape, zero, s.compute, s.world, s.fused_adam, s.offload)


# ------------------------------------------------------------------ heads


def lm_loss_bytes(tokens: int, vocab: int, c: int) -> tuple[int, int]:
    """(forward peak, backward peak) of `sft_loss_sum` over [rows, T, V] logits: the logits, the
    shifted copy (the slice is not contiguous) and its fp32 copy in 16-bit, cross_entropy's
    fp32 log-softmax (saved); backward: that, the NLL gradient and log-softmax's input gradient."""
    logits = tokens * vocab
    upcast = FP32 * logits if c != FP32 else 0
    return logits * (2 * c + FP32) + upcast, 3 * FP32 * logits


def _chunk(rows: int, vocab: int) -> int:
    """fp32 bytes of one chunk of engine/logprobs.py (rows of about DEFAULT_CHUNK_BYTES)."""
    return FP32 * vocab * min(rows, max(1, DEFAULT_CHUNK_BYTES // (FP32 * vocab)))


def selective_logprob_bytes(rows: int, vocab: int, c: int, train: bool, entropy: bool) -> int:
    """Peak of response log-probs (and entropy) over [rows, V] logits (engine/logprobs.py): the
    logits and the forward's fp32 chunk temporaries (a few per chunk with the entropy); in
    training the larger of that and the backward's: the logits' gradient from each term, with
    the temporaries of one chunk of the entropy's backward (log p, p, their product). Measured
    on a 1-chunk [520, 8192] head: 6.3-6.4x the logits, forward and backward alike."""
    logits = c * rows * vocab
    chunk = _chunk(rows, vocab)
    forward = logits + chunk * (5 if entropy else 2)
    if not train:
        return forward
    grads = (2 if entropy else 1) * logits
    return max(forward, logits + grads + chunk * (3 if entropy else 1))


# ------------------------------------------------------------------ a trained model


def train_moments(m: TrainedModelMemory, tokens: int, head: tuple[int, int], checkpointing: bool, accum: int,
                  base: Components, prefix: str) -> dict[str, Components]:
    """The moments of one micro-batch's forward/backward and the optimizer step of trained model m.
    `head`: (forward, backward) peak bytes of its output head (logits or values), which run after
    the root's forward ends (ZeRO-3: all resharded) and before the gradient reaches it."""
    c, shape = m.compute_bytes, m.shape
    held = {**base, "accumulated grads": m.accumulated_grads() if accum > 1 else 0,
            f"{prefix} gathered": m.gathered_after_forward(),
            f"{prefix} activations": saved_activation_bytes(shape, tokens, c, checkpointing)}
    layer_work = working_set_bytes(shape, tokens, c) + (layer_saved_bytes(shape, tokens, c) if checkpointing else 0)
    backward_gathered = 0 if m.keeps_gathered else m.gathered_in_forward()
    return {
        "forward (head)": {**held, "head": head[0]},
        "backward (head)": {**held, "head": head[1]},
        "backward (layers)": {**held, f"{prefix} gathered for backward": backward_gathered,
                              f"{prefix} root grad": m.root_grad, "layer working set": layer_work},
        "optimizer step": {**base, f"{prefix} grads": m.grads, "adam temporary": m.adam_temporary},
    }


__all__ = [
    "CPU_RUNTIME", "Components", "PhasePlan", "Setting", "lm_loss_bytes", "load_model_config", "peak_phase",
    "selective_logprob_bytes", "shape_of", "train_moments", "trained",
]
