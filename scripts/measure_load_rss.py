"""Peak host memory (RSS) per rank while a train engine loads a model: full load vs sharded loading.

    python scripts/measure_load_rss.py                          # a ~197 MB fp32 Llama, 2 ranks, both modes
    python scripts/measure_load_rss.py --model runs/sft/model --nproc 2 --zero-stage 3
    python scripts/measure_load_rss.py --modes sharded --dtype bf16   # the checkpoint saved in bf16

Every rank is a fresh process (gloo on the CPU). After its imports, the process group and one meta
build of the model's class (so the modeling code is imported: a fixed cost, whatever the size), it
reads VmRSS (the fixed overhead), resets its peak (`echo 5 > /proc/self/clear_refs`), builds a
TrainEngine (fp32 master weights, ZeRO-3 by default) and reads VmHWM:
    full     load_causal_lm (the whole model on every rank), then FSDP2 shards it
    sharded  deferred_causal_lm: the model on meta, then each rank reads only its rows
`load_mb` = peak - overhead; `load_fraction` = load_mb / the model's fp32 MB (ZeRO-3 over 2 ranks
cannot go below 0.5: each rank keeps half of the fp32 weights).

Prints one line per mode and rank, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def status(field: str) -> float:
    """A /proc/self/status figure (VmRSS, VmHWM) in MB."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak() -> None:
    """VmHWM := VmRSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build_model(folder: Path, hidden: int, layers: int, vocab: int, dtype: str) -> Path:
    """A random Llama saved as model.safetensors (no tokenizer: loading needs none)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]).save_pretrained(folder)
    return folder


def worker(rank: int, world: int, port: int, model_dir: str, mode: str, zero_stage: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), RLHF_FORCE_CPU="1")
    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf.engine.config import EngineConfig
    from rlhf.engine.distributed import DistributedContext, exit_rank
    from rlhf.engine.fsdp import local_parameter_count
    from rlhf.engine.train_engine import TrainEngine
    from rlhf.models.loading import deferred_causal_lm, load_causal_lm

    ctx = DistributedContext.initialize()
    with torch.device("meta"):  # import the modeling code: part of the fixed overhead
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    ctx.barrier()
    overhead = status("VmRSS")
    reset_peak()
    start = time.perf_counter()
    model, weights = (load_causal_lm(model_dir), None) if mode == "full" else deferred_causal_lm(model_dir)
    config = EngineConfig(zero_stage=zero_stage, dtype="fp32", optimizer_impl="torch", micro_batch_size=1)
    engine = TrainEngine(model, config, ctx, total_steps=1, weights=weights)
    seconds = time.perf_counter() - start
    peak = status("VmHWM")
    result = {"rank": rank, "overhead_mb": overhead, "peak_mb": peak, "load_mb": peak - overhead,
              "local_mb": local_parameter_count(engine.model) * 4 / 2**20, "seconds": seconds}
    Path(out, f"{mode}-{rank}.json").write_text(json.dumps(result))
    ctx.shutdown()
    exit_rank(0)  # as the CLI ends a rank: no interpreter finalization (engine/distributed.py's exit_rank says why)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(model_dir: Path, mode: str, nproc: int, zero_stage: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(nproc, free_port(), str(model_dir), mode, zero_stage, out), nprocs=nproc, join=True)
        return [json.loads(Path(out, f"{mode}-{r}.json").read_text()) for r in range(nproc)]


def fp32_mb(model_dir: Path) -> float:
    """The model's parameters in fp32, from the safetensors headers (tied tensors once)."""
    from rlhf.models.sharded_loading import read_checkpoint

    checkpoint = read_checkpoint(model_dir, str(model_dir))
    if checkpoint is None:
        raise SystemExit(f"{model_dir}: no safetensors weights")
    elements = sum(torch.Size(t.shape).numel() for t in checkpoint.values())
    return elements * 4 / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path,
                        help="a causal LM folder with safetensors (default: build a random Llama)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the built checkpoint's dtype")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=3)
    parser.add_argument("--modes", default="full,sharded")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_model(Path(tmp) / "model", args.hidden, args.layers, args.vocab, args.dtype)
        model_mb = fp32_mb(model_dir)
        results: dict[str, object] = {"model_fp32_mb": round(model_mb, 1), "nproc": args.nproc,
                                      "zero_stage": args.zero_stage}
        for mode in args.modes.split(","):
            ranks = measure(model_dir, mode, args.nproc, args.zero_stage)
            for r in ranks:
                print(f"{mode:8s} rank {r['rank']}: overhead {r['overhead_mb']:7.1f} MB  peak {r['peak_mb']:7.1f} MB  "
                      f"load {r['load_mb']:7.1f} MB ({r['load_mb'] / model_mb:.2f} x model)  local params "
                      f"{r['local_mb']:6.1f} MB  {r['seconds']:.2f} s", flush=True)
            results[mode] = {key: [round(r[key], 2) for r in ranks]
                             for key in ("overhead_mb", "peak_mb", "load_mb", "local_mb", "seconds")}
            results[f"{mode}_load_fraction"] = round(max(r["load_mb"] for r in ranks) / model_mb, 3)
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
