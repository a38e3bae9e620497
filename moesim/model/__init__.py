"""Model shapes and presets."""

from moesim.model.spec import DTYPE_BITS, ModelSpec
from moesim.model.presets import available_presets, load_preset

__all__ = ["DTYPE_BITS", "ModelSpec", "available_presets", "load_preset"]
