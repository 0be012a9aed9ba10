"""Rollout generation for any Hugging Face decoder-only model.

    out = generate(model, input_ids, attention_mask, SamplingParams(max_new_tokens=64,
                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id), generator=g)
    out.sequences     [B, P+N]  prompt (left-padded) + generated tokens, pad after EOS
    out.action_mask   [B, P+N]  True on generated tokens up to and including EOS

The loop is small in the manner of gpt-fast: every buffer, the KV cache included, is allocated
once for prompt + max_new_tokens (engine/kv_cache.py), then a prefill step runs the prompt and
one decode step per token feeds the model a single column and samples from its last logits
(engine/sampling.py). Inside a decode step nothing reads a device value on the host: finished
sequences are handled with `torch.where` (they keep emitting pad) and the only host sync is the
"all finished?" check every `sync_every` steps. Positions follow the left padding exactly as
`transformers.generate` computes them, so greedy output matches it token for token.

The model stays a plain Hugging Face module called through its own forward, so the same loop
runs on a tensor-parallel model whose parameters are DTensors. Under tensor parallelism every
rank of the group must draw the same tokens: pass a generator seeded identically on all ranks.
This torch loop is the reference that faster paths (CUDA graphs, csrc kernels) must match.

`generate(..., fast="auto")` (the default) runs Llama, Qwen2 and Mistral models through the device
backend's fast decoder (`Backend.fast_decoder`: `FastLlamaDecoder`, engine/fast_decode.py, or a
backend's subclass of it), the same math as plain functions over the model's weights, which skips
the Python overhead of the HF forward; anything it does not support (other families, sliding
windows, DTensor parameters, hooks, ...) takes the HF forward, and `fast=False` always does. A
backend's fused sampler and step recorder run behind the same calls (engine/next_token.py); every
one matches the torch path, and `generation_kernels(False)` (engine/backends/base.py) runs the torch
path only. The loop itself is engine/decode_loop.py; a backend's decoder may run it over groups of
rows, with the same draws, so the same tokens.

Group sampling (`samples_per_prompt=N`, as GRPO-style estimators need) prefills the B unique
prompts once, then `StepRunner.expand` copies each prompt's KV cache rows to its N samples'
rows and decoding runs over all B * N rows: the prompt costs one prefill, not N.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import nn
from transformers import PretrainedConfig

from rlhf.engine.backends.registry import backend_for
from rlhf.engine.backends.base import generation_kernels_enabled
from rlhf.engine.decode_loop import DecodeLoop, Transcript, sampled_logprobs
from rlhf.engine.fast_decode import fast_decode_unsupported_reason, support_checked_once
from rlhf.engine.kv_cache import RolloutKVCache, available_memory_bytes, cache_argument, kv_cache_bytes
from rlhf.engine.next_token import sample_next_token
from rlhf.engine.positions import position_ids_from_mask
from rlhf.engine.sampling import KVCacheDtype, SamplingParams
from rlhf.errors import UserError
from rlhf.logging import get_logger

log = get_logger(__name__)

__all__ = ["GenerationOutput", "GenerationTooLarge", "SamplingParams", "check_generation_fits", "check_rollout_fits",
           "generate", "group_index", "prefill", "decode_step", "sampled_logprobs", "select_runner"]


@dataclass
class GenerationOutput:
    """A batch of rollouts, all of width prompt_length + max_new_tokens."""

    sequences: torch.Tensor
    """[B, P+N] int64: the left-padded prompts followed by the generated tokens; pad after EOS."""
    attention_mask: torch.Tensor
    """[B, P+N]: the prompt mask followed by action_mask (dtype of the input mask)."""
    action_mask: torch.Tensor
    """[B, P+N] bool: True exactly on generated tokens, up to and including each EOS."""
    prompt_length: int
    """P, the padded prompt width; generated tokens start at this column."""
    finished: torch.Tensor
    """[B] bool: the sequence emitted EOS (False where it ran into max_new_tokens)."""
    logprobs: torch.Tensor | None = None
    """[B, P+N] float32: each generated token's log-prob under the model's raw logits (before
    temperature, top-k/p and the min_new_tokens EOS mask: the distribution a training forward
    scores), at the token's column; 0 elsewhere. PPO takes them as the rollout policy's
    log-probs instead of running the actor again."""

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] number of generated tokens of each sequence, EOS included."""
        return self.action_mask.sum(dim=-1)


