"""Every bad input a user can give the CLI ends in one `error:` line, exit code 2, no traceback, and
leaves an existing --output folder byte for byte as it was.

One table per kind of input (flags and numbers, config files, ds_configs, data files, model folders,
output folders, generation sizes, chat), run through the real entry point `rlhf.cli.main` in this
process. tests/test_config_rules.py checks the exact wording of the config rules; here each case
names only what its line must contain. Stderr may also hold INFO log lines and progress bars; any
other line (a warning, a traceback, a second error) fails the case.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlhf.cli import main
from tests.conftest import hold_output_lock, write_jsonl

NOISE = re.compile(r"^(\d\d:\d\d:\d\d (\[rank\d+\] )?INFO |.*\d+%\|.*\||.* examples/s\]$)")


# ---------------------------------------------------------------- inputs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dirs: dict[str, Path]) -> dict[str, str]:
    """Good and bad files, folders and models, by name (the cases' `{name}` placeholders)."""
    root = tmp_path_factory.mktemp("bad_inputs")
    model = tiny_model_dirs["llama"]

    def folder(name: str, drop: tuple[str, ...] = ()) -> Path:
        path = root / name
        shutil.copytree(model, path, ignore=shutil.ignore_patterns(*drop))
        return path

    truncated = folder("truncated")
    weights = truncated / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    no_tokenizer = folder("no_tokenizer", drop=("tokenizer*", "chat_template*", "special_tokens*"))
    bad_config = folder("bad_config")
    (bad_config / "config.json").write_text("{not json")
    long_positions = folder("long_positions")  # RoPE: any max_position_embeddings costs nothing
    config = json.loads((long_positions / "config.json").read_text())
    (long_positions / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2**30}))
    (root / "empty_model").mkdir()
    (root / "model.gguf").write_bytes(b"GGUF\x03\x00")
    (root / "a_file").write_text("x")
    (root / "dangling").symlink_to(root / "nowhere")

    rows = [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(16)]
    write_jsonl(root / "sft.jsonl", rows)
    write_jsonl(root / "pairs.jsonl", [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i)} for i in range(16)])
    write_jsonl(root / "prompts.jsonl", [{"prompt": f"sort: {'cbad'[: 3 + i % 2]}"} for i in range(16)])
    (root / "not_utf8.jsonl").write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "x"}\n')
    (root / "not_utf8.csv").write_bytes(b"prompt,response\ncaf\xe9,x\n")
    (root / "not_json.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a", \n')
    write_jsonl(root / "wizard.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "wizard", "content": "abracadabra"}]}])
    write_jsonl(root / "unknown_format.jsonl", [{"question": "a", "answer": "b"}])
    write_jsonl(root / "empty_response.jsonl", [{"prompt": "a", "response": "  "}])
    write_jsonl(root / "no_rejected.jsonl", [{"prompt": "a", "chosen": "b"}])
    (root / "empty.jsonl").write_text("")
    (root / "not_a_list.json").write_text('{"rows": 3}')
    (root / "scalars.json").write_text("[1, 2]")
    (root / "rows.txt").write_text("a\n")
    (root / "garbage.parquet").write_bytes(b"not parquet")
    (root / "empty_data_dir").mkdir()

    (root / "bad.yaml").write_text("lr: [unclosed\n")
    (root / "unknown_key.yaml").write_text("learning_rate: 0.1\n")
    (root / "list.yaml").write_text("- lr\n- 0.1\n")
    (root / "not_utf8.yaml").write_bytes(b"run_name: caf\xe9\n")
    (root / "bad_ds.json").write_text('{"train_batch_size": ')
    (root / "unknown_ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "flux_capacitor": 1}))
    (root / "batch_ds.json").write_text(json.dumps({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2,
                                                    "gradient_accumulation_steps": 2}))
    (root / "e2e_bad.yaml").write_text("ppo:\n  gamma: 2\n")
    (root / "rewards.py").write_text("def not_a_reward(x):\n    return 1.0\n")

    names = {"model": model, "truncated": truncated, "no_tokenizer": no_tokenizer, "bad_config": bad_config,
             "long_positions": long_positions}
    return {**{p.name: str(p) for p in root.iterdir()}, **{k: str(v) for k, v in names.items()}, "root": str(root)}


SFT = ["sft", "--model", "{model}", "--data", "{sft.jsonl}", "--report-to", "none", "--max-steps", "1",
       "--micro-batch-size", "2"]
REWARD = ["reward", "--model", "{model}", "--data", "{pairs.jsonl}", "--report-to", "none", "--max-steps", "1",
          "--micro-batch-size", "2"]
PPO = ["ppo", "--actor", "{model}", "--reward-fn", "sort", "--critic", "{model}", "--data", "{prompts.jsonl}",
       "--report-to", "none", "--max-steps", "1", "--generation-batch-size", "4", "--max-new-tokens", "4"]
E2E = ["e2e", "--report-to", "none", "--n-sft", "16", "--n-pairs", "16", "--n-prompts", "16", "--n-eval-pairs", "4",
       "--n-eval-prompts", "4", "--sft.max-steps", "1", "--reward.max-steps", "1", "--ppo.max-steps", "1"]
CHAT = ["chat", "--model", "{model}", "--prompt", "sort: cba", "--max-new-tokens", "4"]


def sft(*extra: str) -> list[str]:
    return [*SFT, *extra]


def ppo(*extra: str) -> list[str]:
    return [*PPO, *extra]


# (id, arguments (--output {out} is added to every stage command), what the line must contain)
FLAGS = [
    ("sft-lr-nan", sft("--lr", "nan"), "--lr: nan must be a finite number"),
    ("sft-lr-inf", sft("--lr", "inf"), "--lr: inf must be a finite number"),
    ("sft-lr-negative", sft("--lr", "-1"), "--lr: -1.0 must be > 0"),
    ("sft-eval-split-negative", sft("--eval-split", "-0.1"), "--eval-split: -0.1 must be in [0, 1)"),
    ("sft-max-steps-negative", sft("--max-steps", "-5"), "--max-steps: -5 must be"),
    ("sft-max-steps-zero", sft("--max-steps", "0"), "--max-steps: 0 must be -1 (train --epochs epochs) or >= 1"),
    ("sft-epochs-zero", sft("--epochs", "0"), "--epochs: 0 must be >= 1"),
    ("sft-grad-accum-zero", sft("--grad-accum", "0"), "--grad-accum: 0 must be >= 1"),
    ("sft-warmup-ratio", sft("--warmup-ratio", "2"), "--warmup-ratio: 2.0 must be in [0, 1]"),
    ("sft-grad-clip-negative", sft("--grad-clip", "-1"), "--grad-clip: -1.0 must be >= 0"),
    ("sft-save-interval-negative", sft("--save-interval", "-1"), "--save-interval: -1 must be >= 0"),
    ("sft-adam-beta1", sft("--adam-beta1", "1.5"), "--adam-beta1: 1.5 must be in [0, 1)"),
    ("sft-dist-timeout-zero", sft("--dist-timeout", "0"), "--dist-timeout: 0.0 must be > 0"),
    ("sft-max-skipped-negative", sft("--max-skipped-steps", "-1"), "--max-skipped-steps: -1 must be >= 0"),
    ("sft-micro-batch-text", sft("--micro-batch-size", "two"), "Invalid value for '--micro-batch-size'"),
    ("sft-unknown-flag", sft("--learning-rate", "1"), "No such option '--learning-rate'"),
    ("sft-lora-rank-negative", sft("--lora-rank", "-4"), "--lora-rank: -4 must be >= 0"),
    ("sft-lora-dropout-one", sft("--lora-rank", "4", "--lora-dropout", "1"), "--lora-dropout: 1.0 must be in [0, 1)"),
    ("sft-lora-alpha-nan", sft("--lora-rank", "4", "--lora-alpha", "nan"), "--lora-alpha: nan must be a finite number"),
    ("sft-export-adapter-without-lora", sft("--export-adapter"), "export_adapter: true needs lora_rank > 0"),
    ("sft-lora-unknown-target", sft("--lora-rank", "4", "--lora-target-modules", "qkv"),
     "--lora-target-modules: no linear layer named 'qkv'"),
    ("reward-lr-nan", [*REWARD, "--lr", "nan"], "--lr: nan must be a finite number"),
    ("reward-head-std-negative", [*REWARD, "--value-head-init-std", "-1"], "--value-head-init-std: -1.0 must be >= 0"),
    ("ppo-kl-coef-nan", ppo("--kl-coef", "nan"), "--kl-coef: nan must be a finite number"),
    ("ppo-kl-coef-negative", ppo("--kl-coef", "-1"), "--kl-coef: -1.0 must be >= 0"),
    ("ppo-gamma", ppo("--gamma", "2"), "--gamma: 2.0 must be in [0, 1]"),
    ("ppo-lam", ppo("--lam", "-1"), "--lam: -1.0 must be in [0, 1]"),
    ("ppo-clip-range", ppo("--clip-range", "-0.2"), "--clip-range: -0.2 must be > 0"),
    ("ppo-ptx-coef-without-data", ppo("--ptx-coef", "1"), "ptx_coef: 1.0 needs ptx_data"),
    ("ppo-temperature-negative", ppo("--temperature", "-1"), "--temperature: -1.0 must be >= 0"),
    ("ppo-top-p-zero", ppo("--top-p", "0"), "--top-p: 0.0 must be in (0, 1]"),
    ("ppo-top-p-above-one", ppo("--top-p", "1.5"), "--top-p: 1.5 must be in (0, 1]"),
    ("ppo-top-k-negative", ppo("--top-k", "-1"), "--top-k: -1 must be >= 0"),
    ("ppo-max-new-tokens-zero", ppo("--max-new-tokens", "0"), "--max-new-tokens: 0 must be >= 1"),
    ("ppo-max-new-tokens-negative", ppo("--max-new-tokens", "-1"), "--max-new-tokens: -1 must be >= 1"),
    ("ppo-generation-batch-zero", ppo("--generation-batch-size", "0"), "--generation-batch-size: 0 must be >= 1"),
    ("ppo-grpo-one-sample", ppo("--advantage-estimator", "grpo", "--critic", ""), "samples_per_prompt: 1 must be >= 2"),
    ("ppo-no-reward", ["ppo", "--actor", "{model}", "--data", "{prompts.jsonl}"], "--reward (a reward model folder)"),
    ("ppo-reward-fn-missing-file", ppo("--reward-fn", "{root}/nope.py:f"), "nope.py"),
    ("ppo-reward-fn-missing-function", ppo("--reward-fn", "{rewards.py}:score"), "score"),
    ("e2e-ppo-gamma", [*E2E, "--ppo.gamma", "2"], "--ppo.gamma: 2.0 must be in [0, 1]"),
    ("e2e-sft-lr-nan", [*E2E, "--sft.lr", "nan"], "--sft.lr: nan must be a finite number"),
    ("e2e-n-sft-zero", [*E2E, "--n-sft", "0"], "--n-sft: 0 must be >= 1"),
    ("e2e-unknown-stage-flag", [*E2E, "--ppo.wizardry", "1"], "wizardry"),
]

FILES = [
    ("config-missing", sft("--config", "{root}/nope.yaml"), "nope.yaml: config file not found"),
    ("config-bad-yaml", sft("--config", "{bad.yaml}"), "bad.yaml: not valid YAML"),
    ("config-unknown-key", sft("--config", "{unknown_key.yaml}"), "unknown key 'learning_rate'"),
    ("config-not-a-mapping", sft("--config", "{list.yaml}"), "list.yaml: the top level must be a mapping"),
    ("config-not-utf8", sft("--config", "{not_utf8.yaml}"), "not_utf8.yaml: not UTF-8 text"),
    ("e2e-config-section-value", [*E2E, "--config", "{e2e_bad.yaml}"], "e2e_bad.yaml [ppo]: gamma: 2.0 must be in [0, 1]"),
    ("ds-config-missing", sft("--deepspeed-config", "{root}/nope.json"), "nope.json"),
    ("ds-config-bad-json", sft("--deepspeed-config", "{bad_ds.json}"), "bad_ds.json"),
    ("ds-config-unknown-key", sft("--deepspeed-config", "{unknown_ds.json}"), "flux_capacitor"),
    ("ds-config-batch-arithmetic", sft("--deepspeed-config", "{batch_ds.json}"), "7"),
    ("data-missing", ["sft", "--model", "{model}", "--data", "{root}/nope.jsonl"], "nope.jsonl: file or folder not found"),
    ("data-not-utf8", ["sft", "--model", "{model}", "--data", "{not_utf8.jsonl}"], "not_utf8.jsonl line 2: not UTF-8"),
    ("data-csv-not-utf8", ["sft", "--model", "{model}", "--data", "{not_utf8.csv}"], "not_utf8.csv line 2: not UTF-8"),
    ("data-bad-json-line", ["sft", "--model", "{model}", "--data", "{not_json.jsonl}"], "not_json.jsonl line 2: not valid JSON"),
    ("data-wizard-role", ["sft", "--model", "{model}", "--data", "{wizard.jsonl}"],
     "wizard.jsonl row 0 field 'messages' message 1: has role 'wizard'; accepted roles: system, user, assistant"),
    ("data-unknown-format", ["sft", "--model", "{model}", "--data", "{unknown_format.jsonl}"], "unrecognised row"),
    ("data-empty-response", ["sft", "--model", "{model}", "--data", "{empty_response.jsonl}"], "field 'response'"),
    ("data-pairs-without-rejected", [*REWARD[:3], "--data", "{no_rejected.jsonl}"], "no_rejected.jsonl"),
    ("data-empty-file", ["sft", "--model", "{model}", "--data", "{empty.jsonl}"], "empty.jsonl: no rows"),
    ("data-not-a-list", ["sft", "--model", "{model}", "--data", "{not_a_list.json}"], "unrecognised row with fields ['rows']"),
    ("data-rows-not-objects", ["sft", "--model", "{model}", "--data", "{scalars.json}"], "expected an object"),
    ("data-unsupported-type", ["sft", "--model", "{model}", "--data", "{rows.txt}"], "unsupported file type '.txt'"),
    ("data-garbage-parquet", ["sft", "--model", "{model}", "--data", "{garbage.parquet}"], "could not read as parquet"),
    ("data-empty-folder", ["sft", "--model", "{model}", "--data", "{empty_data_dir}"], "empty_data_dir"),
    ("data-missing-flag", ["sft", "--model", "{model}"], "--data is required"),
    ("eval-data-missing", sft("--eval-data", "{root}/nope.jsonl"), "nope.jsonl: file or folder not found"),
    ("ppo-data-not-utf8", ppo("--data", "{not_utf8.jsonl}"), "not_utf8.jsonl line 2: not UTF-8"),
    ("ppo-data-wizard", ppo("--data", "{wizard.jsonl}"), "role 'wizard'"),
]

MODELS = [
    ("sft-model-truncated-weights", sft("--model", "{truncated}"), "model.safetensors is truncated or corrupt"),
    ("sft-model-without-tokenizer", sft("--model", "{no_tokenizer}"), "no_tokenizer: folder has no tokenizer files"),
    ("sft-model-bad-config", sft("--model", "{bad_config}"), "bad_config"),
    ("sft-model-missing", sft("--model", "{root}/nope"), "nope: folder not found"),
    ("sft-model-empty-folder", sft("--model", "{empty_model}"), "folder has no config.json"),
    ("sft-model-is-a-file", sft("--model", "{a_file}"), "is a file"),
    ("sft-model-gguf", sft("--model", "{model.gguf}"), "is a GGUF file; convert it once"),
    ("reward-model-truncated-weights", [*REWARD, "--model", "{truncated}"], "model.safetensors: truncated or corrupt"),
    ("reward-model-without-tokenizer", [*REWARD, "--model", "{no_tokenizer}"], "folder has no tokenizer files"),
    ("ppo-actor-truncated-weights", ppo("--actor", "{truncated}"), "model.safetensors is truncated or corrupt"),
    ("ppo-actor-without-tokenizer", ppo("--actor", "{no_tokenizer}"), "folder has no tokenizer files"),
    ("ppo-critic-missing", ppo("--critic", "{root}/nope"), "nope"),
    ("ppo-reward-not-a-reward-model", ppo("--reward", "{empty_model}"), "empty_model"),
    ("e2e-model-empty-folder", [*E2E, "--model", "{empty_model}"], "folder has no config.json"),
    ("e2e-model-without-tokenizer", [*E2E, "--model", "{no_tokenizer}"], "folder has no tokenizer files"),
    # a base model whose layers need 4 TiB: the allocation fails at once
    ("e2e-out-of-memory", [*E2E, "--tiny-hidden-size", "1048576"], "out of memory: can't allocate memory"),
]

GENERATION = [
    ("ppo-max-new-tokens-past-positions", ppo("--max-new-tokens", "100000"),
     "+ max_new_tokens 100000 = 100030 tokens exceed the model's max_position_embeddings 512"),
    ("ppo-kv-cache-beyond-memory", ppo("--actor", "{long_positions}", "--critic", "{long_positions}",
                                       "--max-new-tokens", "100000000", "--generation-batch-size", "16"),
     "GiB available; lower --generation-batch-size"),
    ("chat-max-new-tokens-past-positions", [*CHAT, "--max-new-tokens", "100000"], "max_position_embeddings 512"),
    ("chat-kv-cache-beyond-memory", ["chat", "--model", "{long_positions}", "--prompt", "hi", "--max-new-tokens",
                                     "1000000000"], "GiB available"),
    ("chat-top-p-above-one", [*CHAT, "--top-p", "2"], "Invalid value for '--top-p': 2.0 is not in the range 0<x<=1"),
    ("chat-top-p-zero", [*CHAT, "--top-p", "0"], "Invalid value for '--top-p'"),
    ("chat-top-p-nan", [*CHAT, "--top-p", "nan"], "nan is not a finite number"),
    ("chat-temperature-negative", [*CHAT, "--temperature", "-1"], "Invalid value for '--temperature'"),
    ("chat-max-new-tokens-zero", [*CHAT, "--max-new-tokens", "0"], "Invalid value for '--max-new-tokens'"),
    ("chat-model-without-tokenizer", [*CHAT, "--model", "{no_tokenizer}"], "folder has no tokenizer files"),
    ("chat-model-truncated", [*CHAT, "--model", "{truncated}"], "truncated or corrupt"),
    ("chat-model-missing", [*CHAT, "--model", "{root}/nope"], "nope: folder not found"),
]

OUTPUTS = [
    ("output-holds-a-run", sft(), "already holds a run; pass --resume"),
    ("output-is-a-file", sft("--output", "{a_file}"), "exists and is not a folder"),
    ("output-under-a-file", sft("--output", "{a_file}/run"), "a_file"),
    ("output-read-only", sft(), "permission denied"),
    ("output-disk-full", sft(), "no space left on"),
    ("ppo-output-read-only", ppo(), "permission denied"),
    ("output-dangling-link", sft("--output", "{dangling}"), "a symbolic link to"),
    ("output-link-out", sft(), "metrics.jsonl is a symbolic link to"),
    ("output-locked", sft(), "in use by another run (pid"),
    ("e2e-output-locked", E2E, "in use by another run (pid"),
]

CASES = FLAGS + FILES + MODELS + GENERATION + OUTPUTS


# ---------------------------------------------------------------- the existing output folder


def tree_digest(root: Path) -> dict[str, str]:
    """Every entry under `root` (links not followed): file contents, link targets, folders."""
    out: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            out[key] = "link:" + os.readlink(path)
        elif path.is_dir():
            out[key] = "dir"
        elif path.is_char_device():  # the disk-full case's /dev/full node: read, it never ends
            out[key] = f"char:{os.stat(path).st_rdev}"
        else:
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _immutable(path: Path, on: bool) -> bool:
    """Make `path` unwritable even for root (chattr +i), or writable again; False where unsupported."""
    if os.geteuid() != 0:
        path.chmod(0o555 if on else 0o755)
        return True
    result = subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True)
    return result.returncode == 0


@pytest.fixture
def output(case_id: str, tmp_path: Path) -> Iterator[Path]:
    """An existing --output folder holding a file of the user's (and what the case needs)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own notes\n")
    if case_id == "output-holds-a-run":
        (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    if case_id == "output-disk-full":
        # The stage's first write, config.yaml.tmp, is a /dev/full node: ENOSPC at once. (A symlink
        # to /dev/full would be refused first: no link may lead out of an output folder.)
        try:
            os.mknod(out / "config.yaml.tmp", stat.S_IFCHR | 0o666, os.makedev(1, 7))
        except OSError:
            pytest.skip("cannot make a /dev/full device node here (needs root)")
    if case_id == "output-link-out":
        (out / "metrics.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    holder = hold_output_lock(out) if case_id.endswith("output-locked") else None
    locked = case_id.endswith("read-only") and _immutable(out, True)
    if case_id.endswith("read-only") and not locked:
        pytest.skip("cannot make a folder read-only here (chattr)")
    yield out
    if locked:
        _immutable(out, False)
    if holder is not None:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "elsewhere.jsonl").exists()


@pytest.fixture
def case_id(request: pytest.FixtureRequest) -> str:
    return request.param


# ---------------------------------------------------------------- the check


def error_output(err: str) -> list[str]:
    """Stderr without INFO log lines and progress bars (tqdm redraws with \\r)."""
    lines = [part for line in err.splitlines() for part in line.split("\r")]
    return [line for line in lines if line.strip() and not NOISE.match(line.strip())]


def expand(args: list[str], inputs: dict[str, str], out: Path) -> list[str]:
    """`{name}` placeholders replaced with the inputs' paths (`{out}`: the output folder)."""
    names = {**inputs, "out": str(out)}
    return [re.sub(r"\{([^}]+)\}", lambda m: names[m.group(1)], a) for a in args]


@pytest.mark.parametrize("case_id, args, message", CASES, ids=[c[0] for c in CASES], indirect=["case_id"])
def test_bad_input_is_one_error_line(case_id, args, message, inputs, output, capsys, monkeypatch, one_thread):
    monkeypatch.chdir(output.parent)
    monkeypatch.delenv("RLHF_DEBUG", raising=False)
    monkeypatch.setenv("RLHF_FORCE_CPU", "1")
    argv = expand(args, inputs, output)
    if argv[0] != "chat" and "--output" not in argv:
        argv += ["--output", str(output)]
    before = tree_digest(output)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err[-3000:]
    assert "Traceback" not in err and "[rank0]:" not in err, err[-3000:]
    lines = error_output(err)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert message in lines[0], lines[0]
    assert tree_digest(output) == before


def test_the_table_covers_every_kind_of_input():
    assert len(CASES) >= 60
    assert len({c[0] for c in CASES}) == len(CASES)
    commands = {c[1][0] for c in CASES}
    assert {"sft", "reward", "ppo", "e2e", "chat"} <= commands


def test_debug_shows_the_traceback(inputs, tmp_path, monkeypatch):
    """RLHF_DEBUG=1: the same error raises with its traceback instead of the one line."""
    from rlhf.errors import UserError

    monkeypatch.setenv("RLHF_DEBUG", "1")
    with pytest.raises(UserError, match="folder has no tokenizer files"):
        main(expand(sft("--model", "{no_tokenizer}", "--output", str(tmp_path / "o")), inputs, tmp_path))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_the_refused_kv_cache_size_is_what_generation_allocates(family, tiny_model_dirs):
    """`kv_cache_bytes` (what generation refuses on) equals the cache the model's forward fills."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.engine.generation import HFForwardRunner
    from rlhf.engine.kv_cache import kv_cache_bytes

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[family], dtype="float32").eval()
    runner = HFForwardRunner(model, max_len=12)
    ids = torch.ones(3, 5, dtype=torch.long)
    with torch.no_grad():
        runner.prefill(ids, torch.ones_like(ids), torch.arange(5).expand(3, 5))
    assert runner.cache.bytes_allocated() == kv_cache_bytes(model.config, 3, 12, torch.float32)
