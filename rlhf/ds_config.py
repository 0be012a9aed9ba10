"""Import a DeepSpeed ds_config.json into the engine config.

Keys fall in three groups: mapped onto an engine field; known DeepSpeed tuning knobs that have no
counterpart under FSDP2 (accepted and reported in one warning, so nothing is dropped silently);
anything else is an error naming the file and key. "auto" values (the Hugging Face convention) mean
"take the value from the rlhf config" and leave the field as it is. Each DeepSpeed section has
its reader function (`_READERS`); every mapped value is checked against its field's rule.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf.config import EngineConfig, PPOConfig, fields_by_name, parse_value
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
# DeepSpeed's compile section: what tunes its own torch.compile call or DeepCompile passes.
_INERT_COMPILE_KEYS = {"kwargs", "deepcompile", "free_activation", "offload_activation", "offload_opt_states",
                       "offload_parameters", "double_buffer", "symmetric_memory", "debug_log"}
_SCHEDULERS = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


@dataclass
class DeepSpeedImport:
    """What a ds_config contributed: checked field values, plus keys accepted without effect."""

    path: Path
    values: dict[str, Any] = field(default_factory=dict)
    """Engine field values."""
    inert: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    """Values for stage fields outside the engine (e.g. hybrid_engine.inference_tp_size for ppo)."""

    def apply_to(self, config: Any) -> None:
        """Set a stage config's engine fields, and those `extra` fields the stage has."""
        for key, value in self.values.items():
            setattr(config.engine, key, value)
        for key, value in self.extra.items():
            if hasattr(config, key):
                setattr(config, key, value)


