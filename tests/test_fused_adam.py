"""FusedAdamW and the fused Adam ops against torch.optim.AdamW / torch.optim.Adam.

CPU tests run in the default suite (the op is JIT-built once, cached); CUDA tests carry the gpu
marker. The FSDP2 test runs 2 gloo ranks on the CPU.
"""

from __future__ import annotations

import copy
import logging
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rlhf.engine.distributed import exit_rank
from rlhf.engine.fused_adam import CPU_OP, CUDA_OP, FusedAdamW, adam_reference_step, fused_adam_available, total_norm
from rlhf.engine.ops import load_op

BIG = 1_000_007  # 1M + 7: many chunks plus a ragged vector tail
MIXED = [1, 7, 1023, 65_536 + 3]  # the last one crosses a CPU chunk boundary
STATE_TOL = dict(rtol=1e-5, atol=1e-6)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cpu_op():
    op = load_op(CPU_OP)
    if op is None:
        pytest.skip("fused_adam_cpu cannot be built here (no C++ compiler?)")
    return op


def counters(n: int, value: float = 0.0) -> list[torch.Tensor]:
    """Per-param step counters as FusedAdamW keeps them; the ops increment them."""
    return [torch.tensor(value) for _ in range(n)]


def torch_adam(params, adam_w_mode: bool, **kwargs) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    return cls(params, foreach=False, **kwargs)


def leaves(sizes: list[int], dtype=torch.float32, device="cpu", seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(device=device, dtype=dtype).requires_grad_() for n in sizes]


def twins(params: list[torch.Tensor], dtype=None) -> list[torch.Tensor]:
    return [p.detach().to(dtype or p.dtype).clone().requires_grad_() for p in params]


def set_grads(groups: list[list[torch.Tensor]], gen: torch.Generator) -> None:
    """The same random gradient (drawn in the first list's dtype) for the i-th tensor of every list."""
    for tensors in zip(*groups):
        g = torch.randn(tensors[0].shape, generator=gen).to(tensors[0].dtype).to(tensors[0].device)
        for t in tensors:
            t.grad = g.to(t.dtype)


def assert_states_close(ours: FusedAdamW, ref: torch.optim.Optimizer, our_params, ref_params) -> None:
    for p, q in zip(our_params, ref_params):
        assert ours.state[p]["step"].item() == ref.state[q]["step"].item()
        for key in ("exp_avg", "exp_avg_sq"):
            assert ours.state[p][key].dtype == torch.float32
            torch.testing.assert_close(ours.state[p][key], ref.state[q][key].float(), **STATE_TOL)


# ------------------------------------------------------------------ fp32 parity with torch


@pytest.mark.parametrize("implementation", ["fused", "reference"])
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fp32_matches_torch(implementation: str, adam_w_mode: bool, weight_decay: float) -> None:
    if implementation == "fused":
        cpu_op()
    ref_params = leaves(MIXED)
    our_params = twins(ref_params)
    hp = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay)
    ref = torch_adam(ref_params, adam_w_mode, **hp)
    ours = FusedAdamW(our_params, adam_w_mode=adam_w_mode, implementation=implementation, **hp)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        set_grads([ref_params, our_params], gen)
        ref.step()
        ours.step()
    for p, q in zip(our_params, ref_params):
        torch.testing.assert_close(p, q, **STATE_TOL)
    assert_states_close(ours, ref, our_params, ref_params)


def test_param_groups_and_lr_scheduler_match_torch() -> None:
    cpu_op()
    ref_params = leaves([1023, 7, 1, 300])
    our_params = twins(ref_params)

    def groups(ps):
        return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0, "lr": 3e-3}]

    ref = torch.optim.AdamW(groups(ref_params), lr=1e-2, foreach=False)
    ours = FusedAdamW(groups(our_params), lr=1e-2)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5**s) for o in (ref, ours)]
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        set_grads([ref_params, our_params], gen)
        ref.step()
        ours.step()
        for s in schedules:
            s.step()
    assert ours.param_groups[1]["lr"] == pytest.approx(3e-3 * 0.5**3)
    for p, q in zip(our_params, ref_params):
        torch.testing.assert_close(p, q, **STATE_TOL)


