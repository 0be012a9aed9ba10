"""Fused Adam/AdamW: one pass over p, g, m, v per step, on CPU (AVX-512/AVX2 + OpenMP) or CUDA.

`FusedAdamW` is a drop-in `torch.optim.Optimizer` (param groups, LR schedulers, `state_dict`)
whose state uses torch AdamW's keys ('step', 'exp_avg', 'exp_avg_sq'), so
`torch.distributed.checkpoint.state_dict.get/set_optimizer_state_dict` and DCP round-trip it.
FSDP2 (DTensor) params are stepped through their local shards as flat multi-tensor lists: no
per-DTensor op dispatch in `step()`. Optimizer state is always fp32 (DTensors sharded like the
params when the params are DTensors); bf16 params may keep an fp32 master copy
(`master_weights=True`, state key 'master_param'), and the step can also write a bf16 copy of
the updated params (`low_precision_dtype=torch.bfloat16`, read with `low_precision_copy(p)`),
which is what ZeRO-Offload hands back to the GPU after a CPU step.

Kernels: csrc/adam (op `fused_adam_cpu` for CPU tensors, `fused_adam_cuda` for CUDA tensors).
Where an op cannot be built, `adam_reference_step` (torch foreach ops, same math) runs instead,
after one warning from engine/ops.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain
from types import ModuleType
from typing import Any, Literal

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from rlhf.engine.op_selftests import Worst
from rlhf.engine.ops import OpSpec, load_op, register_op, register_self_test
from rlhf.logging import get_logger

log = get_logger(__name__)

CPU_OP = "fused_adam_cpu"
CUDA_OP = "fused_adam_cuda"

register_op(
    OpSpec(
        name=CPU_OP,
        sources=("adam/cpu_adam.cpp", "adam/cpu_adam_scalar.cpp", "adam/cpu_adam_avx2.cpp", "adam/cpu_adam_avx512.cpp"),
        # at::parallel_for is inline OpenMP code: without -fopenmp it would run on one thread.
        extra_cflags=("-fopenmp",),
        extra_ldflags=("-fopenmp",),
        build_seconds=20.0,
    )
)
register_op(
    OpSpec(
        name=CUDA_OP,
        sources=("adam/fused_adam_cuda.cpp", "adam/fused_adam_cuda_kernel.cu"),
        needs_cuda=True,
    )
)

Implementation = Literal["auto", "fused", "reference"]
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# State tensors kept in fp32 whatever the param dtype (torch's load_state_dict would cast them).
_FP32_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master_param")


def _op_for(device: torch.device) -> ModuleType | None:
    if device.type == "cpu":
        return load_op(CPU_OP)
    if device.type == "cuda":
        return load_op(CUDA_OP)
    return None


def fused_adam_available(device: torch.device | str) -> bool:
    """Whether the fused kernel for `device`'s type builds and loads here (builds it if needed)."""
    return _op_for(torch.device(device)) is not None


def total_norm(tensors: list[Tensor]) -> Tensor:
    """The L2 norm of all `tensors` together, a float32 0-d tensor (a total gradient norm): on the
    CPU in one parallel pass of the fused_adam_cpu op (chunks summed in double: closer to the exact
    norm than torch's per-tensor float norms, and 3-4x faster for a 39-tensor model), else torch's
    `get_total_norm`."""
    plain = all(t.device.type == "cpu" and t.dtype in _KERNEL_DTYPES and t.is_contiguous() for t in tensors)
    op = load_op(CPU_OP) if tensors and plain else None
    if op is None:
        return torch.nn.utils.get_total_norm(tensors, foreach=True)
    return torch.tensor(op.l2_norm(tensors), dtype=torch.float32)


def adam_reference_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    masters: list[Tensor],
    lp_out: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
) -> None:
    """The kernels' math with torch ops, in place; same arguments and effects as the ops' `adam_step`.

    Increments each step counter, then updates fp32 working copies (the masters when given, else
    the params widened to fp32), like the kernels, so bf16 params step identically on both paths.
    """
    if not params:
        return
    torch._foreach_add_(steps, 1.0)
    by_step: dict[int, list[int]] = {}
    for i, s in enumerate(steps):
        by_step.setdefault(int(s.item()), []).append(i)
    for step, idx in by_step.items():
        pick = lambda xs: [xs[i] for i in idx] if xs else []  # noqa: E731
        _reference_update(
            pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(masters), pick(lp_out),
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step, adam_w_mode=adam_w_mode,
        )


