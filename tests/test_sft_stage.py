"""`rlhf sft` end to end on tiny models: learning, the output contract, ZeRO/offload/precision,
accumulation and world-size equivalence, resume, DeepSpeed configs, W&B offline."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from rlhf.cli import main
from rlhf.models.loading import load_tokenizer
from tests.conftest import read_metrics, run_cli, train_losses

COMMON = ["--max-steps", "6", "--lr", "3e-3", "--report-to", "none", "--optimizer-impl", "torch",
          "--lr-scheduler", "constant", "--zero-stage", "3", "--dtype", "fp32"]


def sft(model: Path, data: Path, output: Path, *extra: str) -> Path:
    main(["sft", "--model", str(model), "--data", str(data), "--output", str(output), *COMMON, *extra])
    return output


@pytest.mark.parametrize("family", ["llama", "opt", "gpt2"])
def test_sft_learns_and_writes_the_output_contract(family, tiny_model_dirs, sft_data, tmp_path):
    out = sft(tiny_model_dirs[family], sft_data, tmp_path / "out", "--micro-batch-size", "8",
              "--max-steps", "10", "--eval-split", "0.1")
    losses = train_losses(out)
    assert len(losses) == 10
    assert losses[-1] < losses[0] * 0.8, losses
    for name in ("model", "config.yaml", "metrics.jsonl", "summary.json", "DONE"):
        assert (out / name).exists(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["eval_perplexity"] > 1.0
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tokenizer = load_tokenizer(str(out / "model"))
    ids = tokenizer(["1+2="], return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert ids.input_ids.shape[1] < generated.shape[1] <= ids.input_ids.shape[1] + 4


def test_micro_batch_times_accumulation_equals_large_micro_batch(tiny_model_dirs, sft_data, tmp_path):
    a = sft(tiny_model_dirs["llama"], sft_data, tmp_path / "a", "--micro-batch-size", "2", "--grad-accum", "4")
    b = sft(tiny_model_dirs["llama"], sft_data, tmp_path / "b", "--micro-batch-size", "8", "--grad-accum", "1")
    assert train_losses(a) == pytest.approx(train_losses(b), abs=1e-5)


@pytest.mark.parametrize("extra", [["--zero-stage", "0"], ["--zero-stage", "2"], ["--zero-stage", "3", "--offload"],
                                   ["--dtype", "bf16"], ["--gradient-checkpointing"]])
def test_engine_variants_train(extra, tiny_model_dirs, sft_data, tmp_path):
    out = sft(tiny_model_dirs["llama"], sft_data, tmp_path / "out", "--micro-batch-size", "8", *extra)
    losses = train_losses(out)
    assert losses[-1] < losses[0], losses


def test_fp16_dynamic_loss_scaling_trains(tiny_model_dirs, sft_data, tmp_path):
    out = sft(tiny_model_dirs["llama"], sft_data, tmp_path / "out", "--micro-batch-size", "8", "--dtype", "fp16",
              "--initial-scale-power", "8", "--loss-scale-window", "2")
    rows = read_metrics(out)
    assert all("loss_scale" in r for r in rows if "loss" in r)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_gradient_checkpointing_gives_the_same_losses(tiny_model_dirs, sft_data, tmp_path):
    a = sft(tiny_model_dirs["llama"], sft_data, tmp_path / "a", "--micro-batch-size", "8")
    b = sft(tiny_model_dirs["llama"], sft_data, tmp_path / "b", "--micro-batch-size", "8", "--gradient-checkpointing")
    assert train_losses(a) == pytest.approx(train_losses(b), abs=1e-5)


def test_resume_continues_exactly(tiny_model_dirs, sft_data, tmp_path):
    full = sft(tiny_model_dirs["llama"], sft_data, tmp_path / "full", "--micro-batch-size", "4",
               "--save-interval", "3", "--keep-checkpoints", "3", "--lr-scheduler", "cosine")
    # Simulate a run killed after step 3: its folder holds step 3's checkpoint and metrics up to 5.
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for name in ("model", "DONE", "summary.json"):
        path = cut / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    shutil.rmtree(cut / "checkpoints" / "step_00000006")
    (cut / "checkpoints" / "latest").write_text("step_00000003")
    with pytest.raises(SystemExit) as exc:  # the folder holds a run: refused without --resume
        sft(tiny_model_dirs["llama"], sft_data, cut, "--micro-batch-size", "4", "--lr-scheduler", "cosine")
    assert exc.value.code == 2
    sft(tiny_model_dirs["llama"], sft_data, cut, "--micro-batch-size", "4", "--save-interval", "3",
        "--lr-scheduler", "cosine", "--resume")
    assert [r["step"] for r in read_metrics(cut)] == [1, 2, 3, 4, 5, 6]
    assert train_losses(cut) == pytest.approx(train_losses(full), abs=1e-6)
    assert (cut / "DONE").exists()


def test_two_rank_zero3_matches_world_size_one(tiny_model_dirs, sft_data, tmp_path):
    args = ["sft", "--model", str(tiny_model_dirs["llama"]), "--data", str(sft_data), *COMMON]
    one = run_cli([*args, "--output", str(tmp_path / "one"), "--micro-batch-size", "8"])
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_cli([*args, "--output", str(tmp_path / "two"), "--micro-batch-size", "4"], nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert train_losses(tmp_path / "two") == pytest.approx(train_losses(tmp_path / "one"), abs=1e-5)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert 0.4 < summary["local_parameters_rank0"] / summary["parameters"] < 0.6


DS_CONFIG = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": "auto",
    "steps_per_print": 10,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 5e8},
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-3,
                                                      "warmup_num_steps": 2, "total_num_steps": 100}},
    "wall_clock_breakdown": False,
}


def test_deepspeed_config_is_imported(tiny_model_dirs, sft_data, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps(DS_CONFIG))
    out = tmp_path / "out"
    main(["sft", "--model", str(tiny_model_dirs["llama"]), "--data", str(sft_data), "--output", str(out),
          "--deepspeed-config", str(ds), "--max-steps", "3", "--report-to", "none"])
    import yaml

    engine = yaml.safe_load((out / "config.yaml").read_text())["engine"]
    assert engine["zero_stage"] == 2 and engine["offload"] is True and engine["dtype"] == "bf16"
    assert engine["grad_accum"] == 2 and engine["micro_batch_size"] == 4
    assert engine["lr"] == 2e-3 and engine["adam_beta2"] == 0.999 and engine["weight_decay"] == 0.01
    assert engine["lr_scheduler"] == "linear" and engine["warmup_steps"] == 2


@pytest.mark.parametrize(
    "change, message",
    [
        ({"train_batch_size": 12, "gradient_accumulation_steps": 2}, "train_batch_size 12 != micro_batch_size 4"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
        ({"fp16": {"enabled": True}}, "fp16 and bf16 are both enabled"),
        ({"not_a_deepspeed_key": 1}, "not_a_deepspeed_key: unknown DeepSpeed key"),
    ],
)
def test_bad_deepspeed_config_fails_with_one_clear_line(change, message, tiny_model_dirs, sft_data, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({**DS_CONFIG, **change}))
    result = run_cli(["sft", "--model", str(tiny_model_dirs["llama"]), "--data", str(sft_data),
                      "--output", str(tmp_path / "out"), "--deepspeed-config", str(ds)])
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, result.stderr[-1500:]
    assert "Traceback" not in result.stderr


def test_wandb_offline_run_holds_the_metrics(tiny_model_dirs, sft_data, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = sft(tiny_model_dirs["llama"], sft_data, tmp_path / "out", "--micro-batch-size", "8", "--report-to", "wandb",
              "--max-steps", "3")
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (record_log,) = runs[0].glob("run-*.wandb")
    # The W&B service process writes the record log; give it a bounded time to flush.
    deadline = time.monotonic() + 60
    data = record_log.read_bytes()
    while data.count(b"sft/loss") < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
        data = record_log.read_bytes()
    # History rows are stored with JSON-encoded values: every logged loss must be in the run.
    assert data.count(b"sft/loss") >= 3
    for loss in train_losses(out):
        assert json.dumps(loss).encode() in data
