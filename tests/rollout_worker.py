"""Run under torchrun (or alone) by tests/test_rollout.py: FSDP2 train shards -> rollout mode.

Writes a JSON file with the greedy sequences, the parity difference, whether training params
are bitwise unchanged, whether the rollout model's storage was released on exit, whether
a deliberately corrupted rollout model is caught, and whether the next rollout reuses the same
skeleton with the right weights again (same sequences, parity holds).
"""

from __future__ import annotations

import argparse
import json

import torch

from rlhf.engine.config import EngineConfig
from rlhf.engine.distributed import DistributedContext, exit_rank
from rlhf.engine.fsdp import local_shard
from rlhf.engine.rollout import RolloutParityError, rollout_mode
from rlhf.engine.sampling import SamplingParams
from rlhf.engine.train_engine import TrainEngine
from rlhf.models.loading import load_causal_lm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--zero-stage", type=int, default=3)
    args = parser.parse_args()

    ctx = DistributedContext.initialize()
    model = load_causal_lm(args.model)
    config = EngineConfig(zero_stage=args.zero_stage, dtype="fp32", micro_batch_size=1, optimizer_impl="torch")
    engine = TrainEngine(model, config, ctx, total_steps=1)
    before = {n: local_shard(p)[0].clone() for n, p in engine.model.named_parameters()}

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 100, (4, 6), generator=g)
    mask = torch.ones_like(prompts)
    mask[0, :3] = 0  # left padding
    prompts[0, :3] = 0
    params = SamplingParams(max_new_tokens=10, do_sample=False, eos_token_id=2, pad_token_id=0)

    with rollout_mode(engine, tp_size=args.tp) as rollout:
        out = rollout.generate(prompts, mask, params)
        parity = rollout.parity_max_diff
        inference = rollout.model
    # The skeleton is kept, its parameter storage freed once rollout mode exits.
    released = all((p.to_local() if hasattr(p, "to_local") else p).untyped_storage().nbytes() == 0
                   for p in inference.parameters())
    unchanged = all(torch.equal(before[n], local_shard(p)[0]) for n, p in engine.model.named_parameters())

    caught = False
    with rollout_mode(engine, tp_size=args.tp) as rollout:
        with torch.no_grad():
            for name, p in rollout.model.named_parameters():
                if name.endswith("mlp.down_proj.weight") or name.endswith("fc2.weight") or name.endswith("c_proj.weight"):
                    local = p.to_local() if hasattr(p, "to_local") else p
                    local.add_(torch.randn(local.shape, generator=torch.Generator().manual_seed(ctx.rank)) * 0.5)
        reused = rollout.model is inference
        try:
            rollout.generate(prompts, mask, params)
        except RolloutParityError:
            caught = True

    with rollout_mode(engine, tp_size=args.tp) as rollout:  # the corruption must not survive a reload
        again = rollout.generate(prompts, mask, params)
        restored = rollout.model is inference and torch.equal(again.sequences, out.sequences) and \
            rollout.parity_max_diff <= 1e-4

    if ctx.is_main:
        with open(args.out, "w") as f:
            json.dump({"sequences": out.sequences.tolist(), "action_mask": out.action_mask.tolist(),
                       "parity": parity, "unchanged": unchanged, "caught": caught, "released": released,
                       "reused": reused, "restored": restored}, f)
    world_size = ctx.world_size
    ctx.shutdown()
    if world_size > 1:
        exit_rank(0)  # as the CLI ends a rank: no interpreter finalization (exit_rank says why)


if __name__ == "__main__":
    main()
