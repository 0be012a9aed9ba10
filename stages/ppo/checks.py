"""What `rlhf ppo` checks before any model loads: flags, model folders, tokens, batch arithmetic."""

from __future__ import annotations

from typing import Any

from rlhf.config import PPOConfig
from rlhf.data.retokenize import same_vocabulary
from rlhf.engine.distributed import DistributedContext
from rlhf.errors import UserError
from rlhf.models.checks import check_tokenizer_fits, max_positions
from rlhf.models.loading import load_tokenizer
from rlhf.models.value_model import check_reward_model_dir, value_model_kind
from rlhf.reward_functions import RewardFunction
from rlhf.stages.reward_sources import check_reward_sources
from rlhf.stages.tool_rollouts import ToolSetup, load_tool_setup


def check_config(config: PPOConfig, ctx: DistributedContext) -> tuple[list[RewardFunction], ToolSetup | None]:
    """Flags PPO cannot run without, the model folders, reward functions and tools (loaded here,
    before any model) and the TP size. Returns the reward functions and the tools. (Whether a
    rollout fits the model is checked once the prompts are read; the batch arithmetic by
    start_stage, `default_minibatch`.)"""
    if not config.actor:
        raise UserError("--actor is required: the policy to train (e.g. the SFT stage's <output>/model)")
    tools = load_tool_setup(config)
    environment_reward = tools.environment_name if tools is not None and tools.environment_rewards else None
    if not config.reward and not config.reward_fn and environment_reward is None:
        raise UserError("--reward (a reward model folder) or --reward-fn (a task name or file.py:function) is required "
                        "(or an --environment with get_reward())")
    if config.critic_free and config.critic:
        raise UserError(f"--critic {config.critic}: --advantage-estimator {config.advantage_estimator} trains no "
                        "critic; drop --critic (or use --advantage-estimator gae)")
    if not config.critic_free and not (config.critic or config.reward):
        raise UserError("--critic is required with --reward-fn (a causal LM or value model folder, e.g. the SFT model)")
    check_model_folders(config)
    functions = check_reward_sources(config, environment_reward)
    if config.ptx_data and config.ptx_coef <= 0:
        raise UserError("--ptx-data needs --ptx-coef > 0")
    ctx.tp_coordinates(config.inference_tp_size)
    return functions, tools


def default_minibatch(config: PPOConfig, world_size: int) -> dict[str, int]:
    """PPO's default for the batch arithmetic (`rlhf.engine.batch_size.resolved_batch`'s
    default_train_batch and max_micro; start_stage and `rlhf plan` pass it): without
    --train-batch-size or --grad-accum the minibatch is the whole experience (one optimizer step per
    PPO epoch), in micro-batches of at most the rollout batch."""
    return {"default_train_batch": config.generation_batch_size * world_size,
            "max_micro": config.generation_batch_size}


def check_model_folders(config: PPOConfig) -> None:
    """--reward and --critic are read from config.json alone, before the actor (or anything) is
    loaded: a wrong folder fails in a second, not after minutes of loading models."""
    if config.reward:
        check_reward_model_dir(config.reward, "--reward")
    if config.critic and value_model_kind(config.critic) is None:
        raise UserError(f"--critic {config.critic}: no config.json; pass a value/reward model folder, a Hugging Face "
                        "*ForSequenceClassification folder or a causal LM folder (e.g. runs/sft/model)")
    if config.reward and not config.critic and not config.critic_free and not same_vocabulary(
            load_tokenizer(config.reward, "--reward"), load_tokenizer(config.actor, "--actor")):
        raise UserError(f"--reward {config.reward}: its tokenizer differs from the actor's, so it cannot be the "
                        "critic (the critic reads the actor's token ids); pass --critic (e.g. the --actor folder)")


def check_token_readers(config: PPOConfig, tokenizer: Any, sequence_len: int) -> None:
    """Every model that reads the actor's token ids (actor, ref, critic) has an embedding row for
    each id the actor's tokenizer gives, and the ref and critic have positions for rollouts of
    `sequence_len` tokens (the actor's are checked with its KV cache, `check_rollout_fits`); the
    --reward model is checked against its own tokenizer. One line each, before any weights are read."""
    check_tokenizer_fits(tokenizer, config.actor, "--actor")
    readers = {"--ref": config.ref if config.ref != config.actor else None,
               "--critic": None if config.critic_free else config.critic or config.reward}
    for flag, folder in readers.items():
        if not folder:
            continue
        check_tokenizer_fits(tokenizer, folder, flag, "the --actor tokenizer")
        positions = max_positions(folder)
        if positions is not None and sequence_len > positions:
            raise UserError(f"{flag} {folder}: rollouts of up to {sequence_len} tokens (prompt + --max-new-tokens) "
                            f"exceed its max_position_embeddings {positions}; lower --max-new-tokens or "
                            "--max-prompt-len")
    if config.reward:
        check_tokenizer_fits(load_tokenizer(config.reward, "--reward"), config.reward, "--reward")


def check_batch_arithmetic(config: PPOConfig, ctx: DistributedContext) -> None:
    """The experience must be whole prompt groups, and the global minibatch (--train-batch-size,
    resolved by start_stage) must divide it."""
    experience = config.generation_batch_size * ctx.world_size
    if experience % config.samples_per_prompt:
        raise UserError(
            f"--samples-per-prompt {config.samples_per_prompt} must divide the experience batch "
            f"generation_batch_size {config.generation_batch_size} x world size {ctx.world_size} = {experience} "
            "(each iteration samples whole groups)"
        )
    if experience % config.engine.train_batch_size:
        raise UserError(
            f"--train-batch-size {config.engine.train_batch_size} must divide the experience batch "
            f"generation_batch_size {config.generation_batch_size} x world size {ctx.world_size} = {experience}"
        )
