"""DPO speed: `rlhf dpo` against TRL 1.16's DPOTrainer on the same model, pairs and settings, one
after the other in one invocation; prints one JSON line last with the pairs/s of both and the ratio.

    # tiny model (the SFT model of a tiny e2e run), pairs of the built-in `sort` task
    rlhf e2e --output runs/e2e --advantage-estimator grpo --reward-fn sort --n-sft 1000 \\
        --n-prompts 64 --n-eval-prompts 64 --ppo.max-steps 1 --report-to none
    python scripts/bench_dpo.py --model runs/e2e/sft/model --task sort --steps 60 --out runs/bench_dpo_tiny --peer-trl

    # SmolLM2-135M-Instruct on larger_number pairs
    rlhf models get smollm2-135m-instruct --output models/smollm2
    python scripts/bench_dpo.py --model models/smollm2 --task larger_number --steps 10 --out runs/bench_dpo --peer-trl

    # ours only (no TRL venv needed)
    python scripts/bench_dpo.py --model runs/e2e/sft/model --task sort --out runs/bench_dpo

TRL's side (--peer-trl) needs a python with trl 1.16 (--peer-python, default $TRL_PYTHON) and its
DPO script (--peer-script, default $TRL_DPO_SCRIPT: a dpo.py taking MODEL PAIRS STEPS OUT and the
environment BATCH, BETA, LR, MAXLEN, LOSS, THREADS, printing one JSON line with seconds_per_step).

Both sides get one jsonl of conversational pairs {"prompt": [user message], "chosen": [assistant
message], "rejected": [assistant message]} of the task (so each applies the model's chat
template), the same batch of pairs per optimizer step (no accumulation), steps, beta, learning
rate (constant, no warmup), loss type, max length, fp32, a frozen reference copy, dropout off and
the same thread count. Seconds per step exclude the first step on both sides: ours from
OUT/ours/metrics.jsonl (`elapsed_s`, training wall time), TRL's from its last JSON line (time
between optimizer-step ends). pairs/s = batch / seconds per step.

Log lines go to stderr; the last stdout line is one JSON object: bench, model, task, steps, batch,
beta, lr, loss_type, seconds_per_step {ours, peer}, pairs_per_s {ours, peer}, speedup (peer / ours
seconds per step), ours {first_loss, last_loss, last_accuracy}, trl (version), machine. Without
--peer-trl TRL's fields are null.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_learning  # noqa: E402
from bench_learning import last_json_line, machine, rounded, run_logged, thread_env  # noqa: E402

DEFAULT_PEER_PYTHON = os.environ.get("TRL_PYTHON")  # a python with trl 1.16
DEFAULT_PEER_SCRIPT = os.environ.get("TRL_DPO_SCRIPT")  # TRL's side: a DPOTrainer script


def log(message: str) -> None:
    print(f"[bench_dpo] {message}", file=sys.stderr, flush=True)


bench_learning.log = log  # run_logged's lines name this benchmark


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model folder (Hugging Face format) both sides train")
    p.add_argument("--task", default="sort", help="built-in task of rlhf.data.tasks whose pairs both train on")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (the first is warm-up, not timed)")
    p.add_argument("--batch", type=int, default=8, help="pairs per optimizer step (TRL per_device_train_batch_size)")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--loss-type", default="sigmoid", help="TRL's loss_type, ours --loss-type")
    p.add_argument("--max-len", type=int, default=256, help="longest prompt + response (TRL max_length)")
    p.add_argument("--seed", type=int, default=0, help="seed of the pairs")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each run")
    p.add_argument("--out", required=True, help="output folder (pairs, ours/, peer/, logs)")
    p.add_argument("--peer-trl", action="store_true", help="also run TRL's DPOTrainer (else TRL's fields are null)")
    p.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON, help="python of the TRL 1.16 venv ($TRL_PYTHON)")
    p.add_argument("--peer-script", default=DEFAULT_PEER_SCRIPT, help="TRL's dpo.py ($TRL_DPO_SCRIPT)")
    return p.parse_args(argv)


def conversational_pairs(task_name: str, n: int, seed: int) -> list[dict[str, Any]]:
    """`n` pairs of the task in TRL's conversational preference format."""
    from rlhf.data.tasks import build_preference_rows, get_task

    def message(role: str, text: str) -> list[dict[str, str]]:
        return [{"role": role, "content": text}]

    return [{"prompt": message("user", row["prompt"]), "chosen": message("assistant", row["chosen"]),
             "rejected": message("assistant", row["rejected"])}
            for row in build_preference_rows(get_task(task_name), n, seed)]


