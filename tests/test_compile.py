"""`--compile`: each decoder layer torch.compiled (before FSDP2 wraps it) gives the eager numbers.

Train engines (with and without activation checkpointing), frozen models, prompt-shared forwards
through a KV cache (run eager), rollout mode (its copy stays plain), `rlhf ppo --compile` from the
command line, and the ds_config `compile` section. Compiling is slow on a small CPU (a few seconds
per graph, cached on disk by inductor across runs), so every model here is the 2-layer tiny Llama.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from rlhf.cli import main
from rlhf.engine.config import EngineConfig
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.inference import FrozenModel
from rlhf.engine.decoder_layers import decoder_layers
from rlhf.engine.rollout import rollout_mode
from rlhf.engine.sampling import SamplingParams
from rlhf.engine.train_engine import TrainEngine
from rlhf.errors import UserError
from rlhf.models.loading import load_causal_lm
from tests.conftest import read_metrics, run_cli, write_jsonl


@pytest.fixture(scope="module")
def ctx(one_thread: None) -> DistributedContext:
    return DistributedContext.initialize()


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test starts with no compiled code, so an earlier test's cache entries (or a spent
    recompile limit, after which dynamo silently runs eager) cannot make it pass without compiling."""
    limit = torch._dynamo.config.recompile_limit  # --compile raises it for the process
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = limit


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


