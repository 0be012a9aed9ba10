"""Rollout generation throughput: rlhf.engine.generation.generate vs Hugging Face `generate`.

Both run the same model on the same prompts with the same sampling (temperature 1, no top-k
or top-p by default) and both generate exactly --new tokens per sequence (neither has a stop
id), so they do identical model work. Each is timed end to end
and with one new token (= the prefill), which separates prefill time from time per decode
step. The achieved bandwidth of a decode step counts the bytes a step must read: every
weight except the input embedding table (only B rows of it are read) plus the keys and values
of all cached tokens; on a GPU compare it with the device's peak via --peak-gbs.

    python scripts/bench_generation.py                  # CPU: tiny Llama (4 layers, hidden 256,
                                                        # char vocab), B=32, P=64, N=64
    python scripts/bench_generation.py --threads 2 --batch 8 --new 128
    python scripts/bench_generation.py --device cuda --preset 1b --batch 1 --peak-gbs 3350
    python scripts/bench_generation.py --device cuda --preset 1b --batch 1 --cuda-graph   # graph-replayed steps
    python scripts/bench_generation.py --fast off       # ours through the HF forward (reference)
    python scripts/bench_generation.py --kernel off     # fast decoder, Python decode step
    python scripts/bench_generation.py --model runs/smollm2 --batch 8 --new 64   # a real model folder,
                                                        # real chat prompts through its chat template
    python scripts/bench_generation.py --samples-per-prompt 4 --prompt 256   # group sampling

--samples-per-prompt N (N > 1) times group sampling instead of HF: generate(B unique prompts,
samples_per_prompt=N), which prefills each prompt once and copies its KV cache to its N samples,
against generate(the B prompts repeated N times), which prefills every copy; both produce B * N
sequences of --new tokens through the same runner. --batch is then the number of unique prompts.

Ours runs the fast Llama-family decoder (engine/fast_decode.py) where it supports the model,
else the model's own forward; --fast picks. On the CPU in float32 its decode steps run the
fused csrc op (engine/backends/cpu/decode_op.py) unless --kernel off (which sets RLHF_DISABLE_OPS=1). The last line of output is one JSON object
(ours_tokens_per_s, hf_tokens_per_s, ratio_vs_hf, the per-phase timings, bandwidth figures,
ours_path and the shape); with --samples-per-prompt it holds group_tokens_per_s,
repeated_tokens_per_s, ratio_group_vs_repeated and each one's prefill and decode-step times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlhf.engine.backends.registry import backend_for
from rlhf.engine.fast_decode import fast_decode_unsupported_reason
from rlhf.engine.generation import SamplingParams, generate
from rlhf.models.tiny import build_char_tokenizer, tiny_config

PRESETS: dict[str, dict[str, int]] = {
    # The default CPU shape: small enough that per-step overheads are visible.
    "tiny": dict(hidden=256, layers=4, heads=4, kv_heads=2, ffn=512, vocab=0),
    # A ~1.1B Llama (TinyLlama-1.1B's shape) for the bandwidth-bound GPU case at batch 1.
    "1b": dict(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model shape; flags below override it")
    p.add_argument("--model", help="a Hugging Face model folder (real weights; prompts are real chat questions "
                   "rendered with its chat template); replaces --preset and the shape flags")
    p.add_argument("--family", default="llama", help="llama, qwen2, mistral, opt or gpt2")
    p.add_argument("--hidden", type=int, help="hidden size")
    p.add_argument("--layers", type=int, help="decoder layers")
    p.add_argument("--heads", type=int, help="attention heads")
    p.add_argument("--kv-heads", type=int, help="key/value heads (GQA)")
    p.add_argument("--ffn", type=int, help="MLP intermediate size")
    p.add_argument("--vocab", type=int, help="vocabulary size (0: the ~100-id char tokenizer)")
    p.add_argument("--batch", type=int, default=32, help="prompts per generate call (unique prompts with "
                   "--samples-per-prompt)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    p.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 on CPU, bfloat16 on GPU"
    )
    p.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of each configuration")
    p.add_argument("--repeats", type=int, default=5, help="timed runs; the median is reported")
    p.add_argument("--peak-gbs", type=float, help="the device's peak memory bandwidth in GB/s")
    p.add_argument(
        "--fast", choices=["auto", "on", "off"], default="auto",
        help="our path: the fast Llama-family decoder where it supports the model (auto), always (on), "
        "or the model's own HF forward, the reference (off)",
    )
    p.add_argument(
        "--kernel", choices=["auto", "off"], default="auto",
        help="the fused CPU decode step where it can run (auto) or the fast decoder's Python step (off)",
    )
    p.add_argument("--cuda-graph", action="store_true",
                   help="our decode steps replayed as CUDA graphs (RLHF_CUDA_GRAPH_DECODE=1, engine/backends/cuda/decode_graph.py)")
    p.add_argument("--no-hf", action="store_true", help="time only ours")
    p.add_argument(
        "--samples-per-prompt", type=int, default=1,
        help="N > 1: time group sampling (each of --batch prompts prefilled once, sampled N times) against "
        "the same prompts repeated N times, instead of ours against HF",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


CHAT_QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for sleeping better.",
    "How do I reverse a list in Python?",
    "What is seven plus eight? Answer with the number only.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "What are the main differences between TCP and UDP?",
    "Suggest a name for a small bakery.",
    "Describe the water cycle for a ten-year-old.",
)


def chat_prompts(tokenizer: Any, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` real chat questions rendered with the model's chat template, left-padded."""
    from rlhf.data.batching import pad_left
    from rlhf.data.rendering import render_prompt
    from rlhf.data.tokenization import encode_prompt

    ids = [encode_prompt(render_prompt([{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]}],
                                       tokenizer), tokenizer) for i in range(batch)]
    input_ids, mask = pad_left(ids, tokenizer.pad_token_id)
    return input_ids.to(device), mask.to(device)


