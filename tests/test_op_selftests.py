"""Load-time self-tests of the csrc ops (engine/ops.py, engine/op_selftests.py).

Every registered op has a self-test; the CPU builds pass theirs, fast; each CUDA self-test is run
here on the CPU against a module wrapping the op's reference (it must pass) and one with a
deliberate error (it must fail); a wrong build loaded through `load_op` is disabled with one
warning and the torch path trains exactly as torch AdamW; verdicts are cached beside the build
and shown by `rlhf report`; RLHF_OPS_SELFTEST=0 skips the checks.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rlhf.engine.backends.registry  # noqa: F401  (registers every backend's ops with their self-tests)
import rlhf.engine.backends.cpu.decode_op
from rlhf.engine import ops
from rlhf.engine.backends.cpu.layer_op import FUSED_LAYERS_OP
from rlhf.engine.backends.cpu.selftests import cpu_decode_self_test, fused_layers_self_test
from rlhf.engine.backends.cuda.kernels import DECODE_ATTENTION_OP, SAMPLING_OP, SELECTIVE_LOG_SOFTMAX_OP
from rlhf.engine.backends.cuda.selftests import (
    decode_attention_self_test,
    sampling_self_test,
    selective_log_softmax_self_test,
)
from rlhf.engine.decode_attention import decode_attention_reference
from rlhf.engine.fused_adam import CPU_OP, CUDA_OP, FusedAdamW, adam_reference_step, fused_adam_self_test
from rlhf.engine.sampling import sample_tokens_reference
from tests.conftest import run_cli

CPU = torch.device("cpu")


def test_every_registered_op_has_a_self_test() -> None:
    names = {spec.name for spec in ops.registered_ops()}
    assert {CPU_OP, CUDA_OP, DECODE_ATTENTION_OP.name, SAMPLING_OP.name, SELECTIVE_LOG_SOFTMAX_OP.name,
            rlhf.engine.backends.cpu.decode_op.CPU_DECODE_OP.name} <= names
    self_tests = ops.self_tests()
    assert names <= set(self_tests) and all(self_tests[name] is not None for name in names), self_tests
    assert self_tests == {
        CPU_OP: fused_adam_self_test, CUDA_OP: fused_adam_self_test,
        rlhf.engine.backends.cpu.decode_op.CPU_DECODE_OP.name: cpu_decode_self_test,
        FUSED_LAYERS_OP.name: fused_layers_self_test,
        DECODE_ATTENTION_OP.name: decode_attention_self_test, SAMPLING_OP.name: sampling_self_test,
        SELECTIVE_LOG_SOFTMAX_OP.name: selective_log_softmax_self_test,
    }


@pytest.mark.parametrize("name", [CPU_OP, rlhf.engine.backends.cpu.decode_op.CPU_DECODE_OP.name])
def test_cpu_builds_pass_their_self_test_well_under_a_second(name: str) -> None:
    module = ops.load_op(name)
    if module is None:
        pytest.skip(f"{name} cannot be built here (no C++ compiler?)")
    verdict = ops.run_self_test(name, module, CPU)
    assert verdict.passed, verdict.detail
    assert verdict.seconds < 1.0
    assert verdict.device.startswith("cpu ") and verdict.build != "unknown"


# --------------------------------------------------------------- CUDA self-tests, run on the CPU


def _adam_module(lr_error: float = 1.0) -> SimpleNamespace:
    def adam_step(*lists, lr: float, **hyper) -> None:
        adam_reference_step(*lists, lr=lr * lr_error, **hyper)
    return SimpleNamespace(adam_step=adam_step)


def _decode_attention_module(error: float = 0.0) -> SimpleNamespace:
    def decode_attention(q, k, v, lengths, mask, used, scale):
        out = decode_attention_reference(q, k[:, :, :used], v[:, :, :used], mask if mask is not None else lengths, scale)
        return out + error
    return SimpleNamespace(decode_attention=decode_attention)


def _sampling_module(always_argmax: bool = False) -> SimpleNamespace:
    def sample_tokens(logits, uniform, temperature, top_k, top_p):
        if always_argmax:
            return torch.argmax(logits, dim=-1)
        return sample_tokens_reference(logits, temperature, top_k, top_p, uniform=uniform)
    return SimpleNamespace(sample_tokens=sample_tokens)


def _selective_log_softmax_module(error: float = 0.0) -> SimpleNamespace:
    def selective_log_softmax_forward(logits, index):
        lse = torch.logsumexp(logits.float(), dim=-1)
        return logits.float().gather(-1, index[..., None]).squeeze(-1) - lse + error, lse
    return SimpleNamespace(selective_log_softmax_forward=selective_log_softmax_forward)


CUDA_CASES = {
    CUDA_OP: (_adam_module(), _adam_module(lr_error=1.001)),
    DECODE_ATTENTION_OP.name: (_decode_attention_module(), _decode_attention_module(error=0.05)),
    SAMPLING_OP.name: (_sampling_module(), _sampling_module(always_argmax=True)),
    SELECTIVE_LOG_SOFTMAX_OP.name: (_selective_log_softmax_module(), _selective_log_softmax_module(error=1e-3)),
}


@pytest.mark.parametrize("name", sorted(CUDA_CASES))
def test_cuda_self_tests_pass_the_reference_and_catch_an_error(name: str) -> None:
    right, wrong = CUDA_CASES[name]
    verdict = ops.run_self_test(name, right, CPU)
    assert verdict.passed, verdict.detail
    failed = ops.run_self_test(name, wrong, CPU)
    assert not failed.passed
    assert failed.detail


def test_a_crashing_op_fails_its_self_test_without_raising() -> None:
    def crash(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    verdict = ops.run_self_test(SAMPLING_OP.name, SimpleNamespace(sample_tokens=crash), CPU)
    assert not verdict.passed and "illegal memory access" in verdict.detail


def test_self_tests_leave_the_global_rng_alone() -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    ops.run_self_test(SAMPLING_OP.name, _sampling_module(), CPU)
    assert torch.equal(torch.rand(3), expected)


# --------------------------------------------------------------- through the loader


def _unloaded(name: str) -> ops._OpState:
    """Op `name` as registered (its spec and self-test), not yet loaded in this process."""
    registered = ops._OPS[name]
    assert registered.self_test is not None
    return ops._OpState(registered.spec, self_test=registered.self_test)


@pytest.fixture
def fresh_adam_op(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """fused_adam_cpu not yet loaded in this process, with an empty op cache."""
    monkeypatch.setenv("RLHF_OPS_CACHE", str(tmp_path / "ops"))
    monkeypatch.delenv("RLHF_DISABLE_OPS", raising=False)
    monkeypatch.delenv("RLHF_OPS_SELFTEST", raising=False)
    monkeypatch.setitem(ops._OPS, CPU_OP, _unloaded(CPU_OP))
    if ops.unavailable_reason(ops._OPS[CPU_OP].spec) is not None:
        pytest.skip("no C++ compiler: the loader never reaches a build")
    return tmp_path


def _wrong_build(tmp_path: Path) -> SimpleNamespace:
    """A fused_adam_cpu 'build' whose step uses twice the learning rate."""
    library = tmp_path / "wrong_adam.so"
    library.write_bytes(b"a deliberately wrong build")

    def adam_step(*lists, lr: float, isa: str = "auto", **hyper) -> None:
        adam_reference_step(*lists, lr=2 * lr, **hyper)
    return SimpleNamespace(adam_step=adam_step, supported_isas=lambda: ["scalar"], best_isa=lambda: "scalar",
                           __file__=str(library))


def _train(optimizer_cls, **kwargs) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = optimizer_cls(model.parameters(), lr=1e-2, **kwargs)
    for _ in range(3):
        model(torch.randn(5, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.weight.detach().clone()


def test_a_wrong_build_is_disabled_with_one_warning_and_torch_trains(
    fresh_adam_op: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: _wrong_build(fresh_adam_op))
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # the rlhf logger does not propagate to pytest's caplog
    logging.getLogger("rlhf").addHandler(handler)
    try:
        ours = _train(FusedAdamW)
    finally:
        logging.getLogger("rlhf").removeHandler(handler)
    warnings = [r.getMessage() for r in records]
    assert len(warnings) == 1
    assert CPU_OP in warnings[0] and "cpu " in warnings[0] and "differ" in warnings[0]
    torch.testing.assert_close(ours, _train(torch.optim.AdamW), rtol=1e-5, atol=1e-6)
    row = next(r for r in ops.op_report() if r["name"] == CPU_OP)
    assert not row["built"] and "self-test failed" in row["error"]

    cached = json.loads(ops.verdict_file(CPU_OP).read_text())
    (verdict,) = cached.values()
    assert verdict["passed"] is False and verdict["build"] == ops.build_hash(_wrong_build(fresh_adam_op))

    # A later process reads the verdict instead of testing the same build again.
    monkeypatch.setitem(ops._OPS, CPU_OP, _unloaded(CPU_OP))
    monkeypatch.setattr(ops, "run_self_test", lambda *args: pytest.fail("the cached verdict was not used"))
    assert ops.load_op(CPU_OP) is None


def test_selftest_0_skips_the_check(fresh_adam_op: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: _wrong_build(fresh_adam_op))
    monkeypatch.setenv("RLHF_OPS_SELFTEST", "0")
    assert ops.load_op(CPU_OP) is not None  # trusted as asked, wrong or not
    assert not ops.verdict_file(CPU_OP).exists()


def test_report_shows_each_ops_verdict() -> None:
    if ops.load_op(CPU_OP) is None:
        pytest.skip("fused_adam_cpu cannot be built here")
    result = run_cli(["report"])
    assert result.returncode == 0, result.stderr
    line = next(li for li in result.stdout.splitlines() if li.strip().startswith(CPU_OP))
    assert "self-test passed" in line
    assert "self-test passed on cpu " in result.stdout
    assert "not built (no CUDA device)" in result.stdout or "cuda " in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(CUDA_CASES))
def test_cuda_builds_pass_their_self_test_on_this_gpu(name: str) -> None:
    module = ops.load_op(name)
    assert module is not None, next(r["error"] for r in ops.op_report() if r["name"] == name)
    verdict = ops.run_self_test(name, module, ops.op_device(ops._OPS[name].spec))
    assert verdict.passed, verdict.detail
    assert verdict.seconds < 1.0


# --------------------------------------------------------------- the self-tests reach every kernel path


@pytest.mark.parametrize("sm_count", [16, 78, 132])  # a small GPU, an L40S-class one, an H100/H200
def test_decode_attention_self_test_runs_one_split_and_several(sm_count: int) -> None:
    from rlhf.engine.backends.cuda.kernels import decode_attention_splits
    from rlhf.engine.backends.cuda.selftests import DECODE_ATTENTION_CASES

    splits = {decode_attention_splits(b, h, kv, s, sm_count) for b, h, kv, s in DECODE_ATTENTION_CASES}
    assert 1 in splits and max(splits) > 1, splits
    chunks = {next((c for c in (8, 4, 2) if (h // kv) % c == 0), 1) for _, h, kv, _ in DECODE_ATTENTION_CASES}
    assert chunks == {1, 2, 8}  # the query-chunk templates the launcher picks


def test_selective_log_softmax_self_test_takes_scalar_and_vector_loads() -> None:
    from rlhf.engine.backends.cuda.kernels import selective_log_softmax_vectorised
    from rlhf.engine.backends.cuda.selftests import SELECTIVE_LOG_SOFTMAX_SHAPES

    for dtype in (torch.float32, torch.bfloat16):
        paths = set()
        for batch, time, vocab in SELECTIVE_LOG_SOFTMAX_SHAPES:
            base = torch.zeros(batch, time + 1, vocab, dtype=dtype)
            paths |= {selective_log_softmax_vectorised(base[:, :time].contiguous()),
                      selective_log_softmax_vectorised(base[:, 1:])}
        assert paths == {True, False}, dtype
