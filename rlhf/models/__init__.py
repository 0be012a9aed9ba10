"""Model loading: causal LMs, value/reward models, tiny models built from configs."""

from rlhf.models.value_model import ValueModel, load_value_model, position_ids_from_mask

__all__ = ["ValueModel", "load_value_model", "position_ids_from_mask"]