def test_large_tensor_every_isa_matches_torch() -> None:
    op = cpu_op()
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(BIG, generator=gen)
    grads = [torch.randn(BIG, generator=gen) for _ in range(2)]
    ref_p = start.clone().requires_grad_()
    ref = torch.optim.AdamW([ref_p], lr=1e-3, weight_decay=0.1, foreach=False)
    for g in grads:
        ref_p.grad = g
        ref.step()
    for isa in op.supported_isas():
        p, m, v = start.clone(), torch.zeros(BIG), torch.zeros(BIG)
        steps = counters(1)
        for g in grads:
            op.adam_step([p], [g], [m], [v], [], [], steps, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.1, adam_w_mode=True, isa=isa)
        assert steps[0].item() == len(grads)
        torch.testing.assert_close(p, ref_p.detach(), **STATE_TOL, msg=lambda m, isa=isa: f"{isa}: {m}")
        torch.testing.assert_close(v, ref.state[ref_p]["exp_avg_sq"], **STATE_TOL)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_every_isa_agrees_with_reference_on_ragged_sizes(adam_w_mode: bool) -> None:
    op = cpu_op()
    sizes = [1, 7, 8, 15, 17, 1023]  # below, at and around the 8- and 16-lane vector widths
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) for n in sizes]
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, adam_w_mode=adam_w_mode)
    expected = [p.clone() for p in params]
    exp_m = [torch.full((n,), 0.1) for n in sizes]
    exp_v = [torch.full((n,), 0.2) for n in sizes]
    start_steps = [2.0, 0.0, 5.0, 2.0, 1.0, 9.0]  # one group, params at different steps
    ref_steps = [torch.tensor(s) for s in start_steps]
    adam_reference_step(expected, grads, exp_m, exp_v, [], [], ref_steps, **hp)
    for isa in op.supported_isas():
        p = [t.clone() for t in params]
        m = [torch.full((n,), 0.1) for n in sizes]
        v = [torch.full((n,), 0.2) for n in sizes]
        steps = [torch.tensor(s) for s in start_steps]
        op.adam_step(p, grads, m, v, [], [], steps, isa=isa, **hp)
        assert [s.item() for s in steps] == [s.item() for s in ref_steps] == [s + 1 for s in start_steps]
        for got, want in zip(p + m + v, expected + exp_m + exp_v):
            torch.testing.assert_close(got, want, **STATE_TOL)


@pytest.mark.parametrize("implementation", ["fused", "reference"])
def test_grad_scale_is_clippings_product_and_the_step_says_whether_params_stay_finite(implementation: str) -> None:
    """FusedAdamW.step(grad_scale=c) steps as torch's AdamW after clipping's in-place product
    (grads *= c), on every kernel set: the kernels multiply as they read, the reference path first
    (in place, as clipping does). The CPU kernels report whether every updated value is finite
    (`step_finite`), a NaN or inf in the vector body or in the scalar tail included; the reference
    path reports None (unknown). A grad_scale that is NaN, inf or negative is refused."""
    gen = torch.Generator().manual_seed(8)
    params = leaves(MIXED, seed=8)
    ref_params = twins(params)
    ours = FusedAdamW(params, lr=1e-2, weight_decay=0.1, implementation=implementation)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, foreach=False)
    for scale in (0.37, 1.0, 0.05):
        set_grads([params, ref_params], gen)
        for q in ref_params:  # set_grads shares one tensor between the twins
            q.grad = q.grad * scale
        ours.step(grad_scale=scale)
        ref.step()
        assert ours.step_finite is (True if implementation == "fused" else None)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), **STATE_TOL)
    assert_states_close(ours, ref, params, ref_params)
    with pytest.raises(ValueError, match="grad_scale"):
        ours.step(grad_scale=float("nan"))
    with pytest.raises(ValueError, match="grad_scale"):
        ours.step(grad_scale=-1.0)

    op = cpu_op()
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adam_w_mode=True)
    for isa in op.supported_isas():
        for bad_index in (None, 3, 16):  # the vector body, the tail past 16 lanes
            p = [torch.randn(17, generator=gen), torch.randn(40, generator=gen)]
            g = [torch.randn(17, generator=gen), torch.randn(40, generator=gen)]
            if bad_index is not None:
                g[0][bad_index] = float("nan") if bad_index == 3 else float("inf")
            finite = op.adam_step(p, g, [torch.zeros(17), torch.zeros(40)], [torch.zeros(17), torch.zeros(40)],
                                  [], [], counters(2), isa=isa, grad_scale=0.5, **hp)
            assert finite is (bad_index is None), (isa, bad_index)
    z = torch.zeros(3)
    with pytest.raises(RuntimeError, match="grad_scale"):
        op.adam_step([z.clone()], [z.clone()], [z.clone()], [z.clone()], [], [], counters(1), grad_scale=float("inf"),
                     **hp)


