"""The decode loop of a rollout: sample, record, decode one step, until every row has finished.

    loop = DecodeLoop(logits, transcript, model_mask, step_positions, prompt_len, params, generator,
                      sample=sample_next_token, recorder=None)
    steps_run = runner.run(loop)     # a runner decodes every row together: loop.run_all(runner)

Inside a step nothing reads a device value on the host: finished rows keep emitting pad
(`torch.where`), and the only host sync is the "all finished?" check every `sync_every` steps,
where a quarter of the rows finished are dropped from the decode batch (`drop_finished`). Every
step draws one uniform per row of the whole batch, so dropping rows, or decoding the rows in groups
(a backend's runner: `loop.run_rows` over each group with the uniforms that group would have
drawn), leaves every row's tokens as they would have been.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from rlhf.engine.sampling import SamplingParams

Draws = Callable[[int], "torch.Tensor | None"]
"""step -> the uniforms [rows] of the rows decoded, or None (greedy)."""
Sample = Callable[..., torch.Tensor]
"""`sample_next_token(logits, params, uniform=...)` (engine/next_token.py)."""


class Decoder(Protocol):
    """What the loop asks of a runner: one decode step, and dropping rows of its cache."""

    def decode(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One token per sequence [B, 1]; `attention_mask` [B, cached + 1] -> [B, V] next logits."""
        ...

    def expand(self, index: torch.Tensor) -> None:
        """Rows `index` ([B'] int64) of the cache become its B' rows."""
        ...


@dataclass
class Transcript:
    """What the generation loop writes, allocated once: the output and the loop's state."""

    sequences: torch.Tensor
    """[B, prompt + max_new] prompts, then the sampled tokens (pad once a row has finished)."""
    action_mask: torch.Tensor
    """[B, prompt + max_new] True at the tokens sampled before the row finished."""
    token_logprobs: torch.Tensor
    """[B, prompt + max_new] each sampled token's log-prob under the raw logits (0 elsewhere)."""
    finished: torch.Tensor
    """[B] the row has emitted an EOS."""
    eos_ids: torch.Tensor

    def rows(self, start: int, stop: int) -> Transcript:
        """Rows [start, stop) of it (views: what a group's loop writes lands here)."""
        return Transcript(self.sequences[start:stop], self.action_mask[start:stop], self.token_logprobs[start:stop],
                          self.finished[start:stop], self.eos_ids)


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] of each row ([B, V], [B] -> [B] float32), computed in fp32 as
    the training forward's log-probs are (engine/logprobs.py)."""
    logits = logits.float()
    picked = logits.gather(-1, tokens[:, None]).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


@dataclass
class DecodeLoop:
    """One rollout's decode loop over the prefill's `logits` [B, V] (see the module docstring)."""

    logits: torch.Tensor
    transcript: Transcript
    model_mask: torch.Tensor
    """[B, prompt + max_new]: the prompt's padding, then every generated slot visible."""
    step_positions: torch.Tensor
    """[B, max_new]: each decode step's position ids."""
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None
    sample: Sample
    recorder: Callable[..., torch.Tensor] | None = None
    """An op that samples and records a step in one call (a backend's; `record_python` is its reference)."""

    @property
    def batch(self) -> int:
        return self.transcript.finished.shape[0]

    def run_all(self, runner: Decoder) -> int:
        """Every row together; -> the steps run (fewer than max_new_tokens once every row finished)."""
        batch, device = self.batch, self.transcript.finished.device

        def draws(step: int) -> torch.Tensor | None:
            # One uniform per row of the whole batch, as the samplers draw them, so that dropping
            # finished rows leaves every other row's tokens as they would have been.
            return (torch.rand(batch, device=device, dtype=torch.float32, generator=self.generator)
                    if self.params.do_sample else None)

        return self.run_rows(runner, 0, batch, draws)

    def run_rows(self, runner: Decoder, start: int, stop: int, draws: Draws) -> int:
        """The loop over rows [start, stop) (all of a rollout's, or one group's, which `runner`
        decodes): sample each step's tokens with the uniforms `draws(step)` gives, record them,
        decode them; -> the steps run."""
        params, max_new = self.params, self.params.max_new_tokens
        t = self.transcript if (start, stop) == (0, self.batch) else self.transcript.rows(start, stop)
        logits, model_mask, step_positions = (x[start:stop] for x in (self.logits, self.model_mask, self.step_positions))
        no_rows = torch.empty(0, dtype=torch.long)
        steps_run = max_new
        rows: torch.Tensor | None = None  # the rows the runner still decodes (None: all of them)
        for step in range(max_new):
            col = self.prompt_len + step
            suppress_eos = step < params.min_new_tokens and t.eos_ids.numel() > 0
            uniform = draws(step)
            if self.recorder is not None:
                tokens = self.recorder(logits.contiguous(), uniform, no_rows if rows is None else rows,
                                       params.temperature, t.eos_ids, suppress_eos, params.pad_token_id, col,
                                       t.sequences, t.action_mask, t.token_logprobs, t.finished)
            else:
                record_python(t, logits, uniform, rows, col, suppress_eos, params, self.sample)
                tokens = t.sequences[slice(None) if rows is None else rows, col : col + 1]
            if step == max_new - 1:
                break
            if params.sync_every and (step + 1) % params.sync_every == 0:
                done = t.finished if rows is None else t.finished[rows]
                n_done = int(done.sum())  # the loop's one host sync
                if n_done == done.numel():
                    steps_run = step + 1
                    break
                if params.drop_finished and 4 * n_done >= done.numel():
                    keep = (~done).nonzero().squeeze(1)
                    runner.expand(keep)
                    rows = keep if rows is None else rows[keep]
                    tokens = tokens[keep]
            index = slice(None) if rows is None else rows
            logits = runner.decode(tokens, model_mask[index, : col + 1], step_positions[index, step : step + 1])
        return steps_run


def record_python(t: Transcript, logits: torch.Tensor, uniform: torch.Tensor | None, rows: torch.Tensor | None,
                  col: int, suppress_eos: bool, params: SamplingParams, sample: Sample) -> None:
    """Sample the decoded rows' tokens from `logits` and write column `col` of the transcript:
    the reference of a backend's recorder (the CPU decode op's `sample_record`)."""
    batch, device = t.finished.shape[0], t.finished.device
    raw_logits = logits
    if suppress_eos:
        logits = logits.index_fill(-1, t.eos_ids, float("-inf"))
    decoded = sample(logits, params, uniform=uniform if uniform is None or rows is None else uniform[rows])
    logprobs = sampled_logprobs(raw_logits, decoded)
    if rows is not None:
        decoded = torch.full((batch,), params.pad_token_id, dtype=decoded.dtype, device=device).index_copy(
            0, rows, decoded)
        logprobs = torch.zeros(batch, dtype=logprobs.dtype, device=device).index_copy(0, rows, logprobs)
    token = torch.where(t.finished, params.pad_token_id, decoded)
    t.sequences[:, col] = token
    t.action_mask[:, col] = ~t.finished
    t.token_logprobs[:, col] = torch.where(t.finished, 0.0, logprobs)
    if t.eos_ids.numel():
        # A broadcast compare rather than torch.isin, whose large-set path sorts.
        t.finished |= (token[:, None] == t.eos_ids).any(dim=-1)


__all__ = ["DecodeLoop", "Decoder", "Draws", "Transcript", "record_python", "sampled_logprobs"]
