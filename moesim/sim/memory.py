"""GPU memory as expert slots: what is left after non-expert weights, KV cache, workspace and staging."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow.parquet as pq

from moesim.errors import ConfigError
from moesim.hw.profile import HardwareProfile
from moesim.model.spec import ModelSpec

GIB = 2**30


@dataclass(frozen=True)
class MemoryPlan:
    gpu_bytes: int
    reserved_bytes: int
    non_expert_bytes: int
    kv_bytes: int
    workspace_bytes: int
    staging_bytes: int
    expert_bytes: int
    capacity: list[int]

    @property
    def free_bytes(self) -> int:
        return (self.gpu_bytes - self.reserved_bytes - self.non_expert_bytes - self.kv_bytes
                - self.workspace_bytes - self.staging_bytes)

    @property
    def total_slots(self) -> int:
        return max(self.free_bytes, 0) // self.expert_bytes

    def arithmetic(self) -> str:
        g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        return (f"GPU {g(self.gpu_bytes)} - reserved {g(self.reserved_bytes)} - non-expert weights "
                f"{g(self.non_expert_bytes)} - KV cache {g(self.kv_bytes)} - workspace {g(self.workspace_bytes)}"
                f" - staging {g(self.staging_bytes)} = {g(self.free_bytes)} for experts of "
                f"{self.expert_bytes / 2**20:.1f} MiB = {self.total_slots} slots")


def peak_kv_tokens(trace_path: str) -> int:
    """Largest total context held at once: per step, the sum over its requests of their context."""
    table = pq.read_table(trace_path, columns=["step", "request", "position"])
    frame = table.to_pandas()
    per_request = frame.groupby(["step", "request"], sort=False)["position"].max() + 1
    return int(per_request.groupby(level=0).sum().max()) if len(per_request) else 0


def plan_memory(model: ModelSpec, profile: HardwareProfile, *, expert_bytes: int, kv_tokens: int,
                workspace_gib: float, staging_slots: int, non_expert_dtype: str,
                slots_per_layer: int | None, ignore_memory: bool) -> MemoryPlan:
    """Split GPU memory into expert slots per layer, or raise with the arithmetic when it cannot fit."""
    plan = MemoryPlan(
        gpu_bytes=profile.gpu_memory_bytes, reserved_bytes=profile.gpu_reserved_bytes,
        non_expert_bytes=model.non_expert_bytes(non_expert_dtype),
        kv_bytes=kv_tokens * model.kv_bytes_per_token(),
        workspace_bytes=int(workspace_gib * GIB), staging_bytes=staging_slots * expert_bytes,
        expert_bytes=expert_bytes, capacity=[])
    layers = model.num_layers
    if ignore_memory:
        per_layer = model.num_experts if slots_per_layer is None else slots_per_layer
        return _with_capacity(plan, [min(per_layer, model.num_experts)] * layers)
    if plan.free_bytes < 0:
        raise ConfigError(f"the model does not fit on the GPU even without experts: {plan.arithmetic()}",
                          field="memory", fix="use a larger GPU profile, --set memory.non_expert_dtype=int4, "
                          "or a shorter trace")
    if slots_per_layer is None:
        per_layer = min(plan.total_slots // layers, model.num_experts)
    else:
        per_layer = slots_per_layer
        if per_layer < 0 or per_layer > model.num_experts:
            raise ConfigError(f"cache.slots_per_layer={per_layer} outside [0, {model.num_experts}]",
                              field="cache.slots_per_layer", fix=f"use 0..{model.num_experts}")
        if per_layer * layers > plan.total_slots:
            raise ConfigError(f"cache of {per_layer} slots x {layers} layers = {per_layer * layers} experts "
                              f"does not fit: {plan.arithmetic()}", field="cache.slots_per_layer",
                              fix=f"use cache.slots_per_layer <= {plan.total_slots // layers}")
    return _with_capacity(plan, [per_layer] * layers)


def _with_capacity(plan: MemoryPlan, capacity: list[int]) -> MemoryPlan:
    return MemoryPlan(**{**plan.__dict__, "capacity": capacity})
