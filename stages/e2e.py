"""`rlhf e2e` (and scripts/e2e.py): SFT -> reward model -> PPO (or SFT -> DPO), each stage's model
feeding the next.

    rlhf e2e                                  # built-in offline default: tiny model + `sort` task
    rlhf e2e --output runs/e2e --reward-fn sort          # PPO on the task's checker (verifiable reward)
    rlhf e2e --advantage-estimator grpo       # SFT -> GRPO on the task's checker (no reward stage, no critic)
    rlhf e2e --config e2e.yaml --ppo.kl-coef 0.1 --sft.lr 1e-3
    rlhf e2e --sft.trl-config sft.yaml --ppo.trl-config grpo.yaml   # TRL configs: docs/trl-config.md
    rlhf e2e --model Qwen/Qwen2-0.5B --data Anthropic/hh-rlhf --nproc-per-node 8
    rlhf e2e --model Qwen/Qwen2-0.5B --data HuggingFaceH4/ultrafeedback_binarized \
        --data-train-split train_prefs --data-test-split test_prefs \
        --data-columns sft_messages=messages      # splits, configs, columns, mixes: docs/data-sources.md
    rlhf e2e --preset smollm2 --advantage-estimator grpo   # SmolLM2-135M-Instruct (`rlhf models get`) learns
                                              # larger_number with GRPO on the task's checker (also rloo, dr_grpo)
    rlhf e2e --preset smollm2                 # the same with a reward model and a critic (PPO)
    rlhf e2e --algorithm dpo                  # SFT -> DPO on the task's preference pairs (no reward stage)
    rlhf e2e --preset smollm2 --algorithm dpo

Run folder: base/ (the built tiny model, or the preset's converted one), data/ (the task's jsonl
files), sft/, reward/, ppo/ or dpo/ (each with the stage output contract) and summary.json. Re-running
skips stages that have DONE and resumes an interrupted stage from its latest checkpoint. All
stages share one W&B group.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from rlhf.algorithms.estimators import ESTIMATORS
from rlhf.config import DataConfig, DPOConfig, E2EConfig, PPOConfig, RewardConfig, SFTConfig
from rlhf.config_sources import ConfigSources, resolve_config
import rlhf.data as data_package
from rlhf.data.tasks import DATASET_FILES, TASKS, get_task, write_task_dataset
from rlhf.ds_config import import_ds_config
from rlhf.engine.distributed import DistributedContext
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.models.gguf import format_report, get_model
from rlhf.models.loading import check_model_files
from rlhf.models.tiny import save_tiny_model
from rlhf.output_lock import lock_output, release_output
from rlhf.outputs import create_folder, is_done, read_summary, refuse_links_out, write_json_atomic
from rlhf.stages import dpo as dpo_stage
from rlhf.stages import ppo as ppo_stage
from rlhf.stages import reward as reward_stage
from rlhf.stages import sft as sft_stage
from rlhf.stages.evaluation import task_success
from rlhf.stages.tool_rollouts import tool_setup
from rlhf.trl_config import E2E_WIRED, import_trl_config

log = get_logger(__name__)

STAGES: dict[str, type] = {"sft": SFTConfig, "reward": RewardConfig, "ppo": PPOConfig, "dpo": DPOConfig}


# preset -> the `rlhf models get` name of its base model.
PRESET_MODELS: dict[str, str] = {"smollm2": "smollm2-135m-instruct"}


def preset_e2e_config(preset: str | None) -> E2EConfig:
    """The e2e defaults of `preset` (the plain defaults for None): what flags and the file then override.

    smollm2: larger_number (rlhf/data/tasks/larger_number.py: why it suits this model), its answers two
    digit tokens and EOS, so 8 new tokens suffice; success is measured greedily on 256 held-out prompts
    (a standard error of at most 3.1 points).
    """
    if preset is None:
        return E2EConfig()
    return E2EConfig(preset=preset, output="runs/e2e-smollm2", task="larger_number", n_sft=64, n_pairs=256,
                     n_prompts=512, n_eval_pairs=64, n_eval_prompts=256, eval_temperature=0.0, eval_max_new_tokens=8)


def resolve_e2e_config(sources: ConfigSources) -> E2EConfig:
    """The e2e options: preset defaults < --config file < flags. The preset is itself read from the
    file or the flags first, since it decides the defaults the others override."""
    probe = resolve_config(E2EConfig(), sources, where="rlhf e2e")
    defaults = preset_e2e_config(probe.preset)
    if is_tool_task(probe.task) and not probe.data and not mentions(sources, "advantage_estimator"):
        defaults.advantage_estimator = "grpo"  # a tool task's rollouts are scored by its checker, in groups
    if defaults == E2EConfig():
        return probe
    return resolve_config(defaults, sources, where="rlhf e2e")


def mentions(sources: ConfigSources, name: str) -> bool:
    """Whether the --config file or a flag sets the field `name`."""
    keys = (name, name.replace("_", "-"))
    return any(k in sources.file for k in keys) or any(sources.flags.get(k) is not None for k in keys)


def is_tool_task(name: str) -> bool:
    """A built-in task whose answers call tools (it lists them: `task.tools()`)."""
    return name in TASKS and hasattr(TASKS[name](), "tools")


def default_stage_configs(cfg: E2EConfig) -> dict[str, Any]:
    """Each stage's e2e defaults: the preset's, or the built-in tiny default's."""
    sft, reward, ppo, dpo = SFTConfig(), RewardConfig(), PPOConfig(), DPOConfig()
    for stage in (sft, reward, ppo, dpo):
        stage.engine.seed = cfg.seed
        stage.engine.optimizer_impl = "auto"
        stage.tracking.report_to = cfg.report_to
        stage.tracking.wandb_project = cfg.wandb_project
        stage.data.max_seq_len = 64
    if cfg.preset == "smollm2":
        smollm2_stage_settings(sft, reward, ppo, dpo)
    else:
        tiny_stage_settings(sft, reward, ppo, dpo)
    return {"sft": sft, "reward": reward, "ppo": ppo, "dpo": dpo}


