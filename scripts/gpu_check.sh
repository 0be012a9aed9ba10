#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one command, for a fresh machine with one GPU, in under 9 minutes:
#
#   OUT=DIR bash scripts/gpu_check.sh                  # every step below, on the GPU
#   GPU_CHECK_DRY=1 OUT=DIR bash scripts/gpu_check.sh  # the same steps at tiny sizes on the CPU (~30 s):
#                                                      # tests/test_gpu_check.py runs it
#
# Steps, in order (each command under `timeout`; a step whose need no longer fits before the deadline
# is skipped, reason "deadline"):
#   install        pip install -e . (--no-deps --no-index: the image's torch/transformers as they are)
#   versions       python, torch, CUDA, transformers, GPU, driver, nvcc
#   device         device copy GB/s (bytes read + written) and an 8192^3 bf16 matmul's TFLOP/s (CUDA events)
#   ops            every csrc op built (in parallel on a GPU) and self-tested: `rlhf report` and its rows
#   pytest_gpu     pytest -m gpu over the test files that hold GPU tests: counts and failures
#   bench_adam     scripts/bench_adam.py (fused Adam against torch's)
#   gen_b1 gen_b64 gen_b1_graph gen_b64_graph
#                  scripts/bench_generation.py on the 1b preset, batch 1 and 64, eager and --cuda-graph,
#                  each against HF generate
#   ppo_1b         rlhf ppo on a 1.1B Llama (TinyLlama's shape, char vocabulary): per-phase seconds and
#                  peak memory against `rlhf plan ppo` for the same flags, and the rollout/training
#                  log-prob differences (old_logprob_diff_max, rollout_parity_max_diff)
#   e2e            a short bf16 rlhf e2e (SFT -> reward -> PPO on the built-in task)
#   sanitizer      opt-in: compute-sanitizer memcheck over the kernel tests, racecheck on decode attention
#   suite          opt-in: the whole test suite with CUDA visible (SUITE_ARGS: more pytest options)
#
# Writes $OUT/gpu_check.log (every step's output under a header) and $OUT/summary.json: each step's
# status (ok, failed, timeout, skipped), seconds and parsed figures, rewritten after every step so it
# is there whatever fails. Work files go to a temporary folder outside $OUT, removed at the end.
#
# Environment: OUT (default ./gpu-logs); GPU_CHECK_DEADLINE_S (default 540: seconds from the start);
# GPU_CHECK_STEPS (the steps to run, default every step above but the opt-in ones; install always
# runs); GPU_CHECK_PEAK_GBS (the GPU's HBM GB/s for bench_generation; default from the GPU's name);
# GPU_CHECK_DRY=1 (the dry run); PYTHON (default python3). Nothing reaches the network: the hubs are
# offline, W&B is disabled and pip installs from the checkout alone.
#
# The dry run forks each Python command from one warm interpreter (zygote-serve below) that has
# imported torch, transformers and rlhf once: on a 2-core machine each fresh process spends ~9 s
# importing them, which the dozen processes of the steps would pay every time.
set -u -o pipefail
[[ -n ${OUT:-} ]] && OUT=$(realpath -m -- "$OUT")  # the caller's relative OUT, before the cd
cd "$(dirname "$0")/.."

DEFAULT_STEPS="versions device ops pytest_gpu bench_adam gen_b1 gen_b64 gen_b1_graph gen_b64_graph ppo_1b e2e"
ALL_STEPS="install $DEFAULT_STEPS sanitizer suite"

OUT="${OUT:-$PWD/gpu-logs}"
DRY="${GPU_CHECK_DRY:-0}"
DEADLINE_S="${GPU_CHECK_DEADLINE_S:-540}"
SELECTED=" install ${GPU_CHECK_STEPS:-$DEFAULT_STEPS} "
PY0="${PYTHON:-python3}"
START_US=${EPOCHREALTIME/./}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
HELPERS="$TMP/gpu_check.py"
WORK="$TMP/work"
mkdir -p "$TMP/fig" "$WORK"
: > "$TMP/status.tsv"

export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled WANDB_SILENT=true
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export TQDM_DISABLE=1  # progress bars would fill the log with carriage returns

