"""`rlhf` command line: one subcommand per stage, flags generated from the typed configs.

Every config field is a flag (its docstring is the help). Precedence, lowest first: defaults <
--deepspeed-config < --config file < flags given on the command line.
"""

from __future__ import annotations

import os
import sys
import typing
from collections.abc import Callable
from typing import Any, Literal

import click

from rlhf.config import FieldInfo, _strip_optional, apply_mapping, leaf_fields, read_config_file, set_field
from rlhf.errors import UserError


def _option(info: FieldInfo) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    flag = "--" + info.name.replace("_", "-")
    base, _ = _strip_optional(info.type)
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


def config_options(cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add one click option per leaf field of `cls`, plus --config / --deepspeed-config / --nproc-per-node."""

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        for info in reversed(leaf_fields(cls)):
            f = _option(info)(f)
        f = click.option("--nproc-per-node", "nproc_per_node", type=int, default=None,
                         help="Run on this many processes (re-launches under torchrun; one GPU each).")(f)
        f = click.option("--deepspeed-config", "deepspeed_config", type=str, default=None,
                         help="A DeepSpeed ds_config.json; its batch, ZeRO, offload, precision, optimizer, "
                              "scheduler and checkpointing keys set the engine.")(f)
        f = click.option("--config", "config_file", type=str, default=None,
                         help="YAML/JSON config file (fields flat or under engine:/data:/tracking:).")(f)
        return f

    return decorate


def build_config(cls: type, kwargs: dict[str, Any]) -> Any:
    """Defaults < ds_config < config file < explicit flags."""
    config = cls()
    ds_path = kwargs.pop("deepspeed_config", None)
    file_path = kwargs.pop("config_file", None)
    kwargs.pop("nproc_per_node", None)
    if ds_path:
        from rlhf.ds_config import import_ds_config

        imported = import_ds_config(ds_path)
        for key, value in imported.values.items():
            setattr(config.engine, key, value)
        for key, value in imported.extra.items():
            if hasattr(config, key):
                setattr(config, key, value)
    if file_path:
        apply_mapping(config, read_config_file(file_path), file_path)
    by_name = {fi.name: fi for fi in leaf_fields(cls)}
    for name, value in kwargs.items():
        if value is None or (isinstance(value, tuple) and not value):
            continue
        info = by_name[name]
        set_field(config, info, list(value) if isinstance(value, tuple) else value, "--" + name.replace("_", "-"))
    return config


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
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "rlhf", *args]
    sys.exit(subprocess.call(cmd))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def cli() -> None:
    """rlhf: SFT, reward-model training and PPO on one hybrid FSDP2 engine.

    \b
    rlhf sft     --model BASE --data demos.jsonl --output runs/sft
    rlhf reward  --model runs/sft/model --data pairs.jsonl --output runs/rm
    rlhf ppo     --actor runs/sft/model --reward runs/rm/model --data prompts.jsonl --output runs/ppo
    rlhf e2e     (all three, chained; no arguments = built-in offline demo)
    """


def _register_stages() -> None:
    from rlhf.config import PPOConfig, RewardConfig, SFTConfig

    @cli.command("sft")
    @config_options(SFTConfig)
    def sft_command(**kwargs: Any) -> None:
        """Supervised fine-tuning on demonstrations (prompt/response, pairs' chosen, dialogs, chat messages)."""
        relaunch_under_torchrun(kwargs.get("nproc_per_node"))
        config = build_config(SFTConfig, kwargs)
        from rlhf.stages import sft

        summary = sft.run(config)
        _print_summary(summary)

    @cli.command("reward")
    @config_options(RewardConfig)
    def reward_command(**kwargs: Any) -> None:
        """Reward-model training on preference pairs (prompt/chosen/rejected, Human/Assistant dialogs, chat messages).

        The model is --model's backbone plus a value head; it is saved to <output>/model with its
        tokenizer (load it with rlhf.models.load_value_model). summary.json holds eval_accuracy,
        chosen_mean, rejected_mean and the training-set score_mean / score_std that PPO uses.
        """
        relaunch_under_torchrun(kwargs.get("nproc_per_node"))
        config = build_config(RewardConfig, kwargs)
        from rlhf.stages import reward

        summary = reward.run(config)
        _print_summary(summary)

    @cli.command("ppo")
    @config_options(PPOConfig)
    def ppo_command(**kwargs: Any) -> None:
        """PPO: rollouts in rollout mode, KL-penalised rewards, GAE, clipped policy and value updates.

        The actor (--actor) trains against the frozen reward model (--reward) or a built-in task's
        checker (--reward-fn); the critic starts from --critic (default: the reward model) and the
        KL reference is --ref (default: the actor). Writes <output>/model (actor) and <output>/critic.
        """
        relaunch_under_torchrun(kwargs.get("nproc_per_node"))
        config = build_config(PPOConfig, kwargs)
        from rlhf.stages import ppo

        summary = ppo.run(config)
        _print_summary(summary)

    from rlhf.config import E2EConfig

    @cli.command("e2e", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @config_options(E2EConfig)
    @click.pass_context
    def e2e_command(ctx: click.Context, **kwargs: Any) -> None:
        """SFT -> reward -> PPO chained; with no arguments, the built-in offline demo on a tiny model.

        \b
        Stage settings: a --config file with `sft:`, `reward:`, `ppo:` sections (top-level keys are
        the e2e options below), or prefixed flags such as --sft.lr 1e-3 --ppo.kl-coef 0.1.
        Re-running skips finished stages and resumes an interrupted one.
        """
        relaunch_under_torchrun(kwargs.get("nproc_per_node"))
        from rlhf.stages import e2e

        flags = e2e.parse_prefixed_flags(list(ctx.args))
        ds_path = kwargs.pop("deepspeed_config", None)
        file_path = kwargs.get("config_file")
        sections: dict[str, Any] = {}
        if file_path:
            mapping = read_config_file(file_path)
            sections = {name: mapping.pop(name) for name in list(mapping) if name in e2e.STAGES}
            kwargs["config_file"] = None
            config = build_config(E2EConfig, kwargs)
            apply_mapping(config, mapping, file_path)
            for name, value in kwargs.items():  # flags still win over the file
                if value is not None and not (isinstance(value, tuple) and not value) and name not in (
                        "config_file", "deepspeed_config", "nproc_per_node"):
                    setattr(config, name, list(value) if isinstance(value, tuple) else value)
        else:
            config = build_config(E2EConfig, kwargs)
        summary = e2e.run(config, sections, flags, file_path or "--config", ds_path)
        if int(os.environ.get("RANK", "0")) == 0:
            click.echo(format_e2e_summary(summary))

    @cli.command("chat")
    @click.option("--model", "model_dir", required=True, help="Any stage's <output>/model (or critic/) folder.")
    @click.option("--prompt", default=None, help="Answer this one prompt and exit (default: interactive).")
    @click.option("--max-new-tokens", default=128, show_default=True, type=int)
    @click.option("--temperature", default=0.7, show_default=True, type=float, help="0 for greedy.")
    @click.option("--top-p", default=0.9, show_default=True, type=float)
    @click.option("--seed", default=0, show_default=True, type=int)
    def chat_command(model_dir: str, prompt: str | None, max_new_tokens: int, temperature: float, top_p: float,
                     seed: int) -> None:
        """Talk to a model: answers with a causal LM, scores 'prompt ||| response' with a reward model."""
        from rlhf.stages.chat import chat

        chat(model_dir, prompt, max_new_tokens, temperature, top_p, seed)

    @cli.command("report")
    def report_command() -> None:
        """Versions and which csrc ops are built (like DeepSpeed's ds_report)."""
        from rlhf.report import print_report

        print_report()


def format_e2e_summary(summary: dict[str, Any]) -> str:
    """The figures that show the pipeline worked, one per line."""
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    keys = ["rm_eval_accuracy", "sft_task_success", "ppo_task_success", "ppo_gain_points", "sft_seconds",
            "reward_seconds", "ppo_seconds", "eval_seconds", "total_seconds"]
    lines = [f"e2e summary ({summary.get('output')}):"]
    lines += [f"  {k:<18} {fmt(summary[k])}" for k in keys if k in summary and summary[k] is not None]
    return "\n".join(lines)


def _print_summary(summary: dict[str, Any]) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        click.echo("summary: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in summary.items() if not isinstance(v, dict)))


_register_stages()


def _shutdown_distributed() -> None:
    """After a successful multi-process command: wait for every rank, then tear the group down."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one `error:` line and exit code 2."""
    try:
        cli.main(args=argv, prog_name="rlhf", standalone_mode=False)
        _shutdown_distributed()
    except UserError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
