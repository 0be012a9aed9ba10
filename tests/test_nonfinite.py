"""Non-finite training: skipped and counted steps, the --max-skipped-steps stop, parameters that blow
up, the export check, and strict JSON outputs (NaN/inf written as null with a "non_finite" flag)."""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import rlhf.stages.sft as sft_stage
from rlhf.cli import main
from rlhf.engine.config import EngineConfig
from rlhf.engine.distributed import DistributedContext, exit_rank
from rlhf.engine.export import export_state_dict
from rlhf.engine.fsdp import local_shard
from rlhf.engine.train_engine import NonFiniteTrainingError, TrainEngine
from rlhf.errors import UserError
from rlhf.models.loading import load_causal_lm
from rlhf.outputs import strict_json, write_summary
from rlhf.tracking import MetricsFile
from tests.conftest import run_cli

NAN = float("nan")


def strict_loads(text: str) -> object:
    """json.loads that refuses NaN/Infinity (Python's json accepts them by default)."""
    def refuse(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def error_lines(stderr: str) -> list[str]:
    """The `error: ...` messages in a stage's stderr (the progress bar, left open by the failing
    step, may precede one on the same terminal line)."""
    return [line[line.index("error: "):] for line in stderr.splitlines() if "error: " in line]


def strict_rows(path: Path) -> list[dict]:
    return [strict_loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------- the engine, in process


@pytest.fixture(scope="module")
def ctx(one_thread: None) -> DistributedContext:
    return DistributedContext.initialize()


def make_engine(model_dir: Path, ctx: DistributedContext, **overrides: object) -> TrainEngine:
    settings = dict(zero_stage=3, dtype="fp32", micro_batch_size=2, optimizer_impl="torch", lr=1e-3,
                    max_skipped_steps=3)
    settings.update(overrides)
    return TrainEngine(load_causal_lm(str(model_dir)), EngineConfig(**settings), ctx, total_steps=50, name="actor")


def one_step(engine: TrainEngine, poison: float | None = None):
    """One optimizer step on a fixed batch; `poison` is added to the loss as a constant, so the
    loss is NaN/inf while its gradient alone would stay finite."""
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = engine.model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
    if poison is not None:
        loss = loss + poison
    engine.backward(loss)
    return engine.step()


def params(engine: TrainEngine) -> list[torch.Tensor]:
    return [local_shard(p)[0].detach().clone() for p in engine.model.parameters()]


@pytest.mark.parametrize("poison", [NAN, float("inf")])
def test_a_non_finite_loss_is_skipped_counted_and_training_goes_on(poison, tiny_model_dirs, ctx):
    engine = make_engine(tiny_model_dirs["llama"], ctx)
    before = params(engine)
    for expected in (1, 2):
        result = one_step(engine, poison)
        assert not result.stepped and not math.isfinite(result.grad_norm)
        assert engine.skipped_steps == expected and engine.consecutive_skipped == expected
    assert all(torch.equal(a, b) for a, b in zip(before, params(engine)))  # nothing was applied
    result = one_step(engine)
    assert result.stepped and math.isfinite(result.grad_norm)
    assert engine.skipped_steps == 2 and engine.consecutive_skipped == 0  # the streak is over
    assert not all(torch.equal(a, b) for a, b in zip(before, params(engine)))
    assert engine.global_step == 3


def test_max_skipped_steps_in_a_row_stops_with_one_line(tiny_model_dirs, ctx):
    engine = make_engine(tiny_model_dirs["llama"], ctx, max_skipped_steps=3)
    one_step(engine, NAN)
    one_step(engine)  # a good step resets the count
    one_step(engine, NAN)
    one_step(engine, NAN)
    with pytest.raises(NonFiniteTrainingError) as info:
        one_step(engine, NAN)
    message = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in message
    for part in ("actor", "step 5", "3 optimizer steps in a row", "--max-skipped-steps 3", "--lr", "--grad-clip"):
        assert part in message, (part, message)
    assert engine.skipped_steps == 4


def test_max_skipped_steps_zero_never_stops(tiny_model_dirs, ctx):
    engine = make_engine(tiny_model_dirs["llama"], ctx, max_skipped_steps=0)
    for _ in range(12):
        assert not one_step(engine, NAN).stepped
    assert engine.skipped_steps == 12 and engine.consecutive_skipped == 12


def test_fp16_overflows_count_only_once_the_loss_scale_is_at_its_minimum(tiny_model_dirs, ctx):
    # Scale 4 -> 2 -> 1 (DeepSpeed's halving, hysteresis 1): those overflows are the scaler's to absorb.
    engine = make_engine(tiny_model_dirs["llama"], ctx, dtype="fp16", initial_scale_power=2, hysteresis=1,
                         min_loss_scale=1.0, max_skipped_steps=2)
    scales = []
    for _ in range(3):
        scales.append(one_step(engine, NAN).loss_scale)
    assert scales == [4.0, 2.0, 1.0] and engine.skipped_steps == 3 and engine.consecutive_skipped == 1
    with pytest.raises(NonFiniteTrainingError, match="even at --min-loss-scale"):
        one_step(engine, NAN)


def test_a_step_that_makes_parameters_non_finite_stops_at_once(tiny_model_dirs, ctx):
    # lr x weight_decay = 1e40 overflows fp32: the decoupled decay turns every weight into inf/NaN.
    engine = make_engine(tiny_model_dirs["llama"], ctx, lr=1e30, weight_decay=1e10)
    with pytest.raises(NonFiniteTrainingError, match=r"actor: training stopped at step 1: .*made parameters NaN/inf"):
        one_step(engine)


def test_the_skip_streak_is_saved_and_restored_for_resume(tiny_model_dirs, ctx):
    engine = make_engine(tiny_model_dirs["llama"], ctx)
    one_step(engine, NAN)
    state = engine.host_state()
    assert state["consecutive_skipped"] == 1
    fresh = make_engine(tiny_model_dirs["llama"], ctx)
    fresh.load_host_state(state)
    assert fresh.consecutive_skipped == 1 and fresh.skipped_steps == 1
    del state["consecutive_skipped"]  # a checkpoint written before the field existed
    fresh.load_host_state(state)
    assert fresh.consecutive_skipped == 0


def test_a_model_with_nan_weights_is_refused_before_training(tiny_model_dirs, ctx):
    model = load_causal_lm(str(tiny_model_dirs["llama"]))
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = NAN
    with pytest.raises(UserError, match=r"critic: the model to train holds NaN/inf weights \(first: "
                                        r"model\.layers\.1\.mlp\.up_proj\.weight\)"):
        TrainEngine(model, EngineConfig(dtype="fp32", micro_batch_size=1), ctx, total_steps=1, name="critic")


def test_export_refuses_a_non_finite_state_dict_and_writes_nothing(tiny_model_dirs, ctx, tmp_path):
    model = load_causal_lm(str(tiny_model_dirs["llama"]))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.norm.weight"][3] = float("inf")
    out = tmp_path / "model"
    with pytest.raises(NonFiniteTrainingError) as info:
        export_state_dict(model, ctx, state, out, None)
    assert str(info.value).startswith(f"{out}: not written") and "model.norm.weight" in str(info.value)
    assert "\n" not in str(info.value)
    assert not out.exists() and not out.with_name("model.tmp").exists()


# ---------------------------------------------------------------- strict JSON


def test_strict_json_writes_null_and_flags_the_fields():
    data = {"loss": NAN, "kl": float("-inf"), "ok": 1.5, "eval": {"loss": float("inf"), "n": 3},
            "scores": [1.0, NAN], "t": torch.tensor(NAN), "path": Path("/x")}
    parsed = strict_loads(strict_json(data))
    assert parsed == {"loss": None, "kl": None, "ok": 1.5, "eval": {"loss": None, "n": 3}, "scores": [1.0, None],
                      "t": None, "path": "/x", "non_finite": ["loss", "kl", "eval.loss", "scores.1", "t"]}
    assert strict_loads(strict_json({"a": 1})) == {"a": 1}  # no flag when everything is finite


def test_summary_and_metrics_files_are_strict_json(tmp_path):
    write_summary(tmp_path, {"train_loss": NAN, "steps": 3})
    assert strict_loads((tmp_path / "summary.json").read_text()) == {
        "train_loss": None, "steps": 3, "non_finite": ["train_loss"]}
    metrics = MetricsFile(tmp_path / "metrics.jsonl")
    metrics.write({"step": 1, "loss": torch.tensor(NAN), "grad_norm": float("inf"), "lr": 0.1})
    metrics.write({"step": 2, "loss": 1.0})
    assert strict_rows(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": None, "grad_norm": None, "lr": 0.1, "non_finite": ["loss", "grad_norm"]},
        {"step": 2, "loss": 1.0},
    ]
    assert metrics.truncate_after(1) == 1  # resume still reads the rows back


# ---------------------------------------------------------------- `rlhf sft`


def sft_args(model: Path, data: Path, output: Path, *extra: str) -> list[str]:
    return ["sft", "--model", str(model), "--data", str(data), "--output", str(output), "--micro-batch-size", "8",
            "--lr", "1e-3", "--report-to", "none", "--optimizer-impl", "torch", "--dtype", "fp32", *extra]


def nan_loss_at(steps: set[int] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make SFT's loss NaN at the given (1-based) optimizer steps, every step when None (one
    micro-batch per step, no eval rows: one loss call per step)."""
    real = sft_stage.sft_loss
    calls = {"n": 0}

    def loss(model, batch):
        calls["n"] += 1
        loss_sum, n, extra = real(model, batch)
        return (loss_sum + NAN if steps is None or calls["n"] in steps else loss_sum), n, extra

    monkeypatch.setattr(sft_stage, "sft_loss", loss)


def test_sft_skips_fewer_nan_steps_than_the_limit_and_finishes(tiny_model_dirs, sft_data, tmp_path, monkeypatch,
                                                               one_thread):
    nan_loss_at({2, 3}, monkeypatch)
    out = tmp_path / "out"
    main(sft_args(tiny_model_dirs["llama"], sft_data, out, "--max-steps", "5", "--max-skipped-steps", "3"))
    assert (out / "DONE").is_file() and (out / "model").is_dir()
    rows = strict_rows(out / "metrics.jsonl")
    assert [r["loss"] is None for r in rows] == [False, True, True, False, False]
    assert rows[1]["non_finite"] == ["loss", "grad_norm"] and rows[2]["skipped_steps"] == 2
    summary = strict_loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == 2 and math.isfinite(summary["train_loss"]) and "non_finite" not in summary


def test_sft_stops_after_max_skipped_steps_without_model_or_done(tiny_model_dirs, sft_data, tmp_path, monkeypatch,
                                                                 capsys, one_thread):
    nan_loss_at(None, monkeypatch)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(sft_args(tiny_model_dirs["llama"], sft_data, out, "--max-steps", "8", "--max-skipped-steps", "3",
                      "--save-interval", "2"))
    assert exit_info.value.code == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "actor: training stopped at step 3" in errors[0], errors
    assert not (out / "model").exists() and not (out / "DONE").exists() and not (out / "summary.json").exists()
    assert (out / "checkpoints" / "step_00000002").is_dir()  # the checkpoint written before the stop is kept
    # Rows of the skipped steps before the stop (the stopping step raises before it is logged).
    assert [r["loss"] for r in strict_rows(out / "metrics.jsonl")] == [None, None]


def test_sft_whose_weights_blow_up_exits_2_with_one_line(tiny_model_dirs, sft_data, tmp_path):
    out = tmp_path / "out"
    proc = run_cli(sft_args(tiny_model_dirs["llama"], sft_data, out, "--max-steps", "4", "--lr", "1e30",
                            "--weight-decay", "1e10"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and "made parameters NaN/inf" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (out / "model").exists() and not (out / "DONE").exists()


@pytest.mark.parametrize("flag,value", [("--lr", "nan"), ("--lr", "inf"), ("--max-skipped-steps", "-1"),
                                        ("--max-skipped-steps", "1.5")])
def test_bad_numbers_are_refused_before_anything_is_written(flag, value, tiny_model_dirs, sft_data, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(sft_args(tiny_model_dirs["llama"], sft_data, out, flag, value))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and flag in err and err.count("\n") == 1, err
    assert not out.exists()


def test_two_rank_sft_stops_and_writes_nothing(tiny_model_dirs, sft_data, tmp_path, cpu_only):
    """The CLI path under torchrun: the streak stops the job (no rank left waiting: run_cli's
    timeout is far below the collective timeout) with one message and no model."""
    out = tmp_path / "out"
    args = sft_args(tiny_model_dirs["llama"], sft_data, out, "--max-steps", "8", "--lr", "1e6", "--weight-decay", "1",
                    "--grad-clip", "0", "--max-skipped-steps", "3")
    args[args.index("--micro-batch-size") + 1] = "4"
    proc = run_cli(args, nproc=2, timeout=240)
    assert proc.returncode != 0
    errors = error_lines(proc.stderr)
    assert errors and len(set(errors)) == 1 and "3 optimizer steps in a row" in errors[0], proc.stderr[-3000:]
    assert not (out / "model").exists() and not (out / "DONE").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _verdict(fn) -> str:
    try:
        fn()
    except NonFiniteTrainingError as exc:
        return str(exc)
    return "ok"


def _two_rank_worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    """Each rank's view of: a NaN loss on rank 1 only; a streak of them; a NaN in rank 1's shard."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), RLHF_FORCE_CPU="1")
    torch.set_num_threads(1)
    ctx = DistributedContext.initialize()
    try:
        engine = make_engine(Path(model_dir), ctx, max_skipped_steps=2)
        poison = NAN if rank == 1 else None  # rank 0's loss and local gradients are finite
        first = one_step(engine, poison)
        second = _verdict(lambda: one_step(engine, poison))
        engine = make_engine(Path(model_dir), ctx)
        with torch.no_grad():  # a NaN in one rank's shard only: the other cannot see it
            if rank == 1:
                next(engine.model.parameters()).to_local().view(-1)[0] = NAN
        blown = _verdict(lambda: engine._check_parameters(1e-3))
        result = {"first_stepped": first.stepped, "second": second, "blown": blown}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        ctx.shutdown()
    exit_rank()  # this worker ran backward under FSDP2: see exit_rank for why it skips finalization


def test_two_ranks_reach_the_same_verdict(tiny_model_dirs, tmp_path):
    """A NaN seen by one rank (its loss, or its parameter shard) makes every rank skip, count and
    stop at the same step: none is left waiting in a collective for the other."""
    mp.spawn(_two_rank_worker, args=(_free_port(), str(tiny_model_dirs["llama"]), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1], results
    assert results[0]["first_stepped"] is False
    assert "actor: training stopped at step 2: 2 optimizer steps in a row" in results[0]["second"]
    assert "made parameters NaN/inf" in results[0]["blown"]


@pytest.mark.usefixtures("one_thread")
def test_collapsed_model_warns_that_nothing_is_learned(tiny_model_dirs, sft_data, tmp_path, monkeypatch):
    """--lr 1e6 leaves finite weights and a constant output (gradient norm exactly 0): not an error,
    but a warning (once) says nothing is learned."""
    import rlhf.engine.train_engine as train_engine

    warnings: list[str] = []
    monkeypatch.setattr(train_engine.log, "warning", lambda msg, *args: warnings.append(msg % args))
    main(["sft", "--model", str(tiny_model_dirs["llama"]), "--data", str(sft_data), "--output", str(tmp_path / "o"),
          "--lr", "1e6", "--max-steps", "8", "--report-to", "none", "--micro-batch-size", "8"])
    assert sum("gradient norm exactly 0 for 3 steps in a row" in w for w in warnings) == 1


def test_all_finite_is_exact_for_huge_values_nan_and_inf() -> None:
    # The CPU answers from the 2-norm first; 1e30 squared overflows it, yet the values are finite.
    from rlhf.engine.train_engine import all_finite

    huge = [torch.full((3, 4), 1e30), torch.ones(5)]
    assert bool(all_finite(huge))
    assert bool(all_finite([torch.zeros(2), torch.randn(70000)]))
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(70000)
        t[12345] = bad
        assert not bool(all_finite([torch.ones(3), t]))
        assert not bool(all_finite([torch.full((2,), 1e30), t]))
    assert bool(all_finite([]))