def test_total_norm_is_the_norm_of_every_value_on_every_kernel_set() -> None:
    """total_norm (a total gradient norm in one pass of the CPU op) is the L2 norm of all the values
    together to float32 rounding (chunks crossing 2^16 values, vector tails, bf16 tensors), on
    every kernel set; NaN and inf propagate (the step is then skipped as an overflow); tensors the
    op does not take (non-contiguous) go to torch's get_total_norm."""
    op = cpu_op()
    gen = torch.Generator().manual_seed(9)
    tensors = [torch.randn(n, generator=gen) for n in (*MIXED, BIG)]
    exact = torch.cat(tensors).double().norm().item()
    got = total_norm(tensors)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(got.item() - exact) <= 1e-6 * exact
    for isa in op.supported_isas():
        assert abs(op.l2_norm(tensors, isa=isa) - exact) <= 2e-6 * exact, isa  # float sums within a chunk
    halves = [t.bfloat16() for t in tensors[:4]]
    assert abs(total_norm(halves).item() - torch.cat(halves).double().norm().item()) <= 1e-6 * exact
    strided = [torch.randn(8, 6, generator=gen).t()]
    torch.testing.assert_close(total_norm(strided), torch.nn.utils.get_total_norm(strided))
    for bad in (float("nan"), float("inf")):
        poisoned = [t.clone() for t in tensors[:3]]
        poisoned[2][5] = bad
        assert not torch.isfinite(total_norm(poisoned))
    with pytest.raises(RuntimeError, match="l2_norm"):
        op.l2_norm([torch.zeros(3, dtype=torch.float64)])


# ------------------------------------------------------------------ bf16 params, masters, bf16 copies


@pytest.mark.parametrize("implementation", ["fused", "reference"])
@pytest.mark.parametrize("master_weights", [False, True])
def test_bf16_params_with_fp32_state(implementation: str, master_weights: bool) -> None:
    """Reference: torch AdamW on an fp32 copy; without a master the copy is rounded to bf16 each step."""
    if implementation == "fused":
        cpu_op()
    our_params = leaves(MIXED, dtype=torch.bfloat16)
    ref_params = twins(our_params, dtype=torch.float32)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, foreach=False)
    ours = FusedAdamW(our_params, lr=1e-2, weight_decay=0.1, master_weights=master_weights,
                      implementation=implementation)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        set_grads([our_params, ref_params], gen)
        ref.step()
        ours.step()
        if not master_weights:
            with torch.no_grad():
                for q in ref_params:
                    q.copy_(q.bfloat16().float())
    assert_states_close(ours, ref, our_params, ref_params)
    for p, q in zip(our_params, ref_params):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p, q.detach().bfloat16())
        if master_weights:
            master = ours.state[p]["master_param"]
            assert master.dtype == torch.float32
            torch.testing.assert_close(master, q.detach(), **STATE_TOL)
            assert torch.equal(p.detach(), master.bfloat16())
        else:
            assert "master_param" not in ours.state[p]


