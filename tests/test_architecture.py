"""The layering and size rules of the code, checked on the source with `ast`.

- The engine sits below the app: no module in engine/ imports `rlhf.*` other than `rlhf.engine.*`,
  `rlhf.errors` and `rlhf.logging` (function-level imports included).
- Functions stay readable: none in engine/ or stages/ is longer than MAX_FUNCTION_LINES.
- The code speaks of the product: no comment or docstring names a work period, a note to a later
  run, a path outside the repository or a document that is not in it (`NOTE_WORDS`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

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
