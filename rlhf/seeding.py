"""One way to derive the seed of every random stream from the run's base seed.

Each stream (the prompt order of an epoch, the sampling of one iteration's rollouts, the minibatch
permutation of one PPO epoch, ...) gets its own seed from `derive_seed(base, purpose, *indices)`,
so streams never collide by arithmetic accident (`seed * 7919 + epoch` vs `seed + iteration * 31`
can meet) and every process computes the same number: the parts are hashed with BLAKE2b, never
with Python's `hash()` (salted per process for strings).
"""

from __future__ import annotations

import hashlib

import torch

SEED_BITS = 63
"""Derived seeds are in [0, 2**63): valid for torch, numpy (after a modulo) and `random`."""


def derive_seed(base_seed: int, purpose: str, *indices: int) -> int:
    """A deterministic seed for the stream `purpose` at `indices` (e.g. epoch, iteration, rank).

    The same arguments give the same seed in every process, run and Python version; different
    purposes or indices give independent-looking seeds.
    """
    parts = [str(int(base_seed)), purpose, *(str(int(i)) for i in indices)]
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def seeded_permutation(n: int, seed: int) -> list[int]:
    """A permutation of range(n) drawn from torch's CPU generator seeded with `seed`."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


__all__ = ["SEED_BITS", "derive_seed", "seeded_permutation"]
