"""The layering and size rules of the code, checked on the source with `ast`.

- The engine sits below the app: no module in engine/ imports `rlhf.*` other than `rlhf.engine.*`,
  `rlhf.errors` and `rlhf.logging` (function-level imports included).
- Functions stay readable: none in engine/ or stages/ is longer than MAX_FUNCTION_LINES.
- The code speaks of the product: no comment or docstring names a work period, a note to a later
  run, a path outside the repository or a document that is not in it (`NOTE_WORDS`).
- No import cycles: rlhf/, stages/ and engine/ import one another along a graph without cycles
  (function-level and TYPE_CHECKING imports counted).
- An import inside a function in rlhf/ or stages/ says why it is not at the module's top (a comment
  on its line or the line above: an optional dependency, the start-up time of `rlhf --help`).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.conftest import REPO

ENGINE_ALLOWED = ("rlhf.engine", "rlhf.errors", "rlhf.logging")
MAX_FUNCTION_LINES = 80


def _modules(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def _imported_modules(tree: ast.AST, package: str = "rlhf.engine") -> list[tuple[int, str]]:
    """(line, absolute name) of everything imported anywhere in the tree, function bodies included:
    `from rlhf import errors` gives rlhf.errors; relative imports are resolved against `package`
    (engine/ is installed as rlhf.engine)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                module = f"{base}.{module}" if module else base
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _package_of(path: Path) -> str:
    """The package a module of engine/ belongs to: rlhf.engine, or a subpackage of it."""
    return ".".join(["rlhf", "engine", *path.parent.relative_to(REPO / "engine").parts])


def _allowed_in_engine(module: str) -> bool:
    if module != "rlhf" and not module.startswith("rlhf."):
        return True  # torch, transformers, the standard library, ...
    return any(module == allowed or module.startswith(allowed + ".") for allowed in ENGINE_ALLOWED)


def test_engine_imports_nothing_above_it() -> None:
    offenders = []
    for path in _modules("engine"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, module in _imported_modules(tree, _package_of(path)):
            if not _allowed_in_engine(module):
                offenders.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not offenders, "engine/ must not import the app:\n" + "\n".join(offenders)


def test_the_import_check_sees_function_level_imports() -> None:
    source = (
        "import torch\nfrom rlhf.engine import ops\nfrom . import kernels\nfrom .. import errors\n\n"
        "def f():\n    from rlhf.config import X\n    import rlhf.models\n    from ..data import y\n"
    )
    modules = [m for _, m in _imported_modules(ast.parse(source))]
    assert modules[:4] == ["torch", "rlhf.engine.ops", "rlhf.engine.kernels", "rlhf.errors"]
    assert [m for m in modules if not _allowed_in_engine(m)] == ["rlhf.config.X", "rlhf.models", "rlhf.data.y"]


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}() is {length} lines")
    return out


@pytest.mark.parametrize("folder", ["engine", "stages"])
def test_no_function_is_longer_than_the_limit(folder: str) -> None:
    offenders = [entry for path in _modules(folder) for entry in _long_functions(path)]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(offenders)


def _package_of_app(path: Path) -> str:
    return ".".join(["rlhf", *path.parent.relative_to(REPO / "rlhf").parts])


def test_foundations_import_neither_stages_nor_the_cli() -> None:
    """The arrows point one way: rlhf.cli -> rlhf.stages -> foundations (rlhf.*) -> rlhf.engine."""
    offenders = []
    for path in _modules("rlhf"):
        if path.name in ("cli.py", "__main__.py", "config_docs.py") and path.parent == REPO / "rlhf":
            continue  # the CLI, and what sits on it: `python -m rlhf`, the page documenting its commands
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, module in _imported_modules(tree, _package_of_app(path)):
            if module.startswith(("rlhf.stages", "rlhf.cli")):
                offenders.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    for path in _modules("stages"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, module in _imported_modules(tree, "rlhf.stages"):
            if module.startswith("rlhf.cli"):
                offenders.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not offenders, "imports against the layering:\n" + "\n".join(offenders)


NOTE_WORDS = re.compile(r"\bsession [0-9]+|\bthis session\b|next\s+gpu\s+session|\.\./shared|\bissue #[0-9]+|"
                        r"\bDESIGN\.md\b|\bSTYLE\.md\b", re.IGNORECASE)
"""Words about how the code was made rather than what it does: work periods ("session N"), notes to
a later run, paths beside the repository, issue numbers, design notes that are not in the repository.
A line compiling a pattern (a check for these words, as this one) is not a use of them."""
SOURCE_FOLDERS = ("rlhf", "stages", "engine", "scripts", "tests", "csrc")
SOURCE_SUFFIXES = (".py", ".sh", ".cpp", ".cu", ".cuh", ".h", ".inc")


def test_the_code_speaks_of_the_product() -> None:
    offenders = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix not in SOURCE_SUFFIXES or "__pycache__" in path.parts:
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if NOTE_WORDS.search(line) and "re.compile(" not in line:
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}")
    assert not offenders, "say what the code does, not how it was made:\n" + "\n".join(offenders)