def test_low_precision_copy_is_the_rounded_update() -> None:
    cpu_op()
    params = leaves(MIXED)
    ours = FusedAdamW(params, lr=1e-2, low_precision_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(6)
    for _ in range(2):
        set_grads([params], gen)
        ours.step()
        for p in params:
            copy_ = ours.low_precision_copy(p)
            assert copy_ is not None and copy_.dtype == torch.bfloat16
            assert torch.equal(copy_, p.detach().bfloat16())


def test_bf16_rounding_is_bit_exact_with_torch_on_every_isa() -> None:
    """With lr = 0 the update leaves w unchanged, so the bf16 outputs must equal torch's rounding."""
    op = cpu_op()
    one = 1.0
    ties = [one + 2**-8, one + 3 * 2**-8, -(one + 2**-8), 2**-130, 3.0e38]  # halfway cases, denormal, overflow
    specials = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0]
    w = torch.tensor(ties + specials + torch.randn(9, generator=torch.Generator().manual_seed(7)).tolist())
    for isa in op.supported_isas():
        p, lp = w.clone(), torch.empty(w.numel(), dtype=torch.bfloat16)
        zeros = [torch.zeros_like(w) for _ in range(3)]
        op.adam_step([p], [zeros[0]], [zeros[1]], [zeros[2]], [], [lp], counters(1), lr=0.0, beta1=0.9,
                     beta2=0.999, eps=1e-8, weight_decay=0.0, adam_w_mode=True, isa=isa)
        assert torch.equal(p.view(torch.int32), w.view(torch.int32)), isa
        want = w.bfloat16()
        # NaN payloads differ between torch's own scalar and vector casts; any NaN will do.
        assert torch.equal(lp.isnan(), want.isnan()), isa
        finite = ~want.isnan()
        assert torch.equal(lp[finite].view(torch.int16), want[finite].view(torch.int16)), isa


# ------------------------------------------------------------------ state dicts and fallbacks


def test_state_dict_round_trip_keeps_fp32_state_for_bf16_params() -> None:
    cpu_op()
    a_params = leaves([1023, 7], dtype=torch.bfloat16)
    b_params = twins(a_params)
    a = FusedAdamW(a_params, lr=1e-2, master_weights=True)
    gen = torch.Generator().manual_seed(8)
    for _ in range(2):
        set_grads([a_params], gen)
        a.step()
    with torch.no_grad():
        for p, q in zip(a_params, b_params):
            q.copy_(p)
    b = FusedAdamW(b_params, lr=5.0, master_weights=True)  # lr comes from the state dict
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for q in b_params:
        assert {k: b.state[q][k].dtype for k in ("exp_avg", "exp_avg_sq", "master_param")} == dict.fromkeys(
            ("exp_avg", "exp_avg_sq", "master_param"), torch.float32
        )
        assert b.state[q]["step"].device.type == "cpu"
    for _ in range(2):
        set_grads([a_params, b_params], gen)
        a.step()
        b.step()
    for p, q in zip(a_params, b_params):
        assert torch.equal(p, q)
        assert torch.equal(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"])


def test_resumes_from_torch_adamw_state() -> None:
    cpu_op()
    ref_params = leaves([1023, 7])
    our_params = twins(ref_params)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(9)
    set_grads([ref_params], gen)
    ref.step()
    with torch.no_grad():
        for p, q in zip(our_params, ref_params):
            p.copy_(q)
    ours = FusedAdamW(our_params, lr=1e-2)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    for _ in range(2):
        set_grads([ref_params, our_params], gen)
        ref.step()
        ours.step()
    for p, q in zip(our_params, ref_params):
        torch.testing.assert_close(p, q, **STATE_TOL)


def test_non_contiguous_param_takes_reference_path_with_one_warning() -> None:
    cpu_op()
    base = torch.randn(5, 4)
    ref_params = [base.clone().t().requires_grad_(), torch.randn(9).requires_grad_()]
    our_params = [base.clone().t().requires_grad_(), ref_params[1].detach().clone().requires_grad_()]
    assert not our_params[0].is_contiguous()
    ref = torch.optim.AdamW(ref_params, lr=1e-2, foreach=False)
    ours = FusedAdamW(our_params, lr=1e-2)
    gen = torch.Generator().manual_seed(10)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # the rlhf logger does not propagate to pytest's caplog
    logging.getLogger("rlhf").addHandler(handler)
    try:
        for _ in range(3):
            set_grads([ref_params, our_params], gen)
            ref.step()
            ours.step()
    finally:
        logging.getLogger("rlhf").removeHandler(handler)
    assert sum("non-contiguous" in r.getMessage() for r in records) == 1
    for p, q in zip(our_params, ref_params):
        torch.testing.assert_close(p, q, **STATE_TOL)


def test_argument_checks() -> None:
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ValueError):
        FusedAdamW(p, lr=-1.0)
    with pytest.raises(ValueError):
        FusedAdamW(p, betas=(1.0, 0.9))
    with pytest.raises(ValueError):
        FusedAdamW(p, low_precision_dtype=torch.float16)
    assert not fused_adam_available("meta")
    op = cpu_op()
    assert fused_adam_available("cpu")
    z = torch.zeros(3)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adam_w_mode=True)
    steps = counters(1)
    with pytest.raises(RuntimeError, match="mismatched sizes"):
        op.adam_step([z.clone()], [z.clone()], [torch.zeros(4)], [z.clone()], [], [], steps, **hp)
    with pytest.raises(RuntimeError, match="master"):
        op.adam_step([z.clone()], [z.clone()], [z.clone()], [z.clone()], [z.clone()], [], steps, **hp)
    with pytest.raises(RuntimeError, match="isa"):
        op.adam_step([z.clone()], [z.clone()], [z.clone()], [z.clone()], [], [], steps, isa="sse9", **hp)
    with pytest.raises(RuntimeError, match="steps"):
        op.adam_step([z.clone()], [z.clone()], [z.clone()], [z.clone()], [], [], [], **hp)
    assert steps[0].item() == 0.0  # a rejected call leaves the counters alone


