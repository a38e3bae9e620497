"""The policy interface: a read-only :class:`LayerView` in, a :class:`LayerPlan` out.

The executor calls ``system.plan(view)`` once per (step, layer). A system is a
composition of small components (cache, prefetch, assignment, and in later
systems substitution and deferral); plans are plain data and, given the same
views and seed, the same plans come out. Nothing here imports SimPy or torch:
the simulator and the real backend run the very same objects.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from moesim.errors import ConfigError, MissingColumnError, MoesimError, did_you_mean
from moesim.hw.cost import CostModel
from moesim.model.spec import ModelSpec
from moesim.policy.state import CacheState


class PolicyError(MoesimError):
    """A policy of one's own broke the policy interface: what one of its methods returned, or changed in the view,
    or raised; named with the component and method, the step and the layer, and how to fix it. The catalogue's
    own policies are not checked (moesim.policy.systems checks a user's, as they plan)."""


class Substitutions(Sequence):
    """A plan's (token row, top-k slot, new expert) rewrites as three integer arrays, rows ascending and
    slots ascending within a row (so each entry once): a list of such tuples to its readers (length,
    iteration, indexing, equality with a list), with no tuple made until one is asked for. A prefill
    layer rewrites thousands of entries at once (002's buddy substitution); executors apply them and sum
    their gate weight as arrays."""

    __slots__ = ("rows", "slots", "experts")

    def __init__(self, rows: np.ndarray, slots: np.ndarray, experts: np.ndarray) -> None:
        self.rows, self.slots, self.experts = (np.asarray(a, dtype=np.int64) for a in (rows, slots, experts))
        if not len(self.rows) == len(self.slots) == len(self.experts):
            raise ValueError("rows, slots and experts of substitutions differ in length")
        later_row = self.rows[1:] > self.rows[:-1]
        later_slot = (self.rows[1:] == self.rows[:-1]) & (self.slots[1:] > self.slots[:-1])
        if not (later_row | later_slot).all():
            raise ValueError("substitutions must be ordered by row, then slot, each entry once")

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return zip(self.rows.tolist(), self.slots.tolist(), self.experts.tolist())

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self)[index]
        return int(self.rows[index]), int(self.slots[index]), int(self.experts[index])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Substitutions):
            return all(np.array_equal(a, b) for a, b in zip((self.rows, self.slots, self.experts),
                                                            (other.rows, other.slots, other.experts)))
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"Substitutions({list(self)!r})"


def kept_rewrites(substitutions: Sequence[tuple[int, int, int]]) -> Sequence[tuple[int, int, int]]:
    """Rewrites as kept beside the plan that made them: :class:`Substitutions` as they are (nothing writes
    into their arrays), anything else copied into a list (a policy may reuse its own)."""
    return substitutions if isinstance(substitutions, Substitutions) else list(substitutions)


@dataclass(slots=True)
class LayerView:
    """What a policy may see when it plans one MoE layer of one forward pass."""

    step: int
    layer: int
    #: "prefill" or "decode"
    phase: str
    #: routed experts of every token in the batch at this layer, (tokens, top_k), best first
    experts: np.ndarray
    #: distinct experts this layer activates, most tokens first
    active: list[int]
    #: tokens routed to each of ``active``
    counts: list[int]
    cache: CacheState
    costs: CostModel
    # The optional trace columns below are read only when a component of the system lists them in its
    # ``columns`` (``columns = ("weights",)``) and the trace has them; otherwise they are None (empty).
    #: gate weight of each of ``experts``, (tokens, top_k)
    weights: np.ndarray | None = None
    #: the router's score of every expert, (tokens, num_experts)
    scores: np.ndarray | None = None
    #: predicted experts by predictor column (``pred_next_layer``, ...), one array per token row
    predictors: dict[str, list[np.ndarray]] = field(default_factory=dict)
    #: simulated (or measured) time at which the plan is made, seconds
    now: float = 0.0
    #: estimated arrival time of in-flight loads of this layer, seconds
    arrivals: dict[int, float] = field(default_factory=dict)
    #: kernel-launch time the executor adds to every GPU expert, seconds
    expert_launch_s: float = 0.0
    #: kernel-launch time of the layer's shared experts, seconds
    shared_launch_s: float = 0.0
    #: request id of every token row
    requests: np.ndarray | None = None
    #: context length the layer's attention reads (the step's longest sequence, positions + 1; 0: unknown)
    context: int = 0
    #: the last :meth:`substituted` call's rewrites and result (the system and the executor both ask)
    _rewritten: tuple[Sequence, "LayerView"] | None = field(default=None, repr=False, compare=False)

    @property
    def tokens(self) -> int:
        return len(self.experts)  # the rows of a 2-D array, as a Python int

    @property
    def num_layers(self) -> int:
        return self.cache.num_layers

    def resident(self, expert: int) -> bool:
        return expert in self.cache.resident[self.layer]

    def substituted(self, substitutions: Sequence[tuple[int, int, int]]) -> "LayerView":
        """This view with the routing rewritten: (token row, top-k slot, new expert) each."""
        if not substitutions:
            return self
        if self._rewritten is not None and (self._rewritten[0] is substitutions
                                            or self._rewritten[0] == substitutions):
            return self._rewritten[1]
        experts = self.experts.copy()
        if isinstance(substitutions, Substitutions):  # each entry once: one assignment sets them all
            experts[substitutions.rows, substitutions.slots] = substitutions.experts
        else:
            for row, slot, expert in substitutions:
                experts[row, slot] = expert
        active, counts = active_experts(experts, self.cache_experts())
        # dataclasses.replace without its per-call field introspection (planning substitutes every layer)
        view = LayerView(*_view_fields_of(self))
        view.experts, view.active, view.counts = experts, active, counts
        self._rewritten = (kept_rewrites(substitutions), view)
        return view

    def cache_experts(self) -> int:
        return self.costs.model.num_experts


