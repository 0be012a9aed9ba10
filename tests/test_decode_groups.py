"""Grouped decoding (engine/backends/cpu/row_groups.py): the group-size rule against hand-computed cases, and
generate() over row groups giving exactly what the one-group loop gives (tokens, log-probs, masks,
the generator's state afterwards)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

import rlhf.engine.backends.cpu as cpu_backend
from rlhf.config import PPOConfig
from rlhf.config_sources import ConfigSources, resolve_config
from rlhf.engine.backends.cpu import CpuBackend
from rlhf.engine.backends import CpuConfig
from rlhf.engine.backends.registry import using_backend
from rlhf.engine.backends.cpu import row_groups as decode_groups
from rlhf.engine.backends.cpu.decoder import CpuLlamaDecoder
from rlhf.engine.backends.cpu.row_groups import last_level_cache_bytes, row_groups, rows_per_group
from rlhf.engine.decode_loop import DecodeLoop
from rlhf.engine.generation import generate
from rlhf.engine.sampling import SamplingParams
from rlhf.errors import UserError
from rlhf.models.tiny import build_tiny_model
from tests.test_generation import PAD, batch, tok  # noqa: F401 (the same left-padded prompts and fixtures)

MB = 2**20


def test_rows_per_group_by_hand() -> None:
    # The 4-layer tiny Llama of scripts/bench_ppo.py on a 32 MB L3: 12.7 MB of packed weights; a row's float16 cache at the
    # mean length is 0.79 MB (256 new tokens) or 0.39 MB (64). Half the cache leaves room for
    # 4.2 / 8.5 rows: 8 either way (at 256 as the fallback, 12.7 + 8 x 0.79 = 19 MB <= 32).
    assert rows_per_group(32, int(12.7 * MB), int(0.79 * MB), 32 * MB) == 8
    assert rows_per_group(32, int(12.7 * MB), int(0.39 * MB), 32 * MB) == 8
    # Small weights: 1 + 32 x 0.39 = 13.5 MB fits half the cache whole; 64 rows take (16 - 1) / 0.39
    # = 38 -> 32 rows a group.
    assert rows_per_group(32, MB, int(0.39 * MB), 32 * MB) == 32
    assert rows_per_group(64, MB, int(0.39 * MB), 32 * MB) == 32
    # Weights beyond the cache (SmolLM2-135M: 540 MB), or 8 rows beyond it: every row together.
    assert rows_per_group(32, 540 * MB, MB // 2, 32 * MB) == 32
    assert rows_per_group(32, 20 * MB, 2 * MB, 32 * MB) == 32
    # No known cache, or no more rows than one group.
    assert rows_per_group(32, MB, MB, None) == 32
    assert rows_per_group(8, 12 * MB, MB, 32 * MB) == 8


def test_row_groups_cover_the_batch_evenly() -> None:
    assert row_groups(32, 8) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert row_groups(20, 8) == [(0, 6), (6, 13), (13, 20)]
    assert row_groups(5, 8) == [(0, 5)]
    assert row_groups(3, 1) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="rows per group must be >= 1"):
        row_groups(4, 0)


def test_last_level_cache_from_sysfs(tmp_path: Path) -> None:
    for name, level, kind, size in [("index0", 1, "Data", "48K"), ("index1", 1, "Instruction", "32K"),
                                    ("index2", 2, "Unified", "1024K"), ("index3", 3, "Unified", "32768K")]:
        (tmp_path / name).mkdir()
        for field, value in (("level", level), ("type", kind), ("size", size)):
            (tmp_path / name / field).write_text(f"{value}\n")
    assert last_level_cache_bytes(tmp_path) == 32 * MB
    (tmp_path / "index3" / "size").write_text("garbage\n")  # an unreadable level is skipped
    assert last_level_cache_bytes(tmp_path) == MB
    assert last_level_cache_bytes(tmp_path / "missing") is None


def test_cpu_config_validates_rows_per_group() -> None:
    for bad in (0, -3, 2.5, True, "0"):
        with pytest.raises(UserError, match="--cpu-decode-rows-per-group"):
            resolve_config(PPOConfig(), ConfigSources(flags={"cpu_decode_rows_per_group": bad}))
    with pytest.raises(UserError, match="cpu_decode_rows_per_group: 0 must be >= 1"):
        resolve_config(PPOConfig(), ConfigSources(file={"cpu": {"cpu_decode_rows_per_group": 0}}))
    assert resolve_config(PPOConfig(), ConfigSources(flags={"cpu_decode_rows_per_group": "3"})).cpu.cpu_decode_rows_per_group == 3


@pytest.fixture(scope="module")
def llama(tok):
    return build_tiny_model("llama", tok, seed=0).eval()


SETTINGS = {
    "sampled, EOS, dropped rows": dict(temperature=0.9, eos_token_id=[7, 40], sync_every=2),
    "top-k (torch sampler)": dict(temperature=0.8, top_k=20, eos_token_id=7, sync_every=3),
    "greedy, min_new_tokens": dict(do_sample=False, eos_token_id=7, min_new_tokens=5),
    "no early stop": dict(temperature=1.1, eos_token_id=None, sync_every=4),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("step", ["packed", "python"])
def test_grouped_decode_equals_one_group(llama, batch, setting: str, step: str, monkeypatch) -> None:
    """Rows decoded in groups of 1, 2 and 5 (each group to its end) give the one-group loop's output,
    with group sampling (12 rows) or without, and leave the generator where it does. Over the fused
    step's packed GEMM (a row's arithmetic is the same whatever rows share its step) bit for bit;
    over torch's matmul (whose kernels change with the row count) the same tokens and log-probs
    to rounding."""
    # The CPU backend's fast_decoder builds the decoder it names (engine/backends/cpu/__init__.py).
    if step == "packed":
        monkeypatch.setattr(cpu_backend, "CpuLlamaDecoder", partial(CpuLlamaDecoder, packed_gemm=True))
    else:
        monkeypatch.setattr(cpu_backend, "CpuLlamaDecoder", partial(CpuLlamaDecoder, cpu_kernel=False))
    grouped_by: list[int] = []
    decode_in_groups = decode_groups.decode_in_groups
    monkeypatch.setattr(decode_groups, "decode_in_groups",
                        lambda decoder, loop, rows: grouped_by.append(rows) or decode_in_groups(decoder, loop, rows))
    ids, mask = batch
    runs = {}
    for rows in (None, 1, 2, 5):
        params = SamplingParams(max_new_tokens=14, pad_token_id=PAD, **SETTINGS[setting])
        runs[rows] = []
        for samples in (1, 3):
            gen = torch.Generator().manual_seed(11)
            with using_backend(CpuBackend(CpuConfig(cpu_decode_rows_per_group=rows))):
                out = generate(llama, ids, mask, params, gen, fast=True, samples_per_prompt=samples)
            runs[rows].append((out, torch.rand(4, generator=gen)))
    assert set(grouped_by) == {1, 2, 5}  # the CPU config's groups reached the decoder
    for rows in (1, 2, 5):
        for (grouped, after), (whole, whole_after) in zip(runs[rows], runs[None]):
            for field in ("sequences", "attention_mask", "action_mask", "finished"):
                assert torch.equal(getattr(grouped, field), getattr(whole, field)), (rows, field)
            if step == "packed":
                assert torch.equal(grouped.logprobs, whole.logprobs), rows
            else:
                torch.testing.assert_close(grouped.logprobs, whole.logprobs, rtol=0, atol=1e-5)
            assert torch.equal(after, whole_after), rows  # the generator drew what the one-group loop drew
    if setting.startswith("sampled"):
        assert runs[None][0][0].finished.any() and not runs[None][0][0].finished.all()


def test_grouped_decode_with_the_default_generator(llama, batch) -> None:
    ids, mask = batch
    outputs = []
    for rows in (None, 3):
        params = SamplingParams(max_new_tokens=10, pad_token_id=PAD, eos_token_id=7, sync_every=2)
        torch.manual_seed(5)
        with using_backend(CpuBackend(CpuConfig(cpu_decode_rows_per_group=rows))):
            out = generate(llama, ids, mask, params, fast=True)  # no packed GEMM: equal to rounding
        outputs.append((out.sequences, out.logprobs, torch.rand(3)))
    (sequences, logprobs, after), (grouped_sequences, grouped_logprobs, grouped_after) = outputs
    assert torch.equal(sequences, grouped_sequences) and torch.equal(after, grouped_after)
    torch.testing.assert_close(grouped_logprobs, logprobs, rtol=0, atol=1e-5)


def test_automatic_groups_follow_the_cache_rule(llama, monkeypatch) -> None:
    """The fused step asks decode_groups with its packed weights' bytes and a row's cache at the
    rollout's mean length; other steps decode every row together unless asked."""
    seen = {}

    def spy(batch: int, weight_bytes: int, kv_bytes_per_row: int, cache_bytes: int | None) -> int:
        seen.update(batch=batch, weights=weight_bytes, row=kv_bytes_per_row, cache=cache_bytes)
        return 4

    monkeypatch.setattr(decode_groups, "rows_per_group", spy)
    monkeypatch.setattr(decode_groups, "last_level_cache_bytes", lambda: 1234)
    decoder = CpuLlamaDecoder(llama, 12, 30, kv_cache_dtype="fp16", packed_gemm=True)
    if decoder.kernel_isa is None:
        pytest.skip("the rlhf_cpu_decode op is not built here")
    decoder.length = 10  # as after a 10-token prefill: the mean length is (10 + 30) / 2
    config = llama.config
    linears = sum(m.weight.numel() for name, m in llama.named_modules()
                  if isinstance(m, torch.nn.Linear) and (".layers." in name or name == "lm_head"))
    padded = sum(t.numel() for t in decoder._packed)  # panels round each output width up to 16 columns
    assert linears <= padded < linears * 1.5
    assert decoder.rows_per_group(12) == 4
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * decoder.head_dim * 2  # fp16 k + v
    assert seen == dict(batch=12, weights=4 * padded, row=per_position * 20, cache=1234)
    for requested, rows in ((5, 5), (50, 12)):
        asked = CpuLlamaDecoder(llama, 12, 30, kv_cache_dtype="fp16", packed_gemm=True, rows_per_group=requested)
        assert asked.rows_per_group(12) == rows
    # Only the packed GEMM's steps are the same whatever rows share them: the others stay whole.
    for kwargs in (dict(cpu_kernel=False), dict(packed_gemm=False)):
        assert CpuLlamaDecoder(llama, 12, 30, **kwargs).rows_per_group(12) == 12
        assert CpuLlamaDecoder(llama, 12, 30, rows_per_group=5, **kwargs).rows_per_group(12) == 5


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_hf_forward_decodes_every_row_together(tok, batch, family: str, monkeypatch) -> None:
    """Row groups are the CPU decoder's alone: a model the fast decoder does not run (GPT-2) or
    fast=False (the HF forward) decodes every row in one group under a CpuBackend configured
    with groups, with the same tokens as without them."""
    model = build_tiny_model(family, tok, seed=0).eval()
    ids, mask = batch
    spans: list[tuple[int, int]] = []
    run_rows = DecodeLoop.run_rows

    def spy(self, runner, start, stop, draws):
        spans.append((start, stop))
        return run_rows(self, runner, start, stop, draws)

    monkeypatch.setattr(DecodeLoop, "run_rows", spy)
    outs = []
    for rows in (None, 2):
        params = SamplingParams(max_new_tokens=6, pad_token_id=PAD, eos_token_id=7)
        with using_backend(CpuBackend(CpuConfig(cpu_decode_rows_per_group=rows))):
            outs.append(generate(model, ids, mask, params, torch.Generator().manual_seed(2),
                                 fast="auto" if family == "gpt2" else False).sequences)
    assert torch.equal(outs[0], outs[1])
    assert spans == [(0, ids.shape[0])] * 2  # one group of every row, both times
