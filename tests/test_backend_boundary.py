"""The device-backend boundary, checked on the source with `ast` and on the CLI's help.

- Nothing outside engine/backends/cpu/ imports a CPU-backend module, nothing outside
  engine/backends/cuda/ a CUDA-backend one: the generic engine and the stages reach a backend only
  through `rlhf.engine.backends` (the package that maps a device to its backend, the one exception).
- Nothing outside a backend names its knobs (vendors, instruction sets, libraries, caches, the allocator,
  its config fields) in code: identifiers, attributes, keywords and strings that are not docstrings.
- Each stage's generic `--help` section shows no `--cpu-...`/`--cuda-...` option; they are listed
  under their own headings.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.conftest import REPO

CODE_FOLDERS = ("engine", "stages", "rlhf")
BACKENDS = {"cpu": REPO / "engine" / "backends" / "cpu", "cuda": REPO / "engine" / "backends" / "cuda"}
REGISTRY = REPO / "engine" / "backends" / "__init__.py"
CSRC_SUFFIXES = (".cpp", ".cu", ".h", ".cuh", ".inc")
KNOBS = {
    "cpu": re.compile(r"onednn|mkldnn|\bmkl\b|avx|amd|intel|zen\d|populate_heap|malloc|mallopt|madvise|"
                      r"last_level_cache|row_group|decode_rows|fused_layers|fuse_layer|cpu_matmul|packed_gemm|"
                      r"kernel_isa|kernel_step|panel_", re.IGNORECASE),
    "cuda": re.compile(r"cuda_graph|decode_graph|CUDAGraph|DecodeGraph|flash.decod|decode_attention_kernel",
                       re.IGNORECASE),
}


def _modules() -> list[Path]:
    return [p for folder in CODE_FOLDERS for p in sorted((REPO / folder).rglob("*.py"))]


def _inside(path: Path, folder: Path) -> bool:
    return folder in path.parents


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
        # attribute docstrings: a string expression right after an assignment
        for field in ("body", "orelse"):
            statements = getattr(node, field, None)
            for stmt in statements if isinstance(statements, list) else []:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(
                        stmt.value.value, str):
                    ids.add(id(stmt.value))
    return ids


def _code_words(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, word) of every identifier, attribute, keyword, argument and non-docstring string."""
    docs = _docstrings(tree)
    words = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name):
            words.append((line, node.id))
        elif isinstance(node, ast.Attribute):
            words.append((line, node.attr))
        elif isinstance(node, ast.keyword) and node.arg:
            words.append((line, node.arg))
        elif isinstance(node, ast.arg):
            words.append((line, node.arg))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words.append((line, node.name))
        elif isinstance(node, ast.alias):
            words.append((line, node.name))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if not node.value.endswith(CSRC_SUFFIXES):  # an op's source files (csrc/), named by their kernels
                words.append((line, node.value))
    return words


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_only_the_backend_imports_its_modules(backend: str) -> None:
    prefix = f"rlhf.engine.backends.{backend}"
    offenders = []
    for path in _modules():
        if _inside(path, BACKENDS[backend]) or path == REGISTRY:
            continue
        for line, module in _imports(ast.parse(path.read_text())):
            if module == prefix or module.startswith(prefix + "."):
                offenders.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not offenders, f"only engine/backends/{backend}/ may import its modules:\n" + "\n".join(offenders)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_only_the_backend_names_its_knobs(backend: str) -> None:
    offenders = []
    for path in _modules():
        if _inside(path, BACKENDS[backend]) or path == REGISTRY:
            continue
        for line, word in _code_words(ast.parse(path.read_text())):
            if KNOBS[backend].search(word):
                offenders.append(f"{path.relative_to(REPO)}:{line} names {word!r}")
    assert not offenders, f"the {backend} backend's knobs named outside engine/backends/{backend}/:\n" + "\n".join(
        offenders)


def test_the_knob_check_reads_code_not_docstrings() -> None:
    source = 'def f(x):\n    """Uses oneDNN."""\n    return populate_heap(x, mode="avx512")\n'
    words = [w for _, w in _code_words(ast.parse(source))]
    assert "populate_heap" in words and "avx512" in words and "Uses oneDNN." not in words


def _help_sections(text: str) -> dict[str, list[str]]:
    """{heading: the flags listed under it} of a click help text."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
            sections[current] = []
        elif current is not None and line.startswith("  -"):
            sections[current].append(line.split()[0])
    return sections


@pytest.mark.parametrize("stage", ["sft", "reward", "ppo"])
def test_tuning_options_have_their_own_help_headings(stage: str) -> None:
    from rlhf.cli import cli

    result = CliRunner().invoke(cli, [stage, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    sections = _help_sections(result.output)
    generic = sections["Options"]
    assert generic and not [f for f in generic if f.startswith(("--cpu-", "--cuda-"))], generic
    cpu = sections["CPU tuning (the cpu: section)"]
    cuda = sections["CUDA tuning (the cuda: section)"]
    assert {"--cpu-fused-layers", "--cpu-matmul"} <= set(cpu) and all(f.startswith("--cpu-") for f in cpu)
    assert "--cuda-graph-decode" in cuda and all(f.startswith("--cuda-") for f in cuda)
    assert "--fused-layers" not in result.output  # the earlier name is accepted, not shown


def test_earlier_flag_names_still_set_the_tuning_fields() -> None:
    from rlhf.config import PPOConfig, load_saved_config
    from rlhf.config_sources import ConfigSources, resolve_config

    config = resolve_config(PPOConfig(), ConfigSources(flags={"fused_layers": False, "decode_rows_per_group": "8"}))
    assert config.cpu.cpu_fused_layers is False and config.cpu.cpu_decode_rows_per_group == 8
    assert config.cpu.cpu_matmul == "auto" and config.cuda.cuda_graph_decode is False
