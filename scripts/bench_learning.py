"""Learning benchmark: rlhf ppo's GRPO against TRL 1.16's GRPOTrainer on the same work, then one
greedy evaluator scores the base, our and TRL's models on held-out prompts of a built-in task.

    # SmolLM2-135M-Instruct on larger_number (the measurement; 30 steps of 32 completions each side)
    rlhf models get smollm2-135m-instruct --output models/smollm2
    python scripts/bench_learning.py --model models/smollm2 --task larger_number --out runs/bench_learning

    # tiny model: the SFT model of a tiny e2e run (character tokenizer, Human/Assistant chat template,
    # trained on `sort`; it solves part of the task), ~25 s to build, then a minute or two here
    rlhf e2e --output runs/e2e --advantage-estimator grpo --reward-fn sort --n-sft 1000 \
        --n-prompts 64 --n-eval-prompts 64 --ppo.max-steps 1 --report-to none
    python scripts/bench_learning.py --model runs/e2e/sft/model --task sort --steps 3 --eval-rows 64 \
        --out runs/bench_learning_tiny

    # ours only (no TRL venv needed); TRL's side needs a python with trl 1.16 (--peer-python)
    python scripts/bench_learning.py --model runs/e2e/sft/model --task sort --skip-peer --out runs/bl

Both sides get one file of conversational rows {"prompt": [{"role": "user", "content": TEXT}],
"answer": task.correct_response(TEXT)} (so each applies the model's chat template) and one reward
file, used unchanged: scripts/rewards/answer_match.py:answer_match (TRL's convention). The
held-out prompts are drawn first with the seed and the training prompts outside them (disjoint).
The training file holds min(--rows, steps x prompts-per-step) rows, so that both sides train on
the same prompts (the peer takes the first steps x P rows).

One GRPOConfig-style file, OUT/grpo.yaml, holds the training settings in TRL's key names: the
benchmark's (group, prompts per step, completion length, learning rate, steps, seed, beta 0,
constant schedule without warmup, fp32) and TRL 1.16's defaults of everything that changes the
math (loss_type dapo, scale_rewards group, epsilon 0.2 both sides, token-level ratio,
max_grad_norm 1, weight_decay 0, AdamW betas 0.9/0.999 and eps 1e-8, temperature/top_p/top_k,
num_iterations 1, mask_truncated_completions false, ...). Ours reads it with `rlhf ppo
--trl-config` (rlhf/trl_config.py maps each key; OUT/ours/config.yaml is then checked against
the expected fields); TRL's GRPO script (--peer-script, a grpo.py) gets GROUP, PROMPTS_PER_STEP,
GEN, LR, BETA, TEMPERATURE, THREADS from the same file and keeps TRL's defaults for the rest, which
are checked against the file in TRL's own python before it runs.

Seconds per step exclude the first step (warm-up) on both sides: ours from OUT/ours/metrics.jsonl
(`elapsed_s`, training wall time per iteration, or the sum of generation_s + reward_s +
experience_s + training_s where elapsed_s is missing), TRL's from its last JSON line (time
between optimizer-step ends). Both run one after the other in this invocation, never at once,
with the same thread count.

The evaluator loads each model folder (OUT/ours/model, OUT/peer/model and --model) with
transformers in fp32, renders each held-out prompt with the model's chat template (plus the
tokenizer's BOS unless the rendered text starts with it, as the model was fine-tuned), greedily
generates --eval-max-new-tokens tokens in left-padded batches and scores the decoded text with
answer_match; accuracy is the mean.

Differences that stay: TRL tokenizes the rendered chat without special tokens, so a tokenizer
that adds a BOS the chat template lacks (the tiny character tokenizer's <s>) gets prompts without
it on TRL's side (SmolLM2's template starts with its BOS: same ids on both sides); ours
samples with an fp16 KV cache for fp32 models on the CPU (--kv-cache-dtype auto); our GRPO std
normalisation adds 1e-6 (TRL 1e-4); grpo.py seeds 0 whatever --seed is; the two data shuffles
differ (same prompts, other order).

Log lines go to stderr; the last stdout line is one JSON object: bench, model, task, steps, group,
prompts_per_step, max_new_tokens, lr, eval_rows, accuracy {base, ours, peer}, seconds_per_step
{ours, peer}, speedup (peer / ours seconds per step), trl (version), machine. With --skip-peer the
TRL's fields are null.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
REWARD_FILE = REPO / "scripts" / "rewards" / "answer_match.py"
REWARD_FN = "answer_match"
DEFAULT_PEER_PYTHON = os.environ.get("TRL_PYTHON")  # a python with trl 1.16
DEFAULT_PEER_SCRIPT = os.environ.get("TRL_GRPO_SCRIPT")  # TRL's side: a GRPOTrainer script (arguments: see run_peer)
PHASE_SECONDS = ("generation_s", "reward_s", "experience_s", "training_s")

# TRL 1.16 GRPOConfig defaults that change what a step computes (trl/trainer/grpo_config.py and
# the TrainingArguments it inherits), written explicitly so that ours applies them too.
TRL_MATH_DEFAULTS: dict[str, Any] = {
    "loss_type": "dapo",
    "scale_rewards": "group",
    "epsilon": 0.2,
    "epsilon_high": 0.2,  # TRL's None means "= epsilon"
    "importance_sampling_level": "token",
    "max_grad_norm": 1.0,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "optim": "adamw_torch_fused",
    "top_p": 1.0,
    "top_k": 0,
    "repetition_penalty": 1.0,
    "num_iterations": 1,
    "mask_truncated_completions": False,
    "entropy_coef": 0.0,
    "top_entropy_quantile": 1.0,
    "multi_objective_aggregation": "sum_then_normalize",
    "use_adaptive_entropy": False,
    "sync_ref_model": False,
    "gradient_checkpointing": False,
}


def log(message: str) -> None:
    print(f"[bench_learning] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model folder (Hugging Face format) both sides start from")
    p.add_argument("--task", default="larger_number", help="built-in task of rlhf.data.tasks")
    p.add_argument("--rows", type=int, default=None, help="training rows (default and most: steps x prompts-per-step)")
    p.add_argument("--eval-rows", type=int, default=128, help="held-out rows, disjoint from the training rows")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (TRL num_generations)")
    p.add_argument("--prompts-per-step", type=int, default=4, help="prompts per optimizer step")
    p.add_argument("--max-new-tokens", type=int, default=16, help="completion length (TRL max_completion_length)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of both sides' rollouts")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (one per generation batch)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of both runs")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each run and of the evaluator")
    p.add_argument("--out", required=True, help="output folder (rows, grpo.yaml, ours/, peer/, logs)")
    p.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON, help="python of the TRL 1.16 venv (default $TRL_PYTHON)")
    p.add_argument("--peer-script", default=DEFAULT_PEER_SCRIPT, help="TRL's grpo.py (default $TRL_GRPO_SCRIPT)")
    p.add_argument("--skip-peer", action="store_true", help="run ours only; TRL's fields are null")
    p.add_argument("--eval-max-new-tokens", type=int, default=None, help="greedy tokens per held-out prompt "
                                                                          "(default --max-new-tokens)")
    p.add_argument("--eval-batch-size", type=int, default=32, help="held-out prompts per generate call")
    args = p.parse_args(argv)
    args.eval_max_new_tokens = args.eval_max_new_tokens or args.max_new_tokens
    if not Path(args.model).is_dir():
        p.error(f"--model {args.model}: no such model folder")
    if not args.skip_peer and not (args.peer_python and args.peer_script):
        p.error("TRL's side needs --peer-python (or TRL_PYTHON) and --peer-script (or TRL_GRPO_SCRIPT); "
                "or pass --skip-peer")
    return args


# ---------------------------------------------------------------- rows


def task_rows(task_name: str, n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Seeded training and held-out rows of a built-in task; no held-out prompt is a training prompt."""
    from rlhf.data.tasks import build_prompt_rows, get_task

    task = get_task(task_name)
    held_out = build_prompt_rows(task, n_eval, seed, what="eval_prompts")
    train = build_prompt_rows(task, n_train, seed, exclude={r["prompt"] for r in held_out}, what="prompts")

    def row(text: str) -> dict:
        return {"prompt": [{"role": "user", "content": text}], "answer": task.correct_response(text)}

    return [row(r["prompt"]) for r in train], [row(r["prompt"]) for r in held_out]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- the shared settings


