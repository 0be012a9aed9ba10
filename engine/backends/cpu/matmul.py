"""Float32 linears on the CPU through oneDNN where MKL is the slower library (AMD CPUs).

    use_onednn_linears(model)    # before FSDP wrapping: swaps nn.Linear classes for OneDnnLinear
    resolve_cpu_matmul("auto")   # "onednn" on an AMD CPU whose torch has oneDNN, else "aten"

torch runs an nn.Linear's matmuls on the CPU through MKL's sgemm. On AMD CPUs MKL takes its
AVX2 code path ("zen" kernels) even where the CPU has AVX-512, and oneDNN's JIT-built AVX-512
kernels (the same library torch ships for its mkldnn ops) are faster at the shapes training runs:
measured on a 2-core AMD EPYC (Zen 4), 4096 rows x hidden 256 / 688, median of 5 alternated runs:
forward 1.02-1.16x, input gradient 1.15-1.29x, weight gradient 0.71-1.01x (slower: it stays on
MKL there; on Zen 5 it takes oneDNN too, over a transposed operand: `weight_grad`), and at a
decode step's 32 rows no gain (below `ONEDNN_MIN_ROWS` it stays on MKL too); a whole forward +
backward 1.09x (tiny Llama, 32 x 128 tokens) and 1.16x (SmolLM2-135M, 4 x 256).
`scripts/bench_matmul.py` measures both, per GEMM and per training step.

`OneDnnLinear` computes what `F.linear` computes, up to the summation order inside a dot product
(|difference| ~1e-6 relative; tests/test_cpu_matmul.py). The swap changes each module's class to a
subclass that overrides `forward` (as `fuse_layer_ops` does), so parameters, state-dict names and
LoRA wrapping are untouched; anything but float32 plain tensors on the CPU (a GPU, bf16, a
DTensor weight in rollout mode's tensor-parallel plan) goes to `F.linear` as before.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from rlhf.engine.backends.cpu.decode_op import load_cpu_decode_op
from rlhf.engine.backends.cpu.layer_op import transposed
from rlhf.engine.ops import cpuinfo_field
from rlhf.errors import UserError

__all__ = [
    "ONEDNN_MIN_DEPTH", "ONEDNN_MIN_DEPTH_FULL_WIDTH", "ONEDNN_MIN_ROWS", "TN_MAX_WIDTH", "TRANSPOSED_INPUT_MAX_WIDTH",
    "amd_avx512", "cpu_matmul_line", "full_width_avx512_amd", "is_plain_linear", "linear", "linear_add", "onednn_available",
    "onednn_min_depth", "onednn_weight_grad", "onednn_weight_grad_transposed", "packed_swiglu_weights", "panel_gemm_op",
    "resolve_cpu_matmul", "shared_input_grads", "shared_input_linears", "swiglu_in_epilogue", "swiglu_linears",
    "transposes_input", "use_onednn_linears", "uses_onednn_linears", "weight_grad",
]

ONEDNN_MIN_ROWS = 64
"""Rows (tokens) from which a linear's forward and input gradient take oneDNN: at a decode step's
32 rows MKL is as fast or faster; from 64 rows on oneDNN is ahead on AMD CPUs."""
ONEDNN_MIN_DEPTH = 256
"""Shortest dot product (the GEMM's inner dimension: in_features for the forward, out_features for
the input gradient) that oneDNN takes before Zen 5 (`onednn_min_depth`): on Zen 4 the input gradient
of a 98-token vocabulary's head ran at half MKL's rate, SmolLM2's k/v projections' (192 outputs) at 0.72x."""

ONEDNN_MIN_DEPTH_FULL_WIDTH = 64
"""`onednn_min_depth` on Zen 5 (AMD family 0x1A on: full-width AVX-512, `full_width_avx512_amd`),
where oneDNN runs shallow products at about twice MKL's rate: measured on a 2-core AMD EPYC Zen 5,
scripts/bench_matmul.py's shapes and [rows, depth] @ [depth, 576], median of 40 calls: depth 64 / 128 /
192 at 4096 rows forward 487 / 484 / 488 GFLOP/s against MKL's 213 / 214 / 222, input gradient added
into a tensor (`_input_grad`) 396 / 450 / 455 against 226 / 227 / 227; at 768 rows 372 / 449 / 463
against 225 / 226 / 224; SmolLM2-135M's k/v input gradient (768 x 192 -> 576) 479 against 132. At
64 rows x depth 64 the added input gradient is 0.93x MKL's, the one shape below; depth 32 and less
(a value head's input gradient: depth 1) stay on MKL."""


@cache
def onednn_available() -> bool:
    """torch was built with oneDNN (mkldnn) and has its dense-input linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@cache
def cpu_vendor() -> str:
    """The CPU's vendor id ("AuthenticAMD", "GenuineIntel", ...) from /proc/cpuinfo; "" elsewhere."""
    return cpuinfo_field("vendor_id")


@cache
def full_width_avx512_amd() -> bool:
    """An AMD CPU of family 0x1A or later (Zen 5): AVX-512 FMAs at full width, where oneDNN's kernels
    run about twice MKL's AVX2 ones even at shapes where on Zen 4 they did not (`onednn_min_depth`).
    Decided by the CPU, not timed at start-up: every rank and a resumed run take the same path."""
    family = cpuinfo_field("cpu family")
    return cpu_vendor() == "AuthenticAMD" and family.isdigit() and int(family) >= 0x1A


def onednn_min_depth() -> int:
    """The shortest dot product oneDNN takes on this CPU: ONEDNN_MIN_DEPTH_FULL_WIDTH on Zen 5
    (`full_width_avx512_amd`), ONEDNN_MIN_DEPTH elsewhere."""
    return ONEDNN_MIN_DEPTH_FULL_WIDTH if full_width_avx512_amd() else ONEDNN_MIN_DEPTH


def resolve_cpu_matmul(choice: str) -> str:
    """"aten" (torch's default: MKL) or "onednn" for the engine's --cpu-matmul `choice`: auto takes
    oneDNN on AMD CPUs (where MKL runs its AVX2 path) when torch has it; onednn without it is the
    user's error (UserError)."""
    if choice == "aten" or (choice == "auto" and (cpu_vendor() != "AuthenticAMD" or not onednn_available())):
        return "aten"
    if choice not in ("auto", "onednn"):
        raise ValueError(f"cpu_matmul must be auto, aten or onednn, got {choice!r}")
    if not onednn_available():
        raise UserError("--cpu-matmul onednn: this torch build has no oneDNN (mkldnn) linear op; use aten or auto")
    return "onednn"


def cpu_matmul_line() -> str:
    """What --cpu-matmul auto runs float32 CPU linears with here, and why (engine/backends/cpu/matmul.py)."""
    library = {"onednn": "oneDNN, decode steps over packed weights",
               "aten": "torch's matmul (MKL)"}[resolve_cpu_matmul("auto")]
    return (f"--cpu-matmul auto: {library} (CPU vendor {cpu_vendor() or 'unknown'}, "
            f"oneDNN {'available' if onednn_available() else 'not in this torch'})")


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ weight[out, in]^T (+ bias) by oneDNN; weight may be a transposed view."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDnnLinear(torch.autograd.Function):
    """F.linear with the forward and the input gradient through oneDNN, the weight gradient as
    `weight_grad` takes it (MKL, or oneDNN on Zen 5)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        return _onednn_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        return _linear_grads(ctx, grad)


@cache
def amd_avx512() -> bool:
    """An AMD CPU with AVX-512 (Zen 4 on; /proc/cpuinfo's avx512f flag), the CPUs whose linears'
    weight gradients take oneDNN (`onednn_weight_grad`)."""
    return cpu_vendor() == "AuthenticAMD" and "avx512f" in cpuinfo_field("flags").split()


@cache
def onednn_weight_grad() -> bool:
    """Whether a linear's weight gradient takes oneDNN as well (`weight_grad`: `tn_weight_grad` up to
    TN_MAX_WIDTH features, else oneDNN over a transposed operand): on AMD CPUs with AVX-512
    (`amd_avx512`). Measured with scripts/bench_matmul.py on a 2-core AMD EPYC Zen 5: MKL 167-213
    GFLOP/s, oneDNN over the transposed operand 1.35-2.10x that at the tiny Llama's shapes (4096
    rows) and 1.31-2.02x at SmolLM2-135M's (1024 rows). On a 2-core Zen 4 EPYC (AVX-512 in two
    halves; oneDNN without the transpose had been 0.71-1.01x MKL there): tn 168-180 GFLOP/s and the
    transposed operand 152-183 against MKL's 141-157 at the tiny Llama's shapes; a training step
    (forward + backward, alternated, medians) of the tiny Llama on 32 x 320 tokens 1325 -> 1279 ms,
    of SmolLM2-135M on 8 x 96 4433 -> 3939 ms. Without AVX-512 (Zen 3 and before, unmeasured) MKL.
    Decided by the CPU, not timed at start-up: every rank and a resumed run take the same path."""
    return amd_avx512()


def weight_grad(grad_rows: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """dY^T X [out, in], the weight gradient of a linear from its output gradient's rows dY [n, out]
    and its input's rows X [n, in] (both contiguous): through MKL, or where `onednn_weight_grad`
    says so (and from ONEDNN_MIN_ROWS rows) through `tn_weight_grad` (narrow linears) or
    `onednn_weight_grad_transposed`."""
    if not _weight_grad_on_onednn(rows.shape[0]):
        return grad_rows.t() @ rows
    if _tn_takes(grad_rows, rows):
        return panel_gemm_op().tn_weight_grad(grad_rows, rows)
    return onednn_weight_grad_transposed(grad_rows, rows)


TN_MAX_WIDTH = 256
"""Widest out or in feature count whose weight gradient (where it takes oneDNN: `weight_grad`) runs
`rlhf_cpu_decode.tn_weight_grad` instead: dY^T X straight from the rows of dY and X (register tiles
of the product over chunks of rows that stay in L2), where oneDNN needs one of them transposed
first, a pass whose share is largest where the GEMM is narrow. Measured on a 2-core Zen 5 EPYC at
4096 rows against the transposing path: 256 -> 256 1.10x (scripts/bench_matmul.py, interleaved
medians) and 1.26-1.30x (back-to-back calls), 256 -> 98 1.10x, 64 x 256 1.36x; 256 -> 688 1.02x,
688 -> 256 0.94x, 384 x 384 0.95-0.99x, 512 x 512 0.98x: so only up to 256. A tiny-Llama training
step (32 x 128 tokens): 226-231 -> 224-229 ms (median of 20 alternated)."""


def _tn_takes(grad_rows: torch.Tensor, rows: torch.Tensor) -> bool:
    """tn_weight_grad computes dY^T X here: both widths at most TN_MAX_WIDTH, in a multiple of 16,
    plain float32 rows, on a CPU whose AVX-512 kernels run (`panel_gemm_op`)."""
    return (max(grad_rows.shape[1], rows.shape[1]) <= TN_MAX_WIDTH and rows.shape[1] % 16 == 0
            and _plain_cpu_float32(grad_rows, rows) and panel_gemm_op() is not None)


def _weight_grad_on_onednn(rows: int) -> bool:
    """Whether weight gradients over `rows` rows take oneDNN (`onednn_weight_grad`, from ONEDNN_MIN_ROWS)."""
    return onednn_weight_grad() and rows >= ONEDNN_MIN_ROWS


def _input_grad(grad_rows: torch.Tensor, weight: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """dY @ W [n, in] (plus `into`, added into it in place): through oneDNN where
    its depth (out features) is at least `onednn_min_depth`, else torch's matmul."""
    onednn = weight.shape[0] >= onednn_min_depth()
    if into is None:
        return _onednn_linear(grad_rows, weight.t(), None) if onednn else grad_rows @ weight
    if onednn:  # not in oneDNN's epilogue add (binary post-op): slower, see _OneDnnLinearAdd
        return into.add_(_onednn_linear(grad_rows, weight.t(), None))
    return into.addmm_(grad_rows, weight)


