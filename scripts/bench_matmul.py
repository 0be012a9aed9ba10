"""Float32 linears on the CPU: torch's matmul (MKL) against oneDNN (engine/backends/cpu/matmul.py), in the same
run at a model's linear shapes, per GEMM of a training step, and a whole model's forward + backward.

    python scripts/bench_matmul.py                     # the comparison's tiny Llama: hidden 256, MLP 688, vocab 98,
                                                       # 4096 rows (a 32 x 128 micro-batch) and 32 (a decode step)
    python scripts/bench_matmul.py --model runs/smollm2/base --rows 1024 32

Per shape (in -> out) and rows: `forward` (x @ W^T), `input_grad` (dY @ W) and `weight_grad`
(dY^T @ X), each side's GFLOP/s as the median of --repeats alternated timings, and oneDNN's speed-up;
the weight gradient also as `onednn_transposed` (oneDNN over a transposed operand, which Zen 5 runs:
engine/backends/cpu/matmul.py's weight_grad) and, on AVX-512 CPUs, `tn` (rlhf_cpu_decode.tn_weight_grad:
dY^T X straight from the rows, which weight_grad takes up to cpu_matmul.TN_MAX_WIDTH features wide;
`tn_vs_onednn_transposed` is its speed-up over the transposing path). Then a tiny model's (or
--model's) forward + backward with every linear as `--cpu-matmul onednn` runs it (forward and input
gradient on oneDNN from ONEDNN_MIN_ROWS rows and `onednn_min_depth` deep, the weight gradient where
`weight_grad_on` says) against plain nn.Linear.
The last line is one JSON object; `resolved_auto` says what `--cpu-matmul auto` picks on this machine.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_layers import build_model, interleaved_medians  # scripts/ is the script's sys.path[0]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder instead of the tiny Llama")
    parser.add_argument("--rows", type=int, nargs="+", default=[4096, 32])
    parser.add_argument("--batch", type=int, default=32, help="whole-model step: sequences")
    parser.add_argument("--seq", type=int, default=128, help="whole-model step: tokens per sequence")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if min(*args.rows, args.batch, args.seq, args.repeats) < 1:
        parser.error("--rows, --batch, --seq and --repeats must be >= 1")
    return args


def gemm_rates(rows: int, d_in: int, d_out: int, repeats: int) -> dict[str, dict[str, float]]:
    from rlhf.engine.backends.cpu.matmul import _onednn_linear, onednn_weight_grad_transposed, panel_gemm_op

    x, w, dy = torch.randn(rows, d_in), torch.randn(d_out, d_in), torch.randn(rows, d_out)
    impls = {
        "forward": {"aten": lambda: F.linear(x, w), "onednn": lambda: _onednn_linear(x, w, None)},
        "input_grad": {"aten": lambda: dy @ w, "onednn": lambda: _onednn_linear(dy, w.t(), None)},
        "weight_grad": {"aten": lambda: dy.t() @ x, "onednn": lambda: _onednn_linear(dy.t(), x.t(), None),
                        "onednn_transposed": lambda: onednn_weight_grad_transposed(dy, x)},
    }
    op = panel_gemm_op()
    if op is not None and d_in % 16 == 0:  # dY^T X straight from the rows (cpu_matmul.TN_MAX_WIDTH)
        impls["weight_grad"]["tn"] = lambda: op.tn_weight_grad(dy, x)
    flops = 2 * rows * d_in * d_out
    out = {}
    for gemm, sides in impls.items():
        seconds = dict(zip(sides, interleaved_medians(list(sides.values()), repeats)))
        out[gemm] = {f"{side}_gflop_per_s": round(flops / s / 1e9, 1) for side, s in seconds.items()}
        out[gemm].update({f"{side}_speedup": round(seconds["aten"] / s, 3) for side, s in seconds.items()
                          if side != "aten"})
        if "tn" in seconds:
            out[gemm]["tn_vs_onednn_transposed"] = round(seconds["onednn_transposed"] / seconds["tn"], 3)
    return out


def train_step(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model(input_ids=ids, use_cache=False).logits.log_softmax(-1).mean().backward()
        model.zero_grad(set_to_none=True)
    return step


def main() -> None:
    from rlhf.engine.backends.cpu.matmul import onednn_min_depth, onednn_weight_grad, resolve_cpu_matmul, use_onednn_linears
    from rlhf.engine.flops import TransformerShape
    from rlhf.engine.backends.cpu.fused_layers import fuse_layer_ops

    args = parse_args()
    aten_model = build_model(argparse.Namespace(model=args.model, family="llama"))
    fuse_layer_ops(aten_model)
    shape = TransformerShape.from_config(aten_model.config)
    linears = sorted({*shape.linear_shapes(), (shape.hidden, shape.vocab)})
    gemms = {f"{rows}x{d_in}->{d_out}": gemm_rates(rows, d_in, d_out, args.repeats)
             for rows in args.rows for d_in, d_out in linears}
    onednn_model = copy.deepcopy(aten_model)
    swapped = use_onednn_linears(onednn_model)
    ids = torch.randint(0, shape.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = float((onednn_model(input_ids=ids).logits - aten_model(input_ids=ids).logits).abs().max())
    aten_s, onednn_s = interleaved_medians([train_step(aten_model, ids), train_step(onednn_model, ids)], args.repeats)
    print(json.dumps({
        "bench": "cpu_matmul", "gemms": gemms, "model": args.model or "tiny-llama", "linears_swapped": swapped,
        "train_step_aten_s": round(aten_s, 4), "train_step_onednn_s": round(onednn_s, 4),
        "train_step_onednn_speedup": round(aten_s / onednn_s, 3), "max_logit_diff": diff,
        "batch": args.batch, "seq": args.seq, "threads": torch.get_num_threads(),
        "resolved_auto": resolve_cpu_matmul("auto"), "weight_grad_on": "onednn" if onednn_weight_grad() else "aten",
        "onednn_min_depth": onednn_min_depth(),
    }))


if __name__ == "__main__":
    main()
