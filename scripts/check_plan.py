"""`rlhf plan` against the peak memory each stage measures, per phase, on the CPU (RSS).

    python scripts/check_plan.py                       # every config below (~10 min on 2 cores)
    python scripts/check_plan.py --only sft-z3 ppo-z3  # some of them
    python scripts/check_plan.py --hidden 768 --layers 10 --vocab 16384   # another model

Builds one Llama-family model (default 512 hidden, 8 layers, 8192 vocabulary: 32M parameters,
so params, gradients and Adam's moments weigh as much as the activations) and a reward model
from it, runs each case's stage (sft at ZeRO 3, 0, 2 and 3 with activation checkpointing, reward,
PPO with a critic and a reward model, GRPO with shared prompts, LoRA sft and PPO; 1 or 2 ranks)
for a few steps with `--report-to none`, and reads the
`peak_mem_gb_<phase>` it logged (the max over the steps after the first: the steady state the
plan predicts) and its `mem_baseline_gb` (the process before any model loads). Then it runs
`rlhf plan` with the same flags and world size, in its own process: the plan's baseline is its
own measurement, nothing is taken from the run.

Every row's data has the same length (SFT and pairs truncated at --max-seq-len, prompts of exactly
--max-prompt-len tokens, responses of exactly --max-new-tokens), so the padded widths the plan
assumes are the widths the stage sees. The stages run with MALLOC_MMAP_THRESHOLD_=65536 (glibc
returns each freed tensor at once, see engine/phase_memory.py): RSS then follows the live tensors, which
is what the plan counts, instead of keeping what earlier phases freed.

Each phase is compared twice: on total RSS, and above each side's own baseline (the measured peak
minus the run's mem_baseline_gb; the predicted components, the runtime constant included), so a
large fixed cost cannot hide an error in what the plan actually models. The last line is JSON.

    python scripts/check_plan.py --engine-malloc --only ppo-z3

runs the stages with the engine's own glibc tuning instead (what a user's run logs): freed memory
stays in the heap, so every phase's RSS peak is the process's peak so far, and each phase is then
compared with the plan's overall peak (the largest phase).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import string
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 0.15


@dataclass(frozen=True)
class Case:
    """One run: a stage, its flags, its world size."""

    name: str
    stage: str
    nproc: int
    flags: tuple[str, ...]


def cases(seq: int, prompt: int, new: int) -> list[Case]:
    common = ("--dtype", "fp32", "--report-to", "none", "--lr", "1e-5", "--sample-log-interval", "0")
    sft = ("--micro-batch-size", "4", "--max-seq-len", str(seq), "--max-steps", "3", "--eval-split", "0.05",
           "--dtype", "fp32", "--report-to", "none", "--lr", "1e-5")
    ppo = ("--generation-batch-size", "8", "--micro-batch-size", "8", "--max-prompt-len", str(prompt),
           "--max-new-tokens", str(new), "--min-new-tokens", str(new), "--max-steps", "3", *common)
    return [
        Case("sft-z3", "sft", 1, (*sft, "--zero-stage", "3")),
        Case("sft-z0", "sft", 1, (*sft, "--zero-stage", "0")),
        Case("sft-z3-ckpt-2rank", "sft", 2, (*sft, "--zero-stage", "3", "--gradient-checkpointing")),
        Case("sft-z2-2rank", "sft", 2, (*sft, "--zero-stage", "2", "--optimizer-impl", "torch")),
        Case("reward-z3", "reward", 1, ("--micro-batch-size", "2", "--max-seq-len", str(seq), "--max-steps", "3",
                                        "--eval-split", "0.05", "--dtype", "fp32", "--report-to", "none")),
        Case("ppo-z3", "ppo", 1, (*ppo, "--zero-stage", "3")),
        Case("ppo-z3-2rank", "ppo", 2, (*ppo, "--zero-stage", "3")),
        Case("sft-lora", "sft", 1, (*sft, "--zero-stage", "3", "--lora-rank", "16", "--lora-dropout", "0.1")),
        Case("ppo-lora-2rank", "ppo", 2, (*ppo, "--zero-stage", "3", "--lora-rank", "16")),
        Case("grpo-z3", "ppo", 1, (*ppo, "--zero-stage", "3", "--advantage-estimator", "grpo", "--samples-per-prompt",
                                   "4", "--reward-fn", "{rewards}")),
    ]


def build_models(root: Path, hidden: int, layers: int, vocab: int) -> tuple[Path, Path]:
    """A Llama-family base model with the char tokenizer, and a reward model made from it."""
    from transformers import AutoModelForCausalLM

    from rlhf.models.tiny import build_char_tokenizer, tiny_config
    from rlhf.models.value_model import ValueModel

    base, reward = root / "base", root / "rm"
    if not (base / "config.json").exists():
        tokenizer = build_char_tokenizer()
        config = tiny_config("llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                             num_heads=hidden // 64, num_kv_heads=hidden // 128, intermediate_size=hidden * 11 // 4,
                             max_positions=2048, pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        AutoModelForCausalLM.from_config(config).save_pretrained(base)
        tokenizer.save_pretrained(base)
    if not (reward / "config.json").exists():
        ValueModel.from_causal_lm_dir(base, head_init_std=0.5).save_pretrained(reward)
        build_char_tokenizer().save_pretrained(reward)
    return base, reward


def write_data(root: Path, seq: int, prompt: int) -> dict[str, Path]:
    """Rows long enough to be cut at --max-seq-len (sft, pairs) and prompts of `prompt` tokens
    (the char tokenizer: one token per character, plus <s> and the chat template's words)."""
    rng = random.Random(0)

    def text(n: int) -> str:
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))

    template = len("<s>Human: \n\nAssistant:") - 2  # <s> is one token
    files = {
        "sft": [{"prompt": text(8), "response": text(seq + 64)} for _ in range(256)],
        "pairs": [{"prompt": text(8), "chosen": text(seq + 64), "rejected": text(seq + 64)} for _ in range(256)],
        "prompts": [{"prompt": "sort: " + text(prompt - template - 6)} for _ in range(256)],
    }
    paths = {"rewards": root / "rewards.py"}
    paths["rewards"].write_text("def vowels(prompt: str, response: str) -> float:\n"
                                "    return sum(c in 'aeiou' for c in response) / max(1, len(response))\n")
    for name, rows in files.items():
        paths[name] = root / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def stage_args(case: Case, base: Path, reward: Path, data: dict[str, Path]) -> list[str]:
    if case.stage == "sft":
        return ["--model", str(base), "--data", str(data["sft"]), *case.flags]
    if case.stage == "reward":
        return ["--model", str(base), "--data", str(data["pairs"]), *case.flags]
    models = ["--actor", str(base)]
    if "--reward-fn" not in case.flags:
        models += ["--reward", str(reward)]
    flags = [f.replace("{rewards}", f"{data['rewards']}:vowels") for f in case.flags]
    return [*models, "--data", str(data["prompts"]), *flags]