class _Reader:
    """Reads one ds_config: converts and checks each mapped value against its field's rule."""

    def __init__(self, path: Path, cfg: dict[str, Any]) -> None:
        self.path = path
        self.cfg = cfg
        self.result = DeepSpeedImport(path)

    def fail(self, key: str, why: str) -> UserError:
        return UserError(f"{self.path}: {key}: {why}")

    def set(self, engine_field: str, value: Any, key: str) -> None:
        if isinstance(value, str) and value == "auto":
            return
        info = fields_by_name(EngineConfig)[engine_field]
        self.result.values[engine_field] = parse_value(info, value, f"{self.path}: {key}")

    def set_extra(self, stage_field: str, value: Any, key: str) -> None:
        if isinstance(value, str) and value == "auto":
            return
        info = fields_by_name(PPOConfig)[stage_field]
        self.result.extra[stage_field] = parse_value(info, value, f"{self.path}: {key}")

    def inert(self, key: str) -> None:
        self.result.inert.append(key)

    def section(self, key: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(key, "must be an object")
        return value

    def unknown(self, key: str) -> UserError:
        return self.fail(key, "unknown DeepSpeed key; remove it, or see README 'DeepSpeed config' for the supported keys")


def _enabled(section: Any) -> bool:
    if not isinstance(section, dict):
        return False
    value = section.get("enabled", False)
    return value is True or (isinstance(value, str) and value.lower() == "true")


# ---------------------------------------------------------------- one reader per section

_PLAIN = {
    "train_batch_size": "train_batch_size",
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "gradient_clipping": "grad_clip",
    "seed": "seed",
    "gradient_checkpointing": "gradient_checkpointing",
}
_FP16_FIELDS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
_ADAM_TYPES = ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam")


def _plain(r: _Reader, key: str, value: Any) -> None:
    r.set(_PLAIN[key], value, key)


def _inert_top(r: _Reader, key: str, value: Any) -> None:
    r.inert(key)


def _fp16(r: _Reader, key: str, value: Any) -> None:
    sec = r.section(key, value)
    if _enabled(sec):
        r.result.values["dtype"] = "fp16"
    for k, v in sec.items():
        if k in _FP16_FIELDS:
            r.set(k, v, f"fp16.{k}")
        elif k in _INERT_FP16_KEYS:
            r.inert(f"fp16.{k}")
        elif k != "enabled":
            raise r.unknown(f"fp16.{k}")


def _bf16(r: _Reader, key: str, value: Any) -> None:
    sec = r.section(key, value)
    if _enabled(sec):
        if r.result.values.get("dtype") == "fp16" or _enabled(r.cfg.get("fp16")):
            raise r.fail(key, "fp16 and bf16 are both enabled; enable one")
        r.result.values["dtype"] = "bf16"
    for k in sec:
        if k not in ("enabled", "immediate_grad_update", "check_grad_overflow"):
            raise r.unknown(f"{key}.{k}")
        if k != "enabled":
            r.inert(f"{key}.{k}")


def _offload(r: _Reader, key: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise r.fail(key, "must be an object")
    for k in value:
        if k in _INERT_OFFLOAD_KEYS:
            r.inert(f"{key}.{k}")
        elif k != "device":
            raise r.unknown(f"{key}.{k}")
    device = value.get("device", "none")
    if device == "nvme":
        raise r.fail(f"{key}.device", "nvme offload is not supported; use cpu")
    if device not in ("cpu", "none", "auto"):
        raise r.fail(f"{key}.device", f"{device!r} is not cpu or none")
    if device == "cpu":
        r.result.values["offload"] = True


def _zero_optimization(r: _Reader, key: str, value: Any) -> None:
    for k, v in r.section(key, value).items():
        if k == "stage":
            if isinstance(v, bool) or v not in (0, 1, 2, 3):
                raise r.fail("zero_optimization.stage", f"{v!r} is not a ZeRO stage; use 0, 1, 2 or 3")
            r.set("zero_stage", v, "zero_optimization.stage")
        elif k in ("offload_optimizer", "offload_param"):
            _offload(r, f"zero_optimization.{k}", v)
        elif k in _INERT_ZERO_KEYS:
            r.inert(f"zero_optimization.{k}")
        else:
            raise r.unknown(f"zero_optimization.{k}")


def _optimizer(r: _Reader, key: str, value: Any) -> None:
    sec = r.section(key, value)
    opt_type = str(sec.get("type", "AdamW"))
    if opt_type.lower() not in _ADAM_TYPES:
        raise r.fail("optimizer.type", f"{opt_type!r} is not supported; use Adam or AdamW")
    for k in sec:
        if k not in ("type", "params"):
            raise r.unknown(f"optimizer.{k}")
    for k, v in sec.get("params", {}).items():
        where = f"optimizer.params.{k}"
        if k == "betas":
            if isinstance(v, str) and v == "auto":
                continue
            if not isinstance(v, (list, tuple)) or len(v) != 2:
                raise r.fail(where, "must be a list of two numbers")
            r.set("adam_beta1", v[0], where)
            r.set("adam_beta2", v[1], where)
        elif k in ("lr", "eps", "weight_decay"):
            r.set({"eps": "adam_eps"}.get(k, k), v, where)
        elif k in ("torch_adam", "adam_w_mode", "bias_correction", "amsgrad_disabled"):
            r.inert(where)
        else:
            raise r.unknown(where)


def _scheduler(r: _Reader, key: str, value: Any) -> None:
    sec = r.section(key, value)
    sched_type = sec.get("type")
    if sched_type not in _SCHEDULERS:
        raise r.fail("scheduler.type", f"{sched_type!r} is not supported; use one of {', '.join(_SCHEDULERS)}")
    r.result.values["lr_scheduler"] = _SCHEDULERS[sched_type]
    params = sec.get("params", {})
    max_lr = params.get("warmup_max_lr")
    renamed = {"warmup_num_steps": "warmup_steps", "warmup_max_lr": "lr", "warmup_min_ratio": "warmup_start_ratio",
               "cos_min_ratio": "min_lr_ratio"}
    for k, v in params.items():
        where = f"scheduler.params.{k}"
        if k in renamed:
            r.set(renamed[k], v, where)
        elif k == "warmup_min_lr":
            if isinstance(v, (int, float)) and isinstance(max_lr, (int, float)) and max_lr > 0:
                r.set("warmup_start_ratio", v / max_lr, f"{where} / warmup_max_lr")
        elif k in ("total_num_steps", "warmup_type", "last_batch_iteration"):
            # the total comes from the stage's own step count; warmup here is linear
            r.inert(where)
        else:
            raise r.unknown(where)


def _activation_checkpointing(r: _Reader, key: str, value: Any) -> None:
    sec = r.section(key, value)
    r.result.values["gradient_checkpointing"] = True
    for k in sec:
        if k not in _INERT_ACTIVATION_KEYS:
            raise r.unknown(f"activation_checkpointing.{k}")
        r.inert(f"activation_checkpointing.{k}")


def _compile(r: _Reader, key: str, value: Any) -> None:
    """`compile{enabled}` -> --compile (each decoder layer, inductor: the only backend used)."""
    for k, v in r.section(key, value).items():
        if k == "enabled":
            r.set("compile", v, "compile.enabled")
        elif k == "backend":
            if v not in ("inductor", "auto"):
                raise r.fail("compile.backend", f"{v!r} is not supported; use inductor")
        elif k in _INERT_COMPILE_KEYS:
            r.inert(f"compile.{k}")
        else:
            raise r.unknown(f"compile.{k}")


def _hybrid_engine(r: _Reader, key: str, value: Any) -> None:
    for k, v in r.section(key, value).items():
        if k == "inference_tp_size":
            r.set_extra("inference_tp_size", v, f"hybrid_engine.{k}")
        elif k in ("enabled", "max_out_tokens", "release_inference_cache", "pin_parameters",
                   "tp_gather_partition_size"):
            r.inert(f"hybrid_engine.{k}")
        else:
            raise r.unknown(f"hybrid_engine.{k}")


SectionReader = Callable[[_Reader, str, Any], None]
_READERS: dict[str, SectionReader] = {
    **{key: _plain for key in _PLAIN},
    **{key: _inert_top for key in _INERT_TOP_KEYS},
    "fp16": _fp16,
    "bf16": _bf16,
    "bfloat16": _bf16,
    "zero_optimization": _zero_optimization,
    "optimizer": _optimizer,
    "scheduler": _scheduler,
    "activation_checkpointing": _activation_checkpointing,
    "compile": _compile,
    "hybrid_engine": _hybrid_engine,
}


def import_ds_config(path: str | Path) -> DeepSpeedImport:
    """Parse a ds_config.json into checked field values; raises UserError on unknown or bad keys."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: DeepSpeed config not found")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: the top level must be a JSON object")
    reader = _Reader(path, cfg)
    for key, value in cfg.items():
        if key not in _READERS:
            raise reader.unknown(key)
        _READERS[key](reader, key, value)
    if reader.result.inert:
        log.warning("%s: accepted without effect under FSDP2: %s", path, ", ".join(sorted(reader.result.inert)))
    return reader.result