TRANSPOSED_INPUT_MAX_WIDTH = 512
"""Widest input (in features) whose weight gradient on oneDNN transposes the input X rather than
the output gradient dY (`transposes_input`, where dY is also at least twice as wide). Measured on a
2-core Zen 5 EPYC (medians of 21 calls, each path's best of 3), rows x out x in, transposing dY
against transposing X: 4096 x 688 x 256 1.23x slower, 4096 x 1376 x 512 1.16x, 1024 x 1376 x 512
1.13x, 4096 x 1024 x 256 1.17x (so X up to 512); but from 576 features in dY's transpose was the
faster: 4096 x 1536 x 576 0.83x, 2048 x 1536 x 576 0.82x, 688 x 1536 x 576 0.96x, 1024 x 4864 x
896 0.90x, and a 49152-token vocabulary's head (SmolLM2-135M, 264 rows) 0.81x (44.1 -> 35.7 ms):
there the [in, out] product the X path transposes back outweighs the copy it saves. With X's
transpose shared by two gradients (`shared_input_grads`, gate and up): 2048 / 4096 x 1536 x 576
0.85x, 4096 x 688 x 256 1.23x."""


def transposes_input(out_features: int, in_features: int) -> bool:
    """Whether oneDNN's weight gradient dY^T X transposes X (then the [in, out] product back) rather
    than dY: dY at least twice as wide as X, and X at most TRANSPOSED_INPUT_MAX_WIDTH wide."""
    return out_features >= 2 * in_features and in_features <= TRANSPOSED_INPUT_MAX_WIDTH