def grpo_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The GRPOConfig (TRL key names) both sides train with."""
    return {
        "per_device_train_batch_size": args.group * args.prompts_per_step,
        "gradient_accumulation_steps": 1,
        "num_generations": args.group,
        "max_completion_length": args.max_new_tokens,
        "learning_rate": args.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "max_steps": args.steps,
        "beta": 0.0,
        "temperature": args.temperature,
        **TRL_MATH_DEFAULTS,
        "bf16": False,
        "fp16": False,
        "seed": args.seed,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
    }


def expected_ours(settings: dict[str, Any]) -> dict[str, Any]:
    """What OUT/ours/config.yaml must hold (dotted paths) once rlhf ppo has read `settings`."""
    s = settings
    return {
        "advantage_estimator": "grpo", "samples_per_prompt": s["num_generations"],
        "generation_batch_size": s["per_device_train_batch_size"], "engine.micro_batch_size":
        s["per_device_train_batch_size"], "engine.grad_accum": 1, "ppo_epochs": s["num_iterations"],
        "max_steps": s["max_steps"], "max_new_tokens": s["max_completion_length"], "engine.lr": s["learning_rate"],
        "engine.lr_scheduler": "constant", "engine.warmup_steps": 0, "engine.warmup_ratio": 0.0,
        "kl_coef": 0.0, "loss_aggregation": "token-mean", "clip_range": s["epsilon"],
        "clip_range_high": s["epsilon_high"], "importance_ratio": "token", "engine.grad_clip": s["max_grad_norm"],
        "engine.weight_decay": s["weight_decay"], "engine.adam_beta1": s["adam_beta1"],
        "engine.adam_beta2": s["adam_beta2"], "engine.adam_eps": s["adam_epsilon"], "temperature": s["temperature"],
        "top_p": s["top_p"], "top_k": s["top_k"], "entropy_coef": 0.0, "engine.dtype": "fp32",
        "engine.seed": s["seed"], "engine.gradient_checkpointing": False, "greedy": False,
        "dynamic_sampling": False, "overlong_buffer": 0, "missing_eos_penalty": 0.0,
    }


def lookup(config: dict[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def check_ours_config(config_path: Path, expected: dict[str, Any]) -> None:
    """Fail when rlhf ppo resolved a field other than the TRL settings mean."""
    config = yaml.safe_load(config_path.read_text())
    wrong = {k: (lookup(config, k), v) for k, v in expected.items() if lookup(config, k) != v}
    if wrong:
        raise SystemExit(f"{config_path}: resolved fields differ from the TRL settings (got, wanted): {wrong}")
    log(f"ours: {len(expected)} resolved fields match the TRL settings ({config_path})")


# ---------------------------------------------------------------- running the two sides


def thread_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline", **(extra or {})}


def run_logged(cmd: list[str], env: dict[str, str], log_path: Path, what: str) -> str:
    """Run `cmd`, stderr to `log_path`; its stdout (also appended to the log). Exits on failure."""
    log(f"{what}: {' '.join(cmd)}  (log {log_path})")
    started = time.perf_counter()
    with log_path.open("w") as err:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=REPO)
    with log_path.open("a") as f:
        f.write(done.stdout)
    if done.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise SystemExit(f"{what} failed (exit {done.returncode}); the end of {log_path}:\n{tail}")
    log(f"{what}: done in {time.perf_counter() - started:.1f} s")
    return done.stdout


def run_ours(args: argparse.Namespace, train: Path, grpo_yaml: Path, out: Path) -> Path:
    cmd = [sys.executable, "-m", "rlhf", "ppo", "--trl-config", str(grpo_yaml), "--actor", args.model,
           "--data", str(train), "--output", str(out), "--reward-fn", f"{REWARD_FILE}:{REWARD_FN}",
           "--dtype", "fp32", "--sample-log-interval", "0"]
    run_logged(cmd, thread_env(args.threads), out.parent / "ours.log", "ours")
    return out


def ours_seconds_per_step(metrics_path: Path) -> float | None:
    """Mean seconds of the iterations after the first: elapsed_s differences, else the phase sums."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "generation_s" in r]
    if len(steps) < 2:
        return None
    if all("elapsed_s" in r for r in steps):
        return (steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]) / (len(steps) - 1)
    return sum(sum(r.get(k, 0.0) for k in PHASE_SECONDS) for r in steps[1:]) / (len(steps) - 1)