# ------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,master_weights", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_cuda_matches_reference(dtype: torch.dtype, master_weights: bool, adam_w_mode: bool) -> None:
    """The CUDA op against the torch reference path on the same GPU, bf16 copy included."""
    assert load_op(CUDA_OP) is not None, "fused_adam_cuda did not build on a CUDA machine"
    sizes = MIXED + [BIG] + [3] * 40  # > 36 tensors: several launches
    ours_p = leaves(sizes, dtype=dtype, device="cuda")
    ref_p = twins(ours_p)
    kw = dict(lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode, master_weights=master_weights)
    ours = FusedAdamW(ours_p, implementation="fused", low_precision_dtype=torch.bfloat16, **kw)
    ref = FusedAdamW(ref_p, implementation="reference", low_precision_dtype=torch.bfloat16, **kw)
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        set_grads([ours_p, ref_p], gen)
        ours.step()
        ref.step()
    for p, q in zip(ours_p, ref_p):
        if dtype == torch.float32 or master_weights:
            torch.testing.assert_close(p, q, **(STATE_TOL if dtype == torch.float32 else {}))
            torch.testing.assert_close(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], **STATE_TOL)
        else:
            _assert_close_up_to_bf16_rounding_flips(p, q, travel=3 * kw["lr"])
        assert torch.equal(ours.low_precision_copy(p), (ours.state[p].get("master_param", p)).detach().bfloat16())


def _assert_close_up_to_bf16_rounding_flips(ours: torch.Tensor, ref: torch.Tensor, travel: float) -> None:
    """bf16 params stepped in place by two correct fp32 updates (different operation order, FMA)
    round the other way where the fp32 result lies on a bf16 rounding boundary: a rare element
    ends one bf16 step apart, at most 2^-7 of the magnitude it had along the way (|value| +
    the distance the steps moved it). A wrong update is off on most elements, by about lr."""
    ours, ref = ours.detach().float(), ref.detach().float()
    diff = (ours - ref).abs()
    one_step = 2.0**-7 * (torch.maximum(ours.abs(), ref.abs()) + travel)
    assert bool((diff <= one_step).all()), (diff - one_step).max()
    flipped = (diff > 1e-5 + 1.6e-2 * ref.abs()).sum().item()
    assert flipped <= max(2, ref.numel() // 10_000), f"{flipped} of {ref.numel()} elements differ"


@pytest.mark.gpu
@needs_cuda
def test_cuda_unaligned_views_and_many_chunks() -> None:
    """FSDP shards are views at odd offsets (scalar path); one tensor spans > 320 chunks (relaunch)."""
    op = load_op(CUDA_OP)
    assert op is not None
    sizes = [1023, 7, 320 * 65_536 + 5]
    gen = torch.Generator(device="cuda").manual_seed(12)

    def views(offset: int) -> list[torch.Tensor]:
        flat = torch.randn(offset + sum(sizes), device="cuda", generator=gen)
        return list(torch.split(flat[offset:], sizes))

    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adam_w_mode=True)
    for offset in (0, 1):
        p, g, m = views(offset), views(offset), views(offset)
        v = [t.abs() for t in views(offset)]
        want = [[t.clone() for t in ts] for ts in (p, m, v)]
        op.adam_step(p, g, m, v, [], [], counters(len(sizes), 1.0), **hp)
        adam_reference_step(want[0], g, want[1], want[2], [], [], counters(len(sizes), 1.0), **hp)
        for got, exp in zip(p + m + v, want[0] + want[1] + want[2]):
            torch.testing.assert_close(got, exp, **STATE_TOL)


