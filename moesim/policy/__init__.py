"""Pure decision objects (no SimPy, no torch): cache, prefetch, assignment; systems compose them."""

from moesim.policy.base import LayerPlan, LayerView, RunContext
from moesim.policy.state import CacheState
from moesim.policy.systems import SYSTEMS, build_system, system_names

__all__ = ["CacheState", "LayerPlan", "LayerView", "RunContext", "SYSTEMS", "build_system", "system_names"]