if [[ $DRY == 1 ]]; then
    DEVICE=cpu
    # Tiny shapes gain nothing from a second thread, and on a shared 2-core machine OpenMP's spinning
    # threads wait on each other: one thread each. pytest warns that the zygote imported its plugins
    # before it could rewrite their asserts: true and harmless.
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -W ignore::pytest.PytestAssertRewriteWarning"
    COPY_MB=16 MATMUL_N=256
    ADAM_ARGS=(--params 1e5 --tensors 4 --steps 1 --warmup 0 --probe-mb 1 --fsdp-layers 1 --fsdp-dim 32)
    GEN_ARGS=(--preset tiny --hidden 32 --layers 1 --heads 2 --kv-heads 1 --ffn 64 --prompt 8 --new 8 --warmup 0
              --repeats 1)
    PPO_SHAPE="32 1 2 1 64"  # hidden layers heads kv_heads ffn
    PPO_ARGS=(--max-steps 2 --generation-batch-size 8 --micro-batch-size 8 --max-new-tokens 4 --max-prompt-len 24)
    E2E_ARGS=(--tiny-hidden-size 32 --tiny-layers 1 --n-sft 64 --n-pairs 64 --n-prompts 16 --n-eval-pairs 8
              --n-eval-prompts 8 --sft.max-steps 2 --sft.micro-batch-size 16 --reward.max-steps 2
              --reward.micro-batch-size 16 --ppo.max-steps 2 --ppo.generation-batch-size 8
              --ppo.micro-batch-size 8 --ppo.max-new-tokens 4)
    E2E_DTYPE=fp32
else
    DEVICE=cuda
    export RLHF_OPS_CACHE="${RLHF_OPS_CACHE:-/tmp/rlhf-ops}"
    COPY_MB=2048 MATMUL_N=8192
    ADAM_ARGS=(--params 2e8 --steps 20 --warmup 5)
    GEN_ARGS=(--preset 1b --prompt 64 --new 128 --warmup 1 --repeats 2)
    PPO_SHAPE="2048 22 32 4 5632"
    PPO_ARGS=(--max-steps 3 --generation-batch-size 64 --micro-batch-size 16 --max-new-tokens 128 --max-prompt-len 64)
    # The default e2e is 1000 SFT steps, 1000 reward steps and 80 PPO iterations (~2 min on an H100).
    E2E_ARGS=(--n-pairs 9600 --n-prompts 2048 --sft.max-steps 300 --reward.max-steps 300 --ppo.max-steps 20)
    E2E_DTYPE=bf16
fi
GPU_NAME=$(timeout 20 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "${GPU_CHECK_PEAK_GBS:-}:$GPU_NAME" in
    :*H200*) PEAK_GBS=4800 ;;
    :*H100*PCIe*) PEAK_GBS=2000 ;;
    :*H100*) PEAK_GBS=3350 ;;
    :*) PEAK_GBS="" ;;
    *) PEAK_GBS=$GPU_CHECK_PEAK_GBS ;;
esac
PEAK_ARGS=()
[[ -n $PEAK_GBS ]] && PEAK_ARGS=(--peak-gbs "$PEAK_GBS")

# ------------------------------------------------------------------------------------ the steps
# Each runs with its output in $STEP_LOG and writes its figures (one JSON object) to $FIG; `left`
# is the seconds its time limit has left, which every command's `timeout` takes.

step_install() {
    if [[ $DRY != 1 ]]; then
        timeout -k 10 "$(left)" "$PY0" -m pip install -q --no-deps --no-build-isolation --no-index -e . || return
    fi
    # Imported from outside the checkout, so through the install (rlhf.engine is engine/ only there).
    (cd "$TMP" && timeout -k 10 "$(left)" "$PY0" - "$OLDPWD" "$DRY" <<'PYEOF') | tee "$FIG"
import json, pathlib, sys
import rlhf, rlhf.engine, rlhf.stages
here = pathlib.Path(rlhf.engine.__file__).resolve().parent.parent == pathlib.Path(sys.argv[1]).resolve()
# The dry run leaves this machine's install as it is (a test must not re-point it).
print(json.dumps({"installed": sys.argv[2] != "1", "rlhf": rlhf.__file__, "this_checkout": here}))
sys.exit(0 if here or sys.argv[2] == "1" else f"rlhf imports from {rlhf.__file__}, not from this checkout")
PYEOF
}

step_versions() {
    timeout -k 10 "$(left)" "${PY[@]}" - <<'PYEOF' | tee "$FIG"
import importlib.metadata, json, os, platform, re, shutil, subprocess
import torch

def output(*cmd):
    if not shutil.which(cmd[0]):
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None

smi = output("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")
nvcc = re.search(r"release ([\d.]+)", output("nvcc", "--version") or "")
cuda = torch.cuda.is_available()
print(json.dumps({
    "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
    "transformers": importlib.metadata.version("transformers"),
    "gpu": torch.cuda.get_device_name(0) if cuda else None,
    "gpu_memory_gb": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
    "driver": smi.splitlines()[0].split(", ")[1] if smi else None,
    "nvcc": nvcc.group(1) if nvcc else None, "cpus": os.cpu_count(), "platform": platform.platform(),
}))
PYEOF
}