_VIEW_FIELDS = tuple(f.name for f in dataclasses.fields(LayerView) if f.name != "_rewritten")
#: the values of :data:`_VIEW_FIELDS` of a view, in one call
_view_fields_of = operator.attrgetter(*_VIEW_FIELDS)


def layer_view(step: int, layer: int, phase: str, experts: np.ndarray, active: list[int], counts: list[int],
               cache: CacheState, costs: CostModel, weights: np.ndarray | None, scores: np.ndarray | None,
               predictors: dict[str, list[np.ndarray]], now: float, arrivals: dict[int, float],
               expert_launch_s: float, shared_launch_s: float, requests: np.ndarray | None,
               context: int) -> LayerView:
    """``LayerView(...)`` with every field given, its fields set without calling the class: an executor makes
    a view for every layer, and calling a class costs about as much again as setting the fields."""
    view = _new_view(LayerView)
    view.step = step
    view.layer = layer
    view.phase = phase
    view.experts = experts
    view.active = active
    view.counts = counts
    view.cache = cache
    view.costs = costs
    view.weights = weights
    view.scores = scores
    view.predictors = predictors
    view.now = now
    view.arrivals = arrivals
    view.expert_launch_s = expert_launch_s
    view.shared_launch_s = shared_launch_s
    view.requests = requests
    view.context = context
    view._rewritten = None
    return view


_new_view = object.__new__


def active_experts(experts: np.ndarray, num_experts: int) -> tuple[list[int], list[int]]:
    """Distinct experts of a layer, most tokens first (ties: lower id), with their token counts."""
    if experts.shape[0] == 1:
        row = experts[0].tolist()
        if len(set(row)) == len(row):
            return row, [1] * len(row)
    counts = np.bincount(experts.ravel(), minlength=num_experts)
    ids = np.flatnonzero(counts)
    order = ids[np.argsort(-counts[ids], kind="stable")]
    return order.tolist(), counts[order].tolist()


def token_mean(scores: np.ndarray) -> np.ndarray:
    """Mean router scores over the token rows, in float64 (``ndarray.mean``'s sum and division); one
    row is its own mean (a decode layer's every time), taken without the reduction."""
    if scores.shape[0] == 1:
        return scores[0].astype(np.float64)
    scores = scores.astype(np.float64)
    return np.add.reduce(scores, axis=0) / scores.shape[0]


def highest(scores: np.ndarray, p: int) -> np.ndarray:
    """Ids of the ``p`` highest scores, highest first, ids ascending among ties (a stable sort's first p);
    only the scores at least the p-th highest are sorted."""
    if p <= 0:
        return np.zeros(0, dtype=np.intp)
    if p >= len(scores):
        return np.argsort(-scores, kind="stable")
    near = np.flatnonzero(scores >= np.partition(scores, len(scores) - p)[len(scores) - p])
    return near[np.argsort(-scores[near], kind="stable")][:p]


def highest_set(scores: np.ndarray, p: int) -> np.ndarray:
    """The ids :func:`highest` picks, in no particular order (for updates where only the set matters):
    without ties at the p-th score, the scores at least the p-th highest, unsorted."""
    if 0 < p < len(scores):
        near = np.flatnonzero(scores >= np.partition(scores, len(scores) - p)[len(scores) - p])
        if near.size == p:
            return near
    return highest(scores, p)