def onednn_weight_grad_transposed(grad_rows: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """dY^T X through oneDNN, whose kernels read a strided source (dY^T seen transposed) at about
    half their rate: dY is transposed first (engine/backends/cpu/layer_op.py's register-tiled transpose) so that
    oneDNN's source is contiguous, or X where `transposes_input` says so (a narrow X under a dY at
    least twice as wide: the cheaper copy; then the [in, out] product is transposed back)."""
    if transposes_input(grad_rows.shape[1], rows.shape[1]):
        return transposed(_onednn_linear(transposed(rows), grad_rows.t(), None))
    return _onednn_linear(transposed(grad_rows), rows.t(), None)


def _linear_grads(ctx: torch.autograd.function.FunctionCtx,
                  grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The input, weight and bias gradients of x @ weight^T + bias (ctx saved x's rows and the
    weight): the input gradient through oneDNN where its depth (out features) is enough, the
    weight gradient as `weight_grad` takes it."""
    rows, weight = ctx.saved_tensors
    grad_rows = grad.reshape(-1, grad.shape[-1]).contiguous()
    grad_x = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = _input_grad(grad_rows, weight).view(*grad.shape[:-1], weight.shape[1])
    if ctx.needs_input_grad[1]:
        grad_weight = weight_grad(grad_rows, rows)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad_rows.sum(0)
    return grad_x, grad_weight, grad_bias


class _OneDnnLinearAdd(torch.autograd.Function):
    """x @ weight^T (+ bias) + residual (the residual stream's add of a decoder layer's output and
    down projections), the add in place on the product's fresh output; the residual's gradient is
    the output's, as the add's would be, with no pass of autograd's own. Not in oneDNN's epilogue
    (its binary post-op): that ran the GEMM slower than the product and the add apart, measured in
    the tiny Llama's forward (4096 rows, 256 -> 256: 343 against 477 GFLOP/s; a 32 x 128-token
    forward 80.5 -> 76.6 ms, a training step 225.5 -> 223.2 ms) and the same at SmolLM2-135M's shapes."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        return _onednn_linear(rows, weight, bias).view(residual.shape).add_(residual)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return *_linear_grads(ctx, grad), grad


class _OneDnnSharedInputLinears(torch.autograd.Function):
    """Linears of one input (q, k and v; gate and up): each forward as `_OneDnnLinear`'s; in the
    backward the input gradients accumulate in place into one tensor (no sum of autograd's own per
    extra linear) and, where `weight_grad` takes oneDNN, the input's rows are transposed once for all
    the weight gradients (X^T dY, each [in, out] product transposed back: the same dot products as
    transposing each dY, one transpose of X instead of one of every dY)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor,
                *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        weights, biases = params[0::2], params[1::2]
        ctx.save_for_backward(rows, *weights)
        ctx.has_bias = [bias is not None for bias in biases]
        return tuple(_onednn_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
                     for weight, bias in zip(weights, biases))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, *weights = ctx.saved_tensors
        grad_rows = [grad.reshape(-1, grad.shape[-1]).contiguous() for grad in grads]
        wanted = [ctx.needs_input_grad[1 + 2 * i] for i in range(len(weights))]
        grad_x, weight_grads = shared_input_grads(rows, weights, grad_rows, ctx.needs_input_grad[0], wanted)
        if grad_x is not None:
            grad_x = grad_x.view(*grads[0].shape[:-1], rows.shape[1])
        params: list[torch.Tensor | None] = []
        for i, (grad, weight_grad_i) in enumerate(zip(grad_rows, weight_grads)):
            params.append(weight_grad_i)
            params.append(grad.sum(0) if ctx.has_bias[i] and ctx.needs_input_grad[2 + 2 * i] else None)
        return grad_x, *params


def shared_input_grads(rows: torch.Tensor, weights: list[torch.Tensor] | tuple[torch.Tensor, ...],
                       grad_rows: list[torch.Tensor] | tuple[torch.Tensor, ...], input_grad: bool,
                       wanted: list[bool]) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """The gradients of linears of one input's rows [n, in] (no biases) from their outputs'
    gradients [n, out_i] (contiguous): the input's (where `input_grad`: the products accumulated in
    place into one tensor) and each weight's where `wanted` (where `weight_grad` takes oneDNN: X^T dY
    transposed back, X transposed once for every gradient `transposes_input` sends that way, else
    over its own dY transposed; dY^T X straight from the rows where it takes `tn_weight_grad`), as
    `_OneDnnSharedInputLinears` runs them."""
    grad_x = None
    if input_grad:
        for grad, weight in zip(grad_rows, weights):
            grad_x = _input_grad(grad, weight, grad_x)
    on_onednn = _weight_grad_on_onednn(rows.shape[0])
    tn = [on_onednn and want and _tn_takes(grad, rows) for grad, want in zip(grad_rows, wanted)]
    over_x = [on_onednn and want and not t and transposes_input(grad.shape[1], rows.shape[1])
              for grad, want, t in zip(grad_rows, wanted, tn)]
    rows_t = transposed(rows) if any(over_x) else None  # once, for every weight gradient that takes it
    weight_grads: list[torch.Tensor | None] = []
    for grad, want, straight, x_side in zip(grad_rows, wanted, tn, over_x):
        if not want:
            weight_grads.append(None)
        elif straight:
            weight_grads.append(panel_gemm_op().tn_weight_grad(grad, rows))
        elif not on_onednn:
            weight_grads.append(grad.t() @ rows)
        elif x_side:
            weight_grads.append(transposed(_onednn_linear(rows_t, grad.t(), None)))
        else:
            weight_grads.append(onednn_weight_grad_transposed(grad, rows))  # over its own dY transposed
    return grad_x, weight_grads


def shared_input_linears(x: torch.Tensor, modules: tuple[nn.Module, ...]) -> list[torch.Tensor]:
    """[module(x) for module in modules], through `_OneDnnSharedInputLinears` where autograd records
    and oneDNN takes x for every one of them (OneDnnLinear modules without hooks of their own):
    one transpose of x and no separate gradient adds in the backward. Forwards that autograd does
    not record gain nothing from it and call the modules."""
    params = [p for module in modules for p in (getattr(module, "weight", None), getattr(module, "bias", None))]
    if (len(modules) > 1 and torch.is_grad_enabled() and any(p is not None and p.requires_grad for p in (x, *params))
            and all(isinstance(m, OneDnnLinearMixin) and not (m._forward_hooks or m._forward_pre_hooks)
                    and _onednn_takes(x, m.weight, m.bias) for m in modules)):
        return list(_OneDnnSharedInputLinears.apply(x, *params))
    return [module(x) for module in modules]


def _dense_matrix(weight: torch.Tensor) -> bool:
    """2-D and row- or column-major without gaps: oneDNN's JIT kernels take these; a column slice of
    a wider matrix (strides (1, wider)) sends it to its reference code, ~1000x slower."""
    return weight.dim() == 2 and (weight.is_contiguous() or weight.t().is_contiguous())


def _plain_cpu_float32(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32
                             and type(t) in (torch.Tensor, nn.Parameter)) for t in tensors)


def _onednn_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """oneDNN runs x @ weight^T (+ bias): enough rows and depth, a dense weight, plain float32 CPU tensors."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return (rows >= ONEDNN_MIN_ROWS and _dense_matrix(weight) and weight.shape[1] >= onednn_min_depth()
            and (bias is None or bias.is_contiguous()) and _plain_cpu_float32(x, weight, bias))