def batch(rows: int = 4, width: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a mask with some left padding (as rollouts have)."""
    ids = torch.randint(4, 90, (rows, width), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    return ids, mask


def make_engine(model_dir: Path, ctx: DistributedContext, **overrides: object) -> TrainEngine:
    # Adam's first step is ~lr x sign(grad): on a gradient element near 0 a rounding-level difference
    # could flip it, so a larger eps keeps the parameter comparison about the gradients.
    config = EngineConfig(zero_stage=3, dtype="fp32", micro_batch_size=4, optimizer_impl="torch", lr=1e-3,
                          adam_eps=1e-6, **overrides)
    return TrainEngine(load_causal_lm(str(model_dir)), config, ctx, total_steps=10, name="actor")


def one_step(engine: TrainEngine, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, dict, dict]:
    """(loss, full gradients, full params after the step) of one LM-loss optimizer step."""
    engine.train()
    labels = ids.masked_fill(mask == 0, -100)
    loss = engine.model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    engine.backward(loss)
    def whole(t: torch.Tensor) -> torch.Tensor:  # plain on one process in fp32 (wraps_in_fsdp)
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    grads = {n: whole(p.grad).clone() for n, p in engine.model.named_parameters()}
    engine.step()
    params = {n: whole(p).detach().clone() for n, p in engine.model.named_parameters()}
    return float(loss.detach()), grads, params


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_compiled_train_engine_matches_eager(tiny_model_dirs, ctx, checkpointing):
    model = tiny_model_dirs["llama"]
    eager = make_engine(model, ctx, gradient_checkpointing=checkpointing)
    compiled = make_engine(model, ctx, gradient_checkpointing=checkpointing, compile=True)
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(compiled.model))
    # Parameter names stay those of the plain model (no `_orig_mod.`): checkpoints and rollout copies rely on it.
    assert [n for n, _ in compiled.model.named_parameters()] == [n for n, _ in eager.model.named_parameters()]
    ids, mask = batch()
    loss_e, grads_e, params_e = one_step(eager, ids, mask)
    loss_c, grads_c, params_c = one_step(compiled, ids, mask)
    assert loss_c == pytest.approx(loss_e, rel=1e-6, abs=1e-6)
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(params_c[name], params_e[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert graphs_compiled() >= 1


def test_compiled_frozen_model_matches_eager_and_keeps_prompt_sharing_eager(tiny_model_dirs, ctx):
    model = tiny_model_dirs["llama"]
    eager = FrozenModel(load_causal_lm(str(model)), ctx, zero_stage=3, dtype="fp32", offload=False,
                        micro_batch_size=4, name="ref")
    compiled = FrozenModel(load_causal_lm(str(model)), ctx, zero_stage=3, dtype="fp32", offload=False,
                           micro_batch_size=4, name="ref", compile=True)
    for width in (12, 9):  # a second length: the recompile with dynamic dims is exact too
        ids, mask = batch(width=width, seed=width)
        torch.testing.assert_close(compiled.logprobs(ids, mask), eager.logprobs(ids, mask), rtol=1e-5, atol=1e-5)
    graphs = graphs_compiled()
    assert graphs >= 1
    # Groups sharing a prompt run it once through a KV cache: those layer calls run eager (a cache
    # would make every layer its own graph and spend the recompile limit), with the same numbers.
    group_ids = torch.cat([ids[:2].repeat_interleave(2, 0)[:, :6], torch.randint(4, 90, (4, 5))], dim=1)
    group_mask = torch.cat([mask[:2].repeat_interleave(2, 0)[:, :6], torch.ones(4, 5, dtype=mask.dtype)], dim=1)
    torch.testing.assert_close(compiled.logprobs(group_ids, group_mask, shared_prefix=6),
                               eager.logprobs(group_ids, group_mask, shared_prefix=6), rtol=1e-5, atol=1e-5)
    assert graphs_compiled() == graphs


def test_rollout_of_a_compiled_engine_is_plain_and_passes_parity(tiny_model_dirs, ctx):
    engine = make_engine(tiny_model_dirs["llama"], ctx, compile=True)
    prompts, mask = batch(rows=2, width=6)
    prompts = prompts.masked_fill(mask == 0, 0)
    params = SamplingParams(max_new_tokens=6, do_sample=False, eos_token_id=2, pad_token_id=0)
    with rollout_mode(engine) as rollout:
        assert all(layer._compiled_call_impl is None for layer in decoder_layers(rollout.model))
        out = rollout.generate(prompts, mask, params)
        assert rollout.parity_max_diff is not None and rollout.parity_max_diff < 1e-4
    assert out.sequences.shape == (2, 12)
    assert graphs_compiled() >= 1  # the parity check ran the compiled train model


@pytest.mark.slow
def test_ppo_with_compile_runs_from_the_command_line(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["llama"]
    reward = tmp_path / "reward.py"
    reward.write_text("def letter_a(prompt: str, response: str) -> float:\n"
                      "    return response.count('a') / max(len(response), 1)\n")
    # Prompts of one length and micro-batches as large as the parity check's 2 rows keep the shapes
    # few: each new (shape, grad mode, frozen or trained) variant costs seconds of compiling.
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in ("bcd", "efg", "cdb", "hgf")] * 4)
    out = tmp_path / "ppo"
    main(["ppo", "--actor", str(model), "--critic", str(model), "--reward-fn", f"{reward}:letter_a",
          "--data", str(data), "--output", str(out), "--max-steps", "2", "--generation-batch-size", "2",
          "--max-new-tokens", "4", "--micro-batch-size", "2", "--report-to", "none", "--optimizer-impl", "torch",
          "--compile"])
    assert (out / "DONE").exists()
    assert len(read_metrics(out)) == 2
    assert "compile: true" in (out / "config.yaml").read_text()
    assert graphs_compiled() >= 1


@pytest.mark.slow
def test_two_rank_ppo_with_compile_and_a_tp2_rollout(tiny_model_dirs, tmp_path):
    """FSDP2 shards over 2 gloo ranks around compiled layers, resharded into a TP-2 rollout (~50 s
    with a cold inductor cache: both ranks compile)."""
    model = tiny_model_dirs["llama"]
    reward = tmp_path / "reward.py"
    reward.write_text("def letter_a(prompt: str, response: str) -> float:\n    return float('a' in response)\n")
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in ("bcd", "efg", "cdb", "hgf")] * 4)
    out = tmp_path / "ppo"
    result = run_cli(["ppo", "--actor", str(model), "--critic", str(model), "--reward-fn", f"{reward}:letter_a",
                      "--data", str(data), "--output", str(out), "--max-steps", "2", "--generation-batch-size", "2",
                      "--max-new-tokens", "4", "--micro-batch-size", "2", "--report-to", "none",
                      "--optimizer-impl", "torch", "--inference-tp-size", "2", "--compile", "--rollout-parity-every", "1"],
                     nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "DONE").exists()
    assert result.stderr.count("compile=True") >= 2 and "recompile_limit" not in result.stderr
    assert all(row["rollout_parity_max_diff"] < 1e-4 for row in read_metrics(out))


def test_ds_config_compile_section(tmp_path):
    from rlhf.ds_config import import_ds_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"compile": {"enabled": True, "backend": "inductor", "kwargs": {}}}))
    imported = import_ds_config(path)
    assert imported.values == {"compile": True} and imported.inert == ["compile.kwargs"]
    path.write_text(json.dumps({"compile": {"enabled": True, "backend": "eager"}}))
    with pytest.raises(UserError, match="compile.backend: 'eager' is not supported; use inductor"):
        import_ds_config(path)
    path.write_text(json.dumps({"compile": {"enabled": True, "mode": "max-autotune"}}))
    with pytest.raises(UserError, match="compile.mode: unknown DeepSpeed key"):
        import_ds_config(path)
