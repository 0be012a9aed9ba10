"""Output files honour the umask (engine/fileio.py): 0644 under umask 022, never a temporary file's 0600.

safetensors writes every file 0600; `rlhf models get`, the stage exports and checkpoints give
their folders the umask's modes before renaming them into place, and every file written to a
temporary name and renamed gets them too. Checked under umask 027 (0640), so a hard-coded 0644
would fail.
"""

from __future__ import annotations

import importlib.util
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rlhf.engine.fileio import current_umask, file_mode, honour_umask, replace_file, write_text_atomic
from rlhf.outputs import write_json_atomic


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_027() -> Iterator[None]:
    previous = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(previous)


def test_the_umask_is_read_without_changing_it(umask_027: None) -> None:
    assert current_umask() == 0o027 and file_mode() == 0o640
    assert current_umask() == 0o027


def test_a_renamed_temporary_file_gets_the_umasks_mode(tmp_path: Path, umask_027: None) -> None:
    tmp = tmp_path / "x.tmp"
    tmp.write_text("x")
    os.chmod(tmp, 0o600)  # as safetensors and tempfile leave it
    replace_file(tmp, tmp_path / "x")
    assert _mode(tmp_path / "x") == 0o640
    write_text_atomic(tmp_path / "latest", "step_1")
    write_json_atomic(tmp_path / "summary.json", {"loss": 1.0})
    assert _mode(tmp_path / "latest") == 0o640 and _mode(tmp_path / "summary.json") == 0o640


def test_a_finished_folder_gets_the_umasks_modes_executables_keep_theirs(tmp_path: Path, umask_027: None) -> None:
    folder = tmp_path / "out.tmp"
    (folder / "sub").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "run.sh").write_text("")
    os.chmod(folder / "model.safetensors", 0o600)
    os.chmod(folder / "run.sh", 0o700)
    os.chmod(folder / "sub", 0o700)
    honour_umask(folder)
    assert _mode(folder / "model.safetensors") == 0o640
    assert _mode(folder / "run.sh") == 0o750 and _mode(folder / "sub") == 0o750 and _mode(folder) == 0o750


def test_tiny_models_are_saved_with_the_umasks_modes(tmp_path: Path) -> None:
    from rlhf.models.tiny import save_tiny_model

    model = save_tiny_model(tmp_path / "m", "llama", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)
    expected = 0o666 & ~current_umask()
    assert {p.name: _mode(p) for p in model.iterdir()} == {p.name: expected for p in model.iterdir()}


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: the 256 symbols a byte-level BPE vocabulary starts from."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + i) for i in range(len(extra))]


def write_tiny_gguf(path: Path, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    ffn: int = 64) -> Path:
    """A tiny float32 Llama GGUF with a byte-level tokenizer (random weights), as llama.cpp lays one out."""
    import gguf

    tokens = [*_bytes_to_unicode(), "<|endoftext|>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    kv = kv_heads * (hidden // heads)
    writer.add_tensor("token_embd.weight", weight(len(tokens), hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output.weight", weight(len(tokens), hidden))
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("gguf", "accelerate")),
                    reason="needs the gguf extra: pip install -e '.[gguf]'")
def test_models_get_gguf_writes_files_with_the_umasks_modes(tmp_path: Path, umask_027: None,
                                                            capsys: pytest.CaptureFixture) -> None:
    from rlhf.cli import main

    source = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "model"
    main(["models", "get", "--gguf", str(source), "--output", str(out), "--max-new-tokens", "2"])
    assert f"wrote {out}" in capsys.readouterr().out
    modes = {p.name: _mode(p) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o640}, {k: oct(v) for k, v in modes.items()}
    assert _mode(out) == 0o750