def linear_add(x: torch.Tensor, linear_module: nn.Module, residual: torch.Tensor) -> torch.Tensor:
    """linear_module(x) + residual, through `_OneDnnLinearAdd` (the add in place on the product's
    output, the residual's gradient passed through) where the module is a OneDnnLinear that oneDNN
    takes x for and the residual is a plain float32 CPU tensor of the output's shape; the same sum
    either way."""
    weight, bias = getattr(linear_module, "weight", None), getattr(linear_module, "bias", None)
    if (isinstance(linear_module, OneDnnLinearMixin) and _onednn_takes(x, weight, bias)
            and _plain_cpu_float32(residual) and residual.shape == (*x.shape[:-1], weight.shape[0])):
        return _OneDnnLinearAdd.apply(x, weight, bias, residual)
    return residual + linear_module(x)


def swiglu_linears(x: torch.Tensor, gate: nn.Module, up: nn.Module) -> torch.Tensor | None:
    """silu(gate(x)) * up(x) through `swiglu_in_epilogue` where both are OneDnnLinear modules;
    None otherwise (and where autograd records: their parameters or x need gradients)."""
    if not (isinstance(gate, OneDnnLinearMixin) and isinstance(up, OneDnnLinearMixin)):
        return None
    return swiglu_in_epilogue(x, gate.weight, gate.bias, up.weight, up.bias)