def peer_env(settings: dict[str, Any], prompts_per_step: int, threads: int) -> dict[str, str]:
    return thread_env(threads, {
        "GROUP": str(settings["num_generations"]), "PROMPTS_PER_STEP": str(prompts_per_step),
        "GEN": str(settings["max_completion_length"]), "LR": repr(settings["learning_rate"]),
        "BETA": repr(settings["beta"]), "TEMPERATURE": repr(settings["temperature"]), "THREADS": str(threads)})


PEER_CHECK = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from trl import GRPOConfig
want = json.loads(sys.argv[1])
# the arguments grpo.py passes; everything else is TRL's default
a = GRPOConfig(output_dir=sys.argv[2], per_device_train_batch_size=want["per_device_train_batch_size"],
               gradient_accumulation_steps=1, num_generations=want["num_generations"],
               max_completion_length=want["max_completion_length"], temperature=want["temperature"],
               learning_rate=want["learning_rate"], beta=want["beta"], num_iterations=1, max_steps=want["max_steps"],
               report_to=[], save_strategy="no", logging_steps=1, bf16=False, fp16=False, use_cpu=True,
               use_vllm=False, seed=0, gradient_checkpointing=False, lr_scheduler_type="constant")
got = {}
for k in want:
    v = getattr(a, k, "<absent>")
    v = getattr(v, "value", v)
    if k == "epsilon_high" and v is None:
        v = a.epsilon
    got[k] = v