def run_ours(args: argparse.Namespace, pairs: Path, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "rlhf", "dpo", "--model", args.model, "--data", str(pairs), "--output", str(out),
           "--micro-batch-size", str(args.batch), "--grad-accum", "1", "--max-steps", str(args.steps),
           "--beta", str(args.beta), "--lr", str(args.lr), "--lr-scheduler", "constant", "--warmup-steps", "0",
           "--loss-type", args.loss_type, "--max-seq-len", str(args.max_len), "--dtype", "fp32",
           "--report-to", "none", "--seed", str(args.seed)]
    run_logged(cmd, thread_env(args.threads), out.parent / "ours.log", "ours")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r and "elapsed_s" in r]
    per_step = (steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]) / (len(steps) - 1) if len(steps) > 1 else None
    return {"seconds_per_step": per_step, "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
            "last_accuracy": steps[-1]["rewards/accuracies"]}


def run_peer(args: argparse.Namespace, pairs: Path, out: Path) -> dict[str, Any]:
    if not args.peer_python or not args.peer_script:
        raise SystemExit("--peer-trl needs --peer-python and --peer-script (or TRL_PYTHON and TRL_DPO_SCRIPT)")
    env = thread_env(args.threads, {"BATCH": str(args.batch), "BETA": str(args.beta), "LR": str(args.lr),
                                    "MAXLEN": str(args.max_len), "LOSS": args.loss_type, "THREADS": str(args.threads)})
    cmd = [args.peer_python, args.peer_script, args.model, str(pairs), str(args.steps), str(out)]
    line = last_json_line(run_logged(cmd, env, out.parent / "peer.log", "peer"), "peer")
    version = run_logged([args.peer_python, "-c", "import trl; print(trl.__version__)"], env,
                         out.parent / "peer_version.log", "peer version").strip()
    return {**line, "trl": version}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for side in ("ours", "peer"):  # each run starts fresh
        shutil.rmtree(out / side, ignore_errors=True)
    pairs = out / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in conversational_pairs(args.task, args.steps * args.batch,
                                                                                args.seed)))
    log(f"{args.steps * args.batch} {args.task} pairs -> {pairs}")
    ours = run_ours(args, pairs, out / "ours")
    peer = run_peer(args, pairs, out / "peer") if args.peer_trl else None
    ours_sps, peer_sps = ours["seconds_per_step"], peer["seconds_per_step"] if peer else None
    result = {
        "bench": "dpo", "model": args.model, "task": args.task, "steps": args.steps, "batch": args.batch,
        "beta": args.beta, "lr": args.lr, "loss_type": args.loss_type,
        "seconds_per_step": {"ours": rounded(ours_sps, 4), "peer": rounded(peer_sps, 4)},
        "pairs_per_s": {"ours": rounded(args.batch / ours_sps if ours_sps else None, 2),
                        "peer": rounded(args.batch / peer_sps if peer_sps else None, 2)},
        "speedup": rounded(peer_sps / ours_sps if peer_sps and ours_sps else None, 2),
        "ours": {k: rounded(v, 4) for k, v in ours.items() if k != "seconds_per_step"},
        "trl": peer["trl"] if peer else None, "machine": machine(),
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
