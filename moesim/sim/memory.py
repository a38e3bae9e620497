"""GPU memory as one budget of expert slots, the same for every system (docs/memory-and-bounds.md).

The budget: GPU memory - reserved - non-expert weights (in ``memory.non_expert_dtype``)
- KV cache (peak context of the trace) - workspace - staging buffers, divided by
the bytes of one expert (in the expert dtype). No system plans memory on its
own: the system's cache policy only decides how the slots spread
(:meth:`moesim.policy.cache.CachePolicy.spread`): per-layer quotas, one
model-wide pool, or whole layers (llama.cpp). Users choose how many slots the
cache gets with ``cache.slots`` (a total) or ``cache.slots_per_layer`` (a number
per layer, or an explicit list ``[2,1,...]``); by default every slot that fits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from moesim.errors import ConfigError
from moesim.hw.profile import HardwareProfile
from moesim.model.spec import ModelSpec
from moesim.policy.state import describe_quotas
from moesim.trace.io import iter_columns

GIB = 2**30


@dataclass(frozen=True)
class CacheRequest:
    """What the user asked of the cache: a total (``cache.slots``), per-layer quotas, or neither (all)."""

    slots: int | None = None
    slots_per_layer: list[int] | None = None

    def __post_init__(self) -> None:
        if self.slots is not None and self.slots_per_layer is not None:
            raise ConfigError("both cache.slots and cache.slots_per_layer given", field="cache.slots",
                              fix="give one: cache.slots is the total, cache.slots_per_layer the quota per layer")
        # negative counts are wrong for every model: refused here, before a sweep runs any point
        if self.slots is not None and self.slots < 0:
            raise ConfigError(f"cache.slots={self.slots} is negative", field="cache.slots", fix="use 0 or more")
        negative = [q for q in self.slots_per_layer or [] if q < 0]
        if negative:
            raise ConfigError(f"cache.slots_per_layer={negative[0]} is negative", field="cache.slots_per_layer",
                              fix="use 0 or more per layer")


@dataclass(frozen=True)
class MemoryPlan:
    gpu_bytes: int
    reserved_bytes: int
    non_expert_bytes: int
    kv_bytes: int
    workspace_bytes: int
    staging_bytes: int
    expert_bytes: int
    #: most experts each layer's cache holds (resident + in flight)
    capacity: list[int]
    #: most experts all layers' caches hold together (None: the per-layer quotas alone bind)
    pool: int | None = None
    #: slots the system keeps outside its cache (a prefetch buffer); counted in ``capacity``/``pool``
    reserved_slots: int = 0
    #: experts each layer's cache fills, where ``capacity`` also holds buffer room (None: all of ``capacity``)
    cached: list[int] | None = None
    #: True for a reference that holds every expert whatever the memory
    ignores_memory: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def cache_quota(self) -> list[int]:
        """Experts each layer's cache itself holds (its initial fill); the rest of ``capacity`` is buffer."""
        return list(self.capacity) if self.cached is None else list(self.cached)

    @property
    def free_bytes(self) -> int:
        return (self.gpu_bytes - self.reserved_bytes - self.non_expert_bytes - self.kv_bytes
                - self.workspace_bytes - self.staging_bytes)

    @property
    def total_slots(self) -> int:
        """Experts that fit in the memory left for them."""
        return max(self.free_bytes, 0) // self.expert_bytes

    @property
    def slots(self) -> int:
        """Experts held at once at most, over all layers (cache and reserved buffer)."""
        total = sum(self.capacity)
        return total if self.pool is None else min(self.pool, total)

    def arithmetic(self) -> str:
        g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        return (f"GPU {g(self.gpu_bytes)} - reserved {g(self.reserved_bytes)} - non-expert weights "
                f"{g(self.non_expert_bytes)} - KV cache {g(self.kv_bytes)} - workspace {g(self.workspace_bytes)}"
                f" - staging {g(self.staging_bytes)} = {g(self.free_bytes)} for experts of "
                f"{self.expert_bytes / 2**20:.1f} MiB = {self.total_slots} slot{'' if self.total_slots == 1 else 's'}")

    def describe(self) -> str:
        """One line: how many slots each layer got, compactly."""
        if self.ignores_memory:
            return f"every expert resident ({self.slots} slots; GPU memory not enforced)"
        if self.reserved_slots:
            text = f"{describe_quotas(self.cache_quota)} + a model-wide prefetch buffer of {self.reserved_slots}"
        else:
            text = describe_quotas(self.capacity, self.pool)
        return f"{text} (of {self.total_slots} that fit)"