print(json.dumps(got))
"""

PEER_UNCHECKED = {"seed", "report_to", "save_strategy"}
"""grpo.py fixes seed 0 (our side takes --seed), report_to [] and save_strategy "no" itself."""


def check_peer_defaults(args: argparse.Namespace, settings: dict[str, Any], out: Path) -> None:
    """Fail when TRL's GRPOConfig (grpo.py's arguments + TRL's defaults) differs from `settings`."""
    done = subprocess.run([args.peer_python, "-c", PEER_CHECK, json.dumps(settings), str(out / "check")],
                          capture_output=True, text=True, env=thread_env(1), timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"peer GRPOConfig check failed:\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    wrong = {k: (got[k], v) for k, v in settings.items() if k not in PEER_UNCHECKED and got[k] != v}
    if wrong:
        raise SystemExit(f"TRL's GRPOConfig differs from {out / 'grpo.yaml'} (peer, file): {wrong}")
    log(f"peer: its GRPOConfig matches grpo.yaml in {len(settings) - len(PEER_UNCHECKED)} keys")


def run_peer(args: argparse.Namespace, settings: dict[str, Any], train: Path, out: Path) -> dict[str, Any]:
    if args.seed != 0:
        log(f"peer: grpo.py always seeds 0; ours seeds {args.seed}")
    check_peer_defaults(args, settings, out.parent)
    cmd = [args.peer_python, args.peer_script, args.model, str(train), f"{REWARD_FILE}:{REWARD_FN}",
           str(args.steps), str(out)]
    stdout = run_logged(cmd, peer_env(settings, args.prompts_per_step, args.threads), out.parent / "peer.log", "peer")
    return last_json_line(stdout, "peer")


def last_json_line(text: str, what: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"{what}: no JSON line in its output")


# ---------------------------------------------------------------- the evaluator


def load_reward() -> Callable[..., list[float]]:
    spec = importlib.util.spec_from_file_location("answer_match_reward", REWARD_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, REWARD_FN)


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The chat-rendered prompt's ids, with the tokenizer's BOS unless the text starts with it."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    bos = tokenizer.bos_token
    return tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]