def tiny_stage_settings(sft: SFTConfig, reward: RewardConfig, ppo: PPOConfig, dpo: DPOConfig) -> None:
    """Tuned so the built-in default (tiny model, `sort` task) learns in minutes on a 2-core CPU."""
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
    # DPO alone lowers the chosen answers' likelihood with the rejected ones' (sampled success 0.64 ->
    # 0.39 after 300 steps); with RPO's NLL term (rpo_alpha 1) it rises to 0.90 (docs/benchmarks.md).
    dpo.max_steps, dpo.engine.lr, dpo.engine.micro_batch_size, dpo.engine.warmup_steps = 300, 1e-4, 32, 10
    dpo.rpo_alpha = 1.0


def smollm2_stage_settings(sft: SFTConfig, reward: RewardConfig, ppo: PPOConfig, dpo: DPOConfig) -> None:
    """SmolLM2-135M-Instruct on larger_number, sized for minutes on 2 CPU cores (float32).

    64 SFT demonstrations (a wrong_fraction share of them the smaller number) teach the answer
    format, not the comparison, which leaves the RL stage the comparison to learn; SmolLM2's chat
    template adds a system turn, so prompts are ~45 tokens and 64 tokens hold prompt + answer.
    """
    sft.epochs = 1
    sft.engine.lr, sft.engine.micro_batch_size, sft.engine.warmup_steps = 2e-5, 4, 2
    reward.epochs = 1
    reward.engine.lr, reward.engine.micro_batch_size, reward.engine.warmup_steps = 3e-5, 8, 2
    ppo.max_steps, ppo.generation_batch_size, ppo.max_new_tokens, ppo.max_prompt_len = 40, 32, 8, 56
    # The 32 rollouts of an iteration in one micro-batch: 3.7 s of training an iteration in four
    # micro-batches of 8, 1.1 s in one (docs/benchmarks.md).
    ppo.engine.lr, ppo.critic_lr, ppo.engine.micro_batch_size = 2e-5, 2e-5, 32
    ppo.engine.lr_scheduler, ppo.kl_coef, ppo.ppo_epochs = "constant", 0.05, 1
    ppo.engine.train_batch_size = None
    # The 256 pairs once; DPO alone collapses the chosen answers' likelihood (greedy success 0.62 ->
    # 0.18), with RPO's NLL term (rpo_alpha 1) it reaches 0.996 (docs/benchmarks.md).
    dpo.epochs, dpo.rpo_alpha = 1, 1.0
    dpo.engine.lr, dpo.engine.micro_batch_size, dpo.engine.warmup_steps = 2e-5, 8, 2


