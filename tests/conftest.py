"""Shared fixtures: tiny models saved to temp folders, small generated datasets, CLI runners."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def addition_rows(n: int, seed: int = 0) -> list[dict]:
    """prompt/response rows: small sums (learnable by a tiny model in a few steps)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        rows.append({"prompt": f"{a}+{b}=", "response": str(a + b)})
    return rows


@pytest.fixture
def log_records() -> Iterator[list[logging.LogRecord]]:
    """The `rlhf` loggers' records during a test (they do not propagate to pytest's caplog)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logging.getLogger("rlhf").addHandler(handler)
    yield records
    logging.getLogger("rlhf").removeHandler(handler)


@pytest.fixture
def rlhf_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog for the `rlhf` loggers (which do not propagate to the root logger)."""
    logger = logging.getLogger("rlhf")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny saved model per family (lazily built)."""
    from rlhf.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("models")

    class Lazy(dict):
        def __missing__(self, family: str) -> Path:
            path = save_tiny_model(root / family, family, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
            self[family] = path
            return path

    return Lazy()


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "sft.jsonl", addition_rows(64))


def run_cli(args: list[str], nproc: int = 1, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `rlhf ARGS` in a subprocess (under torchrun when nproc > 1)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **(env or {})}
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "rlhf", *args]
    else:
        cmd = [sys.executable, "-m", "rlhf", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=REPO)


def read_metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_losses(output: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(output) if "loss" in row]


class SyncCounter(TorchDispatchMode):
    """Counts ops that make the host wait for a device value (`.item()`, `bool(t)`, `nonzero`)."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "_assert_async")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(name in func.__name__ for name in self.SYNCING):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two threads
    per process made the reward training test 5x slower (measured 56 s vs 10 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """2-rank runs are gloo on CPU; the in-process runs they are compared with must be too."""
    monkeypatch.setenv("RLHF_FORCE_CPU", "1")


RAGGED_PROMPT = 6
"""The prompt block's width in `ragged_batch`."""


def ragged_batch(rows: int = 7, width: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (1-6 real tokens) and responses of 1-14 tokens then padding, as rollouts are."""
    gen = torch.Generator().manual_seed(0)
    sequences = torch.randint(4, 90, (rows, width), generator=gen)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for i in range(rows):
        prompt = 1 + i % RAGGED_PROMPT
        response = 1 + (5 * i) % (width - RAGGED_PROMPT)
        mask[i, RAGGED_PROMPT - prompt : RAGGED_PROMPT + response] = 1
    sequences[mask == 0] = 0
    mask[:, -3:] = 0  # three columns of padding in every row
    return sequences, mask


def tiny_actor_and_reward(root: Path) -> tuple[Path, Path]:
    """A tiny GQA Llama actor and a reward model made from it (random head, std 0.5), for the 2-rank PPO tests."""
    from rlhf.models.loading import load_tokenizer
    from rlhf.models.tiny import save_tiny_model
    from rlhf.models.value_model import ValueModel

    actor = save_tiny_model(root / "actor", "llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    reward = root / "rm"
    ValueModel.from_causal_lm_dir(actor, head_init_std=0.5).save_pretrained(reward)
    load_tokenizer(str(actor)).save_pretrained(reward)
    return actor, reward


def one_and_two_rank_metrics(args: list[str], tmp_path: Path) -> tuple[dict, dict]:
    """The first metrics row of `rlhf ARGS` on one rank (generation batch 8, micro 4) and on two
    ranks with a TP-2 rollout (4 and 2 per rank: the same global batch)."""
    one = run_cli([*args, "--output", str(tmp_path / "one"), "--generation-batch-size", "8", "--micro-batch-size", "4"])
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_cli([*args, "--output", str(tmp_path / "two"), "--generation-batch-size", "4", "--micro-batch-size", "2",
                   "--inference-tp-size", "2"], nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    return read_metrics(tmp_path / "one")[0], read_metrics(tmp_path / "two")[0]


_HOLD_LOCK = ("import sys, time; from pathlib import Path; from rlhf.output_lock import lock_output; "
              "lock_output(Path(sys.argv[1])); print('locked', flush=True); time.sleep(600)")


def hold_output_lock(folder: Path) -> subprocess.Popen:
    """Another process holding `folder`'s output lock (rlhf/output_lock.py), as a running stage
    does, until the caller kills it."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(folder)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    return holder