def accepts_logits_to_keep(model: nn.Module) -> bool:
    """The model's forward takes transformers' `logits_to_keep` (the LM head on the last positions only)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _last_logits(logits: torch.Tensor) -> torch.Tensor:
    """[B, T, V] -> [B, V] of the last position, as a plain (possibly gathered) tensor."""
    last = logits[:, -1]
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(last, DTensor):  # a TP lm_head that leaves its output sharded
            last = last.full_tensor()
    return last


def _cached_forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor, cache: RolloutKVCache, **kwargs: int) -> torch.Tensor:
    """The model's own forward over `cache` (which it extends); -> [B, V] logits of the last position."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                **cache_argument(model, cache), use_cache=True, **kwargs)
    return _last_logits(out.logits)


def prefill(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
            cache: RolloutKVCache) -> torch.Tensor:
    """Run the prompt through the model, filling the cache; -> [B, V] logits of the last position."""
    kwargs = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
    return _cached_forward(model, input_ids, attention_mask, position_ids, cache, **kwargs)


def decode_step(model: nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                cache: RolloutKVCache) -> torch.Tensor:
    """Feed one new token per sequence ([B, 1]) at `position_ids` ([B, 1]); -> [B, V] next logits.

    `attention_mask` covers every cached token plus this one ([B, cached + 1]).
    """
    return _cached_forward(model, tokens, attention_mask, position_ids, cache)


