"""RL-stage throughput on the comparison shape, with the per-phase split, optionally beside TRL in the same run.

    python scripts/bench_ppo.py                         # PPO: Llama-family, 4 layers, hidden 256, vocab ~100,
                                                        # batch 32, prompt 64, 64 new tokens, 1 epoch, 1 minibatch
    python scripts/bench_ppo.py --compare-trl --trl-scripts DIR --trl-dir WORK
                                                        # + TRL 0.19.1 PPOTrainer (DIR/rate.sh)
    python scripts/bench_ppo.py --advantage-estimator grpo --compare-trl --trl-scripts DIR --trl-dir WORK
                                                        # GRPO, group 4, responses stop at EOS, a Python reward
                                                        # (share of vowels), KL 0.04 in the loss; + TRL GRPOTrainer

Runs `rlhf ppo` for a few iterations and reads its metrics.jsonl; the first iteration (3 with --compile) is warm-up
and is excluded, so the figures are marginal rates (start-up excluded), measured the way the TRL
comparison scripts measure TRL (time(N2) - time(N1)). With --compare-trl the comparison run goes in
the same invocation, after ours, on the same tiny policy (WORK/tiny/policy, which the comparison's
setup.sh builds), and the last JSON line holds both figures and their ratios. --trl-scripts
(or TRL_COMPARE_SCRIPTS) is the folder of those scripts (setup.sh; rate.sh for PPO, rate_grpo.sh
for the critic-free estimators, each printing TRL's rate as its last JSON line); --trl-dir (or
TRL_COMPARE_DIR) is where setup.sh wrote its files. Without --compare-trl, ours runs on a tiny
model built here and no ratio is printed.

PPO: every response is exactly --new-tokens long (min = max), as in the comparison's PPO. GRPO/RLOO/
REINFORCE++: responses stop at EOS, so completions/s and generated tokens/s are both reported.

compute_bound_fraction: the iteration's model FLOPs (rlhf ppo's `<phase>_gflop` metrics: real
tokens only, from the model config, engine/flops.py), each phase's at the matmul rate torch keeps up
here, now, at that phase's GEMM shapes (`matmul_gflop_per_s`: prefill, decode, forward, training
forward + backward; each GEMM by the fastest of MKL, oneDNN and, for decode, the fused decode
step's packed GEMM (rlhf_cpu_decode.panel_linear, ~2x torch at a step's 32 rows; torch's rate alone
would credit generation with a rate its steps beat), all of them over and over for a quarter second, the best of four such windows: a sustained rate,
as the iteration's is; measured after each of our runs, each phase's fastest measurement used),
over the measured iteration time (with --repeats, `repeats.compute_bound_fraction` lists each run
against the references measured right after it: the spread a shared VM's spells give the figure);
`phase_fractions` splits it by phase. 1.0 would be a run that does nothing but its necessary matmuls at that rate.
`compute_bound_fraction_torch_decode` counts the decode steps at torch's rate instead, for
comparison with figures measured against that reference.
`compute_bound_fraction_vs_burst` is the same against each GEMM's fastest single call
(`matmul_burst_gflop_per_s`), which a shared VM reaches only between its slow moments;
`burst_ceiling` is what nothing but the GEMMs, at the sustained rate, would score against those;
below SLOW_SPELL_CEILING the references were measured in a slow spell of the machine (they would
raise the fraction), which the JSON says (`reference_slow_spell`) and a warning repeats.
`compute_bound_fraction_with_kv_reads` adds the decode steps' KV-cache reads at the read bandwidth
measured in the same run over a mean step's working set (`kv_cache_read_s`, `read_gb_per_s`): the
floor a decode step has besides its matmuls (each step reads its rows' whole cache), so 1.0 - this
is what is left above both bounds.

    python scripts/bench_ppo.py --compare-trl --repeats 3                 # median of 3 alternated runs each
    python scripts/bench_ppo.py --compare-trl --compile --iterations 7   # torch.compile'd layers
    python scripts/bench_ppo.py --advantage-estimator grpo --new-tokens 256 --compare-trl \
        --max-tokens-per-micro-batch 4096                                # responses of 1-256 tokens
(these three with TRL_COMPARE_SCRIPTS and TRL_COMPARE_DIR set)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SLOW_SPELL_CEILING = 0.85  # sustained/burst this low: the machine slowed down while the references ran

VOWELS_REWARD = '''
def vowels(prompt: str, response: str) -> float:
    """The comparison's reward: the share of vowels in the completion."""
    return sum(c in "aeiou" for c in response) / max(1, len(response))
