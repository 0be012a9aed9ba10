"""A FastLlamaDecoder's decode step over static buffers, replayed as CUDA graphs at fixed batch sizes.

On a GPU a small model's decode step is bound by kernel launches, not by the GPU: a 1.1B Llama
at batch 1 spends ~17 ms per step issuing ~25 launches per layer from Python (3.6% of an H100's
memory bandwidth; docs/gpu.md). Captured once as a CUDA graph, a step is one replay.

A graph replays fixed addresses and shapes, so the step reads everything that changes from
buffers allocated once (`StaticDecodeInputs`): the new tokens and their positions, the key mask
over the whole cache ([B, max_len], False beyond the filled prefix) and the cache slot the step
writes (a device scalar: `index_copy_`, not a narrow at a host offset). The attention then runs
over the whole cache buffer, reading only the positions the mask allows.

Rows finish during a rollout and the decode loop drops them, so the batch shrinks. As vLLM does,
graphs are captured at padded batch sizes (`graph_batch_sizes`: 1, 2, 4, 8, ... and the rollout's
batch), each once and reused: `DecodeGraphs.step` runs n rows through the graph of the smallest
size >= n, the rows past n being stale rows of the same cache buffer (the decoder keeps the kept
rows at its front), whose outputs are dropped. The graphs share one memory pool.

`DecodeGraph.step` copies a step's inputs into its buffers, runs the step eagerly the first
time (on a side stream, as capture needs: it is the real step, its KV written and its logits
returned) and captures it; later steps replay the graph. Off CUDA it runs the static step
eagerly every time: the CPU tests check that path against the decoder's own step, and the GPU
tests check the replay against it.

Opt-in until it is validated on GPUs (--cuda-graph-decode, RLHF_CUDA_GRAPH_DECODE=1, or
`CudaLlamaDecoder(cuda_graph=True)`); group sampling's `expand` allocates a new cache and drops
the graphs, and the next step captures again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

StaticStep = Callable[["StaticDecodeInputs"], torch.Tensor]
"""inputs -> [B, V] logits of one decode step over the inputs' B rows (a graph's batch size)."""


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
        key_mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        key_mask[:, 0] = True  # a padding row attends somewhere: its (dropped) output stays finite
        return cls(
            tokens=torch.zeros(batch, 1, dtype=torch.long, device=device),
            positions=torch.zeros(batch, 1, dtype=torch.long, device=device),
            key_mask=key_mask,
            slot=torch.zeros(1, dtype=torch.long, device=device),
        )

    def fill(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             slot: int) -> None:
        """This step's inputs: tokens [n, 1], attention_mask [n, slot + 1], position_ids [n, 1] into
        the first n rows (the rest keep what they held: padding rows, outputs dropped)."""
        rows = tokens.shape[0]
        self.tokens[:rows].copy_(tokens)
        self.positions[:rows].copy_(position_ids)
        # The tail past the filled prefix was never written (allocated False; one graph lives
        # while its prefix only grows), so only the prefix is copied.
        self.key_mask[:rows].narrow(1, 0, attention_mask.shape[1]).copy_(attention_mask)
        self.slot.fill_(slot)


class DecodeGraph:
    """Decode steps of one batch size through `static_step`, captured and replayed on CUDA."""

    def __init__(self, static_step: StaticStep, batch: int, max_len: int, device: torch.device,
                 pool: tuple[int, int] | None = None) -> None:
        self.static_step = static_step
        self.batch = batch
        self.inputs = StaticDecodeInputs.allocate(batch, max_len, device)
        self.capture = device.type == "cuda"
        self.pool = pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.replays = 0

    def step(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             slot: int) -> torch.Tensor:
        """[n, V] logits of one decode step of n <= batch rows (a fresh tensor: the graph's own is
        rewritten by the next)."""
        rows = tokens.shape[0]
        self.inputs.fill(tokens, attention_mask, position_ids, slot)
        if not self.capture:
            return self.static_step(self.inputs)[:rows]
        if self.graph is None:
            return self._run_and_capture()[:rows]
        self.graph.replay()
        self.replays += 1
        assert self.logits is not None
        return self.logits[:rows].clone()

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
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.logits = self.static_step(self.inputs)
        self.graph = graph
        return logits


def graph_batch_sizes(capacity: int) -> tuple[int, ...]:
    """The batch sizes decode graphs are captured at for a rollout of `capacity` rows: powers of two
    below it, and itself."""
    sizes = []
    size = 1
    while size < capacity:
        sizes.append(size)
        size *= 2
    return (*sizes, capacity)


class DecodeGraphs:
    """A rollout's decode graphs, one per padded batch size (`graph_batch_sizes`), each captured
    the first time a step needs it and replayed after; `static_step_for(size)` is the step over a
    graph's `size` rows (the first `size` rows of the decoder's cache buffers)."""

    def __init__(self, static_step_for: Callable[[int], StaticStep], capacity: int, max_len: int,
                 device: torch.device) -> None:
        self.static_step_for = static_step_for
        self.sizes = graph_batch_sizes(capacity)
        self.max_len = max_len
        self.device = device
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.graphs: dict[int, DecodeGraph] = {}

    def size_for(self, rows: int) -> int:
        """The smallest graph batch size that holds `rows` rows."""
        return next(size for size in self.sizes if size >= rows)

    def step(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             slot: int) -> torch.Tensor:
        """[n, V] logits of one decode step of tokens' n rows, through the graph of `size_for(n)`."""
        size = self.size_for(tokens.shape[0])
        graph = self.graphs.get(size)
        if graph is None:
            graph = self.graphs[size] = DecodeGraph(self.static_step_for(size), size, self.max_len, self.device,
                                                    self.pool)
        return graph.step(tokens, attention_mask, position_ids, slot)

    @property
    def replays(self) -> int:
        return sum(graph.replays for graph in self.graphs.values())