class StepRunner(Protocol):
    """One rollout's forward passes: `prefill` once, then `decode` once per new token."""

    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """Left-padded prompts [B, P] -> [B, V] logits of the last position; fills the cache."""
        ...

    def decode(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One token per sequence [B, 1]; `attention_mask` [B, cached + 1] -> [B, V] next logits."""
        ...

    def expand(self, index: torch.Tensor) -> None:
        """After prefill: rows `index` ([B'] int64) of the cache become its B' rows (group sampling)."""
        ...

    def run(self, loop: DecodeLoop) -> int:
        """The decode loop over this runner's rows (`loop.run_all(self)`, or in groups of rows);
        -> the steps it ran."""
        ...


class HFForwardRunner:
    """The reference path: the model's own forward over a `RolloutKVCache`."""

    def __init__(self, model: nn.Module, max_len: int) -> None:
        self.model = model
        self.cache = RolloutKVCache(model.config, max_cache_len=max_len)

    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        return prefill(self.model, input_ids, attention_mask, position_ids, self.cache)

    def decode(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return decode_step(self.model, tokens, attention_mask, position_ids, self.cache)

    def expand(self, index: torch.Tensor) -> None:
        # Under tensor parallelism the cache holds this rank's heads as plain local tensors with
        # the full batch, so selecting rows along dim 0 is the same on every rank.
        self.cache.batch_select_indices(index)

    def run(self, loop: DecodeLoop) -> int:
        return loop.run_all(self)


_logged_fallbacks: set[str] = set()


def select_runner(model: nn.Module, batch: int, max_len: int, fast: bool | Literal["auto"] = "auto",
                  kv_cache_dtype: KVCacheDtype = "model") -> StepRunner:
    """The fast decoder where it supports `model` (and `fast` allows it), else the HF forward.

    fast=True insists on the fast path (ValueError naming the reason when it cannot run);
    "auto" falls back to the HF forward, logging the reason once per distinct reason.
    `kv_cache_dtype` is the fast decoder's (SamplingParams.kv_cache_dtype); the HF forward keeps
    its own cache in the model's dtype.
    """
    if fast is False:
        return HFForwardRunner(model, max_len)
    reason = fast_decode_unsupported_reason(model)
    if reason is None:
        return backend_for(next(model.parameters()).device).fast_decoder(model, batch, max_len, kv_cache_dtype)
    if fast is True:
        raise ValueError(f"generate(fast=True): the fast decoder cannot run this model: {reason}")
    if reason not in _logged_fallbacks:
        _logged_fallbacks.add(reason)
        log.info("generate: using the Hugging Face forward (no fast decoder: %s)%s", reason,
                 "; its KV cache stays in the model's dtype (kv_cache_dtype fp16 is the fast decoder's)"
                 if kv_cache_dtype == "fp16" else "")
    return HFForwardRunner(model, max_len)


def _check_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"generate() needs input_ids and attention_mask of the same [batch, prompt] shape, "
            f"got {tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    # One host sync per rollout, before any step: right padding (or an empty prompt) would put
    # a pad token where generation continues and silently corrupt every rollout.
    if not bool(attention_mask[:, -1].bool().all()):
        raise ValueError(
            "generate() needs left-padded prompts (attention_mask[:, -1] must be 1 for every row); "
            "set tokenizer.padding_side = 'left'"
        )


_COUNT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def group_index(samples_per_prompt: int | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor | None:
    """The unique prompt behind each output row ([B'] int64, torch.repeat_interleave order), or
    None when every prompt is sampled once (then generate() copies nothing).

    `samples_per_prompt` is one count for every prompt or a [B] integer tensor of counts >= 1.
    """
    if isinstance(samples_per_prompt, torch.Tensor):
        counts = samples_per_prompt
        if counts.shape != (batch,) or counts.dtype not in _COUNT_DTYPES:
            raise ValueError(
                f"generate(samples_per_prompt=...) as a tensor must hold one integer count per prompt "
                f"(shape [{batch}]), got {counts.dtype} of shape {tuple(counts.shape)}"
            )
        counts = counts.to(device=device, dtype=torch.long)
        # One host sync per rollout: the output's row count depends on the counts anyway.
        low, high, total = torch.stack([counts.min(), counts.max(), counts.sum()]).tolist() if batch else (1, 1, 0)
        if low < 1:
            raise ValueError(f"generate(samples_per_prompt=...) counts must be >= 1, got a count of {low}")
        if high == 1:
            return None
        return torch.arange(batch, device=device).repeat_interleave(counts, output_size=total)
    if isinstance(samples_per_prompt, bool) or not isinstance(samples_per_prompt, int) or samples_per_prompt < 1:
        raise ValueError(
            f"generate(samples_per_prompt=...) must be an int >= 1 or a tensor of counts, got {samples_per_prompt!r}"
        )
    if samples_per_prompt == 1:
        return None
    return torch.arange(batch, device=device).repeat_interleave(samples_per_prompt)


class GenerationTooLarge(UserError, ValueError):
    """A rollout that cannot run: more positions than the model has, or a KV cache larger than the
    memory left. Raised before anything is allocated (the CLI prints it as one line)."""


def _tp_size(param: torch.Tensor) -> int:
    """The tensor-parallel degree of a rollout-mode parameter (a rank caches only its own heads)."""
    mesh = getattr(param, "device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    return mesh.size(names.index("tp")) if "tp" in names else 1


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_generation_fits(
    config: PretrainedConfig, rows: int, prompt_len: int, max_new_tokens: int, dtype: torch.dtype,
    device: torch.device, tp_size: int = 1, where: str = "generate()", weight_copies: int = 0,
) -> None:
    """Refuse, with the numbers, a rollout of `rows` sequences of `prompt_len` + `max_new_tokens`
    tokens that exceeds the model's max_position_embeddings or whose KV cache (`kv_cache_bytes`),
    with the fast decoder's `weight_copies` bytes, exceeds the memory `device` has available; a
    model past its positions computes garbage, and an oversized cache is found out by the kernel's
    OOM killer, not by an exception."""
    total = prompt_len + max_new_tokens
    max_positions = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    if max_positions is not None and total > max_positions:
        raise GenerationTooLarge(
            f"{where}: prompt {prompt_len} + max_new_tokens {max_new_tokens} = {total} tokens exceed the model's "
            f"max_position_embeddings {max_positions}; lower --max-new-tokens (or --max-prompt-len)")
    cache = kv_cache_bytes(config, rows, total, dtype, tp_size)
    need = cache + weight_copies
    free = available_memory_bytes(device)
    if free is not None and need > free:
        copies = f" and the fast decoder's weight copies {_gib(weight_copies)}" if weight_copies else ""
        raise GenerationTooLarge(
            f"{where}: the KV cache of {rows} sequences x {total} tokens ({dtype}) needs {_gib(cache)}{copies}, but "
            f"{device} has {_gib(free)} available; lower --generation-batch-size, --max-new-tokens or --max-prompt-len")


def check_rollout_fits(
    model_dir: str, rows: int, prompt_len: int, max_new_tokens: int, dtype: str, device: torch.device,
    tp_size: int = 1, where: str = "config",
) -> None:
    """`check_generation_fits` from a model folder's config.json and an engine dtype name ("auto",
    "bf16", ...), before any model is loaded: a stage refuses an impossible rollout at start. A
    folder that cannot be read is left to the model loader, whose error names it."""
    from transformers import AutoConfig

    from rlhf.engine.sharding import COMPUTE_DTYPES, resolve_dtype

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError):
        return
    check_generation_fits(config, rows, prompt_len, max_new_tokens, COMPUTE_DTYPES[resolve_dtype(dtype, device)],
                          device, tp_size, where)


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    fast: bool | Literal["auto"] = "auto",
    samples_per_prompt: int | torch.Tensor = 1,
) -> GenerationOutput:
    """Generate up to `params.max_new_tokens` tokens after each left-padded prompt.

    `generator` (on the model's device) makes sampling reproducible; under tensor parallelism
    it must be seeded identically on every rank of the group. `fast` picks the forward passes
    (see `select_runner`): "auto" uses the fast decoder where it supports the model, False
    always the model's own forward (the reference), True insists on the fast decoder.

    `samples_per_prompt` (group sampling) samples row i of the unique prompts that many times
    (an int, or a [B] tensor of counts >= 1): the output has sum(counts) rows, row i's samples
    contiguous (torch.repeat_interleave order). Each prompt is prefilled once and its KV cache
    and first-token logits are copied to its samples' rows, so only decoding runs per sample.
    """
    _check_prompts(input_ids, attention_mask)
    index = group_index(samples_per_prompt, input_ids.shape[0], input_ids.device)
    if model.training:
        log.warning("generate() called on a model in training mode: dropout makes rollouts noisy")
    prompt_len = input_ids.shape[1]
    rows = input_ids.shape[0] if index is None else index.numel()
    param = next(model.parameters())
    with support_checked_once():
        copies = backend_for(input_ids.device).decoder_weight_bytes(model) if fast is not False else 0
        check_generation_fits(model.config, rows, prompt_len, params.max_new_tokens, param.dtype, input_ids.device,
                              _tp_size(param), weight_copies=copies)
        runner = select_runner(model, input_ids.shape[0], prompt_len + params.max_new_tokens, fast,
                               params.kv_cache_dtype)
    # Positions as transformers.generate computes them: count of real tokens so far, pads at 0.
    prompt_positions = position_ids_from_mask(attention_mask)
    logits = runner.prefill(input_ids, attention_mask, prompt_positions)
    if index is not None:
        # Group sampling: each unique prompt's cache rows and last logits become its samples' rows.
        runner.expand(index)
        logits, input_ids, attention_mask, prompt_positions = (
            t.index_select(0, index) for t in (logits, input_ids, attention_mask, prompt_positions)
        )
    return _decode(runner, logits, input_ids, attention_mask, prompt_positions, params, generator)


def _decode(
    runner: StepRunner, logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    prompt_positions: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
) -> GenerationOutput:
    """Sample from the prefill's `logits` [B, V], then one decode step per token, on B rows
    (engine/decode_loop.py; `runner.run` decodes them together or in groups, with the same tokens)."""
    batch, prompt_len = input_ids.shape
    max_new = params.max_new_tokens
    device = input_ids.device
    sequences = torch.full((batch, prompt_len + max_new), params.pad_token_id, dtype=torch.long, device=device)
    sequences[:, :prompt_len] = input_ids
    t = Transcript(sequences, torch.zeros_like(sequences, dtype=torch.bool),
                   torch.zeros_like(sequences, dtype=torch.float32),
                   torch.zeros(batch, dtype=torch.bool, device=device),
                   torch.tensor(params.eos_token_ids, dtype=torch.long, device=device))
    # The mask the model sees: prompt padding, then every generated slot visible (what a finished
    # row attends to no longer matters, its tokens are forced to pad).
    model_mask = torch.ones_like(sequences, dtype=attention_mask.dtype)
    model_mask[:, :prompt_len] = attention_mask
    step_positions = prompt_positions[:, -1:] + torch.arange(1, max_new + 1, device=device)
    recorder = backend_for(device).recorder(logits, params) if generation_kernels_enabled() else None
    loop = DecodeLoop(logits, t, model_mask, step_positions, prompt_len, params, generator, sample_next_token,
                      recorder)
    steps_run = runner.run(loop)
    log.debug("generated %d of %d steps for %d sequences (%s)", steps_run, max_new, batch, type(runner).__name__)
    out_mask = torch.cat([attention_mask, t.action_mask[:, prompt_len:].to(attention_mask.dtype)], dim=1)
    return GenerationOutput(sequences=t.sequences, attention_mask=out_mask, action_mask=t.action_mask,
                            prompt_length=prompt_len, finished=t.finished, logprobs=t.token_logprobs)
