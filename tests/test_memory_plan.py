"""Measured peak memory per phase (engine/phase_memory.py) and `rlhf plan` (engine/memory_plan.py,
stages/plan.py): the meter, the activation model against autograd's saved tensors, parameter
counts against real models, the command, and the plan against what a stage measures (CPU RSS)."""

from __future__ import annotations

import os
import json
import mmap
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, read_metrics, run_cli

sys.path.insert(0, str(REPO / "scripts"))

import check_plan  # noqa: E402  (scripts/check_plan.py: the same cases, models and data)

from rlhf.cli import main  # noqa: E402
from rlhf.engine import phase_memory  # noqa: E402
from rlhf.engine.fsdp import enable_activation_checkpointing  # noqa: E402
from rlhf.engine.phase_memory import GIB, PhaseMemory  # noqa: E402
from rlhf.engine.memory_plan import model_shape, saved_activation_bytes  # noqa: E402
from rlhf.models.tiny import FAMILIES, tiny_config  # noqa: E402

MIB = 2**20


def touched(mib: int) -> mmap.mmap:
    """Fresh resident pages: an anonymous mapping, every page written (not from malloc, whose freed
    heap an earlier in-process stage may have left resident: the engine's glibc tuning)."""
    pages = mmap.mmap(-1, mib * MIB)
    for offset in range(0, mib * MIB, mmap.PAGESIZE):
        pages[offset] = 1
    return pages


# ------------------------------------------------------------------ the meter


def test_cpu_phase_peaks_nest_and_reset() -> None:
    meter = PhaseMemory(torch.device("cpu"))
    if meter.mode == "lifetime":
        pytest.skip("no /proc here")
    with meter.phase("outer"):
        before = phase_memory.current_rss()
        with meter.phase("inner"):
            touched(96).close()
        touched(16).close()
    peaks = meter.take()
    assert peaks["inner"] - before > 80 * MIB  # the inner block's tensor was seen...
    assert peaks["outer"] >= peaks["inner"]  # ...and counts for the phase around it
    assert meter.take() == {}  # read once: the window starts again


def test_metrics_are_gib_and_reduced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(phase_memory, "_baseline", 1 * GIB)
    meter = PhaseMemory(torch.device("cpu"))
    with meter.phase("train"):
        pass
    seen = []

    def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.clone())
        return t * 2  # as if another rank had twice as much

    metrics = meter.metrics(all_reduce_max)
    assert set(metrics) == {"peak_mem_gb_train", "mem_baseline_gb"}
    assert metrics["mem_baseline_gb"] == pytest.approx(2.0)
    assert metrics["peak_mem_gb_train"] == pytest.approx(2 * float(seen[0][0]) / GIB)


