"""LoRA (peft) in the engine: adapters only are trained, the base with adapters off is the starting
model, merged weights (on the shards, and on a consolidated state dict) equal the adapted model,
rollout mode generates with the merged weights, and bad target modules fail clearly."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from rlhf.config import LoRAConfig
from rlhf.engine.config import EngineConfig
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.backends.cpu.fused_layers import fuse_layer_ops
from rlhf.engine.adapters import adapters_disabled, adapter_state_dict, merge_state_dict, merged_parameters
from rlhf.engine.rollout import rollout_mode
from rlhf.engine.sampling import SamplingParams
from rlhf.engine.train_engine import TrainEngine
from rlhf.errors import UserError
from rlhf.models.lora import apply_lora, resolve_target_modules
from rlhf.models.tiny import build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def ctx() -> DistributedContext:
    return DistributedContext.initialize()


def _tiny(family: str = "llama"):
    return build_tiny_model(family, build_char_tokenizer(), seed=0, hidden_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2)


def _trained_engine(ctx: DistributedContext, family: str, steps: int = 3) -> tuple[TrainEngine, torch.nn.Module]:
    model = _tiny(family)
    base = copy.deepcopy(model).eval()
    fuse_layer_ops(base)  # computed as the engine computes its layers (fused_layers, the default)
    apply_lora(model, LoRAConfig(lora_rank=4, lora_alpha=8.0), seed=0)
    config = EngineConfig(zero_stage=3, dtype="fp32", micro_batch_size=2, lr=1e-2)
    engine = TrainEngine(model, config, ctx, total_steps=steps)
    ids = torch.randint(3, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        engine.backward(engine.model(input_ids=ids, labels=ids).loss)
        assert engine.step().stepped
    engine.eval()
    return engine, base


def test_targets_default_to_every_projection_in_the_decoder_layers() -> None:
    llama = _tiny("llama")
    assert resolve_target_modules(llama, ["all-linear"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                                               "up_proj", "v_proj"]
    assert resolve_target_modules(_tiny("gpt2"), ["all-linear"]) == ["c_attn", "c_fc", "c_proj"]
    with pytest.raises(UserError, match="--lora-target-modules: no linear layer named 'qkv'.*q_proj"):
        resolve_target_modules(llama, ["qkv"])


def test_only_adapters_train_and_the_base_is_the_starting_model(ctx: DistributedContext) -> None:
    model = _tiny()
    apply_lora(model, LoRAConfig(lora_rank=4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    engine, base = _trained_engine(ctx, "llama")
    ids = torch.randint(3, 50, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = engine.model(input_ids=ids).logits
        with adapters_disabled(engine.model):
            without = engine.model(input_ids=ids).logits
        after = engine.model(input_ids=ids).logits
    assert torch.equal(without, base(input_ids=ids).logits)  # the frozen base did not move
    assert not torch.allclose(adapted, without)  # the adapters learned something
    assert torch.equal(after, adapted)  # the context restores the adapters


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # GPT-2: Conv1D, fan_in_fan_out
def test_merged_weights_equal_the_adapted_model(ctx: DistributedContext, family: str) -> None:
    engine, base = _trained_engine(ctx, family)
    state = engine.full_state_dict()
    merged = merge_state_dict(engine.model, state)
    assert set(dict(base.named_parameters())) <= set(merged) <= set(base.state_dict())
    on_shards = merged_parameters(engine.model)
    for name, tensor in on_shards.items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        torch.testing.assert_close(full, merged[name], rtol=1e-6, atol=1e-6)
    base.load_state_dict(merged, strict=False)
    ids = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=ids).logits, engine.model(input_ids=ids).logits, rtol=1e-5,
                                   atol=1e-5)
    adapter = adapter_state_dict(engine.model, state)
    assert adapter and all(k.startswith("base_model.model.") and ".default." not in k for k in adapter)


def test_rollout_generates_with_merged_weights(ctx: DistributedContext) -> None:
    engine, _ = _trained_engine(ctx, "llama")
    prompts = torch.randint(3, 50, (2, 5), generator=torch.Generator().manual_seed(3))
    params = SamplingParams(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with rollout_mode(engine) as rollout:
        out = rollout.generate(prompts, torch.ones_like(prompts), params)
        assert rollout.parity_max_diff < 1e-4
    with torch.no_grad():
        want = engine.model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=6,
                                     do_sample=False, pad_token_id=0)
    assert torch.equal(out.sequences, want)


def test_reference_is_the_actor_with_adapters_off(ctx: DistributedContext) -> None:
    from rlhf.engine.inference import FrozenModel
    from rlhf.engine.adapters import AdaptersOffReference

    engine, base = _trained_engine(ctx, "llama")
    sequences = torch.randint(3, 50, (3, 11), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(sequences)
    mask[0, :3] = 0
    reference = AdaptersOffReference(engine.model, ctx, micro_batch_size=2)
    frozen = FrozenModel(base, ctx, zero_stage=3, dtype="fp32", offload=False, micro_batch_size=2, name="base")
    for share, start in ((0, 0), (0, 5), (4, 5)):
        want = frozen.logprobs(sequences, mask, share, response_start=start)
        got = reference.logprobs(sequences, mask, share, response_start=start)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    adapted = FrozenModel.logprobs(reference, sequences, mask)  # the adapters are back on after the call
    assert not torch.allclose(adapted, reference.logprobs(sequences, mask))


# --------------------------------------------------------------- the stages, from the CLI


def _losses(output) -> list[float]:
    from tests.conftest import train_losses
    return train_losses(output)


@pytest.mark.slow
def test_lora_sft_on_two_ranks_learns_and_its_adapter_equals_the_merged_export(tmp_path, tiny_model_dirs,
                                                                               sft_data) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.conftest import run_cli

    base = tiny_model_dirs["llama"]
    common = ["sft", "--model", str(base), "--data", str(sft_data), "--max-steps", "12", "--lr", "1e-2",
              "--train-batch-size", "8", "--report-to", "none", "--lora-rank", "8", "--lora-dropout", "0.0"]
    one = run_cli([*common, "--output", str(tmp_path / "one"), "--micro-batch-size", "8"])
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_cli([*common, "--output", str(tmp_path / "two"), "--micro-batch-size", "4", "--export-adapter"], nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    losses = _losses(tmp_path / "two")
    assert losses[-1] < losses[0] - 0.3
    assert losses == pytest.approx(_losses(tmp_path / "one"), abs=1e-4)  # 2 ranks = 1 rank
    assert not (tmp_path / "two" / "model" / "config.json").exists()  # an adapter folder, not a model
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "model").eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "two" / "model").eval()
    ids = torch.randint(3, 30, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_lora_ppo_on_two_ranks_uses_the_base_as_reference(tmp_path) -> None:
    from tests.conftest import read_metrics, run_cli, tiny_actor_and_reward, write_jsonl

    actor, reward = tiny_actor_and_reward(tmp_path)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{a}+{a}="} for a in range(32)])
    result = run_cli(["ppo", "--actor", str(actor), "--reward", str(reward), "--data", str(prompts), "--output",
                      str(tmp_path / "ppo"), "--max-steps", "2", "--generation-batch-size", "4", "--max-new-tokens", "6",
                      "--micro-batch-size", "2", "--report-to", "none", "--lora-rank", "4", "--lr", "1e-2"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "ppo")
    # The adapters start at zero: the first iteration's actor is its base, which is the reference.
    assert abs(rows[0]["kl"]) < 1e-6
    assert rows[0]["rollout_parity_max_diff"] < 1e-4
    assert "lora" not in json.dumps(sorted(_saved_names(tmp_path / "ppo" / "model")))


def _saved_names(folder) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return list(f.keys())


def test_lora_reward_model_trains_adapters_and_its_head(tmp_path, tiny_model_dirs) -> None:
    from rlhf.cli import main
    from rlhf.models.value_model import load_value_model
    from tests.conftest import write_jsonl

    pairs = [{"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(64)]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    out = tmp_path / "rm"
    main(["reward", "--model", str(tiny_model_dirs["llama"]), "--data", str(data), "--output", str(out),
          "--max-steps", "20", "--micro-batch-size", "16", "--lr", "5e-3", "--report-to", "none", "--lora-rank", "4"])
    losses = _losses(out)
    assert losses[-1] < losses[0]
    model = load_value_model(out / "model")  # merged: a plain value model folder
    assert not any("lora" in name for name, _ in model.named_parameters())
