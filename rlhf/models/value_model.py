"""Value model: a Hugging Face decoder backbone plus a linear head giving one scalar per token.

The same module is the reward model (its score is the value at the last real token of a
sequence, as InstructGPT and DeepSpeed-Chat's `RewardModel`) and the PPO critic (its per-token
values).

On disk it is a Hugging Face folder:
    config.json        the backbone's config plus "rlhf_model_type": "value" and
                       "rlhf_value_head_shape": [1, hidden]
    model.safetensors  backbone tensors under the causal-LM names (`model.layers.0...`,
                       `transformer.h.0...`) plus `value_head.weight` and `value_head.bias`
Because the backbone keeps its causal-LM names, `AutoModel.from_pretrained(folder)` also reads
the backbone (the head is reported as unexpected), like any other HF checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from transformers import AutoModel, PretrainedConfig, PreTrainedModel

from rlhf.errors import UserError
from rlhf.logging import get_logger

logger = get_logger(__name__)

MODEL_TYPE_KEY = "rlhf_model_type"
HEAD_SHAPE_KEY = "rlhf_value_head_shape"
VALUE_MODEL_TYPE = "value"
HEAD_PREFIX = "value_head."
WEIGHTS_NAME = "model.safetensors"


def backbone_output_size(config: PretrainedConfig) -> int:
    """Width of the backbone's last hidden state: OPT projects it to `word_embed_proj_dim`."""
    return int(getattr(config, "word_embed_proj_dim", None) or config.hidden_size)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, so left padding does not shift them.

    Padding positions get 0 (any valid index works: they are masked out of attention). The
    same convention as Hugging Face generation's `prepare_inputs_for_generation`, so values of
    a left-padded rollout match those of the same sequence without padding.
    """
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def last_token_index(attention_mask: Tensor) -> Tensor:
    """Index [B] of the last position with attention_mask 1, whatever the padding side.

    Read from the mask, never from pad ids: a leading BOS may share the pad id (GPT-2 style).
    """
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return torch.where(attention_mask.bool(), positions, -1).amax(dim=-1)


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


def _load_backbone(path: Path, dtype: torch.dtype | None, ignorable: tuple[str, ...]) -> PreTrainedModel:
    """AutoModel.from_pretrained that fails on missing weights and logs what it skipped."""
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
    skipped = sorted(info["unexpected_keys"])
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

    def __init__(self, backbone: PreTrainedModel, head_init_std: float = 0.0) -> None:
        """Wrap `backbone`; the head starts at zero weights (or N(0, head_init_std)) and zero bias.

        A zero head makes every initial value/score 0, so the first PPO steps are not driven by
        a random critic and a reward model starts without preference.
        """
        super().__init__()
        self.backbone = backbone
        param = next(backbone.parameters())
        self.value_head = nn.Linear(
            backbone_output_size(backbone.config), 1, dtype=param.dtype, device=param.device
        )
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
        cls, path: str | Path, dtype: torch.dtype | None = None, head_init_std: float = 0.0
    ) -> ValueModel:
        """Backbone weights from any HF causal-LM folder (an SFT output, a base model); new head.

        `AutoModel.from_pretrained` maps the causal-LM names onto the bare model for all five
        tiny families (prefix `model.` for Llama/Qwen2/Mistral/OPT, `transformer.` for GPT-2);
        the LM head is left out and logged. `dtype` None keeps the checkpoint's dtype.
        """
        path = Path(path)
        backbone = _load_backbone(path, dtype, ignorable=("lm_head.", HEAD_PREFIX, "score."))
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
        index = last_token_index(attention_mask)
        if bool((index < 0).any()):
            raise ValueError("score() got a row whose attention_mask is all zeros")
        return values.gather(1, index.unsqueeze(1)).squeeze(1)

    def save_pretrained(
        self, directory: str | Path, state_dict: Mapping[str, Tensor] | None = None, safe_serialization: bool = True
    ) -> Path:
        """Write config.json and model.safetensors in Hugging Face format (see module docstring).

        `state_dict` (keys as in `self.state_dict()`) is for models whose parameters are sharded:
        pass the consolidated full state dict, e.g. from
        `get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))`
        on every rank, and call this on rank 0 only. `safe_serialization` exists for call
        compatibility with `PreTrainedModel.save_pretrained`; only safetensors is written.
        """
        if not safe_serialization:
            raise ValueError("ValueModel.save_pretrained writes safetensors only (safe_serialization=True)")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = self.state_dict() if state_dict is None else state_dict
        prefix = self.backbone.base_model_prefix
        tensors: dict[str, Tensor] = {}
        seen: set[int] = set()
        for key, tensor in state.items():
            if isinstance(tensor, DTensor) or not isinstance(tensor, Tensor):
                raise TypeError(f"save_pretrained needs full tensors; {key!r} is a {type(tensor).__name__} "
                                "(pass a consolidated state_dict)")
            if key.startswith("backbone."):
                name = f"{prefix}.{key.removeprefix('backbone.')}"
            elif key.startswith(HEAD_PREFIX):
                name = key
            else:
                raise KeyError(f"unexpected key {key!r} in the value model's state dict")
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.data_ptr() in seen:  # safetensors refuses shared storage (tied weights)
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            tensors[name] = tensor
        head = tensors[HEAD_PREFIX + "weight"]

        config = copy.deepcopy(self.backbone.config)
        config.architectures = [type(self.backbone).__name__]
        config.dtype = next(iter(tensors.values())).dtype
        setattr(config, MODEL_TYPE_KEY, VALUE_MODEL_TYPE)
        setattr(config, HEAD_SHAPE_KEY, list(head.shape))
        config.save_pretrained(directory)
        save_file(tensors, directory / WEIGHTS_NAME, metadata={"format": "pt"})
        return directory


def _read_head(path: Path) -> dict[str, Tensor]:
    """The value head tensors of a saved value model (single file or a sharded index)."""
    index_file = path / f"{WEIGHTS_NAME}.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = {weight_map.get(HEAD_PREFIX + "weight"), weight_map.get(HEAD_PREFIX + "bias")}
    else:
        files = {WEIGHTS_NAME}
    head: dict[str, Tensor] = {}
    for name in files:
        if name is None or not (path / name).is_file():
            continue
        with safe_open(str(path / name), framework="pt") as handle:
            for key in handle.keys():
                if key.startswith(HEAD_PREFIX):
                    head[key.removeprefix(HEAD_PREFIX)] = handle.get_tensor(key)
    return head


def load_value_model(path: str | Path, dtype: torch.dtype | None = None) -> ValueModel:
    """Load a folder written by `ValueModel.save_pretrained` (a reward model or a critic).

    `dtype` None keeps the saved dtype. Raises UserError if the folder is not a value model.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"{path}: not a model folder (no config.json); pass the output model/ of `rlhf reward`")
    config = json.loads(config_file.read_text())
    if config.get(MODEL_TYPE_KEY) != VALUE_MODEL_TYPE:
        raise UserError(
            f"{config_file}: not a value/reward model (no \"{MODEL_TYPE_KEY}\": \"{VALUE_MODEL_TYPE}\"); "
            "pass a folder written by the reward stage, or start from a causal LM with ValueModel.from_causal_lm_dir"
        )
    backbone = _load_backbone(path, dtype, ignorable=(HEAD_PREFIX,))
    model = ValueModel(backbone)
    head = _read_head(path)
    expected = tuple(config.get(HEAD_SHAPE_KEY) or model.value_head.weight.shape)
    if set(head) != {"weight", "bias"} or tuple(head["weight"].shape) != expected:
        raise UserError(f"{path}: value head missing or of the wrong shape (expected {HEAD_PREFIX}weight {list(expected)})")
    head = {k: v.to(model.value_head.weight.dtype) for k, v in head.items()}
    model.value_head.load_state_dict(head)
    return model


def is_value_model_dir(path: str | Path) -> bool:
    """True when `path` holds a model saved by `ValueModel.save_pretrained`."""
    config_file = Path(path) / "config.json"
    return config_file.is_file() and json.loads(config_file.read_text()).get(MODEL_TYPE_KEY) == VALUE_MODEL_TYPE


def value_model_from(path: str | Path, head_init_std: float = 0.0, flag: str = "--model") -> ValueModel:
    """A value/reward model folder as it is (head included), or a causal LM folder with a new head."""
    if not (Path(path) / "config.json").is_file():
        raise UserError(f"{flag} {path}: no config.json; pass a Hugging Face model folder (e.g. runs/sft/model)")
    if is_value_model_dir(path):
        logger.info("%s %s is a value model: continuing from its head", flag, path)
        return load_value_model(path, dtype=torch.float32)
    return ValueModel.from_causal_lm_dir(path, dtype=torch.float32, head_init_std=head_init_std)
