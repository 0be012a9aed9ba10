"""`rlhf e2e` (and scripts/e2e.py): SFT -> reward model -> PPO, each stage's model feeding the next.

    rlhf e2e                                  # built-in offline default: tiny model + `sort` task
    rlhf e2e --output runs/e2e --reward-fn sort          # PPO on the task's checker (verifiable reward)
    rlhf e2e --config e2e.yaml --ppo.kl-coef 0.1 --sft.lr 1e-3
    rlhf e2e --model Qwen/Qwen2-0.5B --data Anthropic/hh-rlhf --nproc-per-node 8

Run folder: base/ (the built tiny model), data/ (the task's jsonl files), sft/, reward/, ppo/
(each with the stage output contract) and summary.json. Re-running skips stages that have DONE
and resumes an interrupted stage from its latest checkpoint. All stages share one W&B group.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rlhf.config import E2EConfig, PPOConfig, RewardConfig, SFTConfig, apply_mapping, leaf_fields, set_field
from rlhf.engine.distributed import DistributedContext
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.outputs import is_done, read_summary, write_json_atomic

log = get_logger(__name__)

STAGES: dict[str, type] = {"sft": SFTConfig, "reward": RewardConfig, "ppo": PPOConfig}


def default_stage_configs(cfg: E2EConfig) -> dict[str, Any]:
    """Stage settings tuned so the built-in default learns in minutes on a 2-core CPU."""
    sft, reward, ppo = SFTConfig(), RewardConfig(), PPOConfig()
    for stage in (sft, reward, ppo):
        stage.engine.seed = cfg.seed
        stage.engine.optimizer_impl = "auto"
        stage.tracking.report_to = cfg.report_to
        stage.tracking.wandb_project = cfg.wandb_project
        stage.data.max_seq_len = 64
    # Measured on the `sort` task (see rlhf/data/tasks/sort.py): ~1000 SFT steps give T=1 success
    # ~0.6; the reward model needs ~1000 steps of fresh pairs to also catch letters that are not in
    # the prompt (else PPO learns to exploit it); PPO then gains with a real KL penalty (0.1).
    sft.max_steps = 1000
    sft.engine.lr, sft.engine.micro_batch_size, sft.engine.warmup_steps = 3e-3, 64, 50
    reward.epochs = 1
    reward.engine.lr, reward.engine.micro_batch_size, reward.engine.warmup_steps = 1e-3, 32, 50
    ppo.max_steps, ppo.generation_batch_size, ppo.max_new_tokens, ppo.max_prompt_len = 80, 64, 10, 32
    ppo.engine.lr, ppo.critic_lr, ppo.engine.micro_batch_size = 1e-4, 5e-4, 64
    ppo.engine.lr_scheduler, ppo.kl_coef, ppo.ppo_epochs = "constant", 0.1, 2
    ppo.engine.train_batch_size = None
    return {"sft": sft, "reward": reward, "ppo": ppo}


def apply_stage_overrides(stages: dict[str, Any], file_sections: dict[str, Any], flags: dict[str, dict[str, str]],
                          source: str) -> None:
    """Config-file sections first, then prefixed flags (`--ppo.kl-coef 0.1`)."""
    for name, mapping in file_sections.items():
        if not isinstance(mapping, dict):
            raise UserError(f"{source}: section '{name}' must be a mapping of that stage's fields")
        apply_mapping(stages[name], mapping, f"{source} [{name}]")
    for name, values in flags.items():
        by_name = {fi.name: fi for fi in leaf_fields(STAGES[name])}
        for key, value in values.items():
            info = by_name.get(key.replace("-", "_"))
            if info is None:
                raise UserError(f"--{name}.{key}: `rlhf {name}` has no such option; see `rlhf {name} --help`")
            set_field(stages[name], info, value, f"--{name}.{key}")


def parse_prefixed_flags(args: list[str]) -> dict[str, dict[str, str]]:
    """['--ppo.kl-coef', '0.1', '--ppo.greedy'] -> {'ppo': {'kl-coef': '0.1', 'greedy': 'true'}}."""
    out: dict[str, dict[str, str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        stage, _, key = arg.removeprefix("--").partition(".")
        if not arg.startswith("--") or stage not in STAGES or not key:
            raise UserError(f"unexpected argument {arg!r}; stage options are given as --sft.X, --reward.X or --ppo.X")
        if "=" in key:
            key, value = key.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
            i += 1
        else:
            value = "false" if key.startswith("no-") else "true"
            key = key.removeprefix("no-")
        out.setdefault(stage, {})[key] = value
        i += 1
    return out


def run_stage(name: str, config: Any, module: Any, ctx: DistributedContext) -> float:
    """Run one stage unless it is DONE; resume it if it was interrupted. Returns seconds spent."""
    output = Path(config.output)
    if is_done(output):
        log.info("e2e: %s is done (%s), skipping", name, output)
        return float(read_summary(output).get("e2e_seconds", 0.0))
    config.resume = output.is_dir() and any(output.iterdir())
    log.info("e2e: %s stage %s -> %s", "resuming" if config.resume else "starting", name, output)
    started = time.perf_counter()
    module.run(config)
    seconds = time.perf_counter() - started
    if ctx.is_main:
        summary = read_summary(output)
        summary["e2e_seconds"] = seconds
        write_json_atomic(output / "summary.json", summary)
    ctx.barrier()
    return seconds


def prepare_base_and_data(cfg: E2EConfig, run_dir: Path, ctx: DistributedContext) -> tuple[str, dict[str, Path] | None]:
    """The base model folder and, for the built-in task, its dataset files (made once, on rank 0)."""
    base = cfg.model
    paths: dict[str, Path] | None = None
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if base is None and not (run_dir / "base" / "config.json").is_file():
            from rlhf.models.tiny import save_tiny_model

            heads = 4 if cfg.tiny_hidden_size <= 256 else cfg.tiny_hidden_size // 64
            save_tiny_model(run_dir / "base", cfg.tiny_family, seed=cfg.seed, hidden_size=cfg.tiny_hidden_size,
                            num_layers=cfg.tiny_layers, num_heads=heads, num_kv_heads=max(1, heads // 2),
                            max_positions=256)
        if not cfg.data and not (run_dir / "data" / "DONE").is_file():
            from rlhf.data.tasks import get_task, write_task_dataset

            write_task_dataset(get_task(cfg.task), run_dir / "data", n_sft=cfg.n_sft, n_pairs=cfg.n_pairs,
                               n_prompts=cfg.n_prompts, n_eval_prompts=cfg.n_eval_prompts,
                               n_eval_pairs=cfg.n_eval_pairs, wrong_fraction=cfg.wrong_fraction, seed=cfg.seed)
            (run_dir / "data" / "DONE").write_text("ok\n")
    ctx.barrier()
    if not cfg.data:
        paths = {p.stem: p for p in (run_dir / "data").glob("*.jsonl")}
    return base or str(run_dir / "base"), paths


def run(cfg: E2EConfig, file_sections: dict[str, Any], flags: dict[str, dict[str, str]], source: str = "--config",
        deepspeed_config: str | None = None) -> dict[str, Any]:
    ctx = DistributedContext.initialize()
    run_dir = Path(cfg.output)
    started = time.perf_counter()
    base, paths = prepare_base_and_data(cfg, run_dir, ctx)
    stages = default_stage_configs(cfg)
    group_file = run_dir / "wandb_group.txt"
    if ctx.is_main and not group_file.is_file():
        group_file.write_text(f"e2e-{run_dir.resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}\n")
    ctx.barrier()
    group = group_file.read_text().strip()
    sft, reward, ppo = stages["sft"], stages["reward"], stages["ppo"]
    sft.model, sft.output = base, str(run_dir / "sft")
    reward.model, reward.output = str(run_dir / "sft" / "model"), str(run_dir / "reward")
    ppo.actor, ppo.output = str(run_dir / "sft" / "model"), str(run_dir / "ppo")
    ppo.reward = str(run_dir / "reward" / "model")
    if cfg.reward_fn:
        ppo.reward_fn, ppo.reward, ppo.critic = cfg.reward_fn, "", str(run_dir / "sft" / "model")
    if paths is not None:
        sft.data.data = [str(paths["sft"])]
        reward.data.data, reward.data.eval_data = [str(paths["pairs"])], [str(paths["eval_pairs"])]
        ppo.data.data = [str(paths["prompts"])]
    else:
        for stage in stages.values():
            stage.data.data, stage.data.data_split = list(cfg.data), cfg.data_split
        reward.data.eval_split = 0.05
    for stage in stages.values():
        stage.tracking.wandb_group = group
    if deepspeed_config:
        from rlhf.ds_config import import_ds_config

        imported = import_ds_config(deepspeed_config)
        for stage in stages.values():
            for key, value in imported.values.items():
                setattr(stage.engine, key, value)
        if "inference_tp_size" in imported.extra:
            ppo.inference_tp_size = imported.extra["inference_tp_size"]
    apply_stage_overrides(stages, file_sections, flags, source)

    from rlhf.stages import ppo as ppo_stage
    from rlhf.stages import reward as reward_stage
    from rlhf.stages import sft as sft_stage

    seconds = {"sft_seconds": run_stage("sft", sft, sft_stage, ctx)}
    if not cfg.reward_fn:
        seconds["reward_seconds"] = run_stage("reward", reward, reward_stage, ctx)
    seconds["ppo_seconds"] = run_stage("ppo", ppo, ppo_stage, ctx)

    summary: dict[str, Any] = {"output": str(run_dir), "task": None if cfg.data else cfg.task,
                               "reward_fn": cfg.reward_fn, "wandb_group": group}
    if not cfg.reward_fn:
        summary["rm_eval_accuracy"] = read_summary(reward.output).get("eval_accuracy")
    if paths is not None:
        t0 = time.perf_counter()
        summary.update(measure_success(cfg, run_dir, paths["eval_prompts"], ctx))
        seconds["eval_seconds"] = time.perf_counter() - t0
    summary.update(seconds)
    summary["total_seconds"] = time.perf_counter() - started
    if ctx.is_main:
        write_json_atomic(run_dir / "summary.json", summary)
    ctx.barrier()
    return summary


def measure_success(cfg: E2EConfig, run_dir: Path, eval_prompts: Path, ctx: DistributedContext) -> dict[str, float]:
    """Task success of T=1 samples on held-out prompts, for the SFT and the PPO model (same seed)."""
    from rlhf.data.tasks import get_task
    from rlhf.stages.evaluation import task_success

    task = get_task(cfg.task)
    prompts = [json.loads(line)["prompt"] for line in eval_prompts.read_text().splitlines() if line.strip()]
    result = {}
    for name in ("sft", "ppo"):
        result[f"{name}_task_success"] = task_success(
            str(run_dir / name / "model"), task, prompts, ctx, cfg.eval_temperature, cfg.eval_max_new_tokens, seed=cfg.seed)
    result["ppo_gain_points"] = 100.0 * (result["ppo_task_success"] - result["sft_task_success"])
    return result


__all__ = ["run", "parse_prefixed_flags", "STAGES"]
