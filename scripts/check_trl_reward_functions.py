"""Run one reward-function file in TRL's GRPOTrainer and in `rlhf ppo --advantage-estimator grpo`.

    python scripts/check_trl_reward_functions.py                    # trl importable in this python
    python scripts/check_trl_reward_functions.py --trl-python /path/to/trl-venv/bin/python
    python scripts/check_trl_reward_functions.py --reward-file my_rewards.py --functions f,g --formats standard

Both trainers get the same tiny model folder (`rlhf.models.tiny`, no network), the same rows (a
standard and a conversational set; each row has a `task` column, the standard ones a
`ground_truth` too) and the same functions: by default scripts/trl_reward_examples.py, TRL's
documented examples plus `probe`, which records how each call looked (the argument names and
types, trainer_state's step). Each runs --steps generation steps of --group x --prompts-per-step
completions. The comparison: every function scored in both (its mean per step, NaN where it
returned None for every sample), the same log_metric names (TRL logs `name`, rlhf
`reward_fn/name`) with the same trainer_state-derived values, and identical probe records.

trl is not a dependency of rlhf: the TRL side imports it inside; `--trl-python` runs that side in
another interpreter (a venv with trl, which need not have rlhf). The rlhf side runs `python -m
rlhf ppo` with this interpreter. Prints one JSON line last: {"ok": ..., "formats": {...}}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "scripts" / "trl_reward_examples.py"
# The probe's fields that depend only on how a trainer calls the function.
PROBE_FIELDS = ("columns", "rows", "prompt", "prompt_roles", "completion", "completion_message", "completion_ids",
                "global_step", "max_steps", "epoch", "logs_callable", "column_lists")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reward-file", type=Path, default=EXAMPLES)
    p.add_argument("--functions", default="", help="comma-separated; default: the file's STANDARD / CONVERSATIONAL")
    p.add_argument("--formats", default="standard,conversational")
    p.add_argument("--model", type=Path, help="a model folder (default: a tiny llama built here)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--trl-python", help="run the TRL side in this interpreter (one with trl installed)")
    p.add_argument("--workdir", type=Path, help="default: a new temporary folder")
    p.add_argument("--part", choices=["all", "trl"], default="all", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


# ------------------------------------------------------------------ inputs


def example_rows(fmt: str, n: int) -> list[dict[str, Any]]:
    """n prompt rows, half math and half coding (Example 4's `task`)."""
    rows = []
    for a in range(n):
        task = "math" if a % 2 else "coding"
        if fmt == "conversational":
            rows.append({"prompt": [{"role": "system", "content": "think first"},
                                    {"role": "user", "content": f"{a}*2?"}], "task": task})
        else:
            rows.append({"prompt": f"{a}+{a}=", "task": task, "ground_truth": str(2 * a)})
    return rows


def function_names(args: argparse.Namespace, fmt: str) -> list[str]:
    if args.functions:
        return [f for f in args.functions.split(",") if f]
    spec = importlib.util.spec_from_file_location("_check_reward_file", args.reward_file)
    if spec is None or spec.loader is None:
        fail(f"--reward-file {args.reward_file}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = getattr(module, fmt.upper(), None)
    if names is None:
        fail(f"--reward-file {args.reward_file} has no {fmt.upper()} list of function names; pass --functions")
    return list(names)


def tiny_model(folder: Path) -> Path:
    try:
        from rlhf.models.tiny import save_tiny_model
    except ImportError:
        fail(f"rlhf is not importable in {sys.executable}: run this script with rlhf's python (and --trl-python "
             "for the TRL side), or pass --model")
    if not (folder / "config.json").is_file():
        save_tiny_model(folder, "llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    return folder


# ------------------------------------------------------------------ TRL's side


def run_trl(args: argparse.Namespace, functions: list[str]) -> dict[str, Any]:
    """TRL's GRPOTrainer over --rows with the file's functions: per step, each function's mean
    reward and every other logged number."""
    try:
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        fail(f"the TRL side needs trl (and datasets) in {sys.executable}: {exc}; pip install trl, or pass "
             "--trl-python PATH (a python with trl)")
    torch.set_num_threads(2)
    spec = importlib.util.spec_from_file_location("_trl_reward_file", args.reward_file)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    batch = args.group * args.prompts_per_step
    config = GRPOConfig(
        output_dir=str(args.out), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=args.group, max_completion_length=args.max_new_tokens, learning_rate=1e-5, beta=0.0,
        num_iterations=1, max_steps=args.steps, report_to=[], save_strategy="no", logging_steps=1, bf16=False,
        fp16=False, use_cpu=True, use_vllm=False, seed=0, lr_scheduler_type="constant",
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[getattr(module, f) for f in functions], args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    started = time.perf_counter()
    trainer.train()
    steps = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in h.items()}
             for h in trainer.state.log_history if "reward" in h]  # NaN: a function that scored no sample
    return {
        "trainer": f"trl-{trl.__version__}", "seconds": round(time.perf_counter() - started, 2), "steps": len(steps),
        "rewards": {f: [h.get(f"rewards/{f}/mean") for h in steps] for f in functions},
        "logged": [{k: v for k, v in h.items() if isinstance(v, (int, float))} for h in steps],
    }


def trl_side(args: argparse.Namespace, functions: list[str], rows: Path, out: Path,
             probe: Path) -> dict[str, Any]:
    """`run_trl` in this interpreter, or with --trl-python in that one (its last stdout line)."""
    env = {**os.environ, "TRL_REWARD_PROBE": str(probe), "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    command = [args.trl_python or sys.executable, str(Path(__file__).resolve()), "--part", "trl", "--model",
               str(args.model), "--rows", str(rows), "--out", str(out), "--reward-file", str(args.reward_file),
               "--functions", ",".join(functions), "--steps", str(args.steps), "--group", str(args.group),
               "--prompts-per-step", str(args.prompts_per_step), "--max-new-tokens", str(args.max_new_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["(no output)"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ rlhf's side


def rlhf_side(args: argparse.Namespace, functions: list[str], rows: Path, out: Path, probe: Path) -> dict[str, Any]:
    """`rlhf ppo --advantage-estimator grpo` with the same functions, rows and sizes."""
    command = [sys.executable, "-m", "rlhf", "ppo", "--actor", str(args.model), "--data", str(rows),
               "--output", str(out), "--advantage-estimator", "grpo", "--samples-per-prompt", str(args.group),
               "--generation-batch-size", str(args.group * args.prompts_per_step),
               "--max-new-tokens", str(args.max_new_tokens), "--max-steps", str(args.steps), "--lr", "1e-5",
               "--lr-scheduler", "constant", "--kl-coef", "0", "--report-to", "none"]
    for f in functions:
        command += ["--reward-fn", f"{args.reward_file}:{f}"]
    env = {**os.environ, "TRL_REWARD_PROBE": str(probe), "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["(no output)"])[-1]}
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "trainer": "rlhf", "seconds": round(time.perf_counter() - started, 2), "steps": len(steps),
        "rewards": {f: [s.get(f"reward/{f}") for s in steps] for f in functions},
        "logged": [{k[len("reward_fn/"):]: v for k, v in s.items() if k.startswith("reward_fn/")} for s in steps],
    }


# ------------------------------------------------------------------ the comparison


def probe_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [{k: r.get(k) for k in PROBE_FIELDS} for r in map(json.loads, path.read_text().splitlines())]


def compare(trl: dict[str, Any], ours: dict[str, Any], trl_probe: list[dict], our_probe: list[dict]) -> dict[str, Any]:
    """What differs between the two runs' calls (not their sampled values)."""
    problems = [f"{side['trainer'] if 'trainer' in side else name}: {side['error']}"
                for name, side in (("trl", trl), ("rlhf", ours)) if "error" in side]
    if problems:
        return {"ok": False, "problems": problems, "trl": trl, "rlhf": ours}
    if trl["steps"] != ours["steps"]:
        problems.append(f"steps: trl {trl['steps']}, rlhf {ours['steps']}")
    for f in trl["rewards"]:
        # a function's mean is missing on a side only where it did not run; None/NaN: it scored no sample
        if len(trl["rewards"][f]) != len(ours["rewards"].get(f, [])):
            problems.append(f"{f}: scored on {len(trl['rewards'][f])} trl steps, {len(ours['rewards'].get(f, []))} "
                            "rlhf steps")
    our_names = sorted({k for step in ours["logged"] for k in step})
    for name in our_names:
        theirs = [step.get(name) for step in trl["logged"]]
        mine = [step.get(name) for step in ours["logged"]]
        if any(v is None for v in theirs):
            problems.append(f"log_metric {name!r}: logged by rlhf, not by trl")
        elif name in ("global_step", "progress") and not all(math.isclose(a, b) for a, b in zip(theirs, mine)):
            problems.append(f"log_metric {name!r}: trl {theirs}, rlhf {mine}")
    if trl_probe != our_probe:
        problems.append(f"probe: trl {trl_probe}, rlhf {our_probe}")

    def shown(side: dict[str, Any]) -> dict[str, Any]:
        metrics = {name: [step.get(name) for step in side["logged"]] for name in our_names}
        return {**{k: v for k, v in side.items() if k != "logged"}, "log_metric": metrics}

    return {"ok": not problems, "problems": problems, "trl": shown(trl), "rlhf": shown(ours), "probe": our_probe}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.part == "trl":
        print(json.dumps(run_trl(args, [f for f in args.functions.split(",") if f])))
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="check_trl_reward_functions_"))
    work.mkdir(parents=True, exist_ok=True)
    args.model = args.model or tiny_model(work / "model")
    args.reward_file = args.reward_file.resolve()
    results = {}
    for fmt in [f for f in args.formats.split(",") if f]:
        if fmt not in ("standard", "conversational"):
            fail(f"--formats {args.formats}: {fmt!r} is neither standard nor conversational")
        folder = work / fmt
        folder.mkdir(exist_ok=True)
        rows = folder / "rows.jsonl"
        rows.write_text("".join(json.dumps(r) + "\n" for r in example_rows(fmt, args.steps * args.prompts_per_step)))
        functions = function_names(args, fmt)
        probes = {side: folder / f"{side}_probe.jsonl" for side in ("trl", "rlhf")}
        for path in probes.values():
            path.unlink(missing_ok=True)
        for side in ("trl", "rlhf"):  # this script's own outputs of an earlier run in the same --workdir
            shutil.rmtree(folder / side, ignore_errors=True)
        trl = trl_side(args, functions, rows, folder / "trl", probes["trl"])
        ours = rlhf_side(args, functions, rows, folder / "rlhf", probes["rlhf"])
        results[fmt] = compare(trl, ours, probe_records(probes["trl"]), probe_records(probes["rlhf"]))
        print(f"{fmt}: {'same calls' if results[fmt]['ok'] else '; '.join(results[fmt]['problems'])}", file=sys.stderr)
    print(json.dumps({"ok": all(r["ok"] for r in results.values()), "workdir": str(work), "formats": results},
                     default=str))


if __name__ == "__main__":
    main()
