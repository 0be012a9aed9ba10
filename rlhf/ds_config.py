"""Import a DeepSpeed ds_config.json into the engine config.

Keys fall in three groups: mapped onto an engine field; known DeepSpeed tuning knobs that have no
counterpart under FSDP2 (accepted and reported in one warning, so nothing is dropped silently);
anything else is an error naming the file and key. "auto" values (the Hugging Face convention) mean
"take the value from the rlhf config" and leave the field as it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf.config import EngineConfig, coerce, _resolved_hints
from rlhf.errors import UserError
from rlhf.logging import get_logger

log = get_logger(__name__)

# DeepSpeed knobs that tune DeepSpeed's own ZeRO implementation; FSDP2 has no counterpart.
_INERT_ZERO_KEYS = {
    "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "reduce_scatter",
    "allgather_partitions", "allgather_bucket_size", "round_robin_gradients", "sub_group_size",
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "memory_efficient_linear", "elastic_checkpoint", "load_from_fp32_weights", "cpu_offload",
    "ignore_unused_parameters", "legacy_stage1", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_gradients", "mics_shard_size", "use_multi_rank_bucket_allreduce",
}
_INERT_TOP_KEYS = {
    "steps_per_print", "wall_clock_breakdown", "prescale_gradients", "gradient_predivide_factor",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "communication_data_type",
    "dump_state", "memory_breakdown", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
    "comms_logger", "checkpoint", "data_efficiency", "compression_training", "sparse_gradients",
    "amp", "fp16_master_weights_and_gradients", "disable_allgather", "seq_parallel_communication_data_type",
}
_INERT_FP16_KEYS = {"auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"}
_INERT_OFFLOAD_KEYS = {"pin_memory", "buffer_count", "fast_init", "nvme_path", "pipeline_read",
                       "pipeline_write", "buffer_size", "max_in_cpu", "ratio"}
_INERT_ACTIVATION_KEYS = {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                          "number_checkpoints", "synchronize_checkpoint_boundary", "profile"}
_SCHEDULERS = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


@dataclass
class DeepSpeedImport:
    """What a ds_config contributed: engine field values, plus keys accepted without effect."""

    values: dict[str, Any] = field(default_factory=dict)
    inert: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    """Values for stage fields outside the engine (e.g. hybrid_engine.inference_tp_size)."""


class _Reader:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.result = DeepSpeedImport()
        self._hints = _resolved_hints(EngineConfig)

    def fail(self, key: str, why: str) -> UserError:
        return UserError(f"{self.path}: {key}: {why}")

    def set(self, engine_field: str, value: Any, key: str) -> None:
        if isinstance(value, str) and value == "auto":
            return
        self.result.values[engine_field] = coerce(value, self._hints[engine_field], f"{self.path}: {key}")

    def section(self, cfg: dict[str, Any], key: str) -> dict[str, Any]:
        value = cfg[key]
        if not isinstance(value, dict):
            raise self.fail(key, "must be an object")
        return value

    def unknown(self, key: str) -> UserError:
        return self.fail(key, "unknown DeepSpeed key; remove it, or see README 'DeepSpeed config' for the supported keys")


def _enabled(section: dict[str, Any]) -> bool:
    value = section.get("enabled", False)
    return value is True or (isinstance(value, str) and value.lower() == "true")


def import_ds_config(path: str | Path) -> DeepSpeedImport:
    """Parse a ds_config.json into engine field values; raises UserError on unknown or bad keys."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: DeepSpeed config not found")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: the top level must be a JSON object")
    r = _Reader(path)
    res = r.result

    simple = {
        "train_batch_size": "train_batch_size",
        "train_micro_batch_size_per_gpu": "micro_batch_size",
        "gradient_accumulation_steps": "grad_accum",
        "gradient_clipping": "grad_clip",
        "seed": "seed",
    }
    for key, value in cfg.items():
        if key in simple:
            r.set(simple[key], value, key)
        elif key == "fp16":
            sec = r.section(cfg, key)
            if _enabled(sec):
                res.values["dtype"] = "fp16"
            for k, v in sec.items():
                if k in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
                    r.set(k, v, f"fp16.{k}")
                elif k in _INERT_FP16_KEYS:
                    res.inert.append(f"fp16.{k}")
                elif k != "enabled":
                    raise r.unknown(f"fp16.{k}")
        elif key in ("bf16", "bfloat16"):
            sec = r.section(cfg, key)
            if _enabled(sec):
                if res.values.get("dtype") == "fp16" or _enabled(cfg.get("fp16", {}) if isinstance(cfg.get("fp16"), dict) else {}):
                    raise r.fail(key, "fp16 and bf16 are both enabled; enable one")
                res.values["dtype"] = "bf16"
            for k in sec:
                if k not in ("enabled", "immediate_grad_update", "check_grad_overflow"):
                    raise r.unknown(f"{key}.{k}")
                if k != "enabled":
                    res.inert.append(f"{key}.{k}")
        elif key == "zero_optimization":
            sec = r.section(cfg, key)
            for k, v in sec.items():
                if k == "stage":
                    if v not in (0, 1, 2, 3):
                        raise r.fail("zero_optimization.stage", f"{v!r} is not a ZeRO stage; use 0, 1, 2 or 3")
                    res.values["zero_stage"] = v
                elif k in ("offload_optimizer", "offload_param"):
                    if not isinstance(v, dict):
                        raise r.fail(f"zero_optimization.{k}", "must be an object")
                    for ok in v:
                        if ok in _INERT_OFFLOAD_KEYS:
                            res.inert.append(f"zero_optimization.{k}.{ok}")
                        elif ok != "device":
                            raise r.unknown(f"zero_optimization.{k}.{ok}")
                    device = v.get("device", "none")
                    if device == "nvme":
                        raise r.fail(f"zero_optimization.{k}.device", "nvme offload is not supported; use cpu")
                    if device not in ("cpu", "none", "auto"):
                        raise r.fail(f"zero_optimization.{k}.device", f"{device!r} is not cpu or none")
                    if device == "cpu":
                        res.values["offload"] = True
                elif k in _INERT_ZERO_KEYS:
                    res.inert.append(f"zero_optimization.{k}")
                else:
                    raise r.unknown(f"zero_optimization.{k}")
        elif key == "optimizer":
            sec = r.section(cfg, key)
            opt_type = str(sec.get("type", "AdamW"))
            if opt_type.lower() not in ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"):
                raise r.fail("optimizer.type", f"{opt_type!r} is not supported; use Adam or AdamW")
            for k in sec:
                if k not in ("type", "params"):
                    raise r.unknown(f"optimizer.{k}")
            params = sec.get("params", {})
            for k, v in params.items():
                if k == "lr":
                    r.set("lr", v, "optimizer.params.lr")
                elif k == "betas":
                    if isinstance(v, str) and v == "auto":
                        continue
                    if not isinstance(v, (list, tuple)) or len(v) != 2:
                        raise r.fail("optimizer.params.betas", "must be a list of two numbers")
                    r.set("adam_beta1", v[0], "optimizer.params.betas")
                    r.set("adam_beta2", v[1], "optimizer.params.betas")
                elif k == "eps":
                    r.set("adam_eps", v, "optimizer.params.eps")
                elif k == "weight_decay":
                    r.set("weight_decay", v, "optimizer.params.weight_decay")
                elif k in ("torch_adam", "adam_w_mode", "bias_correction", "amsgrad_disabled"):
                    res.inert.append(f"optimizer.params.{k}")
                else:
                    raise r.unknown(f"optimizer.params.{k}")
        elif key == "scheduler":
            sec = r.section(cfg, key)
            sched_type = sec.get("type")
            if sched_type not in _SCHEDULERS:
                raise r.fail("scheduler.type", f"{sched_type!r} is not supported; use one of {', '.join(_SCHEDULERS)}")
            res.values["lr_scheduler"] = _SCHEDULERS[sched_type]
            params = sec.get("params", {})
            max_lr = params.get("warmup_max_lr")
            for k, v in params.items():
                if k == "warmup_num_steps":
                    r.set("warmup_steps", v, "scheduler.params.warmup_num_steps")
                elif k == "warmup_max_lr":
                    r.set("lr", v, "scheduler.params.warmup_max_lr")
                elif k == "warmup_min_lr":
                    if isinstance(v, (int, float)) and isinstance(max_lr, (int, float)) and max_lr > 0:
                        r.set("warmup_start_ratio", v / max_lr, "scheduler.params.warmup_min_lr")
                elif k == "warmup_min_ratio":
                    r.set("warmup_start_ratio", v, "scheduler.params.warmup_min_ratio")
                elif k == "cos_min_ratio":
                    r.set("min_lr_ratio", v, "scheduler.params.cos_min_ratio")
                elif k in ("total_num_steps", "warmup_type", "last_batch_iteration"):
                    # the total comes from the stage's own step count; warmup here is linear
                    res.inert.append(f"scheduler.params.{k}")
                else:
                    raise r.unknown(f"scheduler.params.{k}")
        elif key == "activation_checkpointing":
            sec = r.section(cfg, key)
            res.values["gradient_checkpointing"] = True
            for k in sec:
                if k not in _INERT_ACTIVATION_KEYS:
                    raise r.unknown(f"activation_checkpointing.{k}")
                res.inert.append(f"activation_checkpointing.{k}")
        elif key == "gradient_checkpointing":
            r.set("gradient_checkpointing", value, key)
        elif key == "hybrid_engine":
            sec = r.section(cfg, key)
            for k, v in sec.items():
                if k == "inference_tp_size":
                    res.extra["inference_tp_size"] = v
                elif k in ("enabled", "max_out_tokens", "release_inference_cache", "pin_parameters",
                           "tp_gather_partition_size"):
                    res.inert.append(f"hybrid_engine.{k}")
                else:
                    raise r.unknown(f"hybrid_engine.{k}")
        elif key in _INERT_TOP_KEYS:
            res.inert.append(key)
        else:
            raise r.unknown(key)
    if res.inert:
        log.warning("%s: accepted without effect under FSDP2: %s", path, ", ".join(sorted(res.inert)))
    return res
