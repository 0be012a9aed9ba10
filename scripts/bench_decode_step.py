"""The fused float32 CPU decode step with its projections through MKL against packed weights.

engine/backends/cpu/decode_op.py's step runs a layer's four projections through ATen (MKL) or, with
`packed_gemm`, over weights packed once per rollout in 16-column panels by its own kernel (MKL
repacks each weight on every call of a decode step's few rows); the packed side runs once per
kernel set this CPU has (avx2; avx512: the same with the panel GEMM on 16-float registers). All
decoders run the same prompts and feed the same tokens (the MKL side's greedy choices) for --new
steps, alternated --repeats times; the figures are medians of the mean time per decode step.

    python scripts/bench_decode_step.py                          # tiny Llama (4 layers, hidden 256)
    python scripts/bench_decode_step.py --model runs/smollm2 --new 16 --repeats 3   # a model folder
    python scripts/bench_decode_step.py --new 256 --kv-cache-dtype fp16          # rlhf ppo's CPU default cache

The last line is one JSON object: mkl_ms_per_step, packed_ms_per_step (the widest kernel set's),
their ratio, packed_ms_per_step_by_isa and ratio_avx2_vs_widest, each run's figures and the
largest logit difference from the MKL side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlhf.engine.backends.cpu.decode_op import load_cpu_decode_op
from rlhf.engine.backends.cpu.decoder import CpuLlamaDecoder
from rlhf.models.tiny import tiny_config


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Llama-family model folder (default: a tiny Llama)")
    parser.add_argument("--batch", type=int, default=32, help="sequences decoded together")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens (the cache before the first step)")
    parser.add_argument("--new", type=int, default=64, help="decode steps timed")
    parser.add_argument("--repeats", type=int, default=5, help="alternated runs of each side")
    parser.add_argument("--kv-cache-dtype", default="model", choices=("model", "fp16", "auto"),
                        help="the decoders' KV cache (rlhf ppo's --kv-cache-dtype; its default, auto, is fp16 here)")
    return parser.parse_args()


def build_model(path: str | None) -> PreTrainedModel:
    if path is not None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = tiny_config("llama", vocab_size=98, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8,
                         intermediate_size=688)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@torch.no_grad()
def run(model: PreTrainedModel, packed: bool, args: argparse.Namespace, tokens: torch.Tensor,
        ids: torch.Tensor, isa: str = "auto") -> tuple[float, torch.Tensor]:
    """(seconds per decode step, logits of every step) of one decoder over `tokens` [B, new]."""
    batch, prompt = ids.shape
    decoder = CpuLlamaDecoder(model, batch, prompt + args.new, cpu_kernel=True, packed_gemm=packed, kernel_isa=isa,
                               kv_cache_dtype=args.kv_cache_dtype)
    assert decoder.packed_gemm == packed and (isa == "auto" or decoder.kernel_isa == isa)
    mask = torch.ones(batch, prompt + args.new, dtype=torch.long)
    decoder.prefill(ids, mask[:, :prompt], torch.arange(prompt).expand(batch, prompt))
    logits = []
    start = time.perf_counter()
    for step in range(args.new):
        position = torch.full((batch, 1), prompt + step)
        logits.append(decoder.decode(tokens[:, step : step + 1], mask[:, : prompt + step + 1], position))
    return (time.perf_counter() - start) / args.new, torch.stack(logits)


def main() -> None:
    args = parse_args()
    model = build_model(args.model)
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (args.batch, args.prompt), generator=gen)
    _, reference = run(model, False, args, torch.randint(0, vocab, (args.batch, args.new), generator=gen), ids)
    tokens = reference.argmax(-1).t()  # the same tokens for every side: the first run's greedy choices
    isas = [isa for isa in load_cpu_decode_op().supported_isas() if isa != "scalar"]
    sides = {"mkl": (False, "auto"), **{f"packed_{isa}": (True, isa) for isa in isas}}
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    logits = {}
    for _ in range(args.repeats):
        for side, (packed, isa) in sides.items():
            step, logits[side] = run(model, packed, args, tokens, ids, isa)
            seconds[side].append(step)
    ms = {side: statistics.median(runs) * 1e3 for side, runs in seconds.items()}
    widest = f"packed_{isas[-1]}"
    print(json.dumps({
        "mkl_ms_per_step": round(ms["mkl"], 3), "packed_ms_per_step": round(ms[widest], 3),
        "ratio": round(ms["mkl"] / ms[widest], 3),
        "packed_ms_per_step_by_isa": {isa: round(ms[f"packed_{isa}"], 3) for isa in isas},
        "ratio_avx2_vs_widest": round(ms["packed_avx2"] / ms[widest], 3) if "avx2" in isas else None,
        "runs_ms": {side: [round(s * 1e3, 3) for s in runs] for side, runs in seconds.items()},
        "max_logit_diff": max(float((logits[side] - logits["mkl"]).abs().max()) for side in sides),
        "shape": {"batch": args.batch, "prompt": args.prompt, "new": args.new, "model": args.model or "tiny llama",
                  "kv_cache_dtype": args.kv_cache_dtype},
        "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
