"""Hardware profiles and the cost model built on them."""

from moesim.hw.cost import CostModel
from moesim.hw.profile import HardwareProfile, available_profiles, load_profile

__all__ = ["CostModel", "HardwareProfile", "available_profiles", "load_profile"]
