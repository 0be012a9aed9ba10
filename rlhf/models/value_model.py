"""Value model: a Hugging Face decoder backbone plus a linear head giving one scalar per token.

The same module is the reward model (its score is the value at the last real token of a
sequence, as InstructGPT and DeepSpeed-Chat's `RewardModel`) and the PPO critic (its per-token
values).

On disk it is a Hugging Face sequence-classification folder with one label, so other tools load
a reward model with `AutoModelForSequenceClassification.from_pretrained(folder)`:
    config.json        the backbone's config with "architectures": ["<Family>ForSequenceClassification"],
                       "num_labels": 1 (id2label of one entry), plus "rlhf_model_type": "value"
                       and "rlhf_value_head_shape": [1, hidden]
    model.safetensors  backbone tensors under the causal-LM names (`model.layers.0...`,
                       `transformer.h.0...`) and the head as `score.weight`; `score.bias` only
                       when the head's bias is not zero (a critic's; Hugging Face's classifiers
                       have no bias and ignore it; a reward model's bias stays 0, so its scores
                       are the same in transformers)
Loading accepts that format, any `AutoModelForSequenceClassification` folder with num_labels 1
(e.g. a reward model trained elsewhere: its `score` head is kept), and the older layout with
`value_head.weight` / `value_head.bias`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

# Re-exported: `rlhf.models.position_ids_from_mask` and `value_model.last_token_index` are the engine's.
from rlhf.engine.positions import last_token_index, position_ids_from_mask
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.models.checks import check_finite
from rlhf.models.sharded_loading import (
    CheckpointTensor, SafetensorsShardLoader, local_checkpoint, parameters_on_meta, plan_shard_loading,
    renamed_by_transformers,
)

if TYPE_CHECKING:
    from rlhf.engine.fsdp import ShardLoader

logger = get_logger(__name__)

MODEL_TYPE_KEY = "rlhf_model_type"
HEAD_SHAPE_KEY = "rlhf_value_head_shape"
VALUE_MODEL_TYPE = "value"
HEAD_PREFIX = "value_head."
"""Prefix of the head in the module's own state dict (and in folders written before the
sequence-classification layout)."""
SCORE_PREFIX = "score."
"""Prefix of the head on disk: Hugging Face's *ForSequenceClassification name."""
WEIGHTS_NAME = "model.safetensors"


def backbone_output_size(config: PretrainedConfig) -> int:
    """Width of the backbone's last hidden state: OPT projects it to `word_embed_proj_dim`."""
    return int(getattr(config, "word_embed_proj_dim", None) or config.hidden_size)