def run(args: list[str], nproc: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = [*(launcher if nproc > 1 else [sys.executable]), "-m", "rlhf", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
    return result


def measured(output: Path) -> tuple[dict[str, float], float]:
    """Per phase the max logged peak after the first step (GiB), and the baseline."""
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first = min(r["step"] for r in rows)
    peaks: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            # eval runs once or twice; the steady-state rule applies to the phases of every step
            if key.startswith("peak_mem_gb_") and (row["step"] > first or key.endswith("_eval")):
                phase = key[len("peak_mem_gb_"):]
                peaks[phase] = max(peaks.get(phase, 0.0), value)
    return peaks, max(r["mem_baseline_gb"] for r in rows if "mem_baseline_gb" in r)


def check(case: Case, root: Path, base: Path, reward: Path, data: dict[str, Path], env: dict[str, str],
          overall: bool = False) -> dict:
    """Run `case` and its plan; compare each measured phase with the plan's phase (with `overall`:
    with the plan's largest phase)."""
    output = root / case.name
    if output.exists():
        shutil.rmtree(output)
    args = stage_args(case, base, reward, data)
    run([case.stage, *args, "--output", str(output)], case.nproc, env)
    peaks, baseline = measured(output)
    plan_out = run(["plan", case.stage, *args, "--world-size", str(case.nproc), "--device", "cpu"], 1, env)
    plan = json.loads(plan_out.stdout.strip().splitlines()[-1])
    phases = {}
    largest = max(plan["phases"].values(), key=lambda p: p["peak_gb"])
    for phase, got in sorted(peaks.items()):
        want = largest if overall else plan["phases"][phase]
        phases[phase] = {
            "predicted_gb": round(want["peak_gb"], 3), "measured_gb": round(got, 3),
            "ratio": round(want["peak_gb"] / got, 3),
            "predicted_above_baseline_gb": round(want["above_baseline_gb"], 3),
            "measured_above_baseline_gb": round(got - baseline, 3),
            "ratio_above_baseline": round(want["above_baseline_gb"] / (got - baseline), 3),
            "moment": want["moment"],
        }
    return {"case": case.name, "stage": case.stage, "world_size": case.nproc,
            "baseline_measured_gb": round(baseline, 3), "baseline_planned_gb": round(plan["baseline_gb"], 3),
            "phases": phases}


def print_table(results: list[dict]) -> None:
    print(f"{'case':<20} {'phase':<11} {'plan':>7} {'meas':>7} {'ratio':>6} | {'plan-b':>7} {'meas-b':>7} {'ratio':>6}"
          "   (GiB per rank; -b: above the baseline)")
    for r in results:
        for phase, p in r["phases"].items():
            print(f"{r['case']:<20} {phase:<11} {p['predicted_gb']:7.3f} {p['measured_gb']:7.3f} {p['ratio']:6.3f} | "
                  f"{p['predicted_above_baseline_gb']:7.3f} {p['measured_above_baseline_gb']:7.3f} "
                  f"{p['ratio_above_baseline']:6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help="case names to run (default: all)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--workdir", default=None, help="keep models and runs here (default: a temp folder)")
    parser.add_argument("--engine-malloc", action="store_true",
                        help="run with the engine's glibc tuning (freed memory kept) and compare with the overall peak")
    args = parser.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="check_plan_"))
    root.mkdir(parents=True, exist_ok=True)
    base, reward = build_models(root / "models", args.hidden, args.layers, args.vocab)
    data = write_data(root, args.seq_len, args.prompt_len)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    if not args.engine_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    selected = [c for c in cases(args.seq_len, args.prompt_len, args.new_tokens)
                if args.only is None or c.name in args.only]
    results = []
    for case in selected:
        results.append(check(case, root / "runs", base, reward, data, env, args.engine_malloc))
        print(json.dumps(results[-1]), file=sys.stderr)
    print_table(results)
    ratios = [p[k] for r in results for p in r["phases"].values() for k in ("ratio", "ratio_above_baseline")]
    worst = max((abs(x - 1) for x in ratios), default=0.0)
    print(json.dumps({"cases": results, "malloc": "engine" if args.engine_malloc else "MALLOC_MMAP_THRESHOLD_=65536",
                      "worst_relative_error": round(worst, 3),
                      "within_tolerance": worst <= TOLERANCE, "tolerance": TOLERANCE}))


if __name__ == "__main__":
    main()