def split_stage_sections(mapping: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """An e2e config file -> (its top-level e2e keys, its `sft:` / `reward:` / `ppo:` sections)."""
    top = {key: value for key, value in mapping.items() if key not in STAGES}
    sections = {key: value for key, value in mapping.items() if key in STAGES}
    for name, section in sections.items():
        if not isinstance(section, dict):
            raise UserError(f"{source}: section '{name}' must be a mapping of that stage's fields")
    return top, sections


def resolve_stage_configs(stages: dict[str, Any], deepspeed_config: str | None, file_sections: dict[str, Any],
                          flags: dict[str, dict[str, str]], source: str) -> None:
    """Each stage: e2e defaults < ds_config < its TRL config (`stage_trl_config`) < the file's
    section < prefixed flags (`--ppo.kl-coef 0.1`)."""
    deepspeed = None
    if deepspeed_config:
        deepspeed = import_ds_config(deepspeed_config)
    for name, stage in stages.items():
        section, stage_flags = dict(file_sections.get(name) or {}), dict(flags.get(name, {}))
        trl = stage_trl_config(section, stage_flags)
        sources = ConfigSources(deepspeed=deepspeed, trl=trl, file=section, file_name=f"{source} [{name}]",
                                flags=stage_flags, flag_prefix=f"--{name}.")
        resolve_config(stage, sources, where=f"rlhf e2e [{name}]")
        if name != "ppo" and stage.lora.export_adapter:
            raise UserError(f"rlhf e2e [{name}]: export_adapter: the next stage loads {name}'s model, which must be "
                            "the merged one; drop it (ppo may export its adapter)")


def stage_trl_config(section: dict[str, Any], flags: dict[str, str]) -> Any:
    """A stage's TRL config (a TrlImport, or None): `--<stage>.trl-config FILE`, else the section's
    `trl_config: FILE`; both are taken out of the section and the flags. The keys e2e wires itself
    (model_name_or_path, output_dir, dataset_name, reward_model_name_or_path, deepspeed) are left
    out of it, with a warning; e2e's --advantage-estimator keeps a critic-free estimator it names."""
    paths = (flags.pop("trl-config", None), flags.pop("trl_config", None), section.pop("trl_config", None))
    path = next((p for p in paths if p), None)
    if path is None:
        return None
    return import_trl_config(path, int(os.environ.get("WORLD_SIZE", "1")), skip=E2E_WIRED)


def parse_prefixed_flags(args: list[str]) -> dict[str, dict[str, str]]:
    """['--ppo.kl-coef', '0.1', '--ppo.greedy'] -> {'ppo': {'kl-coef': '0.1', 'greedy': 'true'}}."""
    out: dict[str, dict[str, str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        stage, _, key = arg.removeprefix("--").partition(".")
        if not arg.startswith("--") or stage not in STAGES or not key:
            raise UserError(f"unexpected argument {arg!r}; stage options are given as --sft.X, --reward.X, --ppo.X or "
                            "--dpo.X")
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


def base_model(cfg: E2EConfig, run_dir: Path) -> str:
    """The base model: --model (a folder or hub name), else <run>/base (the preset's or the tiny model)."""
    return cfg.model or str(run_dir / "base")


def task_files(cfg: E2EConfig, run_dir: Path) -> dict[str, Path] | None:
    """The built-in task's dataset files by name (sft, pairs, eval_pairs, prompts, eval_prompts);
    None when --data replaces the task."""
    return None if cfg.data else {Path(name).stem: run_dir / "data" / name for name in DATASET_FILES}


def stage_configs(cfg: E2EConfig, run_dir: Path) -> dict[str, Any]:
    """Each stage's e2e defaults, wired to the run folder: which model and data feed which stage."""
    stages = default_stage_configs(cfg)
    sft, reward, ppo = stages["sft"], stages["reward"], stages["ppo"]
    sft.model, sft.output = base_model(cfg, run_dir), str(run_dir / "sft")
    reward.model, reward.output = str(run_dir / "sft" / "model"), str(run_dir / "reward")
    ppo.actor, ppo.output = str(run_dir / "sft" / "model"), str(run_dir / "ppo")
    ppo.reward = str(run_dir / "reward" / "model")
    dpo = stages["dpo"]
    dpo.model, dpo.output = str(run_dir / "sft" / "model"), str(run_dir / "dpo")
    ppo.advantage_estimator = cfg.advantage_estimator
    if ppo.critic_free:
        critic_free_settings(cfg, ppo)
    functions = reward_functions(cfg)
    if functions:
        ppo.reward_fn, ppo.reward = functions, ""
        ppo.critic = None if ppo.critic_free else str(run_dir / "sft" / "model")
    paths = task_files(cfg, run_dir)
    if paths is not None:
        sft.data.data = [str(paths["sft"])]
        reward.data.data, reward.data.eval_data = [str(paths["pairs"])], [str(paths["eval_pairs"])]
        dpo.data.data, dpo.data.eval_data = [str(paths["pairs"])], [str(paths["eval_pairs"])]
        ppo.data.data, ppo.data.eval_data = [str(paths["prompts"])], [str(paths["eval_prompts"])]
        ppo.eval_reward_fn, ppo.eval_interval = [cfg.task], 10  # the learning curve: held-out success, greedy
        ppo.eval_max_new_tokens = cfg.eval_max_new_tokens
        if is_tool_task(cfg.task):
            tool_task_settings(cfg, stages)
    else:
        for name, stage in stages.items():
            share_data_selection(cfg, stage.data, test_split=name != "ppo")
        if cfg.data_test_split is None:
            reward.data.eval_split = dpo.data.eval_split = 0.05
    return stages


TEMPLATES = Path(data_package.__file__).parent / "templates"
"""The chat templates that render tools (rlhf/data/templates/*.jinja)."""


def tool_template(cfg: E2EConfig) -> str | None:
    """The chat template of a tool task: the built-in model's own renders no tools, so the tiny
    model's dialog format or SmolLM2's ChatML with tools (rlhf/data/templates); --model keeps its own."""
    if cfg.model:
        return None
    return str(TEMPLATES / ("chatml_tools.jinja" if cfg.preset == "smollm2" else "plain_tools.jinja"))


def tool_task_settings(cfg: E2EConfig, stages: dict[str, Any]) -> None:
    """A tool task (`calculator`): SFT on its tool-call conversations, the RL stage with its tools and
    room for a turn with a call, the tool's response and the answer (tiny: characters; smollm2: BPE
    tokens, the ChatML system turn listing the tools ~60 of them)."""
    sft, ppo = stages["sft"], stages["ppo"]
    sft.data.chat_template = ppo.data.chat_template = tool_template(cfg)
    ppo.tools = get_task(cfg.task).tool_specs()
    if cfg.preset == "smollm2":  # a call ~30 tokens, the tool's response ~15, the answer ~4
        sft.data.max_seq_len, ppo.max_prompt_len, ppo.max_new_tokens = 192, 96, 80
        ppo.max_steps = 12
    else:
        sft.data.max_seq_len, ppo.max_prompt_len, ppo.max_new_tokens = 256, 80, 128
    ppo.eval_max_new_tokens = ppo.max_new_tokens


def share_data_selection(cfg: E2EConfig, data: DataConfig, test_split: bool) -> None:
    """--data and what selects within it (split, config, columns, mix) for one stage; the test
    split only for sft and reward (ppo has no eval set). A stage's section or prefixed flags
    (`--sft.data-test-split`) override these."""
    data.data, data.data_split = list(cfg.data), cfg.data_split
    data.data_config, data.data_train_split = cfg.data_config, cfg.data_train_split
    data.data_columns, data.data_mix = list(cfg.data_columns), list(cfg.data_mix)
    if test_split:
        data.data_test_split = cfg.data_test_split


def reward_functions(cfg: E2EConfig) -> list[str]:
    """The RL stage's reward functions: --reward-fn, else for a critic-free estimator on the built-in
    task its checker; none means the reward stage trains a reward model."""
    if cfg.reward_fn:
        return list(cfg.reward_fn)
    if not ESTIMATORS[cfg.advantage_estimator].needs_critic and not cfg.data:
        return [cfg.task]
    return []


def critic_free_settings(cfg: E2EConfig, ppo: PPOConfig) -> None:
    """Group sampling for the critic-free estimators, GRPO's KL in the loss at TRL's beta 0.04.

    Tiny default: the same 64 samples per iteration as PPO, as 8 prompts x 8. smollm2: after SFT
    the model picks either number about half the time, so nearly every group of 8 holds both a
    right and a wrong answer; 60 iterations of 4 prompts x 8 at lr 2e-5 without a KL term (TRL's
    GRPO default beta 0: no reference model runs), the 32 rollouts in one micro-batch as PPO's."""
    ppo.samples_per_prompt, ppo.kl_coef = 8, 0.04
    if cfg.preset == "smollm2":
        ppo.generation_batch_size, ppo.max_steps, ppo.engine.lr, ppo.kl_coef = 32, 60, 2e-5, 0.0


def wandb_group(run_dir: Path, ctx: DistributedContext) -> str:
    """One W&B group per e2e run folder, kept across re-runs (written once, on rank 0)."""
    group_file = run_dir / "wandb_group.txt"
    if ctx.is_main and not group_file.is_file():
        group_file.write_text(f"e2e-{run_dir.resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}\n")
    ctx.barrier()
    return group_file.read_text().strip()


def check_model_folder(cfg: E2EConfig) -> None:
    """--model as a local folder must hold a model, checked before any stage starts; a name that is
    not a folder is left to the hub."""
    if cfg.model and Path(cfg.model).is_dir():
        if not (Path(cfg.model) / "config.json").is_file():
            raise UserError(f"--model {cfg.model}: folder has no config.json; give a Hugging Face model folder")
        check_model_files(cfg.model, "--model")


def make_base_model(cfg: E2EConfig, base: Path) -> None:
    """<run>/base: the preset's real model (`rlhf models get`) or the built-in tiny model."""
    if cfg.preset is not None:
        if base.is_dir() and any(base.iterdir()):  # an interrupted conversion: start it again
            shutil.rmtree(base)
        log.info("e2e: %s base model -> %s", PRESET_MODELS[cfg.preset], base)
        log.info("%s", format_report(get_model(PRESET_MODELS[cfg.preset], str(base))))
        return
    heads = 4 if cfg.tiny_hidden_size <= 256 else cfg.tiny_hidden_size // 64
    save_tiny_model(base, cfg.tiny_family, seed=cfg.seed, hidden_size=cfg.tiny_hidden_size,
                    num_layers=cfg.tiny_layers, num_heads=heads, num_kv_heads=max(1, heads // 2), max_positions=256)


def claim_run_folder(run_dir: Path, ctx: DistributedContext) -> None:
    """Rank 0: the run folder created and locked, one e2e per folder (each stage also locks its
    own); refused, in one line on every rank, when another run holds it or a link leads out of it."""
    error = ""
    if ctx.is_main:
        try:
            lock_output(create_folder(run_dir))
            refuse_links_out(run_dir)
        except UserError as exc:
            release_output(run_dir)
            error = str(exc)
    error = str(ctx.broadcast_object(error))
    if error:
        raise UserError(error)


def prepare_base_and_data(cfg: E2EConfig, run_dir: Path, ctx: DistributedContext) -> None:
    """The base model (preset or tiny; none with --model) and, for the built-in task, its dataset
    files (made once, on rank 0)."""
    check_model_folder(cfg)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.model is None and not (run_dir / "base" / "config.json").is_file():
            make_base_model(cfg, run_dir / "base")
        if not cfg.data and not (run_dir / "data" / "DONE").is_file():
            write_task_dataset(get_task(cfg.task), run_dir / "data", n_sft=cfg.n_sft, n_pairs=cfg.n_pairs,
                               n_prompts=cfg.n_prompts, n_eval_prompts=cfg.n_eval_prompts,
                               n_eval_pairs=cfg.n_eval_pairs, wrong_fraction=cfg.wrong_fraction, seed=cfg.seed)
            (run_dir / "data" / "DONE").write_text("ok\n")
    ctx.barrier()


def run(cfg: E2EConfig, file_sections: dict[str, Any], flags: dict[str, dict[str, str]], source: str = "--config",
        deepspeed_config: str | None = None) -> dict[str, Any]:
    run_dir = Path(cfg.output)
    started = time.perf_counter()
    stages = stage_configs(cfg, run_dir)
    # Resolved before any work is done, so that a bad stage setting fails at once.
    resolve_stage_configs(stages, deepspeed_config, file_sections, flags, source)
    sft, reward, ppo = stages["sft"], stages["reward"], stages["ppo"]
    # One process group for every stage: its collective timeout is the longest any stage asks for.
    ctx = DistributedContext.initialize(max(stage.engine.dist_timeout for stage in stages.values()))
    claim_run_folder(run_dir, ctx)
    prepare_base_and_data(cfg, run_dir, ctx)
    group = wandb_group(run_dir, ctx)
    for stage in stages.values():
        stage.tracking.wandb_group = stage.tracking.wandb_group or group
    paths = task_files(cfg, run_dir)
    seconds = {"sft_seconds": run_stage("sft", sft, sft_stage, ctx)}
    summary: dict[str, Any] = {"output": str(run_dir), "task": None if cfg.data else cfg.task,
                               "algorithm": cfg.algorithm, "wandb_group": group}
    if cfg.algorithm == "dpo":
        seconds["dpo_seconds"] = run_stage("dpo", stages["dpo"], dpo_stage, ctx)
        dpo_summary = read_summary(stages["dpo"].output)
        summary.update({f"dpo_{key}": dpo_summary.get(key) for key in ("eval_rewards/accuracies", "eval_loss")})
    else:
        trains_reward_model = not reward_functions(cfg)
        if trains_reward_model:
            seconds["reward_seconds"] = run_stage("reward", reward, reward_stage, ctx)
        seconds["ppo_seconds"] = run_stage("ppo", ppo, ppo_stage, ctx)
        summary.update(reward_fn=reward_functions(cfg), advantage_estimator=cfg.advantage_estimator)
        if trains_reward_model:
            summary["rm_eval_accuracy"] = read_summary(reward.output).get("eval_accuracy")
    if paths is not None:
        t0 = time.perf_counter()
        summary.update(measure_success(cfg, run_dir, paths["eval_prompts"], ctx, ppo))
        seconds["eval_seconds"] = time.perf_counter() - t0
    summary.update(seconds)
    summary["total_seconds"] = time.perf_counter() - started
    if ctx.is_main:
        write_json_atomic(run_dir / "summary.json", summary)
    ctx.barrier()
    if ctx.is_main:
        release_output(run_dir)
    return summary


def measure_success(cfg: E2EConfig, run_dir: Path, eval_prompts: Path, ctx: DistributedContext,
                    ppo: PPOConfig) -> dict[str, float]:
    """Task success on the held-out prompts (greedy at --eval-temperature 0, else sampled with one seed
    for every model) of the base, the SFT and the aligned (PPO or DPO) model, each with its standard
    error, and the aligned model's gain over SFT in points (`ppo_gain_points` / `dpo_gain_points`).
    A tool task's models answer with the RL stage's tools, and once more without any
    (`<model>_task_success_no_tool`): what the tool is worth."""
    task = get_task(cfg.task)
    prompts = [json.loads(line)["prompt"] for line in eval_prompts.read_text().splitlines() if line.strip()]
    final = cfg.algorithm
    models = {"base": base_model(cfg, run_dir), **{name: str(run_dir / name / "model") for name in ("sft", final)}}
    result: dict[str, float] = {"eval_prompts": float(len(prompts)), "eval_temperature": cfg.eval_temperature}
    tools = tool_setup(ppo.tools, ppo.environment, ppo.max_tool_calls, ppo.tool_timeout)
    runs = {"": tools, "_no_tool": None} if tools is not None else {"": None}
    for name, folder in models.items():
        for suffix, with_tools in runs.items():
            max_new = ppo.max_new_tokens if with_tools is not None else cfg.eval_max_new_tokens
            success = task_success(folder, task, prompts, ctx, cfg.eval_temperature, max_new, seed=cfg.seed,
                                   tools=with_tools, chat_template=ppo.data.chat_template)
            result[f"{name}_task_success{suffix}"] = success
            result[f"{name}_task_success{suffix}_se"] = (success * (1.0 - success) / max(len(prompts), 1)) ** 0.5
    result[f"{final}_gain_points"] = 100.0 * (result[f"{final}_task_success"] - result["sft_task_success"])
    return result


__all__ = ["run", "parse_prefixed_flags", "resolve_e2e_config", "STAGES"]