@contextlib.contextmanager
def _quiet_load_report() -> Iterator[None]:
    """Silence transformers' per-load key report; callers check the loading info themselves.

    transformers runs its tensor-parallel plan check (and warns about a bare *Model's unmatched
    plan) whenever the modeling_utils logger is at WARNING or above, so that logger is quieted too.
    """
    names = ("transformers.modeling_utils", "transformers.distributed.tensor_parallel")
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _load_backbone(
    path: Path, dtype: torch.dtype | None, ignorable: tuple[str, ...], read_elsewhere: tuple[str, ...] = ()
) -> PreTrainedModel:
    """AutoModel.from_pretrained that fails on missing weights and logs what it skipped.

    Tensors under `ignorable` are expected and dropped (logged at info); tensors under
    `read_elsewhere` (the value head, which the caller reads itself) are not reported at all.
    """
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: not a Hugging Face model folder (no config.json); pass the folder of a saved model")
    try:
        with _quiet_load_report():
            backbone, info = AutoModel.from_pretrained(path, dtype=dtype or "auto", output_loading_info=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot load the model: {exc}") from exc
    missing = sorted(info["missing_keys"])
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise UserError(f"{path}: {len(missing)} backbone weight(s) missing from the checkpoint: {shown}")
    skipped = sorted(k for k in info["unexpected_keys"] if not (read_elsewhere and k.startswith(read_elsewhere)))
    unusual = [k for k in skipped if not k.startswith(ignorable)]
    if skipped:
        logger.info("%s: %d checkpoint tensor(s) not part of the backbone left unused (%s)",
                    path, len(skipped), ", ".join(skipped[:3]) + (" ..." if len(skipped) > 3 else ""))
    if unusual:
        logger.warning("%s: unexpected tensor(s) outside the backbone ignored: %s", path, ", ".join(unusual[:5]))
    # Loading a saved value model puts our marker keys on the backbone's config; keep it clean.
    for key in (MODEL_TYPE_KEY, HEAD_SHAPE_KEY):
        if hasattr(backbone.config, key):
            delattr(backbone.config, key)
    return backbone


class ValueModel(nn.Module):
    """A decoder backbone (a Hugging Face *Model without LM head) and `value_head`: hidden -> 1.

    `values[:, t]` is the value of the prefix ending at token t (TRL / DeepSpeed-Chat
    convention): the value of the state from which response token t + 1 is generated, so a PPO
    critic aligned with the log-probs of response tokens reads values[:, start - 1 : -1].
    """

    def __init__(self, backbone: PreTrainedModel, head_init_std: float | None = 0.0) -> None:
        """Wrap `backbone`; the head starts at N(0, head_init_std) weights (zero for 0) and zero bias.

        A zero head makes every initial value 0, so the first PPO steps are not driven by a random
        critic; but it also gives the backbone no gradient until the head has moved, which a reward
        model on a real backbone does not recover from. None: std 1/sqrt(hidden + 1) (OpenRLHF /
        TRL classifier heads), what the reward stage uses by default.
        """
        super().__init__()
        self.backbone = backbone
        param = next(backbone.parameters())
        # A backbone on meta (sharded loading) still gets a real head, initialised (and drawing its
        # random numbers) exactly as with a loaded backbone; `_deferred_value_model` keeps its values
        # for the loader and moves it to meta too.
        self.value_head = nn.Linear(
            backbone_output_size(backbone.config), 1, dtype=param.dtype,
            device=torch.device("cpu") if param.is_meta else param.device,
        )
        if head_init_std is None:
            head_init_std = (self.value_head.in_features + 1) ** -0.5
        with torch.no_grad():
            if head_init_std > 0:
                self.value_head.weight.normal_(0.0, head_init_std)
            else:
                self.value_head.weight.zero_()
            self.value_head.bias.zero_()

    @property
    def config(self) -> PretrainedConfig:
        """The backbone's Hugging Face config."""
        return self.backbone.config

    @classmethod
    def from_causal_lm_dir(
        cls, path: str | Path, dtype: torch.dtype | None = None, head_init_std: float | None = 0.0,
        flag: str = "--model",
    ) -> ValueModel:
        """Backbone weights from any HF causal-LM folder (an SFT output, a base model); new head.

        `AutoModel.from_pretrained` maps the causal-LM names onto the bare model for all five
        tiny families (prefix `model.` for Llama/Qwen2/Mistral/OPT, `transformer.` for GPT-2);
        the LM head is left out and logged. `dtype` None keeps the checkpoint's dtype. A NaN or
        infinite weight is a UserError naming `flag`, the folder and the tensor.
        """
        path = Path(path)
        backbone = _load_backbone(path, dtype, ignorable=("lm_head.", HEAD_PREFIX, "score."))
        check_finite(((f"{backbone.base_model_prefix}.{n}", p) for n, p in backbone.named_parameters()),
                     f"{flag} {path}")
        return cls(backbone, head_init_std=head_init_std)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None
    ) -> Tensor:
        """Per-token values [B, T] in float32 (padding positions hold values that mean nothing).

        Position ids default to `position_ids_from_mask`, so left and right padding give the same
        values for the same tokens.
        """
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        # A copy, not a view of the head's output: FSDP2 warns about views returned by a root
        # module because in-place edits of them would skip its backward hook.
        return self.value_head(hidden).squeeze(-1).to(torch.float32, copy=True)

    def score(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """Sequence scores [B]: the value at each row's last token with attention_mask 1."""
        values = self(input_ids, attention_mask, position_ids)
        index = last_token_index(attention_mask)  # raises ValueError on an all-zero row
        return values.gather(1, index.unsqueeze(1)).squeeze(1)

    def save_pretrained(
        self, directory: str | Path, state_dict: Mapping[str, Tensor] | None = None, safe_serialization: bool = True
    ) -> Path:
        """Write config.json and model.safetensors in Hugging Face format (see module docstring).

        `state_dict` (keys as in `self.state_dict()`) is for models whose parameters are sharded:
        pass the consolidated full state dict, e.g. from
        `get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))`
        on every rank, and call this on rank 0 only. An empty `state_dict` writes config.json alone,
        as transformers' `save_pretrained` does: the engine's export then writes every rank's
        shards into the weights file in place (`export_tensors`). `safe_serialization` exists for
        call compatibility with `PreTrainedModel.save_pretrained`; only safetensors is written.
        """
        if not safe_serialization:
            raise ValueError("ValueModel.save_pretrained writes safetensors only (safe_serialization=True)")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = self.state_dict() if state_dict is None else state_dict
        tensors = _disk_tensors(state, self.backbone.base_model_prefix) if state else {}
        config = copy.deepcopy(self.backbone.config)
        config.architectures = [sequence_classification_class(config) or type(self.backbone).__name__]
        config.num_labels = 1
        config.dtype = next(iter(tensors.values())).dtype if tensors else next(self.parameters()).dtype
        setattr(config, MODEL_TYPE_KEY, VALUE_MODEL_TYPE)
        head = tensors[SCORE_PREFIX + "weight"] if tensors else self.value_head.weight
        setattr(config, HEAD_SHAPE_KEY, list(head.shape))
        config.save_pretrained(directory)
        if tensors:
            save_file(tensors, directory / WEIGHTS_NAME, metadata={"format": "pt"})
        return directory

    def export_tensors(self) -> dict[str, Tensor]:
        """Each parameter (this rank's DTensor or a whole tensor, not copied) under the name
        `save_pretrained` writes it with, for the engine's export, which writes every rank's shards
        into the weights file in place (engine/export.py). Collective on a sharded model: every rank
        reads the head's bias, which is left out when zero (as `save_pretrained` does)."""
        tensors: dict[str, Tensor] = {}
        seen: set[int] = set()
        for key, tensor in self.state_dict(keep_vars=True).items():
            name = _disk_name(key, self.backbone.base_model_prefix)
            if name == SCORE_PREFIX + "bias":
                full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                if not bool(full.detach().any()):
                    continue
            if id(tensor) not in seen:  # a tied parameter is written once
                tensors[name] = tensor
            seen.add(id(tensor))
        return tensors


def sequence_classification_class(config: PretrainedConfig) -> str | None:
    """The family's Hugging Face *ForSequenceClassification class name, if it has one."""
    return MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)