'''


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="completions per iteration")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--optimizer-impl", default="auto")
    parser.add_argument("--advantage-estimator", default="gae")
    parser.add_argument("--samples-per-prompt", type=int, default=4, help="group size of the critic-free estimators")
    parser.add_argument("--model", default=None, help="policy folder (default: the comparison's tiny policy with "
                        "--compare-trl, else a tiny Llama built here)")
    parser.add_argument("--zero-stage", default=None, help="the engine's ZeRO stage (default: rlhf ppo's)")
    parser.add_argument("--compare-trl", action="store_true", help="also run TRL's rate script, in this invocation")
    parser.add_argument("--peer-trl", dest="compare_trl", action="store_true", help=argparse.SUPPRESS)  # older name
    parser.add_argument("--trl-scripts", type=Path, default=os.environ.get("TRL_COMPARE_SCRIPTS"),
                        help="with --compare-trl: the folder of the TRL comparison's setup.sh, rate.sh and "
                        "rate_grpo.sh (default: $TRL_COMPARE_SCRIPTS)")
    parser.add_argument("--trl-dir", type=Path, default=os.environ.get("TRL_COMPARE_DIR"),
                        help="with --compare-trl: where its setup.sh wrote the tiny policy, tiny/policy "
                        "(default: $TRL_COMPARE_DIR)")
    parser.add_argument("--compile", action="store_true", help="rlhf ppo --compile (torch.compile each decoder layer)")
    parser.add_argument("--warmup", type=int, default=None, help="leading iterations left out of the rates "
                        "(default 1; 2 with --model, where on a 135M model the first two iterations spend seconds in "
                        "the kernel zeroing fresh pages; 3 with --compile, whose recompiles land in iterations 1-3)")
    parser.add_argument("--recompute-old-logprobs", action="store_true", help="rlhf ppo --recompute-old-logprobs")
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=0, help="rlhf ppo's token budget")
    parser.add_argument("--no-pack-sequences", dest="pack_sequences", action="store_false",
                        help="rlhf ppo --no-pack-sequences: padded forwards with a token budget")
    parser.add_argument("--no-fused-layers", dest="fused_layers", action="store_false",
                        help="rlhf ppo --no-fused-layers: Hugging Face's own RMSNorm/RoPE/SwiGLU/attention modules")
    parser.add_argument("--cpu-matmul", default="auto", help="rlhf ppo --cpu-matmul: auto, aten or onednn")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "model", "fp16"),
                        help="rlhf ppo --kv-cache-dtype: auto/fp16 halve a float32 model's rollout KV cache on the "
                        "CPU; model keeps the model's dtype")
    parser.add_argument("--decode-rows-per-group", type=int, default=None,
                        help="rlhf ppo --decode-rows-per-group (default: its automatic choice; the batch size: every "
                        "row together)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of ours (and of TRL's, alternated); the "
                        "figures are each side's median run; every run's rate, and its fraction against the references "
                        "measured right after it, listed under `repeats`")
    args = parser.parse_args()
    if args.repeats < 1 or args.iterations <= (args.warmup or 0):
        parser.error("--repeats must be >= 1 and --iterations above --warmup")
    if args.compare_trl and not (args.trl_scripts and args.trl_dir):
        parser.error("--compare-trl needs --trl-scripts DIR and --trl-dir DIR (or TRL_COMPARE_SCRIPTS and "
                     "TRL_COMPARE_DIR): the TRL comparison's scripts and the folder its setup.sh writes")
    return args


def build_models(args: argparse.Namespace, root: Path) -> Path:
    """The policy: --model, the comparison's tiny policy with --compare-trl, else a tiny Llama of the given shape."""
    from rlhf.models.tiny import save_tiny_model

    if args.model:
        return Path(args.model)
    if args.compare_trl:
        policy = args.trl_dir / "tiny" / "policy"
        if not (policy / "config.json").is_file():
            raise SystemExit(f"--compare-trl: {policy} missing; run: bash {args.trl_scripts}/setup.sh")
        return policy
    heads = max(4, args.hidden // 64)
    return save_tiny_model(root / "actor", "llama", hidden_size=args.hidden, num_layers=args.layers,
                           num_heads=heads, num_kv_heads=heads, max_positions=2048)


def write_prompts(tokenizer: object, path: Path, count: int, prompt_len: int) -> None:
    """Random lowercase prompts whose rendered form (chat template, or the plain fallback of a
    tokenizer without one) is prompt_len tokens."""
    from rlhf.data.rendering import render_prompt
    from rlhf.data.tokenization import encode_prompt

    overhead = len(encode_prompt(render_prompt([{"role": "user", "content": ""}], tokenizer), tokenizer))
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(count):
            content = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(prompt_len - overhead))
            f.write(json.dumps({"prompt": content.strip() or "a"}) + "\n")


def reward_args(args: argparse.Namespace, actor: Path, root: Path) -> list[str]:
    """PPO: a value model made from the policy (the comparison's rm/ starts from the same weights).
    Critic-free: the comparison's Python reward function."""
    if args.advantage_estimator == "gae":
        from rlhf.models.loading import load_tokenizer
        from rlhf.models.value_model import ValueModel

        reward = root / "reward"
        ValueModel.from_causal_lm_dir(actor, head_init_std=0.02).save_pretrained(reward)
        load_tokenizer(str(actor)).save_pretrained(reward)
        return ["--reward", str(reward), "--min-new-tokens", str(args.new_tokens)]
    (root / "vowels.py").write_text(VOWELS_REWARD)
    return ["--reward-fn", f"{root / 'vowels.py'}:vowels", "--advantage-estimator", args.advantage_estimator,
            "--samples-per-prompt", str(args.samples_per_prompt), "--kl-coef", "0.04"]


def run_ours(args: argparse.Namespace) -> dict:
    """Our rlhf ppo for --iterations; per-iteration means over all but the --warmup first iterations."""
    os.environ.setdefault("WANDB_MODE", "disabled")
    from rlhf.cli import main as rlhf_main
    from rlhf.models.loading import load_tokenizer

    root = Path(tempfile.mkdtemp(prefix="bench_ppo_"))
    actor = build_models(args, root)
    tokenizer = load_tokenizer(str(actor))
    write_prompts(tokenizer, root / "prompts.jsonl", args.batch * (args.iterations + 1), args.prompt_len)
    out = root / "ppo"
    rlhf_main([
        "ppo", "--actor", str(actor), "--data", str(root / "prompts.jsonl"), *reward_args(args, actor, root),
        "--output", str(out), "--max-steps", str(args.iterations), "--generation-batch-size", str(args.batch),
        "--micro-batch-size", str(args.micro_batch_size), "--max-new-tokens", str(args.new_tokens),
        "--max-prompt-len", str(args.prompt_len), "--ppo-epochs", "1", "--dtype", args.dtype,
        "--optimizer-impl", args.optimizer_impl, "--report-to", "none", "--sample-log-interval", "0",
        "--lr", "1e-5", "--temperature", "1.0", *(["--zero-stage", args.zero_stage] if args.zero_stage else []),
        *(["--compile"] if args.compile else []), *([] if args.fused_layers else ["--no-cpu-fused-layers"]),
        "--max-tokens-per-micro-batch", str(args.max_tokens_per_micro_batch), "--cpu-matmul", args.cpu_matmul,
        "--kv-cache-dtype", args.kv_cache_dtype,
        *(["--cpu-decode-rows-per-group", str(args.decode_rows_per_group)] if args.decode_rows_per_group else []),
        *([] if args.pack_sequences else ["--no-pack-sequences"]),
        *(["--recompute-old-logprobs"] if args.recompute_old_logprobs else []),
    ])
    warmup = args.warmup if args.warmup is not None else (3 if args.compile else 2 if args.model else 1)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][warmup:]
    # The run's outputs (models, critic, checkpoints; the value model built from a real policy)
    # are gigabytes for a real model: removed once its metrics are read.
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(root / "reward", ignore_errors=True)
    phases = ("generation_s", "reward_s", "experience_s", "training_s")
    per_phase = {k: statistics.mean(r.get(k, 0.0) for r in rows) for k in phases}
    gflop = {k: statistics.mean(r[k] for r in rows)
             for k in ("prefill_gflop", "decode_gflop", "reward_gflop", "experience_gflop", "training_gflop")}
    per_iteration = sum(per_phase.values())
    tokens = statistics.mean(r["response_length"] for r in rows) * args.batch
    return {
        "completions_per_s": round(args.batch / per_iteration, 3), "tokens_per_s": round(tokens / per_iteration, 1),
        **{k: round(v, 3) for k, v in per_phase.items()}, **{k: round(v, 2) for k, v in gflop.items()},
        "critic_s": round(statistics.mean(r.get("critic_s", 0.0) for r in rows), 3),
        "response_tokens_mean": round(statistics.mean(r["response_length"] for r in rows), 1),
        "old_logprob_diff_max": max((r.get("old_logprob_diff_max", 0.0) for r in rows), default=0.0),
        "iterations_timed": len(rows), "vocab": len(tokenizer), "model": str(actor), "workdir": str(root),
    }


def model_shape(model: Path, args: argparse.Namespace) -> tuple[object, torch.dtype]:
    """The policy's matmul sizes (engine/flops.py's TransformerShape) and the run's dtype."""
    from transformers import AutoConfig

    from rlhf.engine.flops import TransformerShape

    shape = TransformerShape.from_config(AutoConfig.from_pretrained(model))
    return shape, {"fp32": torch.float32, "bf16": torch.bfloat16}.get(args.dtype, torch.float32)


def phase_gemms(shape: object, m: int, backward: bool, dtype: torch.dtype,
                packed: bool = False) -> tuple[list[list], int]:
    """One layer's linears plus the LM head on m rows, as nn.Linear runs them (x @ W^T); with
    backward also the input and weight gradients (dY @ W, dY^T @ X). Per GEMM its implementations:
    torch's matmul (MKL) and, where torch has it, oneDNN (which --cpu-matmul onednn runs;
    engine/backends/cpu/matmul.py; the weight gradient also over a transposed operand, as Zen 5 runs it);
    with `packed` (the decode steps) also the fused decode step's own GEMM over weights packed in
    panels (rlhf_cpu_decode.panel_linear), which runs a step's few rows at about twice torch's rate.
    Returns them and the FLOPs of one pass over all GEMMs."""
    from rlhf.engine.backends.cpu.decode_op import load_cpu_decode_op
    from rlhf.engine.backends.cpu.matmul import _onednn_linear, onednn_available, onednn_weight_grad_transposed

    onednn = onednn_available() and dtype == torch.float32
    decode_op = load_cpu_decode_op() if packed and dtype == torch.float32 else None
    gemms: list[list] = []
    linears = [*shape.linear_shapes(), (shape.hidden, shape.vocab)]
    for d_in, d_out in linears:
        x, w, dy = torch.randn(m, d_in, dtype=dtype), torch.randn(d_out, d_in, dtype=dtype), torch.randn(m, d_out, dtype=dtype)
        panels = decode_op.pack_panels(w.t()) if decode_op is not None else None
        gemms.append([lambda x=x, w=w: torch.nn.functional.linear(x, w)]
                     + [lambda x=x, w=w: _onednn_linear(x, w, None)] * onednn
                     + [lambda x=x, p=panels, n=d_out: decode_op.panel_linear(x, p, n)] * (decode_op is not None))
        if backward:
            gemms.append([lambda dy=dy, w=w: dy @ w] + [lambda dy=dy, w=w: _onednn_linear(dy, w.t(), None)] * onednn)
            gemms.append([lambda dy=dy, x=x: dy.t() @ x]
                         + [lambda dy=dy, x=x: _onednn_linear(dy.t(), x.t(), None),
                            lambda dy=dy, x=x: onednn_weight_grad_transposed(dy, x)] * onednn)
    flops = sum(2 * m * a * b for a, b in linears) * (3 if backward else 1)
    return gemms, flops


def gemm_rates(shape: object, m: int, backward: bool, dtype: torch.dtype, repeats: int = 5,
               min_seconds: float = 0.25, window_seconds: float = 0.25, windows: int = 4,
               packed: bool = False) -> tuple[float, float]:
    """(burst, sustained) FLOP/s of one phase's GEMMs (phase_gemms), each GEMM by its faster
    implementation. Burst: the sum of each GEMM's best single call (of at least `repeats` runs
    and of `min_seconds`: a decode step's few rows take well under a millisecond, and a best of a
    handful would be one hiccup from a rate too low). Sustained: every GEMM in turn, over and over
    for `window_seconds`, total FLOPs over total time: what the machine keeps up under load, the
    way an iteration's time is measured (a mean); the best of `windows` such windows, so that a
    slow spell of the machine during one does not lower the reference (and raise the fraction).
    On a shared VM the two differ: single calls catch the fastest moments, a stream of them pays
    for the slow ones as a training run does. Never above the burst rate."""
    gemms, flops = phase_gemms(shape, m, backward, dtype, packed)
    best = [[float("inf")] * len(impls) for impls in gemms]
    runs, began = 0, time.perf_counter()
    while runs <= repeats or time.perf_counter() - began < min_seconds:  # the first run warms up
        for impls, times in zip(gemms, best):
            for i, impl in enumerate(impls):
                start = time.perf_counter()
                impl()
                times[i] = min(times[i], time.perf_counter() - start)
        runs += 1
    fastest = [impls[times.index(min(times))] for impls, times in zip(gemms, best)]
    burst, sustained = flops / sum(min(times) for times in best), 0.0
    for _ in range(windows):
        passes, began = 0, time.perf_counter()
        while passes == 0 or time.perf_counter() - began < window_seconds:
            for gemm in fastest:
                gemm()
            passes += 1
        sustained = max(sustained, passes * flops / (time.perf_counter() - began))
    return burst, min(sustained, burst)


def matmul_rates(model: Path, args: argparse.Namespace, prompts_per_iteration: int) -> dict[str, dict[str, float]]:
    """FLOP/s of torch's matmul at the GEMM shapes of each phase, measured now, in this process
    ({"burst": {phase: rate}, "sustained": {...}}, gemm_rates): prefill (the unique prompts'
    tokens), decode (one row per sample; also the decode step's own packed GEMM, the fastest at
    those rows), experience/reward forwards and training forward+backward (a micro-batch of
    prompt + response tokens)."""
    shape, dtype = model_shape(model, args)
    micro_tokens = min(args.micro_batch_size, args.batch) * (args.prompt_len + args.new_tokens)
    rows = {"prefill": (prompts_per_iteration * args.prompt_len, False), "decode": (args.batch, False),
            "decode_torch": (args.batch, False), "forward": (micro_tokens, False), "training": (micro_tokens, True)}
    rates: dict[str, dict[str, float]] = {"burst": {}, "sustained": {}}
    for phase, (m, backward) in rows.items():
        rates["burst"][phase], rates["sustained"][phase] = gemm_rates(shape, m, backward, dtype,
                                                                      packed=phase == "decode")
    return rates


def ideal_seconds(ours: dict, rates: dict[str, float]) -> dict[str, float]:
    """Each phase's model FLOPs (rlhf ppo's `<phase>_gflop` metrics) at the given matmul rates."""
    return {
        "generation_s": ours["prefill_gflop"] * 1e9 / rates["prefill"] + ours["decode_gflop"] * 1e9 / rates["decode"],
        "reward_s": ours["reward_gflop"] * 1e9 / rates["forward"],
        "experience_s": ours["experience_gflop"] * 1e9 / rates["forward"],
        "training_s": ours["training_gflop"] * 1e9 / rates["training"],
    }


def compute_bound(ours: dict, rates: dict[str, dict[str, float]]) -> dict:
    """The iteration's model FLOPs at the measured sustained matmul rates, over the measured
    iteration time: the share of the time a perfect GEMM-bound run would need (1.0 = nothing left
    but matmuls at the rate torch keeps up at these shapes). `compute_bound_fraction_vs_burst`:
    the same against the burst rates (each GEMM's fastest single call), and
    `burst_ceiling`: what a run of nothing but those GEMMs at the sustained rate scores against
    the burst rates, the most the vs-burst figure can reach on this machine now
    (`reference_slow_spell` below SLOW_SPELL_CEILING)."""
    ideal, burst = ideal_seconds(ours, rates["sustained"]), ideal_seconds(ours, rates["burst"])
    measured, ceiling = sum(ours[k] for k in ideal), sum(burst.values()) / sum(ideal.values())
    torch_decode = ideal_seconds(ours, {**rates["sustained"], "decode": rates["sustained"]["decode_torch"]})
    return {
        "compute_bound_fraction": round(sum(ideal.values()) / measured, 3),
        # The decode steps at torch's rate, which the packed steps beat: the older, looser reference.
        "compute_bound_fraction_torch_decode": round(sum(torch_decode.values()) / measured, 3),
        "phase_fractions": {k.removesuffix("_s"): round(v / ours[k], 3) if ours[k] else None for k, v in ideal.items()},
        "compute_bound_fraction_vs_burst": round(sum(burst.values()) / measured, 3),
        "burst_ceiling": round(ceiling, 3),
        "reference_slow_spell": ceiling < SLOW_SPELL_CEILING,
        "matmul_gflop_per_s": {k: round(v / 1e9, 1) for k, v in rates["sustained"].items()},
        "matmul_burst_gflop_per_s": {k: round(v / 1e9, 1) for k, v in rates["burst"].items()},
        "iteration_gflop": round(sum(ours[f"{k}_gflop"] for k in ("prefill", "decode", "reward", "experience",
                                                                       "training")), 1),
    }


def kv_cache_reads(model: Path, args: argparse.Namespace, ours: dict, ideal_fraction: float) -> dict:
    """The decode steps' KV-cache reads at the read bandwidth measured now, in this process: the
    part of an iteration no matmul rate bounds. A decode step reads every cached key and value
    of its rows (2 x kv_dim per position and layer); with responses of the run's mean length
    (exact for PPO, whose responses all have --new-tokens; an estimate where they stop at EOS).
    The bandwidth is a sustained read (a second) of a buffer the size of what a mean step reads,
    its cache and the weights: a step's working set, which on a small CPU outgrows the last-level
    cache (a cache-sized buffer read alone would credit the reads at cache speed)."""
    from rlhf.engine.backends.cpu.decoder import kv_cache_halved  # the CPU backend's float16 cache rule

    shape, dtype = model_shape(model, args)
    element = torch.finfo(dtype).bits // 8
    halved = kv_cache_halved(args.kv_cache_dtype, dtype, torch.device("cpu"))
    cached = 2 if halved else element  # bytes a cached value takes
    position_bytes = shape.layers * 2 * shape.kv_dim * cached
    steps = max(round(ours["response_tokens_mean"]) - 1, 0)
    positions = steps * args.prompt_len + steps * (steps + 1) // 2  # step t reads prompt + t positions
    read_bytes = args.batch * positions * position_bytes
    weight_bytes = (shape.layers * shape.layer_linear_flops // 2 + shape.hidden * shape.vocab) * element
    step_bytes = args.batch * position_bytes * positions // max(steps, 1) + weight_bytes
    buffer = torch.ones(max(step_bytes // 4, 1))
    passes, began = 0, time.perf_counter()
    while passes < 3 or time.perf_counter() - began < 1.0:
        buffer.sum()
        passes += 1
    bandwidth = passes * buffer.numel() * 4 / (time.perf_counter() - began)
    seconds = read_bytes / bandwidth
    measured = sum(ours[k] for k in ("generation_s", "reward_s", "experience_s", "training_s"))
    return {"kv_cache_read_s": round(seconds, 3), "read_gb_per_s": round(bandwidth / 1e9, 1),
            "compute_bound_fraction_with_kv_reads": round(ideal_fraction + seconds / measured, 3)}


def run_trl(args: argparse.Namespace) -> dict:
    """TRL's marginal rate from the comparison's own script (PPO: rate.sh, else rate_grpo.sh)."""
    script = args.trl_scripts / ("rate.sh" if args.advantage_estimator == "gae" else "rate_grpo.sh")
    env = {**os.environ, "GEN": str(args.new_tokens), "GROUP": str(args.samples_per_prompt)}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_run(runs: list[dict], key: str) -> dict:
    """The run whose `key` is the median (repeats are odd; of an even count, the lower middle)."""
    return sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]


def main() -> None:
    args = parse_args()
    workdirs: list[str] = []
    try:
        bench(args, workdirs)
    finally:  # the runs' prompts and tiny models; the rest went as each run ended
        for workdir in workdirs:
            shutil.rmtree(workdir, ignore_errors=True)


def bench(args: argparse.Namespace, workdirs: list[str]) -> None:
    """The repeats, alternated with TRL's; prints the JSON line. `workdirs` gets each run's folder."""
    prompts_per_iteration = args.batch // (args.samples_per_prompt if args.advantage_estimator != "gae" else 1)
    ours_runs, trl_runs, rates = [], [], []
    for _ in range(args.repeats):  # alternated, so a slow spell of the machine hits both sides alike
        ours_runs.append(run_ours(args))
        workdirs.append(ours_runs[-1].pop("workdir"))
        # The matmul references after each of our runs, each phase's fastest the one used: a slow
        # spell during one measurement must not lower a reference (and raise the fraction).
        rates.append(matmul_rates(Path(ours_runs[-1]["model"]), args, prompts_per_iteration))
        if args.compare_trl:
            trl_runs.append(run_trl(args))
    ours = median_run(ours_runs, "completions_per_s")
    bound = compute_bound(ours, {kind: {phase: max(r[kind][phase] for r in rates) for phase in rates[0][kind]}
                                 for kind in rates[0]})
    if bound["reference_slow_spell"]:
        print(f"bench_ppo: warning: burst_ceiling {bound['burst_ceiling']} < {SLOW_SPELL_CEILING}: the sustained matmul "
              "references ran in a slow spell of the machine and overstate compute_bound_fraction; rerun with "
              "--repeats 3", file=sys.stderr)
    result = {
        "estimator": args.advantage_estimator, **ours, **bound,
        **kv_cache_reads(Path(ours["model"]), args, ours, bound["compute_bound_fraction"]),
        "shape": {"batch": args.batch, "prompt": args.prompt_len, "new_tokens": args.new_tokens, "dtype": args.dtype,
                  "group": args.samples_per_prompt if args.advantage_estimator != "gae" else 1,
                  "kv_cache_dtype": args.kv_cache_dtype},
    }
    if args.repeats > 1:
        # Each run against the references measured right after it (the headline figure is stricter:
        # the median run against each phase's fastest reference of all the runs).
        result["repeats"] = {"completions_per_s": [r["completions_per_s"] for r in ours_runs],
                             "compute_bound_fraction": [compute_bound(run, rate)["compute_bound_fraction"]
                                                        for run, rate in zip(ours_runs, rates)],
                             "trl": [r.get("samples_per_s", r.get("completions_per_s")) for r in trl_runs]}
    if args.compare_trl:
        trl = median_run(trl_runs, "samples_per_s" if args.advantage_estimator == "gae" else "completions_per_s")
        result["trl"] = trl
        if args.advantage_estimator == "gae":
            result["ratio_samples_per_s"] = round(ours["completions_per_s"] / trl["samples_per_s"], 2)
        else:
            result["ratio_completions_per_s"] = round(ours["completions_per_s"] / trl["completions_per_s"], 2)
            result["ratio_tokens_per_s"] = round(ours["tokens_per_s"] / trl["tokens_per_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
