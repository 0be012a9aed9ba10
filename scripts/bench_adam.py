"""Benchmark the fused Adam op against torch.optim.AdamW (fused / foreach / for-loop).

    python scripts/bench_adam.py                       # CPU, 37M params in 35 tensors + FSDP2
    python scripts/bench_adam.py --device cuda         # the same on a GPU
    python scripts/bench_adam.py --params 5e6 --steps 3  # a quick look

(a) One optimizer step over ~37M fp32 params in 35 tensors (the shapes of a small transformer):
    ms/step of each implementation and GB/s against the 28 bytes/param an Adam step must move
    (read p, g, m, v; write p, m, v; 4 bytes each), and the fraction of this machine's memory
    bandwidth that ours reaches. The bandwidth is measured here, counting bytes read + written,
    with two probes over a large tensor: copy_ into a second buffer, and an in-place mul_ (the
    access pattern of Adam's p, m, v). copy_ alone understates the bound on CPUs: its stores go
    to lines never read, which costs hidden write-allocate reads. The larger probe is the bound.
(b) The step of an FSDP2-wrapped model (world size 1 mesh, so every param is a DTensor): ours
    (local shards, flat lists) against torch AdamW fused=True dispatching on the DTensors.

The last line printed is one JSON object: vs_torch_fused (>1: ours faster), bandwidth_fraction,
fsdp_vs_torch_fused and the raw ms figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from rlhf.engine.fused_adam import CPU_OP, FusedAdamW, fused_adam_available
from rlhf.engine.ops import load_op

BYTES_PER_PARAM = 28  # read p, g, m, v + write p, m, v, all fp32


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, steps: int) -> float:
    """Median wall time of fn() in milliseconds."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def bandwidth_gbs(device: torch.device, nbytes: int, warmup: int, steps: int) -> tuple[float, float]:
    """GB/s of a large copy_ and of a large in-place mul_, each counting bytes read + written."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.zeros_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), device, warmup, steps)
    inplace_ms = time_ms(lambda: dst.mul_(1.0), device, warmup, steps)
    return 2 * nbytes / (copy_ms * 1e-3) / 1e9, 2 * nbytes / (inplace_ms * 1e-3) / 1e9


def transformer_shapes(total: int, tensors: int) -> list[tuple[int, ...]]:
    """`tensors` shapes summing to about `total` elements: per block 4 square + 3 MLP matrices and a norm."""
    per_block = 8
    blocks = max(1, tensors // per_block)
    d = 64
    while blocks * (4 * d * d + 3 * d * (8 * d // 3)) < total:
        d += 64
    shapes: list[tuple[int, ...]] = []
    for _ in range(blocks):
        shapes += [(d, d)] * 4 + [(8 * d // 3, d)] * 3 + [(d,)]
    while len(shapes) < tensors:
        shapes.append((d,))
    return shapes[:tensors]


def bench_flat(args: argparse.Namespace, device: torch.device) -> dict[str, float | int | str]:
    shapes = transformer_shapes(int(args.params), args.tensors)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(device).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device) * 1e-3
    n = sum(p.numel() for p in params)
    print(f"(a) {n / 1e6:.1f}M fp32 params in {len(params)} tensors on {device}", flush=True)

    makers: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "ours": lambda: FusedAdamW(params, lr=1e-4, weight_decay=0.1, implementation="fused"),
        "torch_fused": lambda: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True),
        "torch_foreach": lambda: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=True),
        "torch_forloop": lambda: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=False),
    }
    out: dict[str, float | int | str] = {"n_params": n, "n_tensors": len(params)}
    for name, make in makers.items():
        optim = make()  # one at a time: each holds ~8 bytes/param of state
        ms = time_ms(optim.step, device, args.warmup, args.steps)
        del optim
        out[f"{name}_ms"] = round(ms, 3)
        out[f"{name}_gbs"] = round(BYTES_PER_PARAM * n / (ms * 1e-3) / 1e9, 2)
        print(f"    {name:14s} {ms:9.2f} ms/step  {out[f'{name}_gbs']:7.2f} GB/s", flush=True)
    copy_bw, inplace_bw = bandwidth_gbs(device, args.probe_mb << 20, args.warmup, args.steps)
    bw = max(copy_bw, inplace_bw)
    out["copy_bandwidth_gbs"] = round(copy_bw, 2)
    out["inplace_bandwidth_gbs"] = round(inplace_bw, 2)
    out["vs_torch_fused"] = round(float(out["torch_fused_ms"]) / float(out["ours_ms"]), 3)
    out["bandwidth_fraction"] = round(float(out["ours_gbs"]) / bw, 3)
    print(f"    bandwidth: copy_ {copy_bw:.2f} GB/s, in-place {inplace_bw:.2f} GB/s (read + write); "
          f"ours reaches {out['bandwidth_fraction']:.0%} of the larger", flush=True)
    return out


class Block(nn.Module):
    """The parameter shapes of a pre-norm transformer block (no forward needed: grads are set)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(4))
        self.mlp = nn.ModuleList([nn.Linear(d, 8 * d // 3, bias=False), nn.Linear(d, 8 * d // 3, bias=False),
                                  nn.Linear(8 * d // 3, d, bias=False)])
        self.norms = nn.ModuleList([nn.LayerNorm(d), nn.LayerNorm(d)])


def bench_fsdp(args: argparse.Namespace, device: torch.device) -> dict[str, float | int]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.fsdp_dim) for _ in range(args.fsdp_layers))).to(device)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3  # DTensor grads sharded like the params
    n = sum(p.numel() for p in params)
    print(f"(b) FSDP2 model: {n / 1e6:.1f}M params in {len(params)} DTensors", flush=True)
    out: dict[str, float | int] = {"fsdp_n_params": n, "fsdp_n_tensors": len(params)}
    for name, make in {
        "ours": lambda: FusedAdamW(params, lr=1e-4, weight_decay=0.1, implementation="fused"),
        "torch_fused": lambda: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True),
    }.items():
        optim = make()
        ms = time_ms(optim.step, device, args.warmup, args.steps)
        del optim
        out[f"fsdp_{name}_ms"] = round(ms, 3)
        print(f"    {name:14s} {ms:9.2f} ms/step", flush=True)
    out["fsdp_vs_torch_fused"] = round(out["fsdp_torch_fused_ms"] / out["fsdp_ours_ms"], 3)
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--params", type=float, default=37e6, help="total fp32 params of (a)")
    parser.add_argument("--tensors", type=int, default=35, help="number of tensors of (a)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--probe-mb", type=int, default=512, help="size of the bandwidth probes")
    parser.add_argument("--fsdp-layers", type=int, default=8)
    parser.add_argument("--fsdp-dim", type=int, default=512)
    parser.add_argument("--skip-fsdp", action="store_true")
    args = parser.parse_args()

    device = torch.device(args.device)
    if not fused_adam_available(device):
        raise SystemExit(f"the fused Adam op is not available for {device}; see `rlhf report`")
    result: dict[str, float | int | str] = {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
        "bytes_per_param": BYTES_PER_PARAM,
    }
    if device.type == "cpu":
        result["isa"] = load_op(CPU_OP).best_isa()
    result.update(bench_flat(args, device))
    if not args.skip_fsdp:
        result.update(bench_fsdp(args, device))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