def load_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[PreTrainedModel, Any]:
    """--model's weights and tokenizer (a real model folder)."""
    from rlhf.models.loading import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    return model.eval(), tokenizer


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    shape = dict(PRESETS[args.preset])
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    vocab = shape["vocab"] or len(build_char_tokenizer())
    config = tiny_config(
        args.family, vocab_size=vocab, hidden_size=shape["hidden"], num_layers=shape["layers"],
        num_heads=shape["heads"], num_kv_heads=shape["kv_heads"], intermediate_size=shape["ffn"],
        max_positions=max(512, args.prompt + args.new),
    )
    torch.manual_seed(args.seed)
    with torch.device(device):  # initialise in place: a 1B model is slow to build on CPU and move
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def decode_bytes(model: PreTrainedModel, batch: int, prompt: int, new: int) -> int:
    """Bytes the new - 1 decode steps must read: weights (not the input embedding) + cached K/V."""
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embedding)
    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    per_token = cfg.num_hidden_layers * 2 * kv_heads * head_dim * embedding.element_size() * batch
    # Decode step s attends to the prompt, the s tokens before it and itself.
    kv = sum(per_token * (prompt + s + 1) for s in range(new - 1))
    return weights * (new - 1) + kv


def timed(fns: dict[str, Callable[[], object]], device: torch.device, warmup: int, repeats: int) -> dict[str, float]:
    """Median wall-clock seconds of each fn() after warm-up.

    The timed runs alternate between the functions (a, b, a, b, ...) so that a change in the
    machine's load during the benchmark (a shared CPU) weighs on every side alike.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(
    runs: dict[str, Callable[[int], torch.Tensor]], args: argparse.Namespace, device: torch.device, rows: int
) -> dict[str, dict[str, float]]:
    """Per run: total time for --new tokens, prefill time (one token) and per-decode-step time."""
    for name, run in runs.items():
        out = run(args.new)
        if out.shape != (rows, args.prompt + args.new):
            raise RuntimeError(f"{name}: expected {args.new} new tokens per sequence, got shape {tuple(out.shape)}")
    totals = timed({name: (lambda r=run: r(args.new)) for name, run in runs.items()}, device, args.warmup, args.repeats)
    prefills = timed({name: (lambda r=run: r(1)) for name, run in runs.items()}, device, args.warmup, args.repeats)
    results = {}
    for name in runs:
        total, prefill = totals[name], prefills[name]
        step = (total - prefill) / max(args.new - 1, 1)
        results[name] = {
            "total_s": total, "prefill_s": prefill, "step_s": step, "tokens_per_s": rows * args.new / total,
        }
    return results


def main() -> None:
    args = parse_args()
    if args.samples_per_prompt < 1:
        raise SystemExit(f"--samples-per-prompt must be >= 1, got {args.samples_per_prompt}")
    if args.kernel == "off":
        os.environ["RLHF_DISABLE_OPS"] = "1"  # read when an op is first loaded
    if args.cuda_graph:
        os.environ["RLHF_CUDA_GRAPH_DECODE"] = "1"  # read when each generate call builds its decoder
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    if args.model:
        model, tokenizer = load_model(args, device, dtype)
        input_ids, attention_mask = chat_prompts(tokenizer, args.batch, device)
        pad, args.prompt, args.family, args.preset = tokenizer.pad_token_id, input_ids.shape[1], model.config.model_type, "model"
    else:
        model = build_model(args, device, dtype)
        pad = 0
        input_ids = torch.randint(4, model.config.vocab_size, (args.batch, args.prompt), generator=gen, device=device)
        attention_mask = torch.ones_like(input_ids)
    vocab = model.config.vocab_size

    fast = {"auto": "auto", "on": True, "off": False}[args.fast]
    unsupported = fast_decode_unsupported_reason(model)
    path = "hf_forward" if fast is False or (fast == "auto" and unsupported) else "fast"
    if path == "fast":
        isa = getattr(backend_for(model.device).fast_decoder(model, args.batch, 2), "kernel_isa", None)
        path = f"fast+cpu_decode[{isa}]" if isa else "fast"

    def ours(new: int, ids: torch.Tensor = input_ids, mask: torch.Tensor = attention_mask,
             samples_per_prompt: int = 1) -> torch.Tensor:
        params = SamplingParams(
            max_new_tokens=new, pad_token_id=pad, eos_token_id=None, do_sample=True,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        )
        out = generate(model, ids, mask, params, generator=gen, fast=fast, samples_per_prompt=samples_per_prompt)
        return out.sequences

    # No stop id on either side (eos_token_id=None overrides the model's), so both always
    # generate exactly `new` tokens and HF pays for no min-length logits processor.
    def hf(new: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new,
                do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                pad_token_id=pad, eos_token_id=None,
            )

    group = args.samples_per_prompt
    rows = args.batch * group
    if group > 1:
        repeated_ids, repeated_mask = input_ids.repeat_interleave(group, 0), attention_mask.repeat_interleave(group, 0)
        runs: dict[str, Callable[[int], torch.Tensor]] = {
            "group": lambda new: ours(new, samples_per_prompt=group),
            "repeated": lambda new: ours(new, repeated_ids, repeated_mask),
        }
    else:
        runs = {"ours": ours} if args.no_hf else {"ours": ours, "hf": hf}

    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {args.family} {n_params / 1e6:.1f}M params {dtype} on {device}; batch {args.batch}"
        + (f" prompts x {group} samples" if group > 1 else "")
        + f", prompt {args.prompt}, new {args.new}; threads {torch.get_num_threads()}; ours: {path} path"
        + (f" ({unsupported})" if path == "hf_forward" and unsupported else "")
    )
    results = measure(runs, args, device, rows)
    step_bytes = decode_bytes(model, rows, args.prompt, args.new)
    for name, r in results.items():
        r["decode_gbs"] = step_bytes / (r["step_s"] * max(args.new - 1, 1)) / 1e9 if r["step_s"] > 0 else 0.0
        peak = f" ({100 * r['decode_gbs'] / args.peak_gbs:.1f}% of {args.peak_gbs:g})" if args.peak_gbs else ""
        print(
            f"{name:>8}: {r['tokens_per_s']:9.1f} tokens/s  total {r['total_s'] * 1e3:8.1f} ms  "
            f"prefill {r['prefill_s'] * 1e3:7.1f} ms  decode {r['step_s'] * 1e3:6.2f} ms/step  "
            f"{r['decode_gbs']:7.1f} GB/s{peak}"
        )
    summary = group_summary(results, group) if group > 1 else hf_summary(results, args)
    summary.update({
        "ours_path": path,
        "preset": args.preset, "model": args.model, "family": args.family, "params": n_params,
        "vocab": vocab, "batch": args.batch, "samples_per_prompt": group, "sequences": rows,
        "prompt": args.prompt, "new_tokens": args.new,
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
        "repeats": args.repeats,
    })
    print(json.dumps(summary))


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def hf_summary(results: dict[str, dict[str, float]], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON figures of ours against HF generate (HF's None under --no-hf)."""
    ours_r, hf_r = results["ours"], results.get("hf")
    ratio = ours_r["tokens_per_s"] / hf_r["tokens_per_s"] if hf_r else None
    decode_ratio = hf_r["step_s"] / ours_r["step_s"] if hf_r and ours_r["step_s"] > 0 else None
    if hf_r:  # decode_ratio is None where our decode time rounds to zero (a few new tokens)
        per_step = f", {decode_ratio:.2f}x per decode step" if decode_ratio else ""
        print(f"ours / HF: {ratio:.2f}x end to end{per_step}")
    return {
        "bench": "generation",
        "ours_tokens_per_s": round(ours_r["tokens_per_s"], 2),
        "hf_tokens_per_s": round(hf_r["tokens_per_s"], 2) if hf_r else None,
        "ratio_vs_hf": round(ratio, 3) if ratio else None,
        "decode_step_ratio_vs_hf": round(decode_ratio, 3) if decode_ratio else None,
        "ours_prefill_ms": _ms(ours_r["prefill_s"]),
        "hf_prefill_ms": _ms(hf_r["prefill_s"]) if hf_r else None,
        "ours_decode_ms_per_step": round(ours_r["step_s"] * 1e3, 4),
        "hf_decode_ms_per_step": round(hf_r["step_s"] * 1e3, 4) if hf_r else None,
        "ours_decode_gbs": round(ours_r["decode_gbs"], 2),
        "hf_decode_gbs": round(hf_r["decode_gbs"], 2) if hf_r else None,
        "peak_gbs": args.peak_gbs,
        "ours_fraction_of_peak": round(ours_r["decode_gbs"] / args.peak_gbs, 4) if args.peak_gbs else None,
    }


def group_summary(results: dict[str, dict[str, float]], group: int) -> dict[str, Any]:
    """The JSON figures of group sampling against the prompts repeated `group` times."""
    g, r = results["group"], results["repeated"]
    ratio = g["tokens_per_s"] / r["tokens_per_s"]
    prefill_ratio = r["prefill_s"] / g["prefill_s"] if g["prefill_s"] > 0 else None
    print(f"group / repeated: {ratio:.2f}x end to end"
          + (f", prefill {prefill_ratio:.2f}x faster" if prefill_ratio else ""))
    return {
        "bench": "generation_group_sampling",
        "group_tokens_per_s": round(g["tokens_per_s"], 2),
        "repeated_tokens_per_s": round(r["tokens_per_s"], 2),
        "ratio_group_vs_repeated": round(ratio, 3),
        "group_prefill_ms": _ms(g["prefill_s"]),
        "repeated_prefill_ms": _ms(r["prefill_s"]),
        "prefill_speedup": round(prefill_ratio, 3) if prefill_ratio else None,
        "group_decode_ms_per_step": round(g["step_s"] * 1e3, 4),
        "repeated_decode_ms_per_step": round(r["step_s"] * 1e3, 4),
    }

if __name__ == "__main__":
    main()
