"""What every csrc op's load-time self-test is made of: each build proves itself on the device it runs on.

`engine/ops.py` runs an op's self-test (registered with its `OpSpec`, `register_op(spec, self_test)`)
the first time a build of it is loaded for a device (the verdict is cached beside the build, so
later processes read it): small random inputs of the shapes and dtypes the op sees in training and
generation, against the op's PyTorch reference, in well under a second. A self-test returns a
one-line summary when the op matches, and raises (`OpMismatch`, or whatever the op itself raised)
when it does not; the loader then disables the op for the run and the torch path is used.
Self-tests take the module to check as an argument (they never call the loader) and draw from
their own generators.

The self-tests live beside their ops' owners: the fused Adam's in engine/fused_adam.py, the CPU
backend's in engine/backends/cpu/selftests.py, the CUDA backend's in
engine/backends/cuda/selftests.py. tests/test_op_selftests.py runs each of them on the CPU against a
module that wraps the reference (it must pass) and one with a deliberate error (it must fail).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch


SelfTest = Callable[[ModuleType, torch.device], str]
"""(the built module, the device it runs on) -> a one-line summary; raises on a mismatch."""


class OpMismatch(AssertionError):
    """A built op disagrees with its PyTorch reference."""


class Worst:
    """The largest absolute difference seen over a self-test's comparisons."""

    def __init__(self) -> None:
        self.diff = 0.0
        self.cases = 0

    def close(self, what: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> None:
        got, want = got.detach().float().cpu(), want.detach().float().cpu()
        if got.shape != want.shape:
            raise OpMismatch(f"{what}: shape {tuple(got.shape)}, the reference gives {tuple(want.shape)}")
        both_nan = torch.isnan(got) & torch.isnan(want)
        diff = (got - want).abs().masked_fill(both_nan, 0.0)
        bad = ~(diff <= atol + rtol * want.abs())
        if bool(bad.any()):
            index = tuple(int(i) for i in torch.nonzero(bad)[0])
            raise OpMismatch(f"{what}: {int(bad.sum())} of {bad.numel()} values differ; at {index} the op gives "
                             f"{got[index].item():.6g}, the reference {want[index].item():.6g}")
        self.cases += 1
        if diff.numel():
            self.diff = max(self.diff, float(diff.max()))

    def summary(self) -> str:
        return f"{self.cases} comparisons, max |diff| {self.diff:.2e}"



__all__ = ["OpMismatch", "SelfTest", "Worst"]
