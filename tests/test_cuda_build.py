"""Compile-only check of the CUDA sources under csrc/ with nvcc, for sm_80 (A100) and sm_90 (H100).

This machine may have nvcc but no GPU: the ops' runtime tests then skip, and this is what keeps a
build break in a .cu file from going unnoticed. Every csrc/**/*.cu is compiled (-c) once with both
-gencode targets, all files in parallel, with the nvcc flags torch's cpp_extension adds. The CUDA
op bindings (.cpp, host compiler) get a syntax check against torch's and the toolkit's headers.
Skips when nvcc is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

from rlhf.engine.ops import CSRC_DIR

NVCC = shutil.which("nvcc")
ARCHS = ("80", "90")
CU_FILES = sorted(CSRC_DIR.rglob("*.cu"))
# Torch bindings of CUDA ops, compiled by the host compiler with CUDA headers (add new ones here).
CUDA_BINDINGS = [CSRC_DIR / "adam" / "fused_adam_cuda.cpp"]

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")


def _nvcc_command(source: Path, out_dir: Path) -> list[str]:
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    includes = [f"-I{CSRC_DIR}", *(f"-I{p}" for p in include_paths())]
    obj = out_dir / (source.relative_to(CSRC_DIR).as_posix().replace("/", "__") + ".o")
    return [NVCC, "-c", str(source), "-o", str(obj), "-std=c++20", "-O3", "-Xcompiler", "-fPIC",
            *COMMON_NVCC_FLAGS, *gencode, *includes]


@pytest.fixture(scope="module")
def nvcc_results(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, subprocess.CompletedProcess[str]]:
    """Every .cu compiled once, in parallel (one nvcc per file, both architectures per call)."""
    out_dir = tmp_path_factory.mktemp("nvcc")

    def compile_one(source: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(_nvcc_command(source, out_dir), capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        return dict(zip(CU_FILES, pool.map(compile_one, CU_FILES)))


@pytest.mark.parametrize("source", CU_FILES, ids=[p.relative_to(CSRC_DIR).as_posix() for p in CU_FILES])
def test_cu_file_compiles_for_sm80_and_sm90(source: Path, nvcc_results) -> None:
    result = nvcc_results[source]
    assert result.returncode == 0, (
        f"nvcc failed on {source.relative_to(CSRC_DIR)}:\n{' '.join(result.args)}\n{result.stderr}{result.stdout}"
    )


def _cuda_include_dir() -> str:
    """The toolkit's include folder, as nvcc itself reports it (nvcc may be a wrapper script)."""
    dry = subprocess.run([NVCC, "--dryrun", "-c", "x.cu"], capture_output=True, text=True)
    match = re.search(r'INCLUDES="-I([^"]+?)"', dry.stdout + dry.stderr)
    assert match, f"cannot find the CUDA include folder in nvcc --dryrun output:\n{dry.stderr}"
    return match.group(1).strip()


@pytest.mark.parametrize("binding", CUDA_BINDINGS, ids=[p.relative_to(CSRC_DIR).as_posix() for p in CUDA_BINDINGS])
def test_cuda_binding_compiles(binding: Path, tmp_path: Path) -> None:
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    torch_includes = include_paths()
    # CPU wheels ship the c10/cuda headers but not this one generated file; an empty stand-in
    # lets the check cover our code. CUDA wheels have the real one, which then takes precedence.
    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    cmd = [cxx, "-fsyntax-only", "-std=c++20", f"-DTORCH_EXTENSION_NAME={binding.stem}",
           *(f"-I{p}" for p in torch_includes), f"-I{tmp_path}", f"-I{_cuda_include_dir()}",
           f"-I{sysconfig.get_paths()['include']}", f"-I{CSRC_DIR}", str(binding)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"