def left_padded(batch: list[list[int]], pad_id: int) -> tuple[Any, Any]:
    import torch

    width = max(len(ids) for ids in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, row in enumerate(batch):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids, mask


def greedy_completions(model_dir: str | Path, rows: list[dict], max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy completions of each row's prompt by the model folder, fp32, left-padded batches."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    texts: list[str] = []
    for start in range(0, len(rows), batch_size):
        ids, mask = left_padded([prompt_ids(tokenizer, r["prompt"]) for r in rows[start:start + batch_size]], pad_id)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 temperature=None, top_p=None, top_k=None, pad_token_id=pad_id,
                                 eos_token_id=tokenizer.eos_token_id)
        texts += tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    return [t.strip() for t in texts]


def accuracy(model_dir: str | Path, rows: list[dict], args: argparse.Namespace) -> float:
    started = time.perf_counter()
    texts = greedy_completions(model_dir, rows, args.eval_max_new_tokens, args.eval_batch_size)
    scores = load_reward()([[{"role": "assistant", "content": t}] for t in texts], answer=[r["answer"] for r in rows])
    value = sum(scores) / len(scores)
    log(f"eval {model_dir}: accuracy {value:.3f} over {len(rows)} held-out prompts "
        f"({time.perf_counter() - started:.1f} s; e.g. {texts[0]!r} for answer {rows[0]['answer']!r})")
    return value


# ---------------------------------------------------------------- the result


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cpus"


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def result(args: argparse.Namespace, acc: dict[str, float | None], ours_sps: float | None,
           peer: dict[str, Any] | None) -> dict[str, Any]:
    peer_sps = peer.get("seconds_per_step") if peer else None
    trl = peer["peer"].removeprefix("trl-").removesuffix("-grpo") if peer and "peer" in peer else None
    return {
        "bench": "learning", "model": args.model, "task": args.task, "steps": args.steps, "group": args.group,
        "prompts_per_step": args.prompts_per_step, "max_new_tokens": args.max_new_tokens, "lr": args.lr,
        "eval_rows": args.eval_rows, "accuracy": {k: rounded(v, 4) for k, v in acc.items()},
        "seconds_per_step": {"ours": rounded(ours_sps), "peer": rounded(peer_sps)},
        "speedup": rounded(peer_sps / ours_sps) if peer_sps and ours_sps else None,
        "trl": trl, "machine": machine(),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    per_run = args.steps * args.prompts_per_step
    n_train = min(args.rows or per_run, per_run)
    train_rows, held_out = task_rows(args.task, n_train, args.eval_rows, args.seed)
    train, _ = write_jsonl(out / "train.jsonl", train_rows), write_jsonl(out / "eval.jsonl", held_out)
    settings = grpo_settings(args)
    grpo_yaml = out / "grpo.yaml"
    grpo_yaml.write_text(yaml.safe_dump(settings, sort_keys=False))
    log(f"{args.task}: {len(train_rows)} training rows, {len(held_out)} held-out rows; settings {grpo_yaml}")

    ours = run_ours(args, train, grpo_yaml, out / "ours")
    check_ours_config(ours / "config.yaml", expected_ours(settings))
    ours_sps = ours_seconds_per_step(ours / "metrics.jsonl")
    peer = None if args.skip_peer else run_peer(args, settings, train, out / "peer")
    acc: dict[str, float | None] = {"base": accuracy(args.model, held_out, args),
                                    "ours": accuracy(ours / "model", held_out, args),
                                    "peer": None if peer is None else accuracy(out / "peer" / "model", held_out, args)}
    line = result(args, acc, ours_sps, peer)
    (out / "result.json").write_text(json.dumps(line) + "\n")
    print(json.dumps(line), flush=True)
    return line


if __name__ == "__main__":
    main()