def peak_kv_tokens(trace_path: str, batch_rows: int = 1 << 20) -> int:
    """Largest total context held at once: per step, the sum over its requests of their context.

    Read in batches (a 10-million-row trace in about 100 MiB instead of 700 MiB); the rows of a batch's
    last step wait for the next batch, where that step may go on, so each step is summed whole."""
    names = ("step", "request", "position")
    peak = 0
    held: list[np.ndarray] | None = None  # the rows of the step the previous batch ended in
    for batch in iter_columns(trace_path, names, batch_rows):
        columns = [batch[name].astype(np.int64) for name in names]
        if held is not None:
            columns = [np.concatenate((old, new)) for old, new in zip(held, columns)]
        step = columns[0]
        if not step.size:
            continue
        others = np.flatnonzero(step != step[-1])
        last_start = int(others[-1]) + 1 if others.size else 0
        if last_start:
            peak = max(peak, _peak_context(*(c[:last_start] for c in columns)))
        held = [c[last_start:] for c in columns]
    if held is not None and held[0].size:
        peak = max(peak, _peak_context(*held))
    return peak


def _peak_context(step: np.ndarray, request: np.ndarray, position: np.ndarray) -> int:
    """:func:`peak_kv_tokens` of whole steps' rows."""
    # each (step, request) pair's context is its largest position + 1; a step holds the sum of its pairs'
    _, request = np.unique(request, return_inverse=True)  # ids 0..R-1, so one int64 key per pair
    requests = int(request.max()) + 1
    pairs, pair_of_row = np.unique(step * requests + request, return_inverse=True)
    context = np.zeros(pairs.size, dtype=np.int64)
    np.maximum.at(context, pair_of_row, position + 1)
    _, step_of_pair = np.unique(pairs // requests, return_inverse=True)
    return int(np.bincount(step_of_pair, weights=context).max())


def plan_memory(model: ModelSpec, profile: HardwareProfile, system, *, expert_bytes: int, kv_tokens: int,
                workspace_gib: float, staging_slots: int, non_expert_dtype: str,
                request: CacheRequest = CacheRequest(), given: Mapping[str, str] | None = None) -> MemoryPlan:
    """The memory budget of one replay, spread by ``system`` (a ComposedSystem); raise with the arithmetic
    when the request cannot fit. ``given``: the system's ``--set`` parameters as the user gave them (an error
    names those the user set, not the defaults)."""
    plan = MemoryPlan(
        gpu_bytes=profile.gpu_memory_bytes, reserved_bytes=profile.gpu_reserved_bytes,
        non_expert_bytes=model.non_expert_bytes(non_expert_dtype),
        kv_bytes=kv_tokens * model.kv_bytes_per_token(),
        workspace_bytes=int(workspace_gib * GIB), staging_bytes=staging_slots * expert_bytes,
        expert_bytes=expert_bytes, capacity=[])
    layers, experts = model.num_layers, model.num_experts
    if system.ignores_memory:
        return _with(plan, capacity=[experts] * layers, ignores_memory=True,
                     notes=_unused_request(request, system.name, "holds every expert whatever the memory"))
    if plan.free_bytes < 0:
        raise _no_room(plan, profile)
    if not system.uses_cache:
        return _with(plan, capacity=[0] * layers,
                     notes=_unused_request(request, system.name, "keeps no expert cache on the GPU"))
    reserved = system.reserved_slots(layers)
    requested = _check_request(request, layers, experts)
    fit = plan.total_slots
    total = sum(requested) if requested is not None else request.slots
    if total is None:
        total = max(min(fit - reserved, layers * experts), 0)
    if total + reserved > fit and reserved:
        raise _buffer_too_large(plan, profile, system, request, total, reserved, layers, given or {})
    if total + reserved > fit:
        asked = f"cache.slots={request.slots}" if request.slots is not None else \
            f"cache.slots_per_layer (total {total})"
        raise ConfigError(f"{asked} does not fit on the GPU of {_named(profile)}: {plan.arithmetic()}",
                          field="cache.slots" if request.slots is not None else "cache.slots_per_layer",
                          fix=f"set cache.slots={fit} or fewer (or cache.slots_per_layer={fit // layers} or fewer, the "
                              "same count on every layer)")
    spread = system.spread(total, layers, experts, requested)
    planned = _with(plan, capacity=list(spread.capacity), pool=spread.pool, reserved_slots=reserved,
                    cached=None if spread.cached is None else list(spread.cached))
    return _with(planned, notes=_smaller_cache(request, system, total, planned))


def _buffer_too_large(plan: MemoryPlan, profile: HardwareProfile, system, request: CacheRequest, total: int,
                      reserved: int, layers: int, given: Mapping[str, str]) -> ConfigError:
    """The system's prefetch buffer (``reserved`` slots) and its cache (``total``) do not fit in the slots of
    ``plan``: the error names the parameter that sized the buffer as the user gave it, how many slots the GPU
    holds in all, and the largest buffer that fits beside the cache asked for (beside none: the cache gets what
    the buffer leaves)."""
    fit = plan.total_slots
    key, per, buffer = _buffer_setting(system, reserved, given)
    asked = _asked(request)
    if asked:
        buffer += f" beside the cache of {total} slots that {asked} asks for"
    fixes = []
    largest = (fit - (total if asked else 0)) // per
    if key and largest >= 0:
        fixes.append(f"--set {key}={largest}" + (" or less" if largest else "")
                     + ("" if asked else " (the cache then gets the slots it leaves)"))
    if asked and fit >= reserved:
        left = fit - reserved
        fixes.append(f"--set cache.slots={left}" + (" or less" if left else "") if request.slots is not None else
                     f"--set cache.slots_per_layer={left // layers}" + (" or less" if left // layers else "")
                     + f" (or cache.slots={left})")
    if key == "prefetch.size":
        fixes.append("--set cache.prefetch_slots to size the buffer apart")
    shrunk = any(key_ == "memory_gib" for key_, _, _ in _overridden(profile))
    if not fixes or key not in given:
        needed = plan.gpu_bytes - plan.free_bytes + ((total if asked else 0) + reserved) * plan.expert_bytes
        fixes.append(f"--set hw.gpu.memory_gib={math.ceil(needed / GIB * 100) / 100:g} or more" if shrunk
                     else "a GPU with more memory")
        fixes[-1] += ", or --set memory.non_expert_dtype=int4"
    if asked and fit >= reserved:  # the buffer fits: the cache asked for leaves it no room
        field_ = "cache.slots" if request.slots is not None else "cache.slots_per_layer"
    else:  # the buffer's own setting when the user gave it, else the GPU memory they set, else the profile's
        field_ = key if key in given else "--set" if shrunk else "memory"
    named = f"{_named(profile, overrides=False)} with {_overrides_said(_overridden(profile))}" if shrunk \
        else _named(profile)
    return ConfigError(f"{buffer} does not fit on the GPU of {named}, which holds {fit} expert "
                       f"slot{'' if fit == 1 else 's'} in all, cache and buffer together: {plan.arithmetic()}",
                       field=field_, fix=", or ".join(fixes))


def _buffer_setting(system, reserved: int, given: Mapping[str, str]) -> tuple[str | None, int, str]:
    """(the ``--set`` parameter that sizes ``system``'s prefetch buffer of ``reserved`` slots, the slots one unit
    of it takes, the buffer in words): DALI's ``cache.prefetch_slots``, or twice its ``prefetch.size`` when that
    is left at -1, or ``cache.prefetch_slots`` again for a buffer sized from another prefetcher swapped in
    (twice its ``issued_per_layer``: smoe-token's ``n``, ...); None and the slots alone otherwise."""
    slots = getattr(system.cache, "prefetch_slots", None)
    size = getattr(system.prefetch, "size", None)
    if isinstance(slots, int) and 0 <= slots == reserved:
        key, per, said = "cache.prefetch_slots", 1, f"cache.prefetch_slots={slots}"
    elif isinstance(size, int) and 2 * size == reserved:
        key, per, said = "prefetch.size", 2, f"twice prefetch.size={size}"
    elif isinstance(slots, int) and slots < 0 and system.prefetch.issued_per_layer:
        # sized from another prefetcher swapped in (smoe-token's n, ...): the buffer's own size overrides it
        issued = system.prefetch.issued_per_layer
        key, per = "cache.prefetch_slots", 1
        said = f"twice the {issued} experts prefetch '{system.prefetch.name}' issues per layer"
        return key, per, f"{system.name}'s prefetch buffer of {reserved} slots ({said})"
    else:
        return None, 1, f"{system.name}'s prefetch buffer of {reserved} slots"
    if key not in given:
        said += f", {system.name}'s default" + (" for the model" if key == "prefetch.size" else "")
    return key, per, f"{system.name}'s prefetch buffer of {reserved} slots ({said})"


def _smaller_cache(request: CacheRequest, system, total: int, planned: MemoryPlan) -> list[str]:
    """A note when the cache holds fewer slots than the user asked for (its own size setting binds)."""
    asked = _asked(request)
    held = planned.slots if planned.cached is None else sum(planned.cached)  # a buffer beside it is no cache
    if not asked or held >= total:
        return []
    sized_by = system.cache.sized_by
    return [f"{asked} asks for {total} slots; {system.name}'s cache '{system.cache.name}' holds {held} of them"
            + (f" (its size is {sized_by})" if sized_by else "")]


def _named(profile: HardwareProfile, overrides: bool = True) -> str:
    """The profile as the user gave it: its file when it came from one, and the overrides of its GPU memory
    (the size in the message is then theirs, not the file's)."""
    named = f"{profile.name} ({profile.path})" if profile.path else profile.name
    changed = _overridden(profile) if overrides else []
    return named + (" with " + " and ".join(f"hw.gpu.{key}={new:g}" for key, new, _ in changed) if changed else "")


#: the GPU fields of the memory budget (``gpu.memory_gib`` and ``gpu.reserved_gib`` of a profile)
BUDGET_FIELDS = ("memory_gib", "reserved_gib")


def _overridden(profile: HardwareProfile) -> list[tuple[str, float, float]]:
    """(field, value, the profile's own value) of each budget field an ``hw.gpu.*`` override changed."""
    base = profile.base
    if base is None:
        return []
    return [(key, getattr(profile.gpu, key), getattr(base.gpu, key)) for key in BUDGET_FIELDS
            if getattr(profile.gpu, key) != getattr(base.gpu, key)]


def _overrides_said(changed: list[tuple[str, float, float]]) -> str:
    """The ``hw.gpu.*`` overrides as ``--set`` parameters: the ``parameter '...'`` form is how one is named, and
    the Python API renames the error's field to its keyword (hw__gpu__memory_gib) from it."""
    return " and ".join(f"parameter 'hw.gpu.{key}'={new:g} (the profile's own: {old:g})" for key, new, old in changed)


def _no_room(plan: MemoryPlan, profile: HardwareProfile) -> ConfigError:
    """The model does not fit even without experts: the profile is named as too small, unless an override
    set its memory, which is then named, with the value that would fit."""
    changed = _overridden(profile)
    arithmetic = (f"the model does not fit on the GPU of {_named(profile, overrides=False)} even without experts: "
                  f"{plan.arithmetic()}")
    if not changed:
        return ConfigError(arithmetic, field="memory",
                           fix="use a larger GPU profile, --set memory.non_expert_dtype=int4, or a shorter trace")
    said = _overrides_said(changed)
    fixes = []
    for key, _, _ in changed:
        if key == "memory_gib":  # the least GPU that holds everything but the experts, rounded up
            fixes.append(f"--set hw.gpu.memory_gib={math.ceil((plan.gpu_bytes - plan.free_bytes) / GIB * 100) / 100:g}"
                         " or more")
        elif plan.reserved_bytes + plan.free_bytes >= 0:
            fixes.append(f"--set hw.gpu.reserved_gib={(plan.reserved_bytes + plan.free_bytes) // (GIB // 100) / 100:g}"
                         " or less")
    fixes.append("--set memory.non_expert_dtype=int4")
    return ConfigError(f"{said} leaves too little GPU memory: {arithmetic}", field="--set",
                       fix=", ".join(fixes) + ", or a shorter trace")


def _unused_request(request: CacheRequest, system: str, why: str) -> list[str]:
    """A note when the user sized a cache that ``system`` does not have (the setting changes nothing)."""
    asked = _asked(request)
    return [f"{asked} changes nothing: {system} {why}"] if asked else []


def _asked(request: CacheRequest) -> str:
    """The cache size the user set, as they wrote it ("" when none)."""
    if request.slots is not None:
        return f"cache.slots={request.slots}"
    if request.slots_per_layer is not None:
        return "cache.slots_per_layer=" + ",".join(map(str, request.slots_per_layer))
    return ""


def _check_request(request: CacheRequest, layers: int, experts: int) -> list[int] | None:
    """The explicit per-layer quotas, validated (None when the user gave none)."""
    quotas = request.slots_per_layer
    if quotas is None:
        return None
    if len(quotas) == 1:
        quotas = quotas * layers
    if len(quotas) != layers:
        raise ConfigError(f"cache.slots_per_layer lists {len(quotas)} layers, the model has {layers}",
                          field="cache.slots_per_layer", fix=f"give one number, or a list of {layers}")
    bad = [q for q in quotas if q < 0 or q > experts]
    if bad:
        raise ConfigError(f"cache.slots_per_layer={bad[0]} outside [0, {experts}]", field="cache.slots_per_layer",
                          fix=f"use 0..{experts}")
    return list(quotas)


def _with(plan: MemoryPlan, **changes) -> MemoryPlan:
    return MemoryPlan(**{**plan.__dict__, **changes})
