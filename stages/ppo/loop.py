"""`PPOTrainer`: setup (data, models, tracker, resume), the loop over the phases, checkpoints and the finish."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from rlhf.algorithms.ppo_math import AdaptiveKLController, FixedKLController
from rlhf.config import PPOConfig
from rlhf.data.batching import BatchPlan
from rlhf.data.stage_rows import tokenize_specs
from rlhf.data.tokenization import tokenize_sft
from rlhf.engine.backends.registry import backend_for
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.ema import ParameterEMA
from rlhf.engine.export import export_state_dict
from rlhf.engine.generation import check_rollout_fits
from rlhf.engine.inference import FrozenModel
from rlhf.engine.adapters import AdaptersOffReference, merge_state_dict
from rlhf.engine.phase_memory import PhaseMemory
from rlhf.engine.packing import log_packing, packing_unsupported_reason
from rlhf.engine.preemption import agreed_stop
from rlhf.engine.rollout import default_parity_tolerance
from rlhf.engine.sampling import SamplingParams
from rlhf.engine.sharding import COMPUTE_DTYPES
from rlhf.engine.train_engine import TrainEngine
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.models.checks import fit_max_seq_len
from rlhf.models.loading import deferred_causal_lm, load_tokenizer
from rlhf.models.lora import export_trained_model, with_lora
from rlhf.models.value_model import deferred_value_model_from
from rlhf.reward_functions import RewardFunction, load_reward_functions
from rlhf.stages.experience import LogprobDrift
from rlhf.stages.ppo.checks import check_token_readers
from rlhf.stages.ppo.evaluation_phase import EvaluationPhase, format_eval
from rlhf.stages.ppo.experience_phase import ExperiencePhase
from rlhf.stages.ppo.generation_phase import GenerationPhase
from rlhf.stages.ppo.iteration_log import IterationLog
from rlhf.stages.ppo.parts import disable_dropout, engine_config_for, load_prompts, timed
from rlhf.stages.ppo.update_phase import UpdatePhase
from rlhf.stages.reward_sources import build_reward_source
from rlhf.stages.tool_rollouts import ToolSetup, check_template_renders_tools, load_tool_setup
from rlhf.stages.throughput import iteration_models
from rlhf.stages.trainer import finish_stage, open_run, resume_from_latest, stop_for_signal, wants_checkpoint

log = get_logger(__name__)


class PPOTrainer(GenerationPhase, ExperiencePhase, UpdatePhase, IterationLog, EvaluationPhase):
    """Actor (and critic), reference, reward sources, KL controller and EMA, and the loop over them. Each phase's methods are in its own module."""

    def __init__(self, config: PPOConfig, ctx: DistributedContext, output: Path,
                 reward_functions: list[RewardFunction] | None = None, tools: ToolSetup | None = None) -> None:
        self.config, self.ctx, self.output = config, ctx, output
        self.reward_functions = reward_functions
        # --tools / --environment: rollouts run turns (stages/tool_rollouts.py).
        self.tool_setup = tools if tools is not None or not (config.tools or config.environment) else (
            load_tool_setup(config))
        # Held-out scoring: --eval-reward-fn, else the reward functions (a reward model alone scores no held-out set).
        self.eval_functions = (load_reward_functions(config.eval_reward_fn) if config.eval_reward_fn
                               else list(reward_functions or []))
        self.seed = config.engine.seed
        self.tp = ctx.tp_coordinates(config.inference_tp_size)
        self.batch_per_rank = config.generation_batch_size
        self.group_size = config.samples_per_prompt
        self.experience_size = config.generation_batch_size * ctx.world_size  # samples per iteration
        self.tokenizer = load_tokenizer(config.actor, "--actor", config.data.chat_template)
        if self.tool_setup is not None:
            check_template_renders_tools(self.tokenizer, self.tool_setup.schemas, f"--actor {config.actor}")
        self.load_data()
        # Before any model loads, with the longest prompt there is (not the --max-prompt-len cap).
        check_rollout_fits(config.actor, config.generation_batch_size * config.inference_tp_size,
                           max(map(len, self.prompts.ids)), config.max_new_tokens, config.engine.dtype, ctx.device,
                           config.inference_tp_size, "rlhf ppo")
        check_token_readers(config, self.tokenizer, max(map(len, self.prompts.ids)) + config.max_new_tokens)
        self.total_iterations = config.max_steps if config.max_steps > 0 else self.plan.steps_per_epoch * config.epochs
        self.build_models()
        self.tracker, self.checkpointer = open_run(config, ctx, output, "ppo")
        self.elapsed_seconds = 0.0  # training wall time over the run's iterations (resumed with it)
        self.start_iteration = self.resume()
        self.sampling = SamplingParams(
            max_new_tokens=config.max_new_tokens, min_new_tokens=config.min_new_tokens, do_sample=not config.greedy,
            temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
            eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        self.last_metrics: dict[str, float] = {}
        self.memory = PhaseMemory(ctx.device)  # peak_mem_gb_<phase> per iteration (engine/phase_memory.py)
        self.critic_seconds = 0.0
        self.policy_kl_sum = 0.0
        # Unset, by the actor's dtype: 16-bit recomputes the old log-probs and truncates the rollout weights.
        self.recompute_old_logprobs = config.recomputes_old_logprobs(self.actor.dtype)
        self.rollout_is = config.rollout_is_mode(self.actor.dtype)
        old = ("the trained forward's own (on-policy update)" if self.on_policy_update
               else "recomputed by the actor" if self.recompute_old_logprobs
               else "generation's while within --old-logprob-tolerance")
        log.info("ppo: %s actor: old log-probs %s; rollout importance sampling %s", self.actor.dtype, old,
                 self.rollout_is if self.rollout_is == "off" else f"{self.rollout_is} (cap {config.rollout_is_cap:g})")
        halved = backend_for(ctx.device).rounds_kv_cache(config.kv_cache_dtype, COMPUTE_DTYPES[self.actor.dtype],
                                                         self.actor.model.config.model_type)
        default_tolerance = default_parity_tolerance(self.actor.dtype, halved)
        self.old_logprob_tolerance = (config.old_logprob_tolerance if config.old_logprob_tolerance is not None
                                      else default_tolerance)
        self.parity_tolerance = (config.rollout_parity_tolerance if config.rollout_parity_tolerance is not None
                                 else default_tolerance)
        self.old_logprob_drift = LogprobDrift()
        self.ran_old_logprob_forward = False
        self.optimizer_steps_this_iteration = 0
        self.tied_iterations = 0  # iterations in a row whose groups' rewards all tied (check_reward_signal)
        reward_model = self.reward.model_source
        self.kept_values: torch.Tensor | None = None
        self.flop_models = iteration_models(self.actor.model.config, self.critic.model.config if self.critic else None,
                                            reward_model.model.model.config if reward_model else None)
        self.started = time.perf_counter()

    def load_data(self) -> None:
        """Prompts, the plan that deals them out per iteration, and the optional PTX rows."""
        config = self.config
        self.prompts, self.eval_prompts = load_prompts(config, self.tokenizer,
                                                       None if self.tool_setup is None else self.tool_setup.schemas)
        if self.eval_prompts is not None and not self.eval_functions:
            log.warning("ppo: %d held-out prompts but no function to score them: pass --eval-reward-fn",
                        len(self.eval_prompts.ids))
        # The plan deals out each iteration's global prompts (every rank reads the same list): the
        # experience batch of generation_batch_size x world samples is that many prompts' groups.
        prompts_per_iteration = self.batch_per_rank * self.ctx.world_size // self.group_size
        self.plan = BatchPlan(len(self.prompts.ids), prompts_per_iteration, 1, 1, 0, self.seed)
        if self.plan.steps_per_epoch == 0:
            raise UserError(f"{len(self.prompts.ids)} prompts do not fill one iteration of "
                            f"{self.plan.global_batch_size}; lower --generation-batch-size or add prompts")
        leftover = self.plan.num_rows % self.plan.global_batch_size
        if leftover:
            log.info("ppo: %d prompts do not fill an iteration and wait for the next epoch's shuffle", leftover)
        self.ptx_rows: list[dict] = []
        if config.ptx_data:
            max_seq_len = fit_max_seq_len(config.data.max_seq_len, config.actor, "--actor")
            self.ptx_rows, _ = tokenize_specs(
                config.ptx_data, lambda parsed: tokenize_sft(parsed, self.tokenizer, max_seq_len,
                                                             last_turn_only=config.data.train_last_turn_only),
                "ptx data")

    def build_models(self) -> None:
        """Trained actor and critic (none for the critic-free estimators; separate optimizers),
        frozen reference, reward sources, KL controller, EMA."""
        config, ctx = self.config, self.ctx
        minibatches = self.experience_size // config.engine.train_batch_size
        total_steps = self.total_iterations * config.ppo_epochs * minibatches
        # Every model is built on the meta device and each rank reads only its shards (sharded loading).
        actor, actor_weights = with_lora(*deferred_causal_lm(config.actor, "--actor"), config, config.actor, "actor")
        self.actor = TrainEngine(disable_dropout(actor), engine_config_for(config, config.actor_zero_stage, None), ctx,
                                 total_steps, "actor", actor_weights)
        self.critic: TrainEngine | None = None
        if not config.critic_free:
            critic_source = config.critic or config.reward
            critic, critic_weights = with_lora(*deferred_value_model_from(critic_source, flag="--critic"), config,
                                               critic_source, "critic")
            self.critic = TrainEngine(
                disable_dropout(critic), engine_config_for(config, config.critic_zero_stage, config.critic_lr), ctx,
                total_steps, "critic", critic_weights)
        self.engines = {"actor": self.actor, **({"critic": self.critic} if self.critic else {})}
        self.ref: FrozenModel | None = None
        if not config.needs_reference:
            log.info("ppo: no KL term (--kl-coef 0): the reference model is neither loaded nor run%s; --log-kl "
                     "measures the KL anyway", f" (--ref {config.ref} unused)" if config.ref else "")
        elif config.lora.lora_rank and config.ref in (None, config.actor):
            # The LoRA actor's frozen base is the reference: no second copy of the weights.
            self.ref = AdaptersOffReference(self.actor.model, ctx, config.engine.micro_batch_size)
        else:
            ref, ref_weights = deferred_causal_lm(config.ref or config.actor, "--ref")
            self.ref = FrozenModel(ref, ctx, config.engine.zero_stage, self.actor.dtype, config.offload_ref,
                                   config.engine.micro_batch_size, "ref", compile=config.engine.compile,
                                   weights=ref_weights)
        setup = self.tool_setup
        self.reward = build_reward_source(config, ctx, self.tokenizer, self.actor.dtype, self.reward_functions,
                                          setup.environment_name if setup is not None and setup.environment_rewards
                                          else None)
        if config.pack_sequences and config.max_tokens_per_micro_batch:
            log_packing(self.packing_reasons())
        self.kl_ctl = (AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon) if config.adaptive_kl
                       else FixedKLController(config.kl_coef))
        self.ema = ParameterEMA(self.actor.model, config.ema_decay) if config.ema_decay > 0 else None

    def packing_reasons(self) -> dict[str, str | None]:
        """Each model's reason its forwards never run packed (None: they can), for the log."""
        device = self.ctx.device
        reasons = {"actor": packing_unsupported_reason(self.actor.model, device)}
        if self.critic is not None:
            reasons["critic"] = packing_unsupported_reason(self.critic.model, device)
        if self.ref is not None:
            reasons["ref"] = self.ref.packing_unsupported_reason()
        if self.reward.model_source is not None:
            reasons["reward"] = self.reward.model_source.model.packing_unsupported_reason()
        return reasons

    def resume(self) -> int:
        """With --resume, the trainer's resume (engines, RNG, metrics) plus the KL coefficient and
        the EMA; returns the iteration to start from."""
        state = resume_from_latest(self.config, self.ctx, self.checkpointer, self.engines, self.tracker)
        if state is None:
            return 0
        self.kl_ctl.value = state["kl_coef"]
        self.elapsed_seconds = float(state.get("elapsed_s", 0.0))
        if self.ema is not None and "ema" in state:
            self.ema.load_state_dict(state["ema"])
        return int(state["iteration"])

    def train(self) -> None:
        """One iteration per step: rollouts (+ rewards) -> experience -> update -> logging -> checkpoint."""
        bar = tqdm(total=self.total_iterations, initial=self.start_iteration, desc="ppo", disable=not self.ctx.is_main,
                   dynamic_ncols=True)
        self.started = time.perf_counter()
        signum = agreed_stop(self.ctx) if self.start_iteration < self.total_iterations else None  # while loading
        if signum is not None:
            bar.close()
            stop_for_signal(self.ctx, self.tracker, "ppo", signum, self.start_iteration, None)
        self.log_initial_eval()
        for iteration in range(self.start_iteration, self.total_iterations):
            iteration_started = time.perf_counter()
            seconds: dict[str, float] = {}
            self.critic_seconds = self.policy_kl_sum = 0.0
            self.old_logprob_drift = LogprobDrift()
            rollouts = self.collect_rollouts(iteration, seconds)
            with timed(seconds, "experience_s"), self.memory.phase("experience"):
                exp = self.make_experience(rollouts)
            with timed(seconds, "training_s"), self.memory.phase("training"):
                update_metrics = self.update(exp, iteration)
                backend_for(self.ctx.device).after_step()  # the CPU's: heap pages later iterations would fault in
            if self.ema is not None:
                self.ema.update(self.actor.model)
            kl = self.update_kl_controller(exp)
            self.elapsed_seconds += time.perf_counter() - iteration_started
            update_metrics["elapsed_s"] = self.elapsed_seconds  # training wall time, held-out evaluation excluded
            if self.eval_due(iteration + 1):
                update_metrics.update(self.evaluate_held_out(iteration + 1))
                log.info("ppo: held-out after iteration %d: %s", iteration + 1, format_eval(update_metrics))
            metrics = self.log_iteration(iteration, rollouts, exp, update_metrics, kl, seconds)
            if iteration == self.start_iteration:
                self.check_reward_spread(rollouts)
            bar.update(1)
            bar.set_postfix(score=f"{metrics['score_mean']:.3f}", **({} if kl is None else {"kl": f"{kl:.3f}"}))
            # Every rank stops after the same iteration (one small all_reduce); after the last, the run finishes.
            last = iteration + 1 == self.total_iterations
            signum = None if last else agreed_stop(self.ctx)
            checkpoint = self.save_checkpoint(iteration + 1, stopping=signum is not None)
            if signum is not None:
                bar.close()
                stop_for_signal(self.ctx, self.tracker, "ppo", signum, iteration + 1, checkpoint)
        bar.close()

    def save_checkpoint(self, step: int, stopping: bool = False) -> Path | None:
        """Resume state after `step` iterations, every --save-interval iterations (and at the end
        with --save-final-checkpoint), and when `stopping` for a signal; the checkpoint, if saved."""
        if not (stopping or wants_checkpoint(self.config, step, step == self.total_iterations)):
            return None
        loop_state: dict[str, Any] = {"step": step, "iteration": step, "kl_coef": self.kl_ctl.value,
                                      "elapsed_s": self.elapsed_seconds}
        if self.ema is not None:
            loop_state["ema"] = self.ema.state_dict()
        return self.checkpointer.save(step, self.engines, loop_state)

    def finish(self) -> dict[str, Any]:
        """Export the actor, the critic if any (and the EMA actor), draw curves.png (rlhf/curves.py), write
        summary.json and DONE; returns the summary."""
        ctx, output = self.ctx, self.output
        export_trained_model(self.actor, output / "model", self.tokenizer, self.config.lora)
        if self.critic is not None:
            export_trained_model(self.critic, output / "critic", self.tokenizer, self.config.lora)
        if self.ema is not None:
            full = merge_state_dict(self.actor.model, self.ema.full_state_dict(self.actor.model))
            export_state_dict(self.actor.model, ctx, full if ctx.is_main else {}, output / "model_ema", self.tokenizer)
        summary = {
            "stage": "ppo", "advantage_estimator": self.config.advantage_estimator,
            "samples_per_prompt": self.group_size, "iterations": self.total_iterations, "world_size": ctx.world_size,
            "inference_tp_size": self.tp.size, "train_seconds": time.perf_counter() - self.started,
            "prompts": len(self.prompts.ids), "data": self.prompts.stats,
            **{k: v for k, v in self.last_metrics.items() if isinstance(v, (int, float))},
        }
        if ctx.is_main:
            from rlhf.curves import write_curves  # only the end of the run draws (matplotlib optional, inside)

            try:
                write_curves(output)
            except Exception as exc:  # a figure must never fail a trained run
                log.warning("ppo: curves.png not written (%s: %s)", type(exc).__name__, exc)
        finish_stage(ctx, output, self.tracker, summary)
        return summary
