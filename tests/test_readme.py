"""The README and docs/ as a user meets them: short enough to read, links that resolve, commands
that run as written, and no words of the project's working history (work periods, the
comparison harness's folder, notes to a later run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
THIS_FILE = "tests/test_readme.py"

MAX_LINES = 300
MAX_LINE_CHARS = 300
PROCESS_WORDS = re.compile("|".join([r"\bsession [0-9]+", r"\.\./" + "shared", r"next gpu " + "session", r"\bpeers?" + "'s?\\b",
                                       r"issue #[0-9]+"]), re.IGNORECASE)
DOCS_LINK = re.compile(r"\bdocs/[\w./-]+?\.md\b")
QUICKSTART_MARKER = "<!-- quickstart -->"
INSTALL_AND_RUN = 'pip install torch==2.13.0 && pip install -e ".[test]" && rlhf e2e'
TEST_COMMAND = "python -m pytest -q"


def readme_lines() -> list[str]:
    return README.read_text(encoding="utf-8").splitlines()


def tracked_files(*folders: str) -> list[str]:
    """Tracked files under these folders (or these files), as git lists them."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *folders], cwd=REPO, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [name for name in out.decode().split("\0") if name and name != THIS_FILE]


def process_word_hits(paths: list[str]) -> list[str]:
    hits = []
    for name in paths:
        path = REPO / name
        if not path.is_file():  # deleted in the work tree, not yet in the index
            continue
        text = path.read_bytes().decode("utf-8", errors="ignore")
        for number, line in enumerate(text.splitlines(), 1):
            for match in PROCESS_WORDS.finditer(line):
                hits.append(f"{name}:{number}: {match.group(0)!r} in {line.strip()[:120]!r}")
    return hits


def test_readme_is_short_and_its_lines_fit():
    lines = readme_lines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; at most {MAX_LINES}"
    long = [f"line {n}: {len(line)} characters" for n, line in enumerate(lines, 1) if len(line) > MAX_LINE_CHARS]
    assert not long, long


def test_readme_keeps_the_install_and_test_commands_ci_runs():
    text = README.read_text(encoding="utf-8")
    assert INSTALL_AND_RUN in text and TEST_COMMAND in text


def test_readme_links_to_docs_resolve():
    links = set(DOCS_LINK.findall(README.read_text(encoding="utf-8")))
    assert links, "README.md links to no docs/*.md file"
    missing = sorted(link for link in links if not (REPO / link).is_file())
    assert not missing, f"README.md links to missing files: {missing}"


def test_readme_and_docs_have_no_process_words():
    hits = process_word_hits(tracked_files("README.md", "docs"))
    assert not hits, "\n".join(hits)


def test_code_has_no_process_words():
    hits = process_word_hits(tracked_files("rlhf", "stages", "engine", "scripts", "tests"))
    assert not hits, f"{len(hits)} lines:\n" + "\n".join(hits[:50])


def quickstart_blocks(lines: list[str]) -> list[str]:
    """The ```bash blocks that directly follow a quickstart marker line, in order."""
    blocks, index = [], 0
    while index < len(lines):
        if lines[index].strip() == QUICKSTART_MARKER:
            start = index + 1
            assert start < len(lines) and lines[start].strip() == "```bash", (
                f"README.md line {index + 1}: {QUICKSTART_MARKER} must be followed by a ```bash block")
            end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
            blocks.append("\n".join(lines[start + 1:end]))
            index = end
        index += 1
    return blocks


def test_quickstart_blocks_are_found():
    blocks = quickstart_blocks(readme_lines())
    assert len(blocks) >= 3
    script = "\n".join(blocks)
    for command in ("save_tiny_model", "rlhf sft", "rlhf reward", "rlhf ppo", "--reward-fn", "rlhf data inspect"):
        assert command in script, command


def test_quickstart_runs_as_written(tmp_path):
    """Every quickstart block, in order, in one `bash -e` in an empty folder, with this Python's
    `python` and `rlhf` first on PATH."""
    script = "\n".join(["set -o pipefail", *quickstart_blocks(readme_lines())])
    (tmp_path / "quickstart.sh").write_text(script + "\n")
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "WANDB_MODE": "offline", "WANDB_SILENT": "true", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    result = subprocess.run(["bash", "-e", "quickstart.sh"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=1200)
    seconds = time.perf_counter() - started
    output = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, f"quickstart failed (exit {result.returncode}) after {seconds:.0f} s:\n{output}"
    for stage in ("sft", "rm", "ppo", "grpo"):
        assert (tmp_path / "runs" / stage / "DONE").is_file(), stage
    print(f"quickstart: {seconds:.0f} s")