step_device() {
    timeout -k 10 "$(left)" "${PY[@]}" - "$DEVICE" "$COPY_MB" "$MATMUL_N" <<'PYEOF' | tee "$FIG"
import json, sys, time
import torch

device, copy_mb, n = torch.device(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

def seconds_per_call(fn, warmup=3, repeats=10):
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats

def copy_seconds():  # its buffers are freed on return, before the matmul's
    src = torch.empty(copy_mb << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return seconds_per_call(lambda: dst.copy_(src))

copy_s = copy_seconds()
a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
c = torch.empty_like(a)
matmul_s = seconds_per_call(lambda: torch.mm(a, b, out=c))
print(json.dumps({
    "device": str(device), "copy_mb": copy_mb, "copy_gbs": round(2 * (copy_mb << 20) / copy_s / 1e9, 1),
    "copy_counts": "bytes read + written", "matmul_n": n, "matmul_dtype": "bfloat16",
    "matmul_tflops": round(2 * n**3 / matmul_s / 1e12, 5), "matmul_ms": round(matmul_s * 1e3, 3),
}))
PYEOF
}

step_ops() {
    timeout -k 10 "$(left)" "${PY[@]}" - "$FIG" <<'PYEOF'
import json, subprocess, sys, tempfile
import torch
from rlhf.engine.backends.registry import backend_for  # noqa: F401 - importing it registers every op
from rlhf.engine.ops import op_report, registered_ops, unavailable_reason
from rlhf.report import print_report

available = {s.name for s in registered_ops() if unavailable_reason(s) is None}
build_s = {}
if torch.cuda.is_available():
    # A build is a few nvcc/c++ files, seconds to a minute each: build every op at once, one process
    # each (each its own lock and folder in the op cache), then load them here from the cache.
    child = ("import json, sys; from rlhf.engine.backends.registry import backend_for; "
             "from rlhf.engine.ops import load_op, op_report; load_op(sys.argv[1]); "
             "print(json.dumps([r['built_seconds'] for r in op_report() if r['name'] == sys.argv[1]][0]))")
    logs = {name: tempfile.TemporaryFile("w+") for name in sorted(available)}
    procs = {name: subprocess.Popen([sys.executable, "-c", child, name], stdout=log, stderr=subprocess.STDOUT)
             for name, log in logs.items()}
    for name, proc in procs.items():
        proc.wait()
        logs[name].seek(0)
        lines = logs[name].read().splitlines()
        print(f"-- building {name}: exit {proc.returncode}", *lines[-20:], sep="\n")
        try:
            build_s[name] = json.loads(lines[-1])
        except (IndexError, ValueError):
            build_s[name] = None
print_report()  # `rlhf report`: loads every op (from the cache) and runs or reads its self-test
rows, failed = {}, []
for row in op_report():
    name, verdict = str(row["name"]), row["verdict"]
    ok = row["built"] and (verdict is None or verdict.passed)
    if name in available and not ok:
        failed.append(name)
    rows[name] = {
        "device": "cuda" if row["needs_cuda"] else "cpu", "available": name in available, "built": row["built"],
        "self_test": None if verdict is None else "passed" if verdict.passed else "failed",
        "self_test_detail": verdict.detail if verdict else None, "self_test_s": verdict.seconds if verdict else None,
        "build_s": build_s.get(name, row["built_seconds"]), "error": row["error"],
    }
with open(sys.argv[1], "w") as f:
    json.dump({"ops": rows, "available": len(available), "built": sum(r["built"] for r in rows.values()),
               "self_tests_passed": sum(r["self_test"] == "passed" for r in rows.values()), "failed": failed}, f)
sys.exit(f"ops that build here but failed: {failed}" if failed else 0)
PYEOF
}

step_pytest_gpu() {
    local files rc
    files=$(grep -rl --include='test_*.py' 'mark\.gpu' tests | sort)
    # shellcheck disable=SC2086  # one word per file
    timeout -k 10 "$(left)" "${PY[@]}" -m pytest -m gpu -p no:cacheprovider -rfEs $files
    rc=$?
    timeout 60 "$PY0" "$HELPERS" pytest "$STEP_LOG" > "$FIG"
    return $rc
}

step_bench_adam() {
    timeout -k 10 "$(left)" "${PY[@]}" scripts/bench_adam.py --device "$DEVICE" "${ADAM_ARGS[@]}" || return
    timeout 60 "$PY0" "$HELPERS" last-json "$STEP_LOG" > "$FIG"
}

bench_generation() {  # BATCH [--cuda-graph]
    local batch=$1 graph=${2:-} graphs=false
    [[ -n $graph ]] && graphs=true
    timeout -k 10 "$(left)" "${PY[@]}" scripts/bench_generation.py --device "$DEVICE" "${GEN_ARGS[@]}" \
        "${PEAK_ARGS[@]}" --batch "$batch" $graph || return
    timeout 60 "$PY0" "$HELPERS" last-json "$STEP_LOG" "{\"cuda_graph\": $graphs}" > "$FIG"
}
step_gen_b1() { bench_generation 1; }
step_gen_b64() { bench_generation 64; }
step_gen_b1_graph() { bench_generation 1 --cuda-graph; }
step_gen_b64_graph() { bench_generation 64 --cuda-graph; }

step_ppo_1b() {
    local root="$WORK/ppo_1b" flags plan_rc rc
    mkdir -p "$root"
    # The actor (random weights), a value model from it as the reward model, and prompts of
    # --max-prompt-len tokens, enough for every iteration: as scripts/bench_ppo.py builds them.
    read -r -a shape <<< "$PPO_SHAPE"
    timeout -k 10 "$(left)" "${PY[@]}" - "$root" "$(arg --max-prompt-len)" "$(arg --generation-batch-size)" \
        "$(arg --max-steps)" "$(arg --max-new-tokens)" "${shape[@]}" <<'PYEOF' || return
import sys
from argparse import Namespace
from pathlib import Path
sys.path.insert(0, "scripts")
import bench_ppo
from rlhf.models.loading import load_tokenizer
from rlhf.models.tiny import save_tiny_model

root = Path(sys.argv[1])
prompt_len, batch, steps, new, hidden, layers, heads, kv, ffn = map(int, sys.argv[2:])
actor = save_tiny_model(root / "actor", "llama", hidden_size=hidden, num_layers=layers, num_heads=heads,
                        num_kv_heads=kv, intermediate_size=ffn, max_positions=2048)
bench_ppo.write_prompts(load_tokenizer(str(actor)), root / "prompts.jsonl", batch * (steps + 1), prompt_len)
args = bench_ppo.reward_args(Namespace(advantage_estimator="gae", new_tokens=new), actor, root)
(root / "reward_args").write_text("\n".join(args))
PYEOF
    mapfile -t flags < "$root/reward_args"
    flags=(--actor "$root/actor" --data "$root/prompts.jsonl" "${flags[@]}" --output "$root/ppo" "${PPO_ARGS[@]}"
           --ppo-epochs 1 --report-to none --sample-log-interval 0 --lr 1e-6)
    echo "== rlhf plan ppo"
    timeout -k 10 "$(left)" "${RLHF[@]}" plan ppo "${flags[@]}" --device "$DEVICE" 2>&1 | tee "$root/plan.log"
    plan_rc=$?
    echo "== rlhf ppo"
    timeout -k 10 "$(left)" "${RLHF[@]}" ppo "${flags[@]}"
    rc=$?
    timeout 60 "$PY0" "$HELPERS" ppo "$root/ppo/metrics.jsonl" "$root/plan.log" "{\"shape\": \"$PPO_SHAPE\"}" > "$FIG"
    (( rc == 0 )) || return $rc
    return $plan_rc
}

step_e2e() {
    local rc
    timeout -k 10 "$(left)" "${RLHF[@]}" e2e --output "$WORK/e2e" --report-to none "${E2E_ARGS[@]}" \
        --sft.dtype "$E2E_DTYPE" --reward.dtype "$E2E_DTYPE" --ppo.dtype "$E2E_DTYPE"
    rc=$?
    timeout 60 "$PY0" "$HELPERS" e2e "$WORK/e2e" "{\"dtype\": \"$E2E_DTYPE\"}" > "$FIG"
    return $rc
}

step_sanitizer() {
    local kernels="tests/test_generation_kernels.py tests/test_fused_adam.py tests/test_logprobs.py" rc=0
    # shellcheck disable=SC2086
    timeout -k 10 "$(left)" compute-sanitizer --tool memcheck --print-limit 30 \
        "${PY[@]}" -m pytest -q -m gpu -p no:cacheprovider $kernels || rc=$?
    timeout -k 10 "$(left)" compute-sanitizer --tool racecheck --print-limit 30 \
        "${PY[@]}" -m pytest -q -m gpu -p no:cacheprovider tests/test_generation_kernels.py -k decode_attention_edge \
        || rc=$?
    timeout 60 "$PY0" "$HELPERS" sanitizer "$STEP_LOG" > "$FIG"
    return $rc
}

step_suite() {
    local rc
    # shellcheck disable=SC2086  # SUITE_ARGS: pytest options, one word each
    timeout -k 10 "$(left)" "${PY[@]}" -m pytest -q -p no:cacheprovider --tb=line ${SUITE_ARGS:-}
    rc=$?
    timeout 60 "$PY0" "$HELPERS" pytest "$STEP_LOG" > "$FIG"
    return $rc
}

# ------------------------------------------------------------------------------------ the runner

now_s() { echo $(( (${EPOCHREALTIME/./} - START_US) / 1000000 )); }
left() { local s=$(( STEP_END - $(now_s) )); echo $(( s > 1 ? s : 1 )); }
arg() {  # FLAG: its value in PPO_ARGS
    local i
    for (( i = 0; i < ${#PPO_ARGS[@]}; i++ )); do [[ ${PPO_ARGS[i]} == "$1" ]] && echo "${PPO_ARGS[i+1]}"; done
}

record() {  # NAME STATUS SECONDS RC REASON
    printf '%s\t%s\t%s\t%s\t%s\n' "$@" >> "$TMP/status.tsv"
    write_summary running
}

write_summary() {  # STATE
    timeout 60 "$PY0" "$HELPERS" summary "$TMP" "$OUT/summary.json" "$1" "$DRY" "$DEVICE" "$DEADLINE_S" \
        "$START_US" "$ALL_STEPS" || echo "gpu_check: could not write $OUT/summary.json" >&2
}

run_step() {  # NAME NEED_S CAP_S: step_NAME within CAP_S and the deadline; skipped once NEED_S no longer fits
    local name=$1 need=$2 cap=$3 remaining start_us rc status seconds
    remaining=$(( DEADLINE_S - $(now_s) ))
    if [[ $SELECTED != *" $name "* ]]; then
        record "$name" skipped 0 "" "not selected"
        return
    fi
    if (( remaining < need )); then
        echo "[gpu_check] $name: skipped ($(( remaining > 0 ? remaining : 0 )) s left before the deadline, needs $need)"
        record "$name" skipped 0 "" deadline
        return
    fi
    if [[ $DRY == 1 && ( $name == sanitizer || $name == suite ) ]]; then
        record "$name" skipped 0 "" "dry run"  # compute-sanitizer needs a GPU; the suite is the CPU's own run
        return
    fi
    if [[ $name == sanitizer ]] && ! command -v compute-sanitizer > /dev/null; then
        record "$name" skipped 0 "" "no compute-sanitizer"
        return
    fi
    if [[ $DRY == 1 && $name != install ]]; then
        start_zygote
        remaining=$(( DEADLINE_S - $(now_s) ))
    fi
    STEP_END=$(( $(now_s) + (cap < remaining ? cap : remaining) ))
    STEP_LOG="$TMP/$name.log" FIG="$TMP/fig/$name.json"
    echo "[gpu_check] $name (at most $(left) s) ..."
    start_us=${EPOCHREALTIME/./}
    ( "step_$name" ) > "$STEP_LOG" 2>&1
    rc=$?
    seconds=$(( (${EPOCHREALTIME/./} - start_us) / 1000 ))
    seconds="$(( seconds / 1000 )).$(printf %03d $(( seconds % 1000 )))"
    case $rc in
        0) status=ok ;;
        124|137) status=timeout ;;
        *) status=failed ;;
    esac
    { echo "======== $name: $status (exit $rc, $seconds s)"; cat "$STEP_LOG"; echo; } >> "$LOG"
    echo "[gpu_check] $name: $status ($seconds s)"
    [[ $status == ok ]] || tail -n 15 "$STEP_LOG" | sed "s/^/    $name| /"
    record "$name" "$status" "$seconds" "$rc" ""
}

start_zygote() {  # the dry run's warm interpreter (zygote-serve below), once, before the first step that runs Python
    [[ -n ${ZYGOTE_PID:-} ]] && return
    export GPU_CHECK_ZYGOTE="$TMP/zygote.sock"
    timeout $(( DEADLINE_S + 120 )) "$PY0" "$HELPERS" zygote-serve "$GPU_CHECK_ZYGOTE" < /dev/null \
        > "$TMP/zygote.log" 2>&1 &
    ZYGOTE_PID=$!
    export GPU_CHECK_ZYGOTE_PID=$ZYGOTE_PID
    PY=("$PY0" "$HELPERS" zygote-run)
    RLHF=("${PY[@]}" -m rlhf)
    local started; started=$(now_s)
    timeout 180 "${PY[@]}" -c "" || echo "[gpu_check] the dry run's zygote did not start: see $LOG"
    echo "[gpu_check] dry run: torch, transformers and rlhf imported once, in $(( $(now_s) - started )) s"
}

finish() {
    local rc=$?
    trap - EXIT INT TERM
    [[ -n ${ZYGOTE_PID:-} ]] && kill "$ZYGOTE_PID" 2> /dev/null
    if [[ -f $HELPERS ]]; then
        write_summary "${1:-interrupted}"
        [[ -f $TMP/zygote.log ]] && { echo "======== dry-run zygote"; cat "$TMP/zygote.log"; } >> "$LOG"
    fi
    [[ -n ${GPU_CHECK_KEEP:-} ]] && echo "[gpu_check] work files kept in $TMP" || rm -rf "$TMP"
    exit "$rc"
}

main() {
    trap finish EXIT
    trap 'exit 130' INT TERM
    write_helpers
    local where="on ${GPU_NAME:-no GPU found}"
    [[ $DRY == 1 ]] && where="dry run (cpu, tiny sizes)"
    echo "[gpu_check] $where; deadline $DEADLINE_S s; logs in $LOG"
    PY=("$PY0")
    RLHF=("${PY[@]}" -m rlhf)
    write_summary running
    run_step install 5 120
    run_step versions 5 60
    run_step device 10 60
    run_step ops 20 240
    run_step pytest_gpu 30 150
    run_step bench_adam 15 60
    run_step gen_b1 30 75
    run_step gen_b64 30 75
    run_step gen_b1_graph 30 75
    run_step gen_b64_graph 30 75
    run_step ppo_1b 60 200
    run_step e2e 30 100
    run_step sanitizer 60 300
    run_step suite 120 560
    local failed
    failed=$(awk -F'\t' '$2 == "failed" || $2 == "timeout" { n++ } END { print (n > 0) }' "$TMP/status.tsv")
    echo "[gpu_check] done in $(now_s) s: $OUT/summary.json"
    (exit "$failed")
    finish finished
}

# ------------------------------------------------------------------------------------ Python helpers
# Plain Python (json and re): the summary, the parsers of the steps' output, and the dry run's zygote.

write_helpers() {
    cat > "$HELPERS" <<'PYEOF'
"""gpu_check.sh's helpers: python3 gpu_check.py COMMAND ARGS..."""
import json
import os
import re
import select
import signal
import socket
import sys
import time
from pathlib import Path


def last_json(log, extra="{}"):
    """The last line of LOG that is a JSON object (a bench script's result), with EXTRA merged in."""
    for line in reversed(Path(log).read_text(errors="replace").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                print(json.dumps({**row, **json.loads(extra)}))
                return 0
    print(f"no JSON line in {log}", file=sys.stderr)
    return 1


def pytest_counts(log):
    """pytest's outcome counts from its last summary line; from the progress characters when it was
    cut off (complete: false)."""
    text = Path(log).read_text(errors="replace")
    lines = text.splitlines()
    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors", "deselected", "xfailed", "xpassed")}
    summary = [line for line in lines if re.match(r"^(=+ )?\d+ \w+.* in [\d.]+s", line)]
    if summary:
        for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", summary[-1]):
            counts["errors" if what.startswith("error") else what] += int(n)
        seconds = re.search(r" in ([\d.]+)s", summary[-1])
        counts["seconds"] = float(seconds.group(1)) if seconds else None
    else:
        marks = {".": "passed", "F": "failed", "s": "skipped", "E": "errors", "x": "xfailed", "X": "xpassed"}
        for line in lines:
            progress = re.match(r"^(?:\S+\.py )?([.FsExX]+)\s*(?:\[\s*\d+%\])?$", line)
            for c in progress.group(1) if progress else "":
                counts[marks[c]] += 1
    counts["complete"] = bool(summary)
    counts["failures"] = [line for line in lines if line.startswith(("FAILED ", "ERROR "))][:30]
    print(json.dumps(counts))
    return 0


def jsonl(path):
    """The rows of a metrics.jsonl; none when it is missing (the stage failed before its first step)."""
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def ppo_figures(metrics, plan_log, extra="{}"):
    """rlhf ppo's metrics.jsonl against `rlhf plan ppo`'s JSON line: each phase's mean seconds and
    peak memory (the iterations after the first, when there are several: the first is warm-up) and
    the log-prob differences between rollout and training."""
    rows = jsonl(metrics)
    steady = rows[1:] or rows
    plan = {}
    for line in reversed(Path(plan_log).read_text(errors="replace").splitlines() if Path(plan_log).is_file() else []):
        if line.startswith("{"):
            plan = json.loads(line)
            break
    phases = list(plan.get("phases", {})) or ["generation", "reward", "experience", "training"]

    def mean(key):
        values = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        return round(sum(values) / len(values), 4) if values else None

    def most(key, rows=rows):
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return max(values) if values else None

    out = {
        "iterations": len(rows), "phase_s": {p: mean(f"{p}_s") for p in phases},
        "samples_per_s": mean("samples_per_s"), "tokens_per_s": mean("tokens_per_s"),
        "peak_mem_gb": {p: most(f"peak_mem_gb_{p}", steady) for p in phases},
        "peak_mem_reserved_gb": {p: most(f"peak_mem_reserved_gb_{p}", steady) for p in phases},
        "plan_gb": {p: round(v["peak_gb"], 4) for p, v in plan.get("phases", {}).items()},
        "plan_peak_gb": plan.get("peak_gb"), "plan_device": plan.get("device"), "plan_dtype": plan.get("dtype"),
        "old_logprob_diff_max": most("old_logprob_diff_max"),
        "rollout_parity_max_diff": most("rollout_parity_max_diff"),
    }
    out["measured_over_plan"] = {p: round(out["peak_mem_gb"][p] / out["plan_gb"][p], 3)
                                 for p in phases if out["peak_mem_gb"].get(p) and out["plan_gb"].get(p)}
    print(json.dumps({**out, **json.loads(extra)}))
    return 0 if rows and plan else 1


def e2e_figures(run, extra="{}"):
    """rlhf e2e's summary.json, with its PPO stage's log-prob differences and peak memory."""
    run = Path(run)
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    rows = jsonl(run / "ppo" / "metrics.jsonl")
    keep = {k: v for k, v in summary.items() if isinstance(v, (int, float)) or k in ("task", "advantage_estimator")}

    def most(key):
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return max(values) if values else None

    iterations = [r for r in rows if r.get("step", 0) > 0]  # step 0: the held-out evaluation before training
    keep.update({"ppo_iterations": len(iterations), "old_logprob_diff_max": most("old_logprob_diff_max"),
                 "rollout_parity_max_diff": most("rollout_parity_max_diff"),
                 "ppo_peak_mem_gb": max((v for r in rows for k, v in r.items() if k.startswith("peak_mem_gb_")),
                                        default=None)})
    print(json.dumps({**keep, **json.loads(extra)}))
    return 0 if summary else 1


def sanitizer_figures(log):
    text = Path(log).read_text(errors="replace")
    errors = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
    hazards = [int(n) for n in re.findall(r"RACECHECK SUMMARY: (\d+) hazard", text)]
    print(json.dumps({"memcheck_errors": errors[0] if errors else None,
                      "racecheck_hazards": hazards[-1] if hazards else None}))
    return 0


def summary(tmp, out, state, dry, device, deadline, start_us, steps):
    """$OUT/summary.json from the runner's status.tsv and each step's figures, written atomically."""
    tmp = Path(tmp)
    records = {}
    for line in (tmp / "status.tsv").read_text().splitlines():
        name, status, seconds, rc, reason = (line.split("\t") + [""] * 5)[:5]
        records[name] = {"status": status, "seconds": float(seconds or 0), "rc": int(rc) if rc else None}
        if reason:
            records[name]["reason"] = reason
        fig = tmp / "fig" / f"{name}.json"
        if fig.is_file() and fig.stat().st_size:
            try:
                records[name]["figures"] = json.loads(fig.read_text())
            except ValueError:
                records[name]["figures_unparsed"] = fig.read_text()[-2000:]
        log = tmp / f"{name}.log"
        if status in ("failed", "timeout") and log.is_file():
            records[name]["log_tail"] = log.read_text(errors="replace").splitlines()[-12:]
    pending = "pending" if state == "running" else "not run"
    result = {
        "script": "scripts/gpu_check.sh", "state": state, "dry_run": dry == "1", "device": device,
        "deadline_s": int(deadline), "elapsed_s": round(time.time() - int(start_us) / 1e6, 1),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(int(start_us) / 1e6)),
        "log": "gpu_check.log",
        "versions": records.get("versions", {}).get("figures", {}),
        "steps": {name: records.get(name, {"status": pending}) for name in steps.split()},
    }
    partial = Path(out + ".partial")
    partial.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(partial, out)
    return 0


# ------------------------------------------------------------------ the dry run's zygote

CHILD = 0  # the pid of the command running now
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
           "rlhf.cli", "rlhf.engine.backends.registry", "rlhf.engine.generation", "rlhf.report", "rlhf.models.tiny",
           "rlhf.stages.sft", "rlhf.stages.reward", "rlhf.stages.ppo", "rlhf.stages.e2e", "rlhf.stages.plan",
           "pytest", "hypothesis")


def zygote_serve(path):
    """Import what the steps import, then serve: for each client (`zygote-run ARGS...`) fork a child
    that takes the client's stdin/stdout/stderr, cwd and environment and runs ARGS as `python ARGS`
    would; the client gets the child's pid, then its exit code. Nothing runs here but imports: a
    child must not inherit thread pools (torch's OpenMP pool starts in the child, at its first op)."""
    import importlib
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the child then imports it itself, and fails as a process would
            print(f"zygote: {name} not preloaded: {type(exc).__name__}: {exc}", file=sys.stderr)
    import gc
    gc.freeze()  # the preloaded objects outlive every child: its collections (pytest's 5) need not walk them
    sys.stdout.flush()
    sys.stderr.flush()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    signal.signal(signal.SIGTERM, stop_serving)
    print(f"zygote: ready ({len(sys.modules)} modules)", file=sys.stderr, flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            serve_one(conn, server)


def serve_one(conn, server):
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    size = int.from_bytes(data[:8], "big")
    data = data[8:]
    while len(data) < size:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    request = json.loads(data)
    global CHILD
    pid = CHILD = os.fork()
    if pid == 0:
        server.close()
        conn.close()
        os.setpgid(0, 0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        run_child(request)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass  # the child did it first
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            CHILD = 0
            break
        readable, _, _ = select.select([conn], [], [], 0.05)
        if readable and not conn.recv(1):  # the client was killed (its timeout): so is its command
            kill_group(pid, signal.SIGKILL)
    try:
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    except OSError:
        pass


def stop_serving(signum, _frame):
    """SIGTERM (the script's end): the command running now goes too."""
    if CHILD:
        kill_group(CHILD, signal.SIGKILL)
    os._exit(128 + signum)


def run_child(request):
    import logging
    import runpy
    import traceback
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    argv, code = request["argv"], 0
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = argv[1:], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] in ("-c", "-"):
            source = argv[1] if argv[0] == "-c" else sys.stdin.read()
            sys.argv, sys.path[0] = (["-c", *argv[2:]] if argv[0] == "-c" else argv), ""
            exec(compile(source, "<string>" if argv[0] == "-c" else "<stdin>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def kill_group(pid, signum):
    try:
        os.killpg(pid, signum)
    except OSError:
        pass


def zygote_run(argv):
    """A client: what `python ARGV` does, run by the zygote's child; forwards TERM/INT/HUP to it."""
    path, server = os.environ["GPU_CHECK_ZYGOTE"], os.environ["GPU_CHECK_ZYGOTE_PID"]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    while True:
        try:
            sock.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            stat = Path(f"/proc/{server}/stat")
            if not stat.is_file() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                print("gpu_check: the dry run's zygote is not running (see gpu_check.log)", file=sys.stderr)
                return 1
            time.sleep(0.1)
    payload = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(sock, [len(payload).to_bytes(8, "big") + payload], [0, 1, 2])
    reply = sock.makefile("r")
    pid = int(reply.readline())
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda s, _frame: kill_group(pid, s))
    line = reply.readline()
    code = int(line) if line.strip() else 1
    return code if code >= 0 else 128 - code


COMMANDS = {"last-json": last_json, "pytest": pytest_counts, "ppo": ppo_figures, "e2e": e2e_figures,
            "sanitizer": sanitizer_figures, "summary": summary, "zygote-serve": zygote_serve}

if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    sys.exit(zygote_run(args) if command == "zygote-run" else COMMANDS[command](*args))
PYEOF
}

main "$@"