class PerTokens(dict):
    """A cost model's figures by token count, each computed once: a plain lookup on a policy's per-layer path
    (``CostModel``'s own memo costs a call and a tuple key). :meth:`of` starts afresh for another cost model."""

    def __init__(self, costs: CostModel, compute) -> None:
        super().__init__()
        self.costs, self.compute = costs, compute

    def __missing__(self, tokens: int):
        value = self[tokens] = self.compute(self.costs, tokens)
        return value

    @classmethod
    def of(cls, current: PerTokens | None, costs: CostModel, compute) -> PerTokens:
        return current if current is not None and current.costs is costs else cls(costs, compute)


def expert_times(costs: CostModel, tokens: int) -> tuple[float, float]:
    """(GPU kernel, CPU) seconds of one expert with ``tokens`` tokens, launches not included (a
    :class:`PerTokens` compute function)."""
    return costs.gpu_expert(tokens), costs.cpu_expert(tokens)


@dataclass(slots=True, init=False)
class LayerPlan:
    """What the executor does for one layer, in order: evict, load, compute, prefetch."""

    #: experts computed on the GPU, in execution order
    gpu: list[int]
    #: experts computed on the CPU pool, in execution order
    cpu: list[int]
    #: demand loads into this layer's cache slots (a subset of ``gpu`` neither resident nor in flight)
    loads: list[int]
    #: GPU experts streamed through the staging buffers (ping-pong, 000 Alg. 1): loaded, used, not cached
    streamed: list[int]
    #: (layer, expert) loads for later use, queued behind demand loads
    prefetches: list[tuple[int, int]]
    #: (layer, expert) to drop before loading, making room
    evictions: list[tuple[int, int]]
    #: evicted (layer, expert) whose weights are copied device-to-host first (mixtral-offloading's swap);
    #: the i-th follows the i-th demand load on the copy engine, in stream order
    writebacks: list[tuple[int, int]]
    #: (token row, slot in top-k, new expert) rewrites of the routing (a list, or :class:`Substitutions`)
    substitutions: Sequence[tuple[int, int, int]]
    #: experts whose CPU computation overlaps the next layer (001 Sec. 4)
    deferred: list[int]
    #: extra time on the critical path, seconds, by breakdown category ("predict", "cache_management")
    overhead_s: dict[str, float]
    #: submit ``prefetches`` once this layer's GPU experts finish instead of at plan time (000 Sec. IV-E)
    prefetch_after_gpu: bool = False
    #: drop prefetches still queued (not yet on the wire) before this plan's loads (004 Sec. 5.2)
    cancel_queued_prefetches: bool = False
    #: None: unused. Seconds of a next-layer prediction on the GPU stream (004 Sec. 4.2, GPU parts (2)-(4)):
    #: the GPU experts resident at plan time run first, then the prediction (breakdown ``predict``), then
    #: ``prefetches`` are submitted, then the other GPU experts as their copies land. Overrides
    #: ``prefetch_after_gpu``; applies even with no prefetches (the prediction ran, all it named was there)
    prefetch_after_predict: float | None = None

    # written out (empty lists and dict by default): every layer makes a plan, and a list literal costs a
    # third of a default_factory call
    def __init__(self, gpu: list[int] | None = None, cpu: list[int] | None = None, loads: list[int] | None = None,
                 streamed: list[int] | None = None, prefetches: list[tuple[int, int]] | None = None,
                 evictions: list[tuple[int, int]] | None = None, writebacks: list[tuple[int, int]] | None = None,
                 substitutions: Sequence[tuple[int, int, int]] | None = None, deferred: list[int] | None = None,
                 overhead_s: dict[str, float] | None = None, prefetch_after_gpu: bool = False,
                 cancel_queued_prefetches: bool = False, prefetch_after_predict: float | None = None) -> None:
        self.gpu = [] if gpu is None else gpu
        self.cpu = [] if cpu is None else cpu
        self.loads = [] if loads is None else loads
        self.streamed = [] if streamed is None else streamed
        self.prefetches = [] if prefetches is None else prefetches
        self.evictions = [] if evictions is None else evictions
        self.writebacks = [] if writebacks is None else writebacks
        self.substitutions = [] if substitutions is None else substitutions
        self.deferred = [] if deferred is None else deferred
        self.overhead_s = {} if overhead_s is None else overhead_s
        self.prefetch_after_gpu = prefetch_after_gpu
        self.cancel_queued_prefetches = cancel_queued_prefetches
        self.prefetch_after_predict = prefetch_after_predict


