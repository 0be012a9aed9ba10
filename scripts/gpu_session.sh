#!/usr/bin/env bash
# The GPU checks (docs/gpu.md), phase by phase, each in one command:
#
#   bash scripts/gpu_session.sh correctness   # pytest -m gpu, rlhf report, compute-sanitizer memcheck + racecheck
#   (and its parts alone: gputests, racecheck, memcheck_rest)
#   bash scripts/gpu_session.sh bench         # bench_adam, bench_generation 1b (batch 1 and 64) on cuda
#   bash scripts/gpu_session.sh graphs        # CUDA-graph decode steps: their GPU test, bench_generation 1b
#   bash scripts/gpu_session.sh e2e           # rlhf e2e on the GPU (bf16), --report-to none
#   bash scripts/gpu_session.sh ppo1b         # rlhf ppo on a 1.1B Llama: per-phase time and peak memory
#   bash scripts/gpu_session.sh suite         # the whole test suite with CUDA visible
#
# Several phases may be named in one call; SUITE_ARGS passes pytest options to `suite` (-n 8 with
# xdist, -k ...). Logs go to $OUT when it is set, else to ./gpu-logs. The project is installed
# editable without touching the machine's packages (--no-deps: the image's torch/transformers are
# used as they are).
set -u
cd "$(dirname "$0")/.."
LOGS="${OUT:-$PWD/gpu-logs}"
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline RLHF_OPS_CACHE="${RLHF_OPS_CACHE:-/tmp/rlhf-ops}"
PY="${PYTHON:-python3}"

setup() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    "$PY" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "transformers", transformers.__version__, torch.cuda.get_device_name(0))'
    nvcc --version | tail -2
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
    "$PY" -c 'import rlhf, rlhf.engine; print("rlhf importable")' || exit 1
}

correctness() {
    echo "== pytest -m gpu (builds the CUDA ops)"
    timeout 280 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs 2>&1 | tee "$LOGS/gpu_tests.log" | tail -40
    echo "== op report"
    rlhf report 2>&1 | tail -30 | tee "$LOGS/report.log"
    local kernels="tests/test_generation_kernels.py tests/test_fused_adam.py tests/test_logprobs.py"
    echo "== compute-sanitizer memcheck"
    timeout 170 compute-sanitizer --tool memcheck --print-limit 30 \
        "$PY" -m pytest -q -m gpu -p no:cacheprovider $kernels 2>&1 | tee "$LOGS/memcheck.log" | tail -25
    racecheck
}

racecheck() {
    echo "== compute-sanitizer racecheck (decode attention)"
    timeout 100 compute-sanitizer --tool racecheck --print-limit 30 \
        "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_generation_kernels.py -k "decode_attention_edge" \
        2>&1 | tee "$LOGS/racecheck.log" | tail -15
}

memcheck_rest() {
    echo "== compute-sanitizer memcheck (fused Adam, log-probs)"
    timeout 90 compute-sanitizer --tool memcheck --print-limit 30 \
        "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_fused_adam.py tests/test_logprobs.py 2>&1 \
        | tee "$LOGS/memcheck_rest.log" | tail -8
}

gputests() {
    echo "== pytest -m gpu (builds the CUDA ops)"
    timeout 280 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs 2>&1 | tee "$LOGS/gpu_tests.log" | tail -15
}

graphs() {
    echo "== bench_generation 1b with CUDA-graph decode steps (RLHF_CUDA_GRAPH_DECODE=1)"
    timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_fast_decode.py -k graph 2>&1 | tail -5
    for b in 1 64; do
        timeout 200 "$PY" scripts/bench_generation.py --device cuda --preset 1b --batch $b --new 128 --repeats 3 \
            --peak-gbs 3350 --cuda-graph 2>&1 | tee "$LOGS/bench_gen_graph_b$b.log" | tail -4
    done
}

