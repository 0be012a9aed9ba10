"""`rlhf ppo`: PPO on prompts with the hybrid engine.

    rlhf ppo --actor runs/sft/model --reward runs/rm/model --data prompts.jsonl --output runs/ppo
    rlhf ppo --actor runs/sft/model --reward-fn sort --data prompts.jsonl --output runs/ppo   # verifiable reward
    rlhf ppo ... --nproc-per-node 2 --zero-stage 3 --inference-tp-size 2

One iteration: rollouts in `rollout_mode` (tensor-parallel actor, static KV cache) -> actor and
reference log-probs, critic values, reward scores -> KL-penalised per-token rewards -> GAE ->
whitened advantages -> ppo_epochs of clipped policy and value updates over minibatches (+ entropy
bonus, + PTX loss) -> EMA of the actor -> KL controller update. Writes the final actor to
<output>/model, the critic to <output>/critic (and the EMA actor to <output>/model_ema).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from rlhf.algorithms.losses import sft_loss_sum
from rlhf.algorithms.ppo import AdaptiveKLController, FixedKLController, explained_variance, masked_mean, policy_loss, value_loss
from rlhf.config import PPOConfig, to_dict
from rlhf.data.batching import collate_sft, pad_left
from rlhf.data.formats import parse_row
from rlhf.data.sources import load_rows, stage_share
from rlhf.data.tokenization import tokenize_prompts, tokenize_sft
from rlhf.engine.checkpoint import Checkpointer
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.export import export_model, export_state_dict
from rlhf.engine.inference import FrozenModel, causal_lm_logprobs, position_ids_for
from rlhf.engine.logprobs import entropy_from_logits_chunked
from rlhf.engine.rollout import rollout_mode
from rlhf.engine.sampling import SamplingParams
from rlhf.engine.train_engine import TrainEngine
from rlhf.errors import UserError
from rlhf.stages.experience import Experience, build_experience, global_whiten, mean_kl_per_sequence, shaped_scores
from rlhf.logging import get_logger
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.models.value_model import load_value_model, value_model_from
from rlhf.outputs import write_config
from rlhf.tracking import Tracker
from rlhf.stages.trainer import finish_stage, start_stage

log = get_logger(__name__)


# ------------------------------------------------------------------ setup helpers


def disable_dropout(model: nn.Module) -> nn.Module:
    """PPO's ratio must compare the same function: no dropout in actor or critic (TRL does the same)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def reward_statistics(reward_path: str, normalize: bool) -> tuple[float, float, bool]:
    """(mean, std, normalise?) of reward-model scores from the reward stage's summary.json."""
    if not normalize:
        return 0.0, 1.0, False
    summary = Path(reward_path).parent / "summary.json"
    if summary.is_file():
        data = json.loads(summary.read_text())
        if "score_mean" in data and "score_std" in data:
            return float(data["score_mean"]), float(data["score_std"]), True
    log.warning("no score_mean/score_std in %s: rewards are not normalised", summary)
    return 0.0, 1.0, False


def engine_config_for(config: PPOConfig, zero_stage: int | None, lr: float | None) -> Any:
    cfg = copy.deepcopy(config.engine)
    if zero_stage is not None:
        cfg.zero_stage = zero_stage
    if lr is not None:
        cfg.lr = lr
    return cfg


class Prompts:
    """Tokenized prompts plus their last user turn's text (for rule-based rewards and sample tables)."""

    def __init__(self, config: PPOConfig, tokenizer: Any) -> None:
        if not config.data.data:
            raise UserError("--data is required: prompts (or any rows with a prompt) as json/jsonl/parquet/csv")
        raw = [row for spec in config.data.data for row in load_rows(spec)]
        raw = stage_share(raw, config.data.data_split, "ppo", config.engine.seed)
        parsed = [parse_row(r) for r in raw]
        ids, stats = tokenize_prompts(parsed, tokenizer, config.max_prompt_len)
        stats.log("ppo prompts")
        self.ids: list[list[int]] = ids
        self.texts: list[str] = [parsed[i].prompt[-1]["content"] for i in stats.kept_indices]
        self.stats = stats.as_dict()
        if not self.ids:
            raise UserError(f"--data {' '.join(config.data.data)}: no prompts of at most {config.max_prompt_len} tokens")