def _disk_name(key: str, prefix: str) -> str:
    """The on-disk name of a key of the module's state dict (see the module docstring)."""
    if key.startswith("backbone."):
        return f"{prefix}.{key.removeprefix('backbone.')}"
    if key.startswith(HEAD_PREFIX):
        return SCORE_PREFIX + key.removeprefix(HEAD_PREFIX)
    raise KeyError(f"unexpected key {key!r} in the value model's state dict")


def _disk_tensors(state: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The module's state dict under the on-disk names (see the module docstring), on CPU."""
    tensors: dict[str, Tensor] = {}
    seen: set[int] = set()
    for key, tensor in state.items():
        if isinstance(tensor, DTensor) or not isinstance(tensor, Tensor):
            raise TypeError(f"save_pretrained needs full tensors; {key!r} is a {type(tensor).__name__} "
                            "(pass a consolidated state_dict)")
        name = _disk_name(key, prefix)
        tensor = tensor.detach().to("cpu").contiguous()
        if name == SCORE_PREFIX + "bias" and not bool(tensor.any()):
            continue  # a zero bias is what a bias-free Hugging Face classifier computes
        if tensor.data_ptr() in seen:  # safetensors refuses shared storage (tied weights)
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    return tensors


def _read_head(path: Path) -> dict[str, Tensor]:
    """The head tensors ("weight", maybe "bias") of a saved value model, under either prefix."""
    index_file = path / f"{WEIGHTS_NAME}.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = {f for k, f in weight_map.items() if k.startswith((HEAD_PREFIX, SCORE_PREFIX))}
    else:
        files = {WEIGHTS_NAME}
    head: dict[str, Tensor] = {}
    for name in files:
        if not (path / name).is_file():
            continue
        with safe_open(str(path / name), framework="pt") as handle:
            for key in handle.keys():
                for prefix in (HEAD_PREFIX, SCORE_PREFIX):
                    if key.startswith(prefix):
                        head[key.removeprefix(prefix)] = handle.get_tensor(key)
    return head


def value_model_kind(path: str | Path) -> str | None:
    """"value" (written by this project), "classifier" (a Hugging Face sequence classifier),
    "causal_lm" (any other model folder) or None (no config.json). Reads config.json only."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    if config.get(MODEL_TYPE_KEY) == VALUE_MODEL_TYPE:
        return "value"
    if any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        return "classifier"
    return "causal_lm"


def _num_labels(config: dict) -> int:
    return len(config["id2label"]) if config.get("id2label") else int(config.get("num_labels", 2))


def check_reward_model_dir(path: str | Path, flag: str = "--reward") -> None:
    """Fail before anything is loaded unless `path` is a value model or a one-label classifier."""
    kind = value_model_kind(path)
    if kind is None:
        raise UserError(f"{flag} {path}: no config.json; pass the reward stage's <output>/model or a Hugging "
                        "Face sequence-classification folder")
    if kind == "causal_lm":
        raise UserError(f"{flag} {path}: a causal LM, not a value/reward model; pass the reward stage's "
                        f"<output>/model (train one with `rlhf reward --model {path} ...`) or a Hugging Face "
                        "*ForSequenceClassification folder with num_labels 1")
    config = json.loads((Path(path) / "config.json").read_text())
    if kind == "classifier" and _num_labels(config) != 1:
        raise UserError(f"{flag} {path}: a sequence classifier with {_num_labels(config)} labels; a reward model "
                        "has num_labels 1 (one score per sequence)")


def load_value_model(path: str | Path, dtype: torch.dtype | None = None, flag: str = "--reward") -> ValueModel:
    """Load a value model: one written by `ValueModel.save_pretrained` (a reward model or a critic)
    or a Hugging Face sequence classifier with one label (its `score` head becomes the value head).

    `dtype` None keeps the saved dtype. Raises UserError if the folder is neither.
    """
    path = Path(path)
    check_reward_model_dir(path, flag)
    config = json.loads((path / "config.json").read_text())
    backbone = _load_backbone(path, dtype, ignorable=(), read_elsewhere=(HEAD_PREFIX, SCORE_PREFIX))
    model = ValueModel(backbone)
    head = _read_head(path)
    expected = tuple(config.get(HEAD_SHAPE_KEY) or model.value_head.weight.shape)
    if "weight" not in head or tuple(head["weight"].shape) != expected or set(head) - {"weight", "bias"}:
        raise UserError(f"{path}: value head missing or of the wrong shape (expected {SCORE_PREFIX}weight {list(expected)})")
    head.setdefault("bias", torch.zeros(1))
    model.value_head.load_state_dict({k: v.to(model.value_head.weight.dtype) for k, v in head.items()})
    prefix = backbone.base_model_prefix
    check_finite(((_disk_name(n, prefix), p) for n, p in model.named_parameters()), f"{flag} {path}")
    return model


def is_value_model_dir(path: str | Path) -> bool:
    """True when `path` holds a value model: ours, or a Hugging Face sequence classifier."""
    return value_model_kind(path) in ("value", "classifier")


def value_model_from(path: str | Path, head_init_std: float | None = 0.0, flag: str = "--model") -> ValueModel:
    """A value/reward model folder as it is (head included), or a causal LM folder with a new head."""
    if not (Path(path) / "config.json").is_file():
        raise UserError(f"{flag} {path}: no config.json; pass a Hugging Face model folder (e.g. runs/sft/model)")
    if is_value_model_dir(path):
        logger.info("%s %s is a value model: continuing from its head", flag, path)
        return load_value_model(path, dtype=torch.float32, flag=flag)
    return ValueModel.from_causal_lm_dir(path, dtype=torch.float32, head_init_std=head_init_std, flag=flag)


# ---------------------------------------------------------------- sharded loading (for the engines)


def _meta_backbone(path: Path, checkpoint: Mapping[str, CheckpointTensor]) -> PreTrainedModel | None:
    """The fp32 backbone of `path`'s config with its parameters on meta (the config as
    `_load_backbone` leaves it), or None when the folder must be loaded in full."""
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot load the model: {exc}") from exc
    for key in (MODEL_TYPE_KEY, HEAD_SHAPE_KEY):
        if hasattr(config, key):
            delattr(config, key)
    if getattr(config, "quantization_config", None) is not None:
        return None
    with parameters_on_meta():
        backbone = AutoModel.from_config(config, dtype=torch.float32)
    backbone.eval()  # as from_pretrained returns it
    return None if renamed_by_transformers(backbone, checkpoint) else backbone


def _value_model_keys(prefix: str) -> Callable[[str], list[str]]:
    """Checkpoint keys of a ValueModel parameter, as `save_pretrained` writes them and
    `load_value_model` reads them: backbone tensors under the causal-LM names (or a bare model's),
    the head as `score.*` (or the older `value_head.*`)."""
    def candidates(name: str) -> list[str]:
        if name.startswith("backbone."):
            rest = name.removeprefix("backbone.")
            return [f"{prefix}.{rest}", rest]
        rest = name.removeprefix(HEAD_PREFIX)
        return [SCORE_PREFIX + rest, HEAD_PREFIX + rest]

    return candidates


def _checkpoint_head(path: Path, checkpoint: Mapping[str, CheckpointTensor], model: ValueModel) -> dict[str, Tensor]:
    """Check the saved head as `load_value_model` does; returns the fills for what it lacks (a
    zero bias: Hugging Face's classifiers have none)."""
    config = json.loads((path / "config.json").read_text())
    head = {key.removeprefix(p): checkpoint[key] for key in checkpoint for p in (HEAD_PREFIX, SCORE_PREFIX)
            if key.startswith(p)}
    expected = tuple(config.get(HEAD_SHAPE_KEY) or model.value_head.weight.shape)
    if "weight" not in head or head["weight"].shape != expected or set(head) - {"weight", "bias"}:
        raise UserError(f"{path}: value head missing or of the wrong shape (expected {SCORE_PREFIX}weight "
                        f"{list(expected)})")
    return {} if "bias" in head else {HEAD_PREFIX + "bias": torch.zeros_like(model.value_head.bias)}


def _deferred_value_model(
    path: Path, flag: str, new_head_std: float | None, new_head: bool
) -> tuple[ValueModel, SafetensorsShardLoader] | None:
    """A ValueModel on meta and the loader of its shards, or None when it must be loaded in full.
    `new_head`: a causal LM's backbone and a head initialised with `new_head_std` (its initial values
    are kept for the loader: they are in no checkpoint); else the folder's own head."""
    where = f"{flag} {path}"
    checkpoint = local_checkpoint(path, where)
    backbone = _meta_backbone(path, checkpoint) if checkpoint is not None else None
    if backbone is None or checkpoint is None:
        return None
    model = ValueModel(backbone, head_init_std=new_head_std)
    ignored = tuple(getattr(backbone, "_keys_to_ignore_on_load_unexpected", None) or ())
    if new_head:
        fills = {HEAD_PREFIX + name: p.detach().clone() for name, p in model.value_head.named_parameters()}
        ignored += (r"^lm_head\.", "^" + re.escape(HEAD_PREFIX), "^" + re.escape(SCORE_PREFIX))
    else:
        fills = _checkpoint_head(path, checkpoint, model)
    model.value_head.to("meta")
    return model, plan_shard_loading(model, checkpoint, path, where, _value_model_keys(backbone.base_model_prefix),
                                     ignored, fills)


def deferred_load_value_model(path: str | Path, flag: str = "--reward") -> tuple[ValueModel, ShardLoader | None]:
    """`load_value_model(path, float32, flag)` for an engine: on meta with a loader of each rank's
    shards when the folder has safetensors weights (see rlhf/models/sharded_loading.py), else
    loaded in full with no loader."""
    path = Path(path)
    check_reward_model_dir(path, flag)
    deferred = _deferred_value_model(path, flag, 0.0, new_head=False)
    return deferred if deferred is not None else (load_value_model(path, dtype=torch.float32, flag=flag), None)


def deferred_value_model_from(
    path: str | Path, head_init_std: float | None = 0.0, flag: str = "--model"
) -> tuple[ValueModel, ShardLoader | None]:
    """`value_model_from` for an engine, as `deferred_load_value_model`."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{flag} {path}: no config.json; pass a Hugging Face model folder (e.g. runs/sft/model)")
    if is_value_model_dir(path):
        logger.info("%s %s is a value model: continuing from its head", flag, path)
        return deferred_load_value_model(path, flag)
    deferred = _deferred_value_model(path, flag, head_init_std, new_head=True)
    if deferred is not None:
        return deferred
    return ValueModel.from_causal_lm_dir(path, dtype=torch.float32, head_init_std=head_init_std, flag=flag), None