# ------------------------------------------------------------------ FSDP2, 2 gloo ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_model(mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # Odd sizes: uneven shards, and a 1-element bias that leaves rank 1 an empty shard.
    model = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp_groups(model: nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [{"params": [p for p in params if p.ndim == 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0}]


def _train(models, optims, seed: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 7, generator=gen)
        for model, optim in zip(models, optims):
            model(x).square().mean().backward()
            optim.step()
            optim.zero_grad()


def _fsdp_worker(rank: int, port: int, ckpt_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        ours_m, ref_m = _fsdp_model(mesh), _fsdp_model(mesh)
        ours = FusedAdamW(_fsdp_groups(ours_m), lr=1e-2, implementation="fused")
        ref = torch.optim.AdamW(_fsdp_groups(ref_m), lr=1e-2, foreach=False)
        _train([ours_m, ref_m], [ours, ref], seed=rank + 1, steps=3)
        for p, q in zip(ours_m.parameters(), ref_m.parameters()):
            assert isinstance(p, DTensor)
            torch.testing.assert_close(p.full_tensor(), q.full_tensor(), **STATE_TOL)

        ours_sd = get_optimizer_state_dict(ours_m, ours)
        ref_sd = get_optimizer_state_dict(ref_m, ref)
        assert ours_sd["state"].keys() == ref_sd["state"].keys()
        for fqn, st in ours_sd["state"].items():
            assert st.keys() == ref_sd["state"][fqn].keys() == {"step", "exp_avg", "exp_avg_sq"}
            for key in ("exp_avg", "exp_avg_sq"):
                assert isinstance(st[key], DTensor) and st[key].placements == ref_sd["state"][fqn][key].placements
                torch.testing.assert_close(st[key].full_tensor(), ref_sd["state"][fqn][key].full_tensor(), **STATE_TOL)
        dcp.save({"optim": ours_sd}, checkpoint_id=ckpt_dir)

        # A fresh optimizer over a copy of the trained params, resumed from the checkpoint.
        resumed_m = _fsdp_model(mesh)
        with torch.no_grad():
            for p, q in zip(resumed_m.parameters(), ours_m.parameters()):
                p.to_local().copy_(q.to_local())
        resumed = FusedAdamW(_fsdp_groups(resumed_m), lr=1.0)
        target = {"optim": get_optimizer_state_dict(resumed_m, resumed)}
        dcp.load(target, checkpoint_id=ckpt_dir)
        set_optimizer_state_dict(resumed_m, resumed, target["optim"])
        assert resumed.param_groups[0]["lr"] == 1e-2
        _train([ours_m, resumed_m], [ours, resumed], seed=rank + 10, steps=2)
        for p, q in zip(ours_m.parameters(), resumed_m.parameters()):
            assert torch.equal(p.to_local(), q.to_local())
            assert torch.equal(ours.state[p]["exp_avg"].to_local(), resumed.state[q]["exp_avg"].to_local())
        dist.barrier()  # no rank tears gloo down while its peer is still communicating
    finally:
        dist.destroy_process_group()
    exit_rank()  # this worker ran backward under FSDP2: see exit_rank for why it skips finalization


def test_fsdp2_two_ranks_match_torch_and_round_trip_dcp() -> None:
    cpu_op()  # build once here rather than in both ranks at the same time
    with tempfile.TemporaryDirectory() as ckpt_dir:
        mp.spawn(_fsdp_worker, args=(_free_port(), ckpt_dir), nprocs=2, join=True)
