"""Grouped decoding (engine/decode_groups.py): the group-size rule against hand-computed cases, and
generate() over row groups giving exactly what the one-group loop gives (tokens, log-probs, masks,
the generator's state afterwards)."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import pytest
import torch

from rlhf.engine import decode_groups, generation
from rlhf.engine.decode_groups import last_level_cache_bytes, row_groups, rows_per_group
from rlhf.engine.fast_decode import FastLlamaDecoder
from rlhf.engine.generation import generate
from rlhf.engine.sampling import SamplingParams
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


def test_sampling_params_validate_rows_per_group() -> None:
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="decode_rows_per_group"):
            SamplingParams(max_new_tokens=4, pad_token_id=PAD, decode_rows_per_group=bad)


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
    if step == "packed":
        monkeypatch.setattr(generation, "FastLlamaDecoder", partial(FastLlamaDecoder, packed_gemm=True))
    else:
        monkeypatch.setattr(generation, "FastLlamaDecoder", partial(FastLlamaDecoder, cpu_kernel=False))
    ids, mask = batch
    runs = {}
    for rows in (None, 1, 2, 5):
        params = SamplingParams(max_new_tokens=14, pad_token_id=PAD, decode_rows_per_group=rows, **SETTINGS[setting])
        runs[rows] = []
        for samples in (1, 3):
            gen = torch.Generator().manual_seed(11)
            out = generate(llama, ids, mask, params, gen, fast=True, samples_per_prompt=samples)
            runs[rows].append((out, torch.rand(4, generator=gen)))
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
        params = SamplingParams(max_new_tokens=10, pad_token_id=PAD, eos_token_id=7, sync_every=2,
                                decode_rows_per_group=rows)
        torch.manual_seed(5)
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
    decoder = FastLlamaDecoder(llama, 12, 30, kv_cache_dtype="fp16", packed_gemm=True)
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
    assert decoder.rows_per_group(12, requested=5) == 5 and decoder.rows_per_group(12, requested=50) == 12
    # Only the packed GEMM's steps are the same whatever rows share them: the others stay whole.
    for other in (FastLlamaDecoder(llama, 12, 30, cpu_kernel=False),
                  FastLlamaDecoder(llama, 12, 30, packed_gemm=False)):
        assert other.rows_per_group(12) == 12 and other.rows_per_group(12, requested=5) == 5


def test_the_hf_forward_decodes_every_row_together_and_says_so(llama, batch, monkeypatch) -> None:
    ids, mask = batch
    monkeypatch.setattr(generation, "_logged_fallbacks", set())
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # the rlhf logger does not propagate to pytest's caplog
    logging.getLogger("rlhf").addHandler(handler)
    try:
        outs = [generate(llama, ids, mask, SamplingParams(max_new_tokens=6, pad_token_id=PAD, eos_token_id=7,
                                                          decode_rows_per_group=rows),
                         torch.Generator().manual_seed(2), fast=False).sequences for rows in (None, 2)]
    finally:
        logging.getLogger("rlhf").removeHandler(handler)
    assert torch.equal(outs[0], outs[1])
    assert any("decode_rows_per_group=2 is the fast decoder's" in r.getMessage() for r in records)
