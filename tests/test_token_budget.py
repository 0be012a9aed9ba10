"""--max-tokens-per-micro-batch for `rlhf sft` and `rlhf reward`: each step's rows regrouped by
length into micro-batches within the budget take the step the fixed micro-batches take (the loss
is normalised by the step's global token or pair count either way)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf.cli import main
from rlhf.data.tasks import SortTask, build_preference_rows
from rlhf.engine.micro_batches import budget_partition
from rlhf.models.tiny import save_tiny_model
from tests.conftest import read_metrics, write_jsonl

COMMON = ["--report-to", "none", "--optimizer-impl", "torch", "--dtype", "fp32", "--zero-stage", "3",
          "--lr", "3e-3", "--lr-scheduler", "constant", "--max-steps", "4", "--micro-batch-size", "4",
          "--grad-accum", "2"]

pytestmark = pytest.mark.usefixtures("one_thread", "cpu_only")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("budget") / "base", "llama", seed=0,
                           hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)


def _pairs(directory: Path) -> Path:
    task = SortTask(min_len=2, max_len=6, alphabet="abcdefgh", mistakes=("swap", "unsorted", "repeat"))
    return write_jsonl(directory / "pairs.jsonl", build_preference_rows(task, 64, seed=0))


def steps(output: Path) -> list[dict]:
    return [r for r in read_metrics(output) if "loss" in r]


def test_budget_partition() -> None:
    cost = lambda items: len(items) * max(items)  # noqa: E731  (items are their own lengths)
    assert budget_partition([9, 8, 5, 4, 4, 1], cost, budget=16) == [[9], [8, 5], [4, 4, 1]]  # 2 x 8, 3 x 4
    assert budget_partition([9, 8, 5, 4, 4, 1], cost, budget=100) == [[9, 8, 5, 4, 4, 1]]
    assert budget_partition([9, 8, 5, 4, 4, 1], cost, budget=100, at_least=3) == [[9], [8, 5], [4, 4, 1]]
    with pytest.raises(ValueError):
        budget_partition([1, 2], cost, budget=10, at_least=3)


@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_budget_micro_batches_take_the_fixed_step(stage: str, model: Path, sft_data: Path, tmp_path: Path) -> None:
    if stage == "sft":
        data = sft_data
    else:
        data = _pairs(tmp_path)
    extra = ["--value-head-init-std", "0.5"] if stage == "reward" else []
    runs = {}
    for name, budget in (("fixed", []), ("budget", ["--max-tokens-per-micro-batch", "40"])):
        out = tmp_path / name
        main([stage, "--model", str(model), "--data", str(data), "--output", str(out), *COMMON, *extra, *budget])
        runs[name] = steps(out)
    assert len(runs["fixed"]) == len(runs["budget"]) == 4
    for a, b in zip(runs["budget"], runs["fixed"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_packed_micro_batches_take_the_fixed_step(stage: str, model: Path, sft_data: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget that holds rows of different lengths: their micro-batches run packed (no padding;
    reward: the chosen and rejected sequences' scores), and the steps equal the fixed
    micro-batches' and --no-pack-sequences' (padded) ones."""
    from rlhf.stages import reward, sft

    module, packed_fn = (sft, "packed_logprobs") if stage == "sft" else (reward, "packed_scores")
    packed_calls: list[int] = []
    real = getattr(module, packed_fn)
    monkeypatch.setattr(module, packed_fn, lambda *a, **k: packed_calls.append(1) or real(*a, **k))
    data, extra = sft_data, []
    if stage == "reward":
        data, extra = _pairs(tmp_path), ["--value-head-init-std", "0.5"]
    runs = {}
    for name, budget in (("fixed", []), ("packed", ["--max-tokens-per-micro-batch", "200"]),
                         ("padded", ["--max-tokens-per-micro-batch", "200", "--no-pack-sequences"])):
        calls_before = len(packed_calls)
        out = tmp_path / name
        main([stage, "--model", str(model), "--data", str(data), "--output", str(out), *COMMON, *extra, *budget])
        runs[name] = steps(out)
        assert (len(packed_calls) > calls_before) == (name == "packed"), name
    for name in ("packed", "padded"):
        for a, b in zip(runs[name], runs["fixed"]):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    if stage == "reward":
        summaries = {name: json.loads((tmp_path / name / "summary.json").read_text()) for name in runs}
        for key in ("eval_accuracy", "score_mean", "score_std"):  # after 4 Adam steps: rounding grows
            assert summaries["packed"][key] == pytest.approx(summaries["padded"][key], rel=1e-3, abs=1e-4), key
