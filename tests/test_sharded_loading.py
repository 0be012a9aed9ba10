"""Sharded loading: every engine builds its model on the meta device and each rank reads only its
own rows of each tensor from the safetensors files (rlhf/models/sharded_loading.py).

Two gloo ranks on the CPU compare every local shard (and buffer) with today's path, full loading
then sharding, bit for bit: an untied family (Llama), tied ones (Qwen2; GPT-2 with its
`transformer.` prefix and Conv1D weights), a ValueModel with a new head and one with its saved head
(frozen in bf16 too), a sharded checkpoint with an index saved in bf16 (into fp32 master weights),
ZeRO-0's replicated mesh and CPU offload. The vocabulary of 101 rows and the value head's single row
give uneven and empty shards. The same run exports each model both ways, in place from every
rank's shards and gathered on rank 0, and compares the files. Bad folders fail with one line naming
the folder and the tensor; a folder without safetensors falls back to the full load. The memory bound is measured by
scripts/measure_load_rss.py on a ~190 MB model: peak RSS per rank while loading <= 0.6 x the
model's fp32 bytes + the process's RSS before loading.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from rlhf.engine.config import EngineConfig
from rlhf.engine.distributed import DistributedContext, exit_rank
from rlhf.engine.export import export_model, export_state_dict
from rlhf.engine.inference import FrozenModel
from rlhf.engine.train_engine import TrainEngine
from rlhf.errors import UserError
from rlhf.models.loading import deferred_causal_lm, load_causal_lm
from rlhf.models.sharded_loading import parameters_on_meta
from rlhf.models.tiny import save_tiny_model, tiny_config
from rlhf.models.value_model import (
    ValueModel, deferred_load_value_model, deferred_value_model_from, load_value_model, value_model_from,
)
from tests.conftest import REPO

SIZES = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The model folders the 2-rank cases load."""
    root = tmp_path_factory.mktemp("sharded_loading")
    llama = save_tiny_model(root / "llama", "llama", **SIZES)
    critic = root / "critic"  # a saved value model whose head has a bias (a critic's)
    model = ValueModel.from_causal_lm_dir(llama, head_init_std=0.5)
    with torch.no_grad():
        model.value_head.bias.fill_(0.25)
    model.save_pretrained(critic)
    bf16_index = root / "bf16_index"  # several files and model.safetensors.index.json, in bf16
    AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16).save_pretrained(bf16_index, max_shard_size="20KB")
    assert (bf16_index / "model.safetensors.index.json").is_file()
    return {"llama": str(llama), "qwen2": str(save_tiny_model(root / "qwen2", "qwen2", **SIZES)),
            "gpt2": str(save_tiny_model(root / "gpt2", "gpt2", **SIZES)), "critic": str(critic),
            "bf16_index": str(bf16_index)}


# ---------------------------------------------------------------- 2 ranks: bit for bit


def _mismatches(full: nn.Module, sharded: nn.Module) -> list[str]:
    """Names whose local shard (or buffer, or requires_grad) differs between the two models."""
    a, b = dict(full.named_parameters()), dict(sharded.named_parameters())
    bad = sorted(a.keys() ^ b.keys())
    for name in a.keys() & b.keys():
        x, y = a[name].to_local(), b[name].to_local()
        same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        if not same or a[name].requires_grad != b[name].requires_grad:
            bad.append(name)
    buffers_a, buffers_b = dict(full.named_buffers()), dict(sharded.named_buffers())
    bad += [f"buffer {n}" for n in buffers_a if n not in buffers_b or not torch.equal(buffers_a[n], buffers_b[n])]
    return sorted(bad)


def _train(model: nn.Module, weights, ctx: DistributedContext, **engine: object) -> nn.Module:
    config = EngineConfig(**{"zero_stage": 3, "dtype": "fp32", "optimizer_impl": "torch", "micro_batch_size": 1,
                             **engine})
    return TrainEngine(model, config, ctx, total_steps=1, weights=weights).model