# ---------------------------------------------------------------- import cycles and lazy imports

APP_PACKAGES = {"rlhf": "rlhf", "stages": "rlhf.stages", "engine": "rlhf.engine"}
"""Each source folder and the package it installs as (pyproject.toml's package-dir)."""


def _package_of_stages(path: Path) -> str:
    return ".".join(["rlhf", "stages", *path.parent.relative_to(REPO / "stages").parts])


def _app_modules() -> dict[str, tuple[ast.AST, str, Path]]:
    """Every module of rlhf/, stages/ and engine/ by its installed name (a package by its
    __init__.py): its tree, the package its relative imports start from, its file."""
    package_of = {"rlhf": _package_of_app, "stages": _package_of_stages, "engine": _package_of}
    found = {}
    for folder, package in APP_PACKAGES.items():
        for path in _modules(folder):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            name = ".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])
            found[name] = (ast.parse(path.read_text(), filename=str(path)), package_of[folder](path), path)
    return found


def _import_graph(modules: dict[str, tuple[ast.AST, str, Any]]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}, over `modules` only. Every import counts: function-level
    ones and those under TYPE_CHECKING too. `from X import name` is an edge to X.name when that is
    a module, else to X (`_imported_modules` gives X.name either way)."""
    graph: dict[str, dict[str, int]] = {}
    for module, (tree, package, _) in modules.items():
        edges = graph.setdefault(module, {})
        for line, imported in _imported_modules(tree, package):
            target = imported
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module:
                edges.setdefault(target, line)
    return graph


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module: each is a set of modules
    that import one another, in a cycle, directly or through the others."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _import_cycles(in_engine: bool) -> list[str]:
    """Each import cycle among the modules of the engine (`in_engine`) or above it, with the imports
    that close it (file:line imports module)."""
    modules = _app_modules()
    graph = _import_graph(modules)
    found = []
    for component in _strongly_connected(graph):
        if all(m.startswith("rlhf.engine.") or m == "rlhf.engine" for m in component) != in_engine:
            continue
        edges = [f"    {modules[a][2].relative_to(REPO)}:{line} imports {b}"
                 for a in component for b, line in graph[a].items() if b in component]
        found.append("cycle: " + " <-> ".join(component) + "\n" + "\n".join(edges))
    return found


def test_the_cycle_check_sees_a_cycle_through_a_function_level_import() -> None:
    sources = {
        "rlhf.a": ("from rlhf import b\n", "rlhf"),
        "rlhf.b": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlhf.c import C\n", "rlhf"),
        "rlhf.c": ("def f():\n    from .a import thing\n", "rlhf"),
        "rlhf.d": ("import rlhf.a\nfrom rlhf.c import f\n", "rlhf"),
    }
    graph = _import_graph({m: (ast.parse(src), package, None) for m, (src, package) in sources.items()})
    assert graph["rlhf.c"] == {"rlhf.a": 2} and graph["rlhf.d"] == {"rlhf.a": 1, "rlhf.c": 2}
    assert _strongly_connected(graph) == [["rlhf.a", "rlhf.b", "rlhf.c"]]


def test_no_import_cycle_above_the_engine() -> None:
    """rlhf/ and stages/ import one another without cycles (engine/'s own: the test below)."""
    cycles = _import_cycles(in_engine=False)
    assert not cycles, "import cycles (move the shared code to a module both import):\n" + "\n".join(cycles)


def test_no_import_cycle_in_the_engine() -> None:
    cycles = _import_cycles(in_engine=True)
    assert not cycles, "import cycles in engine/ (move the shared code to a module both import):\n" + "\n".join(cycles)


def _unexplained_imports(source: str) -> list[int]:
    """Lines of the function-level imports with no comment on their line or the line above it."""
    comments = {token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT}
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines |= {inner.lineno for inner in ast.walk(node) if isinstance(inner, (ast.Import, ast.ImportFrom))}
    return sorted(line for line in lines if line not in comments and line - 1 not in comments)


def test_the_lazy_import_check_wants_a_comment() -> None:
    source = ("import os\n\ndef f():\n    import torch  # seconds to import\n    # optional\n    import wandb\n"
              "    import json\n\n    def g():\n        import yaml\n")
    assert _unexplained_imports(source) == [7, 10]


@pytest.mark.parametrize("folder", ["rlhf", "stages"])
def test_function_level_imports_say_why(folder: str) -> None:
    """An import inside a function is at the module's top unless it says why it waits (a comment on
    its line or the line above): an optional dependency, or the start-up time of `rlhf --help`."""
    offenders = []
    for path in _modules(folder):
        source = path.read_text()
        lines = source.splitlines()
        offenders += [f"{path.relative_to(REPO)}:{n}: {lines[n - 1].strip()}" for n in _unexplained_imports(source)]
    assert not offenders, ("function-level imports without a comment saying why (or move them to the top):\n"
                           + "\n".join(offenders))


# ---------------------------------------------------------------- the device-backend boundary
# The device-backend boundary, checked on the source with `ast` and on the CLI's help.
# 
# - Nothing outside engine/backends/cpu/ imports a CPU-backend module, nothing outside
#   engine/backends/cuda/ a CUDA-backend one: the generic engine and the stages reach a backend only
#   through the interface (engine/backends/registry.py, which maps a device to its backend, and
#   tuning.py, the config sections).
# - Nothing outside a backend names its knobs (vendors, instruction sets, libraries, caches, the allocator,
#   its config fields) in code: identifiers, attributes, keywords and strings that are not docstrings.
# - Each stage's generic `--help` section shows no `--cpu-...`/`--cuda-...` option; they are listed
#   under their own headings.




CODE_FOLDERS = ("engine", "stages", "rlhf")
BACKENDS = {"cpu": REPO / "engine" / "backends" / "cpu", "cuda": REPO / "engine" / "backends" / "cuda"}
INTERFACE = {REPO / "engine" / "backends" / name for name in ("registry.py", "tuning.py", "__init__.py")}
"""The backends' own interface: the registry that maps a device to its backend, their config sections."""
CSRC_SUFFIXES = (".cpp", ".cu", ".h", ".cuh", ".inc")
KNOBS = {
    "cpu": re.compile(r"onednn|mkldnn|\bmkl\b|avx|amd|intel|zen\d|populate_heap|malloc|mallopt|madvise|"
                      r"last_level_cache|row_group|decode_rows|fused_layers|fuse_layer|cpu_matmul|packed_gemm|"
                      r"kernel_isa|kernel_step|panel_", re.IGNORECASE),
    "cuda": re.compile(r"cuda_graph|decode_graph|CUDAGraph|DecodeGraph|flash.decod|decode_attention_kernel",
                       re.IGNORECASE),
}


def _code_modules() -> list[Path]:
    return [p for folder in CODE_FOLDERS for p in sorted((REPO / folder).rglob("*.py"))]


def _inside(path: Path, folder: Path) -> bool:
    return folder in path.parents


def _absolute_imports(tree: ast.AST) -> list[tuple[int, str]]:
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
    for path in _code_modules():
        if _inside(path, BACKENDS[backend]) or path in INTERFACE:
            continue
        for line, module in _absolute_imports(ast.parse(path.read_text())):
            if module == prefix or module.startswith(prefix + "."):
                offenders.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not offenders, f"only engine/backends/{backend}/ may import its modules:\n" + "\n".join(offenders)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_only_the_backend_names_its_knobs(backend: str) -> None:
    offenders = []
    for path in _code_modules():
        if _inside(path, BACKENDS[backend]) or path in INTERFACE:
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


def test_the_cli_loads_no_backend_and_no_torch() -> None:
    """`rlhf --help` stays fast: the configs compose the backends' tuning sections without importing them."""
    import subprocess
    import sys

    code = "import sys, rlhf.cli; print(sorted(m for m in sys.modules if m == 'torch' or '.backends.' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "['rlhf.engine.backends.tuning']", out


def _sdpa_calls_sharing_kv_heads(source: str) -> list[int]:
    """Lines of `scaled_dot_product_attention(...)` calls that pass `enable_gqa` (other than False)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == \
                "scaled_dot_product_attention":
            gqa = [k for k in node.keywords if k.arg == "enable_gqa"]
            if gqa and not (isinstance(gqa[0].value, ast.Constant) and gqa[0].value.value is False):
                lines.append(node.lineno)
    return lines


def test_the_sdpa_lint_sees_enable_gqa() -> None:
    source = "import torch.nn.functional as F\nF.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=g)\n"
    assert _sdpa_calls_sharing_kv_heads(source) == [2]
    assert _sdpa_calls_sharing_kv_heads("F.scaled_dot_product_attention(q, k, v, enable_gqa=False)\n") == []


def test_only_masked_attention_passes_enable_gqa() -> None:
    """CUDA's SDPA serves enable_gqa under an explicit mask with the math kernel (O(T^2) scores kept
    for backward): engine/attention.py is the one call that decides by device."""
    allowed = REPO / "engine" / "attention.py"
    found = [f"{path.relative_to(REPO)}:{line}" for folder in ("rlhf", "stages", "engine", "scripts")
             for path in sorted((REPO / folder).rglob("*.py")) if path != allowed
             for line in _sdpa_calls_sharing_kv_heads(path.read_text())]
    assert found == [], f"SDPA calls passing enable_gqa outside engine/attention.py: {found}"
    assert _sdpa_calls_sharing_kv_heads(allowed.read_text())
