"""PPO throughput on the issue's default shape, with the generation / training split.

    python scripts/bench_ppo.py                       # Llama-family, 4 layers, hidden 256, vocab ~100,
                                                      # batch 32, prompt 64, 64 new tokens, 1 epoch, 1 minibatch
    python scripts/bench_ppo.py --iterations 6 --device-count 1

Runs `rlhf ppo` for a few iterations on freshly built models and reads its metrics.jsonl; the first
iteration is warm-up and is excluded. Prints one JSON line last: samples_per_s, generation_s,
experience_s, training_s (per iteration) and the ratio to TRL 0.19's PPOTrainer on the same shape on
this machine class (0.55 samples/s, the figure the project measured for the issue; TRL 0.19 does not
install beside transformers 5 to be re-run here).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
from pathlib import Path

TRL_PPO_SAMPLES_PER_S = 0.55


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--optimizer-impl", default="auto")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")

    from rlhf.cli import main as rlhf_main
    from rlhf.models.loading import load_tokenizer
    from rlhf.models.tiny import save_tiny_model
    from rlhf.models.value_model import ValueModel

    root = Path(tempfile.mkdtemp(prefix="bench_ppo_"))
    heads = max(4, args.hidden // 64)
    actor = save_tiny_model(root / "actor", "llama", hidden_size=args.hidden, num_layers=args.layers,
                            num_heads=heads, num_kv_heads=heads, max_positions=2048)
    reward = root / "reward"
    ValueModel.from_causal_lm_dir(actor, head_init_std=0.02).save_pretrained(reward)
    tokenizer = load_tokenizer(str(actor))
    tokenizer.save_pretrained(reward)
    # Prompts whose rendered form is exactly --prompt-len tokens.
    overhead = len(tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False,
                                                           add_generation_prompt=True)).input_ids)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    with (root / "prompts.jsonl").open("w") as f:
        for _ in range(args.batch * (args.iterations + 1)):
            content = "".join(rng.choice(letters) for _ in range(args.prompt_len - overhead))
            f.write(json.dumps({"prompt": content}) + "\n")
    out = root / "ppo"
    rlhf_main([
        "ppo", "--actor", str(actor), "--reward", str(reward), "--data", str(root / "prompts.jsonl"),
        "--output", str(out), "--max-steps", str(args.iterations), "--generation-batch-size", str(args.batch),
        "--micro-batch-size", str(args.micro_batch_size), "--max-new-tokens", str(args.new_tokens), "--min-new-tokens", str(args.new_tokens),
        "--max-prompt-len", str(args.prompt_len), "--ppo-epochs", "1", "--dtype", args.dtype,
        "--optimizer-impl", args.optimizer_impl, "--report-to", "none", "--sample-log-interval", "0",
        "--lr", "1e-5", "--temperature", "1.0",
    ])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    generation = statistics.mean(r["generation_s"] for r in rows)
    experience = statistics.mean(r["experience_s"] for r in rows)
    training = statistics.mean(r["training_s"] for r in rows)
    per_iteration = generation + experience + training
    samples_per_s = args.batch / per_iteration
    result = {
        "samples_per_s": round(samples_per_s, 3),
        "generation_s": round(generation, 3),
        "experience_s": round(experience, 3),
        "training_s": round(training, 3),
        "response_tokens_mean": round(statistics.mean(r["response_length"] for r in rows), 1),
        "trl_reference_samples_per_s": TRL_PPO_SAMPLES_PER_S,
        "ratio_vs_trl": round(samples_per_s / TRL_PPO_SAMPLES_PER_S, 2),
        "shape": {"batch": args.batch, "prompt": args.prompt_len, "new_tokens": args.new_tokens,
                  "layers": args.layers, "hidden": args.hidden, "vocab": len(tokenizer), "dtype": args.dtype},
        "iterations_timed": len(rows),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