def test_sampling_fallback_without_clear_refs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if phase_memory.current_rss() is None:
        pytest.skip("no /proc here")
    monkeypatch.setattr(phase_memory, "CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    monkeypatch.setattr(phase_memory, "SAMPLE_SECONDS", 0.0005)
    meter = PhaseMemory(torch.device("cpu"))
    assert meter.mode == "sample"
    before = phase_memory.current_rss()
    with meter.phase("p"):
        x = touched(64)
        time.sleep(0.05)  # the sampler sees it
        x.close()
    assert meter.take()["p"] - before > 48 * MIB


# ------------------------------------------------------------------ the model of memory


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in a forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return sum(saved.values())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("lora", [None, (4, 0.0), (4, 0.1)])
def test_activation_model_matches_autograd(family: str, dtype: torch.dtype, checkpointing: bool,
                                           lora: tuple[int, float] | None) -> None:
    """The per-family table of saved tensors is what Hugging Face's layers keep (within the RoPE
    tables and integer ids it leaves out), in fp32 and in 16-bit compute, and with peft's LoRA
    adapters (frozen base; with and without adapter dropout)."""
    from functools import partial

    from transformers import AutoModelForCausalLM

    from rlhf.config import LoRAConfig
    from rlhf.models.lora import apply_lora

    config = tiny_config(family, vocab_size=50, hidden_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=160)
    if family in ("llama", "qwen2", "mistral"):
        config.head_dim = 16  # queries narrower than the hidden size: widths counted apart
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    adapt = partial(apply_lora, config=LoRAConfig(lora_rank=lora[0], lora_dropout=lora[1])) if lora else None
    if adapt is not None:
        adapt(model)
    model = model.to(dtype).train()
    if checkpointing:
        enable_activation_checkpointing(model)
    ids = torch.randint(0, 50, (2, 12))
    measured = saved_bytes(model, ids)
    predicted = saved_activation_bytes(model_shape(config, adapt=adapt), ids.numel(), dtype.itemsize, checkpointing)
    assert predicted == pytest.approx(measured, rel=0.03)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_shapes_count_the_real_parameters(family: str) -> None:
    """The meta-device shapes hold exactly the parameters of the model the stages build: causal
    LM (tied embeddings once) and value model (backbone + head with bias)."""
    from transformers import AutoModelForCausalLM

    from rlhf.models.value_model import ValueModel

    config = tiny_config(family, vocab_size=100, hidden_size=32, num_layers=3)
    lm = AutoModelForCausalLM.from_config(config)
    value = ValueModel(lm.base_model)
    assert model_shape(config, "lm").params == sum(p.numel() for p in lm.parameters())
    assert model_shape(config, "value").params == sum(p.numel() for p in value.parameters())
    assert model_shape(config).layers == 3


def test_a_plain_trained_model_gathers_nothing() -> None:
    """One process in fp32 without offload: the engine leaves the model plain (no FSDP2), so the
    plan gathers nothing for it; 16-bit compute, offload or a second rank bring FSDP2's gathered
    copies back."""
    from rlhf.engine.memory_plan import TrainedModelMemory

    shape = model_shape(tiny_config("llama", vocab_size=100, hidden_size=32, num_layers=3))
    plain = TrainedModelMemory(shape, zero_stage=3, compute_bytes=4, world_size=1)
    assert plain.plain and plain.gathered_in_forward() == plain.root_grad == 0
    for wrapped in (TrainedModelMemory(shape, 3, 2, 1), TrainedModelMemory(shape, 3, 4, 1, offload=True),
                    TrainedModelMemory(shape, 3, 4, 2)):
        assert not wrapped.plain and wrapped.gathered_in_forward() > 0 and wrapped.root_grad > 0


def test_packed_decode_weights_are_planned_where_the_step_packs_them() -> None:
    """The packed copy (engine/backends/cpu/decoder.py) is every layer's projections and the LM head in
    16-column panels: exactly what the decoder packs; the generation phase holds it only where
    --cpu-matmul resolves to oneDNN (the decoder's "auto")."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from rlhf.config import PPOConfig
    from rlhf.engine.backends.cpu.decode_op import load_cpu_decode_op
    from rlhf.engine.backends.cpu.matmul import onednn_available
    from rlhf.engine.backends.cpu.decoder import CpuLlamaDecoder
    from rlhf.engine.backends.cpu.plan_terms import packed_weight_bytes
    from rlhf.stages.plan import load_model_config, plan_stage

    config = tiny_config("llama", vocab_size=97, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=72)
    op = load_cpu_decode_op()
    if op is not None:
        decoder = CpuLlamaDecoder(AutoModelForCausalLM.from_config(config).eval(), 2, 8, packed_gemm=True)
        decoder.kernel_step_from(op, "scalar")
        assert packed_weight_bytes(model_shape(config), 4) == sum(t.numel() * 4 for t in decoder._packed)
    ppo = PPOConfig(actor="tiny", reward_fn=["sort"], advantage_estimator="grpo", samples_per_prompt=4)
    planned = {}
    for choice in ("aten", "onednn") if onednn_available() else ("aten",):
        run = dataclasses.replace(ppo, cpu=dataclasses.replace(ppo.cpu, cpu_matmul=choice))
        generation = next(p for p in plan_stage("ppo", run, 1, "cpu", baseline_gb=0.0).phases if p.name == "generation")
        assert generation.moment == "decode"
        planned[choice] = generation.components.get("packed weights", 0)  # zero terms are dropped
    assert planned["aten"] == 0
    expected = packed_weight_bytes(model_shape(load_model_config("tiny", "--actor")), 4)
    assert planned.get("onednn", expected) == expected > 0


# ------------------------------------------------------------------ the command


def test_plan_command_prints_a_table_then_json(capsys: pytest.CaptureFixture) -> None:
    main(["plan", "ppo", "--actor", "tiny", "--reward", "tiny:llama", "--world-size", "2", "--device", "cpu",
          "--max-new-tokens", "16", "--baseline-gb", "0.5"])
    out = capsys.readouterr().out.strip().splitlines()
    plan = json.loads(out[-1])
    assert "generation" in out[1] and "rollout copy" in "\n".join(out)
    assert set(plan["phases"]) == {"generation", "reward", "experience", "training"}
    assert plan["world_size"] == 2 and plan["baseline_gb"] == 0.5
    for phase in plan["phases"].values():
        assert phase["peak_gb"] == pytest.approx(0.5 + sum(phase["components_gb"].values()))
        assert phase["above_baseline_gb"] > 0


def test_plan_reads_the_stage_config_file(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """`rlhf plan ppo --config` takes the stage's own file (sections and flags as `rlhf ppo`)."""
    config = tmp_path / "ppo.yaml"
    config.write_text("actor: tiny:qwen2\nreward_fn: [sort]\nadvantage_estimator: grpo\nsamples_per_prompt: 4\n"
                      "engine:\n  zero_stage: 2\n")
    main(["plan", "ppo", "--config", str(config), "--nproc-per-node", "2", "--device", "cpu", "--baseline-gb", "0"])
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["world_size"] == 2
    training = plan["phases"]["training"]["components_gb"]
    assert "critic params" not in training and "actor gathered" in training  # no critic; ZeRO-2 keeps it gathered


def test_plan_holds_no_reference_without_a_kl_term(capsys: pytest.CaptureFixture) -> None:
    """At --kl-coef 0 PPO builds no reference model; --log-kl brings it back, and the plan follows."""
    common = ["plan", "ppo", "--actor", "tiny", "--reward-fn", "sort", "--advantage-estimator", "grpo", "--samples-per-prompt", "4", "--device",
              "cpu", "--baseline-gb", "0", "--kl-coef", "0"]
    plans = []
    for extra in ([], ["--log-kl"]):
        main([*common, *extra])
        plans.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    without, logged = (p["phases"]["experience"]["components_gb"] for p in plans)
    assert "ref params" not in without and not any(k.startswith("ref ") for k in without)
    assert logged["ref params"] > 0


def test_dpo_plan_holds_the_reference_only_where_the_stage_keeps_one(capsys: pytest.CaptureFixture) -> None:
    """A frozen reference copy by default; none with LoRA (adapters off), SimPO or precomputed log-probs."""
    common = ["plan", "dpo", "--model", "tiny", "--device", "cpu", "--baseline-gb", "0", "--micro-batch-size", "4",
              "--seq-len", "64"]
    train = {}
    for name, extra in (("copy", []), ("lora", ["--lora-rank", "4"]), ("simpo", ["--loss-type", "simpo"]),
                        ("precomputed", ["--precompute-ref-logprobs"])):
        main([*common, *extra])
        train[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["phases"]["train"]["components_gb"]
    assert train["copy"]["ref params"] == pytest.approx(train["copy"]["model params"])  # fp32: the same bytes
    for name in ("lora", "simpo", "precomputed"):
        assert not any(k.startswith("ref ") for k in train[name]), name


def test_plan_rejects_a_missing_model(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "sft", "--model", str(tmp_path / "nowhere")])
    assert exit_info.value.code == 2
    assert "--model" in capsys.readouterr().err


def test_zero3_on_more_ranks_plans_less_per_rank() -> None:
    from rlhf.config import SFTConfig
    from rlhf.stages.plan import plan_stage

    config = SFTConfig(model="tiny")
    one, eight = (plan_stage("sft", config, world, "cpu", baseline_gb=0.0) for world in (1, 8))
    train1, train8 = one.phases[0].components, eight.phases[0].components
    assert train8["model params"] * 8 == pytest.approx(train1["model params"], rel=0.1)
    assert eight.peak < one.peak


# ------------------------------------------------------------------ plan against measurement


def compare(case: check_plan.Case, tmp_path: Path, hidden: int, layers: int, vocab: int) -> dict:
    """check_plan.py's comparison of one case, in a temp folder."""
    import os

    base, reward = check_plan.build_models(tmp_path / "models", hidden, layers, vocab)
    data = check_plan.write_data(tmp_path, 256, 64)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, "MALLOC_MMAP_THRESHOLD_": "65536",
           "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return check_plan.check(case, tmp_path / "runs", base, reward, data, env)


def assert_within(result: dict, tolerance: float = check_plan.TOLERANCE) -> None:
    for phase, p in result["phases"].items():
        assert abs(p["ratio"] - 1) <= tolerance, (phase, p)
        assert abs(p["ratio_above_baseline"] - 1) <= tolerance, (phase, p)


@pytest.mark.slow
def test_sft_measures_each_phase_and_the_plan_predicts_it(tmp_path: Path) -> None:
    """sft logs peak_mem_gb_train/_eval and mem_baseline_gb; the plan is within 15% of them, on
    total RSS and above the baseline (a 10M-parameter model: params, grads and Adam weigh as
    much as the activations)."""
    cases = {c.name: c for c in check_plan.cases(256, 64, 64)}
    result = compare(cases["sft-z3"], tmp_path, hidden=256, layers=8, vocab=8192)
    assert set(result["phases"]) == {"train", "eval"}
    assert_within(result)
    rows = read_metrics(tmp_path / "runs" / "sft-z3")
    assert all("peak_mem_gb_train" in r and "mem_baseline_gb" in r for r in rows if "loss" in r)


@pytest.mark.slow
def test_plan_predicts_ppo_phases_within_15_percent(tmp_path: Path) -> None:
    """PPO's four phases (GAE, reward model and critic) on a 10M-parameter model."""
    cases = {c.name: c for c in check_plan.cases(256, 64, 64)}
    result = compare(cases["ppo-z3"], tmp_path, hidden=256, layers=8, vocab=8192)
    assert set(result["phases"]) == {"generation", "reward", "experience", "training"}
    assert_within(result)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("RLHF_PLAN_CHECK") != "1",
                    reason="the full plan check (~6 min): RLHF_PLAN_CHECK=1, or python scripts/check_plan.py")