def split_plan(gpu: list[int], cpu: list[int]) -> LayerPlan:
    """``LayerPlan(gpu, cpu)``, every other field empty or off, made without calling the class (a plan for
    every layer: calling a class costs about a fifth of the plan)."""
    plan = _new_plan(LayerPlan)
    plan.gpu = gpu
    plan.cpu = cpu
    plan.loads = []
    plan.streamed = []
    plan.prefetches = []
    plan.evictions = []
    plan.writebacks = []
    plan.substitutions = []
    plan.deferred = []
    plan.overhead_s = {}
    plan.prefetch_after_gpu = False
    plan.cancel_queued_prefetches = False
    plan.prefetch_after_predict = None
    return plan


_new_plan = object.__new__


@dataclass
class RunContext:
    """What a system learns once, before the first step."""

    model: ModelSpec
    costs: CostModel
    #: per-layer slot quotas of the cache
    capacity: list[int]
    trace_path: str | None = None
    #: model-wide slot limit when the cache is one pool (None: the quotas alone)
    pool: int | None = None
    seed: int = 0
    #: columns the trace carries (a policy that needs a missing one refuses)
    columns: tuple[str, ...] = ()
    #: notes the system wants in the report (fallbacks it took, for instance)
    notes: list[str] = field(default_factory=list)
    #: state components of this run share, by a key of their choosing (MoE-Infinity's prefetch and cache, one
    #: activation tracker): it lives and dies with the run, so no run sees another's
    shared: dict[str, Any] = field(default_factory=dict)


class Component:
    """A policy part with documented dataclass fields as its parameters.

    Subclasses are dataclasses; their fields are reachable on the command line as
    ``--set <role>.<field>=value``. ``name`` is the registry name.
    """

    name: ClassVar[str] = ""
    role: ClassVar[str] = ""
    #: optional trace columns the component reads from its views (``weights``, ``scores``, ``pred_next_layer``,
    #: ...): views carry only the columns some component lists; one the trace lacks stays None (``configure``
    #: may refuse to run: ``ctx.columns`` lists the trace's)
    columns: ClassVar[tuple[str, ...]] = ()
    #: the columns of ``columns`` it cannot run without, each with why (:meth:`check_columns` refuses a trace
    #: that lacks one, before the run: a portfolio member stopped before its first step is refused too)
    requires: ClassVar[dict[str, str]] = {}
    #: the step phases in which the component acts (a decode-only one leaves prefill steps alone)
    phases: ClassVar[tuple[str, ...]] = ("prefill", "decode")
    #: parameters documented "negative: ...": every finite negative value means what their negative default
    #: means (the others take their negative default by name and no other negative)
    any_negative: ClassVar[tuple[str, ...]] = ()

    def for_model(self, model: ModelSpec) -> None:
        """Called once the model is known, before GPU memory is planned: settle defaults that depend on the
        model and size what the memory plan reads (a prefetch buffer, say); default does nothing."""

    def configure(self, ctx: RunContext) -> None:
        """Called once before the run; default does nothing."""

    def check_columns(self, ctx: RunContext) -> None:
        """Refuse a trace that lacks a column of :attr:`requires` (called before :meth:`configure`)."""
        for column, why in self.requires.items():
            require_column(ctx, column, f"{self.role} '{self.name}'", why)

    @classmethod
    def parameters(cls) -> dict[str, Any]:
        if not dataclasses.is_dataclass(cls):
            return {}
        return {f.name: field_default(f) for f in dataclasses.fields(cls) if not f.name.startswith("_") and f.init}

    @classmethod
    def parameter_types(cls) -> dict[str, Any]:
        """Each parameter's annotation as a type (``int | None``, ``list[int]``), where it resolves; a ``--set``
        value of a parameter whose default is None or a list is read by it."""
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # an annotation naming what its module cannot resolve: coerce by the default alone
            return {}
        return {name: hints[name] for name in cls.parameters() if name in hints}

    def set_param(self, key: str, raw: str) -> None:
        params = self.parameters()
        if key not in params:
            valid = [f"{self.role}.{p}" for p in params]
            raise ConfigError(f"unknown parameter '{self.role}.{key}' for {self.role} '{self.name}'",
                              fix=f"{did_you_mean(f'{self.role}.{key}', valid)}valid: {', '.join(valid) or 'none'}")
        if key in self.any_negative and isinstance(raw, str):
            try:
                value = type(params[key])(raw)
            except ValueError:
                value = None
            if value is not None and math.isfinite(value) and value < 0:
                setattr(self, key, value)
                return
        setattr(self, key, coerce(raw, params[key], f"{self.role}.{key}", self.parameter_types().get(key)))


