"""A FastLlamaDecoder's decode step over static buffers, replayed as one CUDA graph.

On a GPU a small model's decode step is bound by kernel launches, not by the GPU: a 1.1B Llama
at batch 1 spends ~17 ms per step issuing ~25 launches per layer from Python (3.6% of an H100's
memory bandwidth; README, GPU status). Captured once as a CUDA graph, a step is one replay.

A graph replays fixed addresses and shapes, so the step reads everything that changes from
buffers allocated once (`StaticDecodeInputs`): the new tokens and their positions, the key mask
over the whole cache ([B, max_len], False beyond the filled prefix) and the cache slot the step
writes (a device scalar: `index_copy_`, not a narrow at a host offset). The attention op then
runs over the whole cache buffer, reading only the positions the mask allows.

`DecodeGraph.step` copies a step's inputs into those buffers, runs the step eagerly the first
time (on a side stream, as capture needs: it is the real step, its KV written and its logits
returned) and captures it; later steps replay the graph. Off CUDA it runs the static step
eagerly every time: the CPU tests check that path against the decoder's own step, and the GPU
tests check the replay against it.

Opt-in until it is validated on GPUs (RLHF_CUDA_GRAPH_DECODE=1, or
`FastLlamaDecoder(cuda_graph=True)`); group sampling's `expand` drops the graph (new batch,
new cache buffers) and the next step captures again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

StaticStep = Callable[["StaticDecodeInputs"], torch.Tensor]


def cuda_graph_decode_requested() -> bool:
    """RLHF_CUDA_GRAPH_DECODE=1 asks for graph-replayed decode steps where they can run."""
    return os.environ.get("RLHF_CUDA_GRAPH_DECODE", "0") == "1"


@dataclass
class StaticDecodeInputs:
    """What a decode step reads, at addresses that stay fixed for the graph's life."""

    tokens: torch.Tensor
    """[B, 1] int64: the tokens sampled last step."""
    positions: torch.Tensor
    """[B, 1] int64: their position ids."""
    key_mask: torch.Tensor
    """[B, max_len] bool: the cache positions each row attends to (the new token's slot included)."""
    slot: torch.Tensor
    """[1] int64: the cache position this step's keys and values are written to."""

    @classmethod
    def allocate(cls, batch: int, max_len: int, device: torch.device) -> StaticDecodeInputs:
        return cls(
            tokens=torch.zeros(batch, 1, dtype=torch.long, device=device),
            positions=torch.zeros(batch, 1, dtype=torch.long, device=device),
            key_mask=torch.zeros(batch, max_len, dtype=torch.bool, device=device),
            slot=torch.zeros(1, dtype=torch.long, device=device),
        )

    def fill(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             slot: int) -> None:
        """This step's inputs: tokens [B, 1], attention_mask [B, slot + 1], position_ids [B, 1]."""
        self.tokens.copy_(tokens)
        self.positions.copy_(position_ids)
        # The tail past the filled prefix was never written (allocated False; one graph lives
        # while its prefix only grows), so only the prefix is copied.
        self.key_mask.narrow(1, 0, attention_mask.shape[1]).copy_(attention_mask)
        self.slot.fill_(slot)


class DecodeGraph:
    """Decode steps of one batch size through `static_step`, captured and replayed on CUDA."""

    def __init__(self, static_step: StaticStep, batch: int, max_len: int, device: torch.device) -> None:
        self.static_step = static_step
        self.inputs = StaticDecodeInputs.allocate(batch, max_len, device)
        self.capture = device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.replays = 0

    def step(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             slot: int) -> torch.Tensor:
        """[B, V] logits of one decode step (a fresh tensor: the graph's own is rewritten by the next)."""
        self.inputs.fill(tokens, attention_mask, position_ids, slot)
        if not self.capture:
            return self.static_step(self.inputs)
        if self.graph is None:
            return self._run_and_capture()
        self.graph.replay()
        self.replays += 1
        assert self.logits is not None
        return self.logits.clone()

    def _run_and_capture(self) -> torch.Tensor:
        """The first step, eagerly on a side stream (lazy initialisation stays out of the
        capture), then the same step captured; capturing runs nothing, so the cache is written once."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self.static_step(self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        logits.record_stream(torch.cuda.current_stream())  # allocated on the side stream, used on this one
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (NCCL's watchdog polling its events) stay legal.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.logits = self.static_step(self.inputs)
        self.graph = graph
        return logits