def packed_swiglu_weights(x: torch.Tensor, gate: nn.Module, up: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The gate and up weights where an MLP's silu(gate(x)) * up(x) with autograd can run the packed
    SwiGLU GEMM (`panel_gemm_op`): OneDnnLinear modules without biases or hooks of their own that
    oneDNN takes x for (so the backward's GEMMs run as `shared_input_grads` runs them); None otherwise."""
    if panel_gemm_op() is None or not all(
            isinstance(m, OneDnnLinearMixin) and not (m._forward_hooks or m._forward_pre_hooks)
            and getattr(m, "bias", None) is None and _onednn_takes(x, m.weight, None) for m in (gate, up)):
        return None
    if gate.weight.shape != up.weight.shape:
        return None
    return gate.weight, up.weight


def swiglu_in_epilogue(x: torch.Tensor, gate_weight: torch.Tensor, gate_bias: torch.Tensor | None,
                       up_weight: torch.Tensor, up_bias: torch.Tensor | None) -> torch.Tensor | None:
    """silu(x @ gate_weight^T + gate_bias) * (x @ up_weight^T + up_bias) with the activation in a
    GEMM's epilogue, for forwards autograd does not record (reward, reference and value scoring, a
    rollout's prefill) where oneDNN takes both products; None otherwise.

    Without biases, on AVX-512 CPUs: `rlhf_cpu_decode.panel_swiglu` over the two weights packed
    side by side (`panel_gemm_op`), each register tile of the gate product and the same tile of
    the up product computed together and combined before they are stored, so neither [rows, ffn]
    product is written or read back (tiny Llama, 4096 x 256 -> 688: 6.0 ms against 7.0 for the
    oneDNN epilogue below; the packing is ~0.06 ms a call, a 1/100 of the GEMMs). SiLU as torch
    writes it, x / (1 + exp(-x)) (exp to ~1 ulp). Otherwise the gate product in oneDNN with swish
    in its epilogue (which rounds differently from torch's silu, ~1 ulp) and the up product's
    output multiplied in place into it (the product in oneDNN's binary post-op ran the GEMM slower
    than the two apart; see _OneDnnLinearAdd)."""
    rows = x.reshape(-1, x.shape[-1])
    tensors = (x, gate_weight, gate_bias, up_weight, up_bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return None  # no backward through the epilogues: the fused SwiGLU's has what it needs
    if not (_onednn_takes(rows, gate_weight, gate_bias) and _onednn_takes(rows, up_weight, up_bias)):
        return None
    rows = rows.contiguous()
    shape = (*x.shape[:-1], up_weight.shape[0])
    op = panel_gemm_op() if gate_bias is None and up_bias is None else None
    if op is not None:
        panels = op.pack_swiglu_panels(gate_weight.t(), up_weight.t())
        return op.panel_swiglu(rows, panels, gate_weight.shape[0]).view(shape)
    activated = torch.ops.mkldnn._linear_pointwise(rows, gate_weight, gate_bias, "swish", [], "")
    return activated.mul_(_onednn_linear(rows, up_weight, up_bias)).view(shape)


@cache
def panel_gemm_op() -> ModuleType | None:
    """The `rlhf_cpu_decode` op where its AVX-512 kernels run here: its SwiGLU GEMM and its
    weight-gradient GEMM (`tn_weight_grad`), the ones measured faster than oneDNN's where they are
    used (on AVX2 its blocks are smaller and they are not); None otherwise."""
    op = load_cpu_decode_op()
    return op if op is not None and "avx512" in op.supported_isas() else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through oneDNN for float32 plain tensors on the CPU with at least `ONEDNN_MIN_ROWS`
    rows and `onednn_min_depth` input features (its input gradient: output features), the weight
    stored row- or column-major."""
    if _onednn_takes(x, weight, bias):
        return _OneDnnLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class OneDnnLinearMixin(nn.Module):
    weight: torch.Tensor
    bias: torch.Tensor | None
    computes_as_plain_linear = True  # what F.linear computes (engine/fast_decode.py's computes_as_linear)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's argument name
        return linear(input, self.weight, self.bias)


_ONEDNN_CLASSES: dict[type, type] = {}


def _onednn_class(cls: type) -> type:
    if cls not in _ONEDNN_CLASSES:
        _ONEDNN_CLASSES[cls] = type(f"OneDnn{cls.__name__}", (OneDnnLinearMixin, cls), {"__module__": __name__})
    return _ONEDNN_CLASSES[cls]


def use_onednn_linears(model: nn.Module) -> int:
    """Swap every plain nn.Linear in `model` for its OneDnnLinear subclass, in place; returns how many."""
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = _onednn_class(nn.Linear)
            swapped += 1
    return swapped


def is_plain_linear(module: nn.Module) -> bool:
    """An nn.Linear as torch defines it, or swapped by `use_onednn_linears` (the same computation):
    not a LoRA, quantized or other subclass."""
    return type(module) is nn.Linear or type(module) is _ONEDNN_CLASSES.get(nn.Linear)


def uses_onednn_linears(model: nn.Module) -> bool:
    """Whether `use_onednn_linears` swapped any of `model`'s linears (the engine's --cpu-matmul)."""
    return any(isinstance(module, OneDnnLinearMixin) for module in model.modules())