def require_column(ctx: RunContext, column: str, who: str, why: str) -> None:
    """Refuse to run without ``column``: one line naming the trace, the column and the fix."""
    if ctx.columns and column not in ctx.columns:
        raise MissingColumnError(f"{who} needs the trace column '{column}' ({why}), which this trace lacks",
                                 source=ctx.trace_path, field=column,
                                 fix=f"capture or synthesize the trace with '{column}' (moesim trace synth writes it "
                                     f"by default), or pick another component with --set")


def field_default(f: dataclasses.Field) -> Any:
    """A dataclass field's default, its factory's value for one made by a factory (a list, say)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


#: what ``--set`` values of these types are read as, where a parameter's default does not say (None)
_SAMPLES: dict[Any, Any] = {bool: False, int: 0, float: 0.0, str: ""}


def coerce(raw: Any, default: Any, key: str, kind: Any = None) -> Any:
    """Convert a ``--set`` string to the parameter's type: ``kind``, its annotation, where it says more than
    the default does (``int | None``, ``list[int]``, ``float`` with a whole-number default), else the type of
    the default."""
    if not isinstance(raw, str):
        return raw
    if kind is not None:
        typed = _coerce_annotated(raw, default, key, kind)
        if typed is not _UNTYPED:
            return typed
    try:
        if isinstance(default, bool):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if isinstance(default, (int, float)):
            value = type(default)(raw)
            # a negative default is the parameter's "choose for me" (-1: the paper's value for the model, say):
            # it may be asked for again by name; any other negative is refused
            return value if value == default < 0 else _in_range(value, key)
        if default is None:
            if raw.lower() in ("true", "false"):
                return raw.lower() == "true"
            for cast in (int, float):
                try:
                    return cast(raw)
                except ValueError:
                    pass
            return None if raw.lower() in ("none", "null") else raw
    except ValueError:
        kind = type(default).__name__
        fix = "give true or false (or 1/0, yes/no, on/off)" if kind == "bool" else \
            f"give a {'whole number' if kind == 'int' else kind}, e.g. {default!r}"
        raise ConfigError(f"'{raw}' is not a valid {kind}", field=key, fix=fix) from None
    return raw


_UNTYPED = object()


def _coerce_annotated(raw: str, default: Any, key: str, kind: Any) -> Any:
    """:func:`coerce` by an annotation: an optional type (``none`` or ``null`` for None), a list or tuple
    (``1,2,3`` or ``[1, 2, 3]``, each item of the item type), or a number type the default does not have; or
    ``_UNTYPED`` where the default's type says as much."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if raw.strip().lower() in ("none", "null"):
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            return _UNTYPED
        return coerce(raw, _SAMPLES.get(inner[0], default) if default is None else default, key, inner[0])
    if origin in (list, tuple) or kind in (list, tuple):
        items = raw.strip()
        if items[:1] + items[-1:] in ("[]", "()"):
            items = items[1:-1]
        item_kind = args[0] if args and args[0] is not Ellipsis else None
        values = [coerce(item.strip(), _SAMPLES.get(item_kind), f"{key}[{i}]", item_kind)
                  for i, item in enumerate(items.split(",")) if items.strip()]
        return tuple(values) if (origin or kind) is tuple else values
    if kind is float and isinstance(default, int) and not isinstance(default, bool):
        return coerce(raw, float(default), key)  # a float parameter whose default is written whole
    if default is None and kind in _SAMPLES:
        return coerce(raw, _SAMPLES[kind], key) if kind is not str else raw
    return _UNTYPED


#: the largest value a numeric ``--set`` parameter takes (counts, sizes, microseconds)
SET_MAXIMUM = 2**40


def _in_range(value: int | float, key: str) -> int | float:
    """Numeric parameters are counts, sizes, times and fractions: finite, not negative, not absurd."""
    if not math.isfinite(value):
        raise ConfigError(f"{value} is not a finite number", field=key, fix="give a finite value")
    if value < 0:
        raise ConfigError(f"{value} is negative", field=key, fix="give a value >= 0")
    if value > SET_MAXIMUM:
        raise ConfigError(f"{value:g} is beyond the limit of {SET_MAXIMUM:g}", field=key, fix="give a smaller value")
    return value