def _frozen(model: nn.Module, weights, ctx: DistributedContext) -> nn.Module:
    return FrozenModel(model, ctx, zero_stage=3, dtype="bf16", offload=False, micro_batch_size=1, name="reward",
                       weights=weights).model


def _causal_cases(ctx: DistributedContext, folders: dict[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for family in ("llama", "qwen2", "gpt2"):
        model, weights = deferred_causal_lm(folders[family])
        assert weights is not None and all(p.is_meta for p in model.parameters())
        sharded = _train(model, weights, ctx)
        full = _train(load_causal_lm(folders[family]), None, ctx)
        out[family] = _mismatches(full, sharded)
        tied = sharded.get_output_embeddings().weight is sharded.get_input_embeddings().weight
        out[f"{family}_tied"] = [tied, full.get_output_embeddings().weight is full.get_input_embeddings().weight]
        ids = torch.arange(3, 40).reshape(1, -1)
        with torch.no_grad():
            out[f"{family}_logits"] = bool(torch.equal(full(input_ids=ids).logits, sharded(input_ids=ids).logits))
    bf16 = folders["bf16_index"]
    out["bf16_index"] = _mismatches(_train(load_causal_lm(bf16), None, ctx), _train(*deferred_causal_lm(bf16), ctx))
    llama = folders["llama"]
    for name, engine in (("zero0", {"zero_stage": 0}), ("offload", {"offload": True}),
                         ("checkpointing", {"gradient_checkpointing": True})):
        out[name] = _mismatches(_train(load_causal_lm(llama), None, ctx, **engine),
                                _train(*deferred_causal_lm(llama), ctx, **engine))
    out["frozen_bf16"] = _mismatches(_frozen(load_causal_lm(llama), None, ctx),
                                     _frozen(*deferred_causal_lm(llama), ctx))
    return out


def _value_cases(ctx: DistributedContext, folders: dict[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    torch.manual_seed(0)  # a new random head: drawn alike on both paths
    full = value_model_from(folders["llama"], head_init_std=None)
    full.value_head.bias.requires_grad_(False)  # as the reward stage does
    after_full = torch.get_rng_state()
    torch.manual_seed(0)
    model, weights = deferred_value_model_from(folders["llama"], head_init_std=None)
    model.value_head.bias.requires_grad_(False)
    out["new_head_rng"] = bool(torch.equal(after_full, torch.get_rng_state()))  # later draws stay the same too
    out["new_head"] = _mismatches(_train(full, None, ctx), _train(model, weights, ctx))
    critic = folders["critic"]
    out["saved_head"] = _mismatches(_train(value_model_from(critic), None, ctx),
                                    _train(*deferred_value_model_from(critic), ctx))
    out["saved_head_bf16"] = _mismatches(_frozen(load_value_model(critic, dtype=torch.float32), None, ctx),
                                         _frozen(*deferred_load_value_model(critic), ctx))
    return out


def _export_cases(ctx: DistributedContext, folders: dict[str, str], out_dir: Path) -> None:
    """Each model exported both ways: in place from every rank's shards, and gathered on rank 0."""
    for name, (model, weights) in (("llama", deferred_causal_lm(folders["llama"])),
                                   ("qwen2", deferred_causal_lm(folders["qwen2"])),
                                   ("gpt2", deferred_causal_lm(folders["gpt2"])),
                                   ("critic", deferred_value_model_from(folders["critic"]))):
        engine = TrainEngine(model, EngineConfig(dtype="fp32", optimizer_impl="torch", micro_batch_size=1), ctx,
                             total_steps=1, weights=weights)
        export_model(engine, out_dir / f"{name}-in-place", None, max_file_bytes=20_000 if name == "gpt2" else 2**30)
        export_state_dict(engine.model, ctx, engine.full_state_dict(), out_dir / f"{name}-gathered", None)


def _worker(rank: int, port: int, folders: dict[str, str], out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), RLHF_FORCE_CPU="1")
    torch.set_num_threads(1)
    ctx = DistributedContext.initialize()
    try:
        result = {**_causal_cases(ctx, folders), **_value_cases(ctx, folders)}
        _export_cases(ctx, folders, Path(out_dir))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        ctx.shutdown()
    exit_rank()  # as the CLI ends a rank: no interpreter finalization (exit_rank says why)


def test_two_ranks_load_and_export_as_full_loading_and_gathering(folders: dict[str, str], tmp_path: Path) -> None:
    mp.spawn(_worker, args=(_free_port(), folders, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        mismatches = {k: v for k, v in result.items() if isinstance(v, list) and v and isinstance(v[0], str)}
        assert not mismatches, (rank, mismatches)
        assert result["llama_tied"] == [False, False]
        assert result["qwen2_tied"] == [True, True] and result["gpt2_tied"] == [True, True]
        assert all(result[f"{f}_logits"] for f in ("llama", "qwen2", "gpt2")), result
        assert result["new_head_rng"] is True
    _check_exports(tmp_path)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _check_exports(out: Path) -> None:
    """The in-place export holds the gathered export's tensors (a tied head once, as transformers
    saves it), the same config files, and loads back; a small max_file_bytes splits it with an index."""
    for name in ("llama", "qwen2", "gpt2", "critic"):
        in_place, gathered = out / f"{name}-in-place", out / f"{name}-gathered"
        ours, theirs = _tensors(in_place), _tensors(gathered)
        tied = name in ("qwen2", "gpt2")
        assert set(ours) == set(theirs) - ({"lm_head.weight"} if tied else set()), name
        assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in ours), name
        for config in gathered.glob("*.json"):
            assert (in_place / config.name).read_text() == config.read_text(), (name, config.name)
    index = json.loads((out / "gpt2-in-place" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert set(index["weight_map"]) == set(_tensors(out / "gpt2-gathered")) - {"lm_head.weight"}
    for name in ("qwen2", "gpt2"):
        reloaded = AutoModelForCausalLM.from_pretrained(out / f"{name}-in-place")
        assert reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight
        assert torch.equal(reloaded.get_input_embeddings().weight, _tensors(out / f"{name}-gathered")["lm_head.weight"])
    critic = load_value_model(out / "critic-in-place")
    assert torch.equal(critic.value_head.bias, torch.full((1,), 0.25))


# ---------------------------------------------------------------- one process


def test_meta_construction_keeps_buffers_real() -> None:
    """Parameters land on meta; RoPE's inv_freq (in no checkpoint) is computed as in a normal build."""
    config = tiny_config("llama", vocab_size=101, **SIZES)
    with parameters_on_meta():
        meta = AutoModelForCausalLM.from_config(config)
    real = AutoModelForCausalLM.from_config(config)
    assert all(p.is_meta for p in meta.parameters())
    assert not any(p.is_meta for p in nn.Linear(2, 2).parameters())  # the patch is gone after the block
    buffers = dict(real.named_buffers())
    assert buffers and all(torch.equal(b, buffers[n]) for n, b in meta.named_buffers())
    assert meta.lm_head.weight is not meta.model.embed_tokens.weight  # untied stays untied


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(7, 3))
        self.scalar = nn.Parameter(torch.empty(()))
        self.register_buffer("scale", torch.ones(3))  # persistent: read from the checkpoint
        self.register_buffer("steps", torch.arange(4.0), persistent=False)  # in no checkpoint: kept


def test_reader_converts_dtypes_and_reads_persistent_buffers(tmp_path: Path, monkeypatch) -> None:
    """One process, no sharding: a bf16 checkpoint into fp32 parameters (through a staging buffer
    smaller than the tensor), a 0-d parameter, a persistent buffer read, a non-persistent one kept."""
    import rlhf.models.sharded_loading as sharded_loading
    from rlhf.engine.fsdp import materialize_local_shards

    monkeypatch.setattr(sharded_loading, "CHUNK_BYTES", 12)  # 2 rows of 3 bf16 values per read: 4 reads
    stored = {"weight": torch.randn(7, 3).bfloat16(), "scalar": torch.tensor(2.5).bfloat16(),
              "scale": torch.tensor([1.0, 2.0, 3.0])}
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with parameters_on_meta():
        toy = _Toy()
    checkpoint = sharded_loading.read_checkpoint(tmp_path, "toy")
    loader = sharded_loading.plan_shard_loading(toy, checkpoint, tmp_path, "toy", lambda name: [name])
    materialize_local_shards(toy, torch.device("cpu"), loader)
    assert toy.weight.dtype == torch.float32 and torch.equal(toy.weight, stored["weight"].float())
    assert torch.equal(toy.scalar, torch.tensor(2.5)) and torch.equal(toy.scale, stored["scale"])
    assert torch.equal(toy.steps, torch.arange(4.0))


def _edited_copy(src: str, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_bad_checkpoints_fail_with_one_line_naming_folder_and_tensor(folders: dict[str, str], tmp_path: Path) -> None:
    llama = folders["llama"]
    extra = _edited_copy(llama, tmp_path / "extra", lambda t: t.update({"model.wizard.weight": torch.zeros(2)}))
    missing = _edited_copy(llama, tmp_path / "missing", lambda t: t.pop("model.norm.weight"))
    shape = _edited_copy(llama, tmp_path / "shape", lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(UserError, match=rf"--actor {extra}: 1 checkpoint tensor\(s\) .* model.wizard.weight"):
        deferred_causal_lm(str(extra), "--actor")
    with pytest.raises(UserError, match=rf"--ref {missing}: 1 weight\(s\) missing from the checkpoint: model.norm"):
        deferred_causal_lm(str(missing), "--ref")
    with pytest.raises(UserError, match=rf"{shape}: tensor model.norm.weight has shape \[7\] .* needs \[32\]"):
        deferred_causal_lm(str(shape))
    head = _edited_copy(folders["critic"], tmp_path / "head", lambda t: t.update({"score.weight": torch.ones(2, 32)}))
    with pytest.raises(UserError, match=rf"{head}: value head missing or of the wrong shape"):
        deferred_load_value_model(head)
    with pytest.raises(UserError, match=r"is a reward/value model, not a causal LM"):
        deferred_causal_lm(folders["critic"], "--actor")
    index = tmp_path / "index"
    shutil.copytree(folders["bf16_index"], index)
    next(index.glob("model-0000*.safetensors")).unlink()
    with pytest.raises(UserError, match=rf"{index}: model.safetensors.index.json names model-0000\d-of-\d+"):
        deferred_causal_lm(str(index))


def test_a_folder_without_safetensors_is_loaded_in_full(folders: dict[str, str], tmp_path: Path, monkeypatch) -> None:
    import rlhf.models.sharded_loading as sharded_loading

    lines: list[str] = []
    monkeypatch.setattr(sharded_loading.log, "info", lambda msg, *args: lines.append(msg % args))
    folder = tmp_path / "bin"
    shutil.copytree(folders["qwen2"], folder)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    model, weights = deferred_causal_lm(str(folder))
    assert weights is None and not any(p.is_meta for p in model.parameters())
    assert lines == [f"--model {folder} has no safetensors weights: every rank loads the whole model before sharding"]
    assert torch.equal(model.model.embed_tokens.weight, load_causal_lm(folders["qwen2"]).model.embed_tokens.weight)


# ---------------------------------------------------------------- memory


@pytest.mark.slow
def test_peak_rss_while_loading_is_about_half_the_model_per_rank() -> None:
    """2 ranks, ZeRO-3, a ~190 MB fp32 Llama: each rank's peak RSS while its TrainEngine loads is at most
    0.6 x the model's fp32 bytes over the process's RSS before loading (0.5 is the rank's own half)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "scripts/measure_load_rss.py", "--modes", "sharded"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    model_mb, sharded = result["model_fp32_mb"], result["sharded"]
    assert 150 < model_mb < 300
    for overhead, peak in zip(sharded["overhead_mb"], sharded["peak_mb"]):
        assert peak <= 0.6 * model_mb + overhead, result