@pytest.mark.parametrize("name", ["ppo-z3", "ppo-z3-2rank", "sft-z3-ckpt-2rank", "sft-z0", "sft-z2-2rank",
                                  "reward-z3", "grpo-z3", "sft-lora", "ppo-lora-2rank"])
def test_plan_predicts_every_stage_within_15_percent(name: str, tmp_path: Path) -> None:
    """scripts/check_plan.py's cases on its 32M-parameter model: 1 and 2 ranks, ZeRO 0, 2 and 3,
    checkpointing, GAE with a reward model and critic, GRPO with shared prompts, LoRA."""
    cases = {c.name: c for c in check_plan.cases(256, 64, 64)}
    assert_within(compare(cases[name], tmp_path, hidden=512, layers=8, vocab=8192))


def test_ppo_logs_peak_memory_per_phase(tmp_path: Path, tiny_model_dirs: dict) -> None:
    """Every PPO iteration row has the four phases' peaks and the baseline."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "abc"[: 1 + i % 3]}) + "\n" for i in range(16)))
    rewards = tmp_path / "r.py"
    rewards.write_text("def one(prompt, response):\n    return float(len(response))\n")
    out = tmp_path / "ppo"
    result = run_cli(["ppo", "--actor", str(tiny_model_dirs["llama"]), "--critic", str(tiny_model_dirs["llama"]),
                      "--reward-fn", f"{rewards}:one", "--data", str(prompts), "--output", str(out),
                      "--max-steps", "2", "--generation-batch-size", "4", "--max-new-tokens", "4",
                      "--report-to", "none", "--optimizer-impl", "torch"])
    assert result.returncode == 0, result.stderr[-2000:]
    for row in read_metrics(out):
        for phase in ("generation", "reward", "experience", "training"):
            assert row[f"peak_mem_gb_{phase}"] > row["mem_baseline_gb"] > 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("lora", [None, (4, 0.0), (4, 0.1)])
def test_activation_model_matches_autograd_with_fused_layers(family: str, lora: tuple[int, float] | None) -> None:
    """With the fused layer ops (float32 CPU, the default there), the layers keep less: each norm
    its input and rstd, the MLP no act(gate); the table follows."""
    from functools import partial

    from transformers import AutoModelForCausalLM

    from rlhf.config import LoRAConfig
    from rlhf.engine.backends.cpu.fused_layers import fuse_layer_ops
    from rlhf.models.lora import apply_lora

    config = tiny_config(family, vocab_size=50, hidden_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=160)
    config.head_dim = 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    adapt = partial(apply_lora, config=LoRAConfig(lora_rank=lora[0], lora_dropout=lora[1])) if lora else None
    if adapt is not None:
        adapt(model)
    assert fuse_layer_ops(model) > 0
    model = model.float().train()
    ids = torch.randint(0, 50, (2, 12))
    predicted = saved_activation_bytes(model_shape(config, adapt=adapt, fused_layer_ops=True), ids.numel(), 4)
    assert predicted == pytest.approx(saved_bytes(model, ids), rel=0.03)
    assert predicted < saved_activation_bytes(model_shape(config, adapt=adapt), ids.numel(), 4)
