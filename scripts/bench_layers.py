"""Forward + backward of a Llama-family model with the fused layer ops (engine/backends/cpu/fused_layers.py) against
Hugging Face's eager modules, in the same run on the same weights and tokens.

    python scripts/bench_layers.py                        # the TRL comparison's tiny Llama: 4 layers, hidden 256,
                                                          # 8 heads, MLP 688; batch 32 x 128 tokens, float32
    python scripts/bench_layers.py --family qwen2 --batch 8 --seq 512
    python scripts/bench_layers.py --model runs/smollm2/base --batch 4 --seq 256     # a real model folder

Each side runs --repeats timed steps (after 3 untimed) of forward, log-softmax of the logits,
backward, the two sides in turn; the figures are medians. The last line is one JSON object: fused
and eager seconds per forward + backward and per forward (no grad), their ratios, one layer's
attention forward + backward alone (the fused kernels against torch's SDPA), and the largest logit
difference.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="llama", help="tiny model family: llama, qwen2, mistral")
    parser.add_argument("--model", default=None, help="a model folder instead of a tiny model")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    if min(args.batch, args.seq, args.repeats) < 1:
        parser.error("--batch, --seq and --repeats must be >= 1")
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from rlhf.models.tiny import tiny_config

    torch.manual_seed(0)
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    config = tiny_config(args.family, vocab_size=98, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8,
                         intermediate_size=688)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).float()


def interleaved_medians(steps: list, repeats: int) -> list[float]:
    """Median seconds of each step, timed in turn (a slow spell of the machine hits all alike)."""
    for step in steps:
        for _ in range(3):
            step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for step, seen in zip(steps, times):
            start = time.perf_counter()
            step()
            seen.append(time.perf_counter() - start)
    return [statistics.median(seen) for seen in times]


def train_step(model: torch.nn.Module, ids: torch.Tensor):
    def step() -> None:
        model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1).mean().backward()
        model.zero_grad(set_to_none=True)
    return step


def forward(model: torch.nn.Module, ids: torch.Tensor):
    def step() -> None:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    return step


def attention_step(fn, model: torch.nn.Module, batch: int, seq: int):
    """Forward + backward of one layer's causal attention alone, at the model's head shape."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(batch, h, seq, head_dim, generator=gen).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(batch, seq, heads, head_dim, generator=gen)

    def step() -> None:
        fn(q, k, v, None, head_dim**-0.5).backward(grad)
        q.grad = k.grad = v.grad = None
    return step


def main() -> None:
    from rlhf.engine.backends.cpu.fused_layers import attention, attention_reference, fuse_layer_ops

    args = parse_args()
    eager = build_model(args)
    fused = copy.deepcopy(eager)
    swapped = fuse_layer_ops(fused)
    ids = torch.randint(0, eager.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = float((fused(input_ids=ids, use_cache=False).logits - eager(input_ids=ids, use_cache=False).logits)
                     .abs().max())
    eager_train, fused_train = interleaved_medians([train_step(eager, ids), train_step(fused, ids)], args.repeats)
    eager_fwd, fused_fwd = interleaved_medians([forward(eager, ids), forward(fused, ids)], args.repeats)
    torch_attention, fused_attention = interleaved_medians(
        [attention_step(attention_reference, eager, args.batch, args.seq),
         attention_step(attention, eager, args.batch, args.seq)], args.repeats)
    print(json.dumps({
        "bench": "fused_layers", "fused_train_s": round(fused_train, 4), "eager_train_s": round(eager_train, 4),
        "train_time_ratio": round(fused_train / eager_train, 3), "fused_forward_s": round(fused_fwd, 4),
        "eager_forward_s": round(eager_fwd, 4), "forward_time_ratio": round(fused_fwd / eager_fwd, 3),
        "fused_attention_train_s": round(fused_attention, 5), "sdpa_attention_train_s": round(torch_attention, 5),
        "attention_speedup": round(torch_attention / fused_attention, 2), "max_logit_diff": diff,
        "modules_swapped": swapped, "model": args.model or args.family,
        "batch": args.batch, "seq": args.seq, "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