def _reference_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    masters: list[Tensor],
    lp_out: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adam_w_mode: bool,
) -> None:
    work = masters if masters else [p if p.dtype == torch.float32 else p.float() for p in params]
    g32 = [g if g.dtype == torch.float32 else g.float() for g in grads]
    if weight_decay != 0.0 and not adam_w_mode:
        g32 = torch._foreach_add(g32, work, alpha=weight_decay)  # new tensors: grads stay intact
    if weight_decay != 0.0 and adam_w_mode:
        torch._foreach_mul_(work, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, g32, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g32, g32, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(bias_correction2))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(work, exp_avgs, denom, value=-lr / bias_correction1)
    for p, w in zip(params, work):
        if w is not p:
            p.copy_(w)
    for out, w in zip(lp_out, work):
        out.copy_(w)


@dataclass
class _Bucket:
    """Local tensors of one group that step in one call (same device, dtype and extras)."""

    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    exp_avgs: list[Tensor] = field(default_factory=list)
    exp_avg_sqs: list[Tensor] = field(default_factory=list)
    masters: list[Tensor] = field(default_factory=list)
    lp_out: list[Tensor] = field(default_factory=list)
    steps: list[Tensor] = field(default_factory=list)


def _local(t: Tensor) -> Tensor:
    # The local shard itself. DTensor.to_local() on an nn.Parameter returns a fresh view per call
    # (one op dispatch per param per step), hence the attribute.
    return t._local_tensor if isinstance(t, DTensor) else t


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (or Adam with `adam_w_mode=False`) stepping whole param groups with one fused kernel.

    Args:
        params: tensors or param-group dicts, as for torch.optim.AdamW.
        lr, betas, eps, weight_decay: as torch.optim.AdamW; per group like any optimizer.
        adam_w_mode: True for AdamW (decoupled weight decay: p *= 1 - lr*wd), False for Adam
            (L2: grad += wd * p). Also a per-group key.
        master_weights: keep an fp32 master copy of every non-fp32 param (state 'master_param');
            the step updates the master and rounds it into the param.
        low_precision_dtype: torch.bfloat16 to also write a bf16 copy of each updated param in
            the same pass (see `low_precision_copy`); None for no copy.
        implementation: "auto" (the op where it builds, else the torch reference), "fused" (the
            op or an error), "reference" (always the torch reference math).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        adam_w_mode: bool = True,
        *,
        master_weights: bool = False,
        low_precision_dtype: torch.dtype | None = None,
        implementation: Implementation = "auto",
    ) -> None:
        if float(lr) < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if low_precision_dtype not in (None, torch.bfloat16):
            raise ValueError(f"low_precision_dtype must be None or torch.bfloat16, got {low_precision_dtype}")
        if implementation not in ("auto", "fused", "reference"):
            raise ValueError(f"implementation must be auto, fused or reference, got {implementation!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=adam_w_mode)
        super().__init__(params, defaults)
        self.master_weights = master_weights
        self.low_precision_dtype = low_precision_dtype
        self.implementation: Implementation = implementation
        self._low_precision: dict[Tensor, Tensor] = {}
        self._reference_reasons: set[str] = set()
        self._ops: dict[str, ModuleType | None] = {}
        self.step_finite: bool | None = None  # set by step()

    # ---------------------------------------------------------------- public helpers

    def low_precision_copy(self, param: Tensor) -> Tensor | None:
        """The bf16 copy of `param` written by the last step (a DTensor like `param` if it is one)."""
        local = self._low_precision.get(param)
        if local is None or not isinstance(param, DTensor):
            return local
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )

    # ---------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *,  # type: ignore[override]
             grad_scale: float = 1.0) -> float | None:
        """One optimizer step over every param that has a gradient, each gradient taken times
        `grad_scale` (gradient clipping's coefficient: the CPU kernels multiply as they read, the
        other paths multiply the gradients in place first, as torch's clipping does).
        `step_finite` then says whether every updated param is finite (the CPU kernels check as
        they write), or is None where a bucket took another path."""
        if not (math.isfinite(grad_scale) and grad_scale >= 0.0):
            raise ValueError(f"FusedAdamW.step: grad_scale must be a finite number >= 0, got {grad_scale}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_finite = True
        for group in self.param_groups:
            self._step_group(group, grad_scale)
        return loss

    def _step_group(self, group: dict[str, Any], grad_scale: float = 1.0) -> None:
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError("FusedAdamW supports neither amsgrad nor maximize")
        entries = [(p, self.state[p]) for p in group["params"] if p.grad is not None]
        if not entries:
            return
        buckets: dict[tuple[Any, ...], _Bucket] = {}
        for p, state in entries:
            if not state:
                self._init_state(p, state)
            grad = p.grad
            if grad.is_sparse:
                raise RuntimeError("FusedAdamW does not support sparse gradients")
            if isinstance(p, DTensor) and grad.placements != p.placements:
                grad = grad.redistribute(p.device_mesh, p.placements)
            local_p = _local(p)
            local_g = _local(grad)
            exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
            master = state.get("master_param")
            local_master = _local(master) if master is not None else None
            lp = self._low_precision_target(p, local_p)
            fused = self._use_op(local_p, local_g, (local_p, local_g, exp_avg, exp_avg_sq, local_master))
            key = (local_p.device, local_p.dtype, master is not None, lp is not None, fused)
            bucket = buckets.setdefault(key, _Bucket())
            bucket.params.append(local_p)
            bucket.grads.append(local_g)
            bucket.exp_avgs.append(exp_avg)
            bucket.exp_avg_sqs.append(exp_avg_sq)
            bucket.steps.append(state["step"])  # an FSDP rank with an empty shard still counts it
            if local_master is not None:
                bucket.masters.append(local_master)
            if lp is not None:
                bucket.lp_out.append(lp)

        beta1, beta2 = group["betas"]
        hyper = dict(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            adam_w_mode=bool(group["adam_w_mode"]),
        )
        for (device, _, _, _, fused), b in buckets.items():
            lists = (b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.masters, b.lp_out, b.steps)
            if fused and device.type == "cpu":
                finite = self._ops["cpu"].adam_step(*lists, **hyper, grad_scale=grad_scale)
                self.step_finite = self.step_finite and finite
                continue
            if grad_scale != 1.0:
                torch._foreach_mul_(b.grads, grad_scale)
            self.step_finite = None
            if fused:
                self._ops[device.type].adam_step(*lists, **hyper)
            else:
                adam_reference_step(*lists, **hyper)

    # ---------------------------------------------------------------- internals

    def _init_state(self, p: Tensor, state: dict[str, Any]) -> None:
        # Same keys and 'step' placement (a CPU float32 scalar) as torch AdamW's default path;
        # zeros_like on a DTensor gives a DTensor sharded like the param.
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        if self.master_weights and p.dtype != torch.float32:
            state["master_param"] = p.detach().to(dtype=torch.float32, copy=True)

    def _low_precision_target(self, p: Tensor, local_p: Tensor) -> Tensor | None:
        if self.low_precision_dtype is None:
            return None
        lp = self._low_precision.get(p)
        if lp is None or lp.shape != local_p.shape or lp.device != local_p.device:
            lp = torch.empty_like(local_p, dtype=self.low_precision_dtype, memory_format=torch.contiguous_format)
            self._low_precision[p] = lp
        return lp

    def _use_op(self, local_p: Tensor, local_g: Tensor, tensors: tuple[Tensor | None, ...]) -> bool:
        """Whether this param can take the fused op; otherwise say why once and use the reference."""
        if self.implementation == "reference":
            return False
        kind = local_p.device.type
        if kind not in self._ops:
            self._ops[kind] = _op_for(local_p.device)
        reason = None
        if self._ops[kind] is None:
            reason = f"no fused Adam op for {kind}"
        elif local_p.dtype not in _KERNEL_DTYPES or local_g.dtype != local_p.dtype:
            reason = f"param/grad dtypes {local_p.dtype}/{local_g.dtype} (kernels take fp32 or bf16, grad = param dtype)"
        elif not all(t is None or t.is_contiguous() for t in tensors):
            reason = "non-contiguous param, grad or state"
        if reason is None:
            return True
        if self.implementation == "fused":
            raise RuntimeError(f"FusedAdamW(implementation='fused'): {reason}")
        # A missing op was already reported (once) by engine/ops.py; say the other reasons once.
        if self._ops[kind] is not None and reason not in self._reference_reasons:
            self._reference_reasons.add(reason)
            log.warning("FusedAdamW: %s; those params take the torch reference path", reason)
        return False

    # ---------------------------------------------------------------- checkpoints

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # groups loaded from a torch AdamW state dict lack it
            group.setdefault("adam_w_mode", self.defaults.get("adam_w_mode", True))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, keeping moments and masters in fp32 and 'step' on the CPU.

        torch casts floating state to the param dtype, which for bf16 params would round the
        fp32 moments through bf16; the saved fp32 tensors are restored over those casts.
        """
        saved_state = state_dict["state"]
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        super().load_state_dict(state_dict)
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            saved = saved_state.get(saved_id)
            if saved is None:
                continue
            state = self.state[p]
            for key in _FP32_STATE_KEYS:
                value = saved.get(key)
                if isinstance(value, Tensor):
                    state[key] = value.to(device=_local(p).device, dtype=torch.float32)
            step = state.get("step")
            if isinstance(step, Tensor):
                state["step"] = step.to(device="cpu", dtype=torch.float32)
            elif step is not None:
                state["step"] = torch.tensor(float(step), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Load-time self-test of both ops (engine/op_selftests.py)
# ---------------------------------------------------------------------------------------------

_ADAM_SIZES = (1, 7, 33, 1031)  # tails of every vector width
_ADAM_CASES = (
    # param dtype, fp32 master copy, bf16 copy out, weight decay, AdamW (decoupled) or Adam
    (torch.float32, False, False, 0.01, True),
    (torch.float32, False, True, 0.1, False),
    (torch.bfloat16, True, True, 0.01, True),
    (torch.bfloat16, False, False, 0.0, True),
)


def _adam_tensors(dtype: torch.dtype, masters: bool, lp: bool, device: torch.device,
                  gen: torch.Generator) -> dict[str, list[torch.Tensor]]:
    def randn(n: int) -> torch.Tensor:
        return torch.randn(n, generator=gen).to(device)

    params = [randn(n) for n in _ADAM_SIZES]
    return {
        "params": [p.to(dtype) for p in params],
        "grads": [randn(n).to(dtype) for n in _ADAM_SIZES],
        "exp_avgs": [0.1 * randn(n) for n in _ADAM_SIZES],
        "exp_avg_sqs": [0.01 * randn(n).abs() for n in _ADAM_SIZES],
        "masters": [p.clone() for p in params] if masters else [],
        "lp_out": [torch.empty(n, dtype=torch.bfloat16, device=device) for n in _ADAM_SIZES] if lp else [],
        "steps": [torch.tensor(float(i)) for i in range(len(_ADAM_SIZES))],  # CPU scalars, as in FusedAdamW
    }


def fused_adam_self_test(module: ModuleType, device: torch.device) -> str:
    """Two steps of every kernel set the build has, for fp32 and bf16 params with and without
    master copies and bf16 outputs, equal to `adam_reference_step`."""
    worst = Worst()
    isas = list(module.supported_isas()) if hasattr(module, "supported_isas") else [None]
    gen = torch.Generator().manual_seed(0)
    for isa in isas:
        for dtype, masters, lp, weight_decay, adam_w_mode in _ADAM_CASES:
            ours = _adam_tensors(dtype, masters, lp, device, gen)
            ref = {k: [t.clone() for t in ts] for k, ts in ours.items()}
            hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay, adam_w_mode=adam_w_mode)
            for _ in range(2):
                module.adam_step(*ours.values(), **hyper, **({"isa": isa} if isa else {}))
                adam_reference_step(*ref.values(), **hyper)
            what = f"adam_step isa={isa or 'cuda'} {dtype} masters={masters} lp_out={lp}"
            for key in ("exp_avgs", "exp_avg_sqs", "masters", "steps"):
                for got, want in zip(ours[key], ref[key]):
                    worst.close(f"{what} {key}", got, want, rtol=1e-5, atol=1e-6)
            for key in ("params", "lp_out"):
                bf16 = key == "lp_out" or dtype == torch.bfloat16  # one rounding step of bf16 apart
                for got, want in zip(ours[key], ref[key]):
                    worst.close(f"{what} {key}", got, want, rtol=1.6e-2 if bf16 else 1e-5, atol=1e-5 if bf16 else 1e-6)
    return worst.summary()


register_self_test(CPU_OP, fused_adam_self_test)
register_self_test(CUDA_OP, fused_adam_self_test)