ppo1b() {
    # PPO on a 1.1B Llama (TinyLlama's shape, char vocabulary), bf16; per-phase
    # time, peak GPU memory per phase and the rollout/training log-prob difference, from
    # metrics.jsonl. PPO1B_SHAPE="hidden layers heads kv_heads ffn" shrinks it (a CPU smoke test).
    echo "== rlhf ppo on the 1B shape"
    local root=/tmp/ppo1b
    rm -rf "$root" && mkdir -p "$root"
    read -r hidden layers heads kv ffn <<< "${PPO1B_SHAPE:-2048 22 32 4 5632}"
    "$PY" - "$root" "$hidden" "$layers" "$heads" "$kv" "$ffn" <<'PYEOF' || return
import sys
from pathlib import Path
sys.path.insert(0, "scripts")
from argparse import Namespace
import bench_ppo
from rlhf.models.loading import load_tokenizer
from rlhf.models.tiny import save_tiny_model
root, (hidden, layers, heads, kv, ffn) = Path(sys.argv[1]), map(int, sys.argv[2:])
actor = save_tiny_model(root / "actor", "llama", hidden_size=hidden, num_layers=layers, num_heads=heads,
                        num_kv_heads=kv, intermediate_size=ffn, max_positions=2048)
bench_ppo.write_prompts(load_tokenizer(str(actor)), root / "prompts.jsonl", 64 * 6, 64)
args = bench_ppo.reward_args(Namespace(advantage_estimator="gae", new_tokens=128), actor, root)
(root / "reward_args").write_text(" ".join(args))
PYEOF
    timeout "${PPO1B_SECONDS:-400}" rlhf ppo --actor "$root/actor" --data "$root/prompts.jsonl" \
        $(cat "$root/reward_args") --output "$root/ppo" --max-steps "${PPO1B_STEPS:-5}" \
        --generation-batch-size 64 --micro-batch-size 16 --max-new-tokens 128 --max-prompt-len 64 \
        --ppo-epochs 1 --report-to none --sample-log-interval 0 --lr 1e-6 2>&1 | grep -v "it/s" \
        | tee "$LOGS/ppo1b.log" | tail -8
    cp "$root/ppo/metrics.jsonl" "$LOGS/ppo1b_metrics.jsonl" 2>/dev/null
    "$PY" - "$root/ppo/metrics.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
keys = ("generation_s", "reward_s", "experience_s", "training_s", "samples_per_s", "old_logprob_diff_max")
for row in rows:
    memory = {k[len("peak_mem_gb_"):]: round(v, 2) for k, v in row.items() if k.startswith("peak_mem_gb_")}
    print(json.dumps({**{k: float(f"{row.get(k, float('nan')):.4g}") for k in keys}, "peak_mem_gb": memory}))
PYEOF
}

e2e() {
    echo "== rlhf e2e (cuda, bf16)"
    timeout "${E2E_SECONDS:-200}" rlhf e2e --output /tmp/e2e-gpu --report-to none 2>&1 | tee "$LOGS/e2e.log" \
        | grep -v "it/s" | tail -25
    tail -3 /tmp/e2e-gpu/ppo/metrics.jsonl > "$LOGS/ppo_metrics_tail.jsonl" 2>/dev/null
    cp /tmp/e2e-gpu/summary.json "$LOGS/" 2>/dev/null
}

bench() {
    echo "== bench_adam"
    timeout 150 "$PY" scripts/bench_adam.py --device cuda --params 2e8 --steps 20 --warmup 5 2>&1 \
        | tee "$LOGS/bench_adam.log" | tail -12
    echo "== bench_generation 1b, batch 1 and 64"
    timeout 200 "$PY" scripts/bench_generation.py --device cuda --preset 1b --batch 1 --new 128 --repeats 3 \
        --peak-gbs 3350 2>&1 | tee "$LOGS/bench_gen_b1.log" | tail -6
    timeout 200 "$PY" scripts/bench_generation.py --device cuda --preset 1b --batch 64 --new 128 --repeats 3 \
        --peak-gbs 3350 2>&1 | tee "$LOGS/bench_gen_b64.log" | tail -6
}

suite() {
    echo "== whole suite with CUDA visible"
    timeout "${SUITE_SECONDS:-560}" "$PY" -m pytest -q -p no:cacheprovider --timeout 120 --tb=line ${SUITE_ARGS:-} 2>&1 | tee "$LOGS/suite.log" | tail -40
}

setup
for phase in "$@"; do
    "$phase"
done
