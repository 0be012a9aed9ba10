"""Time the train -> rollout switch: the kept skeleton (what `rollout_mode` does) against building
a new inference skeleton every time (what it did before), in the same process.

    python scripts/bench_rollout_switch.py                    # a small built-in Llama
    python scripts/bench_rollout_switch.py --model DIR        # e.g. SmolLM2-135M-Instruct

Prints one JSON line last: median seconds per switch both ways and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from rlhf.engine.config import EngineConfig
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.sharding import COMPUTE_DTYPES
from rlhf.engine.rollout import build_inference_skeleton, load_rollout_weights, rollout_mode
from rlhf.engine.train_engine import TrainEngine
from rlhf.models.loading import load_causal_lm
from rlhf.models.tiny import build_char_tokenizer, build_tiny_model


def _model_dir(path: str | None, scratch: str) -> str:
    if path:
        return path
    tok = build_char_tokenizer()
    model = build_tiny_model("llama", tok, seed=0, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4)
    model.save_pretrained(scratch)
    tok.save_pretrained(scratch)
    return scratch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: a built-in 8-layer Llama)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ctx = DistributedContext.initialize()
    with tempfile.TemporaryDirectory() as scratch:
        model = load_causal_lm(_model_dir(args.model, scratch))
    config = EngineConfig(zero_stage=3, dtype="fp32", micro_batch_size=1, optimizer_impl="torch")
    engine = TrainEngine(model, config, ctx, total_steps=1)
    dtype = COMPUTE_DTYPES[engine.dtype]

    def kept() -> None:
        with rollout_mode(engine):
            pass

    def rebuilt() -> None:
        inference = build_inference_skeleton(engine.model, ctx, 1, dtype)
        load_rollout_weights(inference, engine.model, ctx, 1)

    kept()  # the first switch builds the kept skeleton
    times: dict[str, list[float]] = {"kept": [], "rebuilt": []}
    for _ in range(args.repeats):
        for name, switch in (("kept", kept), ("rebuilt", rebuilt)):
            start = time.perf_counter()
            switch()
            times[name].append(time.perf_counter() - start)
    kept_s, rebuilt_s = statistics.median(times["kept"]), statistics.median(times["rebuilt"])
    print(json.dumps({"model": args.model or "built-in llama 8x256", "params": sum(p.numel() for p in model.parameters()),
                      "kept_switch_s": round(kept_s, 4), "rebuilt_switch_s": round(rebuilt_s, 4),
                      "speedup_vs_rebuilt": round(rebuilt_s / kept_s, 2), "threads": torch.get_num_threads()}))
    ctx.shutdown()


if __name__ == "__main__":
    main()