# ------------------------------------------------------------------ the stage


def run(config: PPOConfig) -> dict[str, Any]:
    ctx = DistributedContext.initialize()
    if not config.actor:
        raise UserError("--actor is required: the policy to train (e.g. the SFT stage's <output>/model)")
    if not config.reward and not config.reward_fn:
        raise UserError("--reward (a reward model folder) or --reward-fn TASK is required")
    critic_path = config.critic or config.reward
    if not critic_path:
        raise UserError("--critic is required with --reward-fn (a causal LM or value model folder, e.g. the SFT model)")
    tp = config.inference_tp_size
    if tp < 1 or ctx.world_size % tp:
        raise UserError(f"--inference-tp-size {tp} must divide the world size {ctx.world_size}")
    G = config.generation_batch_size
    experience_global = G * ctx.world_size
    if config.engine.train_batch_size is None and config.engine.grad_accum is None:
        config.engine.train_batch_size = experience_global  # one minibatch per PPO epoch by default
        config.engine.micro_batch_size = min(config.engine.micro_batch_size, G)
    output = start_stage(config, ctx, "ppo")
    if experience_global % config.engine.train_batch_size:
        raise UserError(
            f"--train-batch-size {config.engine.train_batch_size} must divide the experience batch "
            f"generation_batch_size {G} x world size {ctx.world_size} = {experience_global}"
        )

    # --- data
    tokenizer = load_tokenizer(config.actor, "--actor")
    prompts = Prompts(config, tokenizer)
    prompts_per_iteration = experience_global  # every rank ends with G rollouts
    iterations_per_epoch = len(prompts.ids) // prompts_per_iteration
    if iterations_per_epoch == 0:
        raise UserError(f"{len(prompts.ids)} prompts do not fill one iteration of {prompts_per_iteration}; "
                        "lower --generation-batch-size or add prompts")
    total_iterations = config.max_steps if config.max_steps > 0 else iterations_per_epoch * config.epochs
    minibatches = experience_global // config.engine.train_batch_size
    total_optimizer_steps = total_iterations * config.ppo_epochs * minibatches
    ptx_rows: list[dict] = []
    if config.ptx_data:
        if config.ptx_coef <= 0:
            raise UserError("--ptx-data needs --ptx-coef > 0")
        parsed = [parse_row(r) for spec in config.ptx_data for r in load_rows(spec)]
        ptx_rows, ptx_stats = tokenize_sft(parsed, tokenizer, config.data.max_seq_len)
        ptx_stats.log("ptx data")

    # --- models
    actor_cfg = engine_config_for(config, config.actor_zero_stage, None)
    critic_cfg = engine_config_for(config, config.critic_zero_stage, config.critic_lr)
    actor = TrainEngine(disable_dropout(load_causal_lm(config.actor, "--actor")), actor_cfg, ctx, total_optimizer_steps, "actor")
    critic = TrainEngine(disable_dropout(value_model_from(critic_path, flag="--critic")), critic_cfg, ctx, total_optimizer_steps, "critic")
    ref = FrozenModel(load_causal_lm(config.ref or config.actor, "--ref"), ctx, config.engine.zero_stage,
                      actor.dtype, config.offload_ref, config.engine.micro_batch_size, "ref")
    reward_model: FrozenModel | None = None
    task = None
    if config.reward_fn:
        from rlhf.data.tasks import get_task

        task = get_task(config.reward_fn)
        score_mean, score_std, normalize = 0.0, 1.0, False
    else:
        reward_tok = load_tokenizer(config.reward, "--reward")
        if reward_tok.get_vocab() != tokenizer.get_vocab():
            raise UserError(f"--reward {config.reward}: its tokenizer differs from the actor's; train the reward "
                            "model from the same base (e.g. the SFT model)")
        reward_model = FrozenModel(load_value_model(config.reward, dtype=torch.float32), ctx, config.engine.zero_stage,
                                   actor.dtype, config.offload_reward, config.engine.micro_batch_size, "reward")
        score_mean, score_std, normalize = reward_statistics(config.reward, config.normalize_reward)
    kl_ctl = (AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon) if config.adaptive_kl
              else FixedKLController(config.kl_coef))
    ema = {n: p.detach().to_local().clone() for n, p in actor.model.named_parameters()} if config.ema_decay > 0 else None

    if ctx.is_main:
        write_config(output, config)
    tracker = Tracker(output, "ppo", config.tracking, to_dict(config), ctx.is_main)
    checkpointer = Checkpointer(output / "checkpoints", ctx, config.keep_checkpoints)
    start_iteration = 0
    latest = checkpointer.latest() if config.resume else None
    if latest is not None:
        state = checkpointer.load(latest, {"actor": actor, "critic": critic})
        start_iteration, kl_ctl.value = state["iteration"], state["kl_coef"]
        if ema is not None and "ema" in state:
            ema = state["ema"]
        if ctx.is_main:
            tracker.metrics.truncate_after(start_iteration)

    sampling = SamplingParams(
        max_new_tokens=config.max_new_tokens, min_new_tokens=config.min_new_tokens, do_sample=not config.greedy, temperature=config.temperature,
        top_k=config.top_k, top_p=config.top_p, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    group_index, tp_rank = ctx.rank // tp, ctx.rank % tp
    micro = config.engine.micro_batch_size
    per_rank_minibatch = config.engine.train_batch_size // ctx.world_size
    bar = tqdm(total=total_iterations, initial=start_iteration, desc="ppo", disable=not ctx.is_main, dynamic_ncols=True)
    started = time.perf_counter()
    last: dict[str, float] = {}
    for iteration in range(start_iteration, total_iterations):
        epoch, it_in_epoch = divmod(iteration, iterations_per_epoch)
        order = torch.randperm(len(prompts.ids), generator=torch.Generator().manual_seed(config.engine.seed * 7919 + epoch)).tolist()
        batch_idx = order[it_in_epoch * prompts_per_iteration : (it_in_epoch + 1) * prompts_per_iteration]
        group_idx = batch_idx[group_index * G * tp : (group_index + 1) * G * tp]

        # 1. rollouts: the TP group generates its prompts together, then each rank keeps its share
        t0 = time.perf_counter()
        ids, mask = pad_left([prompts.ids[i] for i in group_idx], tokenizer.pad_token_id)
        ids, mask = ids.to(ctx.device), mask.to(ctx.device)
        gen = torch.Generator(device=ctx.device).manual_seed(config.engine.seed * 1_000_003 + iteration * 101 + group_index)
        with rollout_mode(actor, tp, config.rollout_parity_tolerance) as rollout:
            out = rollout.generate(ids, mask, sampling, gen)
            rollout_metrics = dict(rollout.metrics)
        mine = slice(tp_rank * G, (tp_rank + 1) * G)
        sequences, attn, action = out.sequences[mine], out.attention_mask[mine], out.action_mask[mine]
        ended_with_eos = out.finished[mine]
        my_texts = [prompts.texts[i] for i in group_idx[mine]]
        generation_s = time.perf_counter() - t0

        # 2. experience: log-probs, values, scores (no grad), then rewards and advantages
        t1 = time.perf_counter()
        actor.eval(), critic.eval()
        with torch.no_grad():
            chunks = [slice(i, min(i + micro, G)) for i in range(0, G, micro)]
            old_lp = torch.cat([causal_lm_logprobs(actor.model, sequences[c], attn[c])[0] for c in chunks])
            ref_lp = ref.logprobs(sequences, attn)
            values = torch.cat([critic.model(sequences[c], attn[c], position_ids=position_ids_for(attn[c])) for c in chunks])
            responses = [tokenizer.decode(s[a], skip_special_tokens=True).strip() for s, a in zip(sequences, action)]
            if task is not None:
                raw_scores = torch.tensor([task.score(p, r) for p, r in zip(my_texts, responses)], device=ctx.device)
            else:
                assert reward_model is not None
                raw_scores = reward_model.scores(sequences, attn)
        exp = build_experience(
            sequences, attn, action, old_lp, ref_lp, values, raw_scores,
            lambda s: shaped_scores(s, ended_with_eos, score_mean, score_std, normalize, config.missing_eos_penalty),
            kl_ctl.value, config.kl_estimator, config.reward_clip, config.gamma, config.lam,
            (lambda x, m: global_whiten(x, m, ctx)) if config.whiten_advantages else None,
        )
        experience_s = time.perf_counter() - t1

        # 3. PPO updates
        t2 = time.perf_counter()
        actor.train(), critic.train()
        sums: dict[str, float] = {}
        micro_steps = optimizer_steps = 0
        for ppo_epoch in range(config.ppo_epochs):
            perm = torch.randperm(G, generator=torch.Generator().manual_seed(config.engine.seed + iteration * 31 + ppo_epoch))
            for mb_start in range(0, G, per_rank_minibatch):
                mb = perm[mb_start : mb_start + per_rank_minibatch]
                for mc_start in range(0, len(mb), micro):
                    part = exp.select(mb[mc_start : mc_start + micro].to(ctx.device))
                    step_metrics = ppo_micro_step(actor, critic, part, config, ptx_rows, tokenizer.pad_token_id, iteration)
                    for k, v in step_metrics.items():
                        sums[k] = sums.get(k, 0.0) + v
                    micro_steps += 1
                actor_step, critic_step = actor.step(), critic.step()
                optimizer_steps += 1
                sums["actor_grad_norm"] = sums.get("actor_grad_norm", 0.0) + actor_step.grad_norm
                sums["critic_grad_norm"] = sums.get("critic_grad_norm", 0.0) + critic_step.grad_norm
        training_s = time.perf_counter() - t2
        if ema is not None:
            with torch.no_grad():
                for n, p in actor.model.named_parameters():
                    ema[n].mul_(config.ema_decay).add_(p.detach().to_local(), alpha=1 - config.ema_decay)

        # 4. metrics (global over ranks)
        kl_seq = float(ctx.all_reduce_sum(mean_kl_per_sequence(exp).detach().double())) / ctx.world_size
        kl_ctl.update(kl_seq, experience_global)
        metrics = iteration_metrics(exp, ctx, sums, micro_steps, optimizer_steps)
        total_s = generation_s + experience_s + training_s
        response_tokens = float(ctx.all_reduce_sum(exp.action_mask.sum().double()))
        metrics.update(
            kl=kl_seq, kl_coef=kl_ctl.value, generation_s=generation_s, experience_s=experience_s,
            training_s=training_s, samples_per_s=experience_global / total_s,
            tokens_per_s=response_tokens / generation_s, actor_lr=actor.scheduler.get_last_lr()[0],
            ended_with_eos=float(ctx.all_reduce_sum(ended_with_eos.float().sum().double())) / experience_global,
            **rollout_metrics,
        )
        last = metrics
        step = iteration + 1
        if step % config.tracking.log_interval == 0 or step == total_iterations:
            tracker.log(metrics, step=step)
        if config.sample_log_interval > 0 and (iteration % config.sample_log_interval == 0 or step == total_iterations):
            rows = [[p, r, float(s)] for p, r, s in zip(my_texts[:4], responses[:4], raw_scores[:4].tolist())]
            tracker.log_table("samples", ["prompt", "response", "score"], rows, step=step)
        bar.update(1)
        bar.set_postfix(score=f"{metrics['score_mean']:.3f}", kl=f"{kl_seq:.3f}")
        if step == total_iterations or (config.save_interval > 0 and step % config.save_interval == 0):
            loop_state: dict[str, Any] = {"iteration": step, "kl_coef": kl_ctl.value}
            if ema is not None:
                loop_state["ema"] = ema
            checkpointer.save(step, {"actor": actor, "critic": critic}, loop_state)
    bar.close()

    # --- outputs
    export_model(actor, output / "model", tokenizer)
    export_model(critic, output / "critic", tokenizer)
    if ema is not None:
        export_ema(actor, ema, output / "model_ema", tokenizer)
    summary = {
        "stage": "ppo", "iterations": total_iterations, "world_size": ctx.world_size,
        "inference_tp_size": tp, "train_seconds": time.perf_counter() - started, "prompts": len(prompts.ids),
        "data": prompts.stats, **{k: v for k, v in last.items() if isinstance(v, (int, float))},
    }
    finish_stage(ctx, output, tracker, summary)
    return summary


def ppo_micro_step(
    actor: TrainEngine, critic: TrainEngine, exp: Experience, config: PPOConfig, ptx_rows: list[dict],
    pad_token_id: int, iteration: int,
) -> dict[str, float]:
    """Forward/backward of one micro-batch through actor (policy loss) and critic (value loss)."""
    logprobs, logits = causal_lm_logprobs(actor.model, exp.sequences, exp.attention_mask)
    p_loss, clipfrac, approx_kl = policy_loss(logprobs, exp.old_logprobs, exp.advantages, exp.action_mask, config.clip_range)
    entropy = masked_mean(entropy_from_logits_chunked(logits[:, :-1]), exp.action_mask)
    loss = p_loss - config.entropy_coef * entropy if config.entropy_coef > 0 else p_loss
    ptx = torch.zeros(())
    if ptx_rows:
        g = torch.Generator().manual_seed(iteration * 7 + len(exp))
        picks = torch.randint(len(ptx_rows), (len(exp),), generator=g).tolist()
        batch = collate_sft([ptx_rows[i] for i in picks], pad_token_id)
        ptx_logits = actor.model(input_ids=batch["input_ids"].to(logits.device),
                                 attention_mask=batch["attention_mask"].to(logits.device), use_cache=False).logits
        ptx_sum, n = sft_loss_sum(ptx_logits, batch["labels"].to(logits.device))
        ptx = ptx_sum / n.clamp(min=1)
        loss = loss + config.ptx_coef * ptx
    actor.backward(loss)
    values = critic.model(exp.sequences, exp.attention_mask, position_ids=position_ids_for(exp.attention_mask))[:, :-1]
    v_loss, v_clipfrac = value_loss(values, exp.old_values, exp.returns, exp.action_mask, config.clip_range_value)
    critic.backward(v_loss)
    return {
        "policy_loss": float(p_loss.detach()), "value_loss": float(v_loss.detach()), "clipfrac": float(clipfrac),
        "approx_kl": float(approx_kl), "value_clipfrac": float(v_clipfrac), "entropy": float(entropy.detach()),
        "ptx_loss": float(ptx.detach()),
    }


def iteration_metrics(exp: Experience, ctx: DistributedContext, sums: dict[str, float], n_micro: int,
                      n_steps: int) -> dict[str, float]:
    """Score, reward, length and value statistics over the global batch, plus mean update losses."""
    mask = exp.action_mask
    lengths = mask.sum(-1).float()
    seq_reward = (exp.rewards * mask).sum(-1)
    local = torch.stack([
        exp.scores.sum(), (exp.scores ** 2).sum(), seq_reward.sum(), lengths.sum(), torch.tensor(float(len(exp)))
    ]).double()
    tot = ctx.all_reduce_sum(local)
    n = float(tot[4])
    score_mean = float(tot[0]) / n
    score_var = max(float(tot[1]) / n - score_mean ** 2, 0.0)
    ev = explained_variance(exp.old_values, exp.returns, mask)
    out = {
        "score_mean": score_mean, "score_std": score_var ** 0.5, "reward_total": float(tot[2]) / n,
        "response_length": float(tot[3]) / n, "value_explained_variance": float(ev),
    }
    per_micro = ("policy_loss", "value_loss", "clipfrac", "approx_kl", "value_clipfrac", "entropy", "ptx_loss")
    keys = sorted(sums)
    reduced = ctx.all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64)) / ctx.world_size
    for k, v in zip(keys, reduced.tolist()):
        out[k] = v / (max(n_micro, 1) if k in per_micro else max(n_steps, 1))
    return out


def export_ema(actor: TrainEngine, ema: dict[str, torch.Tensor], directory: Path, tokenizer: Any) -> None:
    """Write the EMA weights (held as local shards) as a Hugging Face model."""
    from torch.distributed.tensor import DTensor

    full = {}
    for name, p in actor.model.named_parameters():
        shard = ema[name]
        full[name] = (DTensor.from_local(shard, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
                      if isinstance(p, DTensor) else shard).cpu()
    export_state_dict(actor.model, actor.ctx, full if actor.ctx.is_main else {}, directory, tokenizer)
