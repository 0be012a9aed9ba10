"""Deterministic global batches split across ranks and micro-steps, and padding collators."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from rlhf.logging import get_logger
from rlhf.seeding import derive_seed, seeded_permutation

log = get_logger(__name__)


@dataclass(frozen=True)
class BatchPlan:
    """How one epoch's rows are cut into global batches, and which part is this rank's.

    The global batch (micro x accum x world rows) is the same set of rows at any world size, so
    runs with the same train_batch_size see the same data per optimizer step.
    """

    num_rows: int
    micro_batch_size: int
    grad_accum: int
    world_size: int
    rank: int
    seed: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_rows // self.global_batch_size

    def epoch_order(self, epoch: int) -> list[int]:
        """The row order of `epoch`: the same on every rank, a fresh shuffle each epoch."""
        return seeded_permutation(self.num_rows, derive_seed(self.seed, "epoch_order", epoch))

    def step_micro_batches(self, epoch: int, step_in_epoch: int, order: list[int] | None = None) -> list[list[int]]:
        """This rank's micro-batches (row indices) of one optimizer step."""
        order = order if order is not None else self.epoch_order(epoch)
        start = step_in_epoch * self.global_batch_size
        chunk = order[start : start + self.global_batch_size]
        per_rank = self.micro_batch_size * self.grad_accum
        mine = chunk[self.rank * per_rank : (self.rank + 1) * per_rank]
        return [mine[i : i + self.micro_batch_size] for i in range(0, per_rank, self.micro_batch_size)]

    def iterate(self, epoch: int, start_step: int = 0) -> Iterator[tuple[int, list[list[int]]]]:
        """(step_in_epoch, micro-batches) for the rest of the epoch."""
        order = self.epoch_order(epoch)
        leftover = self.num_rows - self.steps_per_epoch * self.global_batch_size
        if leftover and start_step == 0 and self.rank == 0:
            log.info("epoch %d: %d rows do not fill a global batch of %d and wait for the next epoch's shuffle",
                     epoch, leftover, self.global_batch_size)
        for step in range(start_step, self.steps_per_epoch):
            yield step, self.step_micro_batches(epoch, step, order)


def pad_right(sequences: Sequence[Sequence[int]], pad_value: int) -> torch.Tensor:
    """[B, max_len] tensor, right-padded."""
    width = max(len(s) for s in sequences)
    out = torch.full((len(sequences), width), pad_value, dtype=torch.long)
    for i, s in enumerate(sequences):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def pad_left(sequences: Sequence[Sequence[int]], pad_value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, max_len] ids, attention mask), left-padded for generation."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_value, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def collate_sft(examples: Sequence[dict[str, list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    ids = pad_right([e["input_ids"] for e in examples], pad_token_id)
    labels = pad_right([e["labels"] for e in examples], -100)
    mask = pad_right([[1] * len(e["input_ids"]) for e in examples], 0)
    # The loss averages over supervised next-token targets (labels shifted by one).
    num_units = (labels[:, 1:] != -100).sum()
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "num_units": num_units}


def collate_pairs(examples: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Chosen rows then rejected rows in one right-padded batch of 2B sequences."""
    seqs = [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
    ids = pad_right(seqs, pad_token_id)
    mask = pad_right([[1] * len(s) for s in seqs], 0)
    margin = torch.tensor([float(e.get("margin", 0.0)) for e in examples])
    return {"input_ids": ids, "attention_mask": mask, "margin": margin, "num_units": torch.tensor(len(examples))}


def collate_preference(examples: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Preference pairs as 2B rows [left-padded prompt | response | right padding], chosen rows then
    rejected rows: every prompt ends at column `response_start` (the longest prompt's length), so
    the two rows of a pair share their first response_start columns (ids and mask) and their
    prompt can run once (engine/prompt_sharing.py, engine/packing.py). `ref_logps` [2B] when the
    rows carry precomputed reference log-probs (`ref_logps`: chosen, rejected)."""
    prompts = [e["chosen_ids"][: e["prompt_len"]] for e in examples]
    responses = ([e["chosen_ids"][e["prompt_len"]:] for e in examples]
                 + [e["rejected_ids"][e["prompt_len"]:] for e in examples])
    start = max(len(p) for p in prompts)
    width = start + max(len(r) for r in responses)
    ids = torch.full((len(responses), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(responses), width), dtype=torch.long)
    for row, response in enumerate(responses):
        prompt = prompts[row % len(examples)]
        tokens = torch.tensor(prompt + response, dtype=torch.long)
        ids[row, start - len(prompt) : start + len(response)] = tokens
        mask[row, start - len(prompt) : start + len(response)] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "response_start": torch.tensor(start),
             "num_units": torch.tensor(len(examples))}
    if "ref_logps" in examples[0]:
        batch["ref_logps"] = torch.tensor([e["ref_logps"][0] for e in examples] + [e["ref_logps"][1] for e in examples],
                                          dtype=torch.float32)
    return batch
