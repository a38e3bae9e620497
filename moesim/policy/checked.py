"""A user's own policies, checked as they run.

The catalogue's components and systems keep the policy interface by construction (and their tests); one of a
user's own is checked as it runs: each method's result where a system reads it, the view unchanged by the call,
the method's own errors named; and a system class of one's own, its whole plan. Each fault is one line
(:class:`~moesim.policy.base.PolicyError`) naming the component and method, the step and layer, and the fix.
"""

from __future__ import annotations

import numbers
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from moesim.errors import MoesimError
from moesim.policy.base import Component, LayerPlan, LayerView, PolicyError, Substitutions

if TYPE_CHECKING:
    from moesim.policy.systems import ComposedSystem


def is_catalogue(cls: type) -> bool:
    """Whether ``cls`` is moesim's own (a catalogue system or component), not a user's."""
    module = getattr(cls, "__module__", None) or ""
    return module == "moesim" or module.startswith("moesim.")


def check_users_policies(system: ComposedSystem) -> None:
    """Check every component of ``system`` that is not the catalogue's as it runs, and the plans of a system
    class of one's own (the catalogue's run as they are)."""
    unchecked = False
    for role, component in system.components.items():
        if is_catalogue(type(component)):
            continue
        _check_has_methods(role, component)
        for method, check in (*_RESULT_CHECKS.get(role, {}).items(), *_COMMON_CHECKS.items()):
            if callable(getattr(type(component), method, None)):
                try:
                    setattr(component, method, _CheckedMethod(component, role, method, check))
                except AttributeError:  # __slots__: the method stays as it is, and the whole plan is checked
                    unchecked = True
    # engine.check is off by default: an unchecked component's fault (an eviction of an expert not resident)
    # otherwise stopped the engine with an assertion, an "internal error" naming no policy
    if unchecked or not is_catalogue(type(system)):
        system.plan = _CheckedPlan(system)  # type: ignore[method-assign]


#: per role, the methods one of which a component must define (the base class's does nothing, or raises), and
#: how to define it
_REQUIRED = {
    "assign": (("split",), "split(self, view) returning (gpu, cpu), two lists that hold view.active"),
    "cache": (("victims", "initial"), "victims(self, view, layer, n, protected, incoming=None) returning up to n "
                                      "resident experts to evict, or, for a cache that never evicts, "
                                      "initial(self, layer, capacity) returning the experts it keeps"),
    "prefetch": (("candidates",), "candidates(self, view) returning (layer, expert) pairs to load ahead"),
    "substitute": (("rewrite",), "rewrite(self, view) returning (token row, top-k slot, new expert) rewrites"),
    "defer": (("choose",), "choose(self, view, plan) returning experts of plan.cpu to finish one layer late"),
}


def _check_has_methods(role: str, component: Component) -> None:
    """Refuse a user's component that defines none of its role's methods (it would do nothing, or fail at the
    first layer)."""
    if role not in _REQUIRED:
        return
    methods, how = _REQUIRED[role]
    base = next(c for c in type(component).__mro__ if is_catalogue(c) and getattr(c, "role", "") == role
                and c.__dict__.get("name") is None)
    if all(getattr(type(component), m, None) is getattr(base, m, None) for m in methods):
        raise PolicyError(f"has no {' or '.join(methods)} of its own",
                          source=f"{role} '{component.name}' ({type(component).__name__})", fix=f"define {how}")


def _fault(who: str, view: LayerView | None, problem: str, fix: str) -> PolicyError:
    where = f"at step {view.step}, layer {view.layer}, " if view is not None else ""
    return PolicyError(f"{where}{problem}", source=who, fix=fix)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _iterable(value: Any) -> bool:
    return value is not None and not isinstance(value, (str, bytes, Mapping)) and hasattr(value, "__iter__")


def _ints(who: str, view: LayerView | None, value: Any, what: str, fix: str) -> list[int]:
    """``value`` as a list of ints (numpy integers and arrays taken too); one line naming what else it holds."""
    if not _iterable(value):
        raise _fault(who, view, f"returned {_short(value)} as {what}, not a list of expert ids", fix)
    out = []
    for e in value:
        if not _is_int(e):
            raise _fault(who, view, f"returned {_short(e)} in {what}, not an expert id (an int)", fix)
        out.append(int(e))
    return out


def _pairs(who: str, view: LayerView | None, value: Any, what: str, fix: str) -> list[tuple[int, int]]:
    """``value`` as a list of (layer, expert) tuples of ints; one line naming an item that is none."""
    if not _iterable(value):
        raise _fault(who, view, f"returned {_short(value)} as {what}, not a list of (layer, expert) pairs", fix)
    out = []
    for item in value:
        if not (_iterable(item) and len(item) == 2 and all(map(_is_int, item))):
            raise _fault(who, view, f"returned {_short(item)} in its list, not a (layer, expert) pair of ints", fix)
        out.append((int(item[0]), int(item[1])))
    return out


def _returned_none(who: str, view: LayerView | None, fix: str, nothing: str) -> PolicyError:
    return _fault(who, view, "returned None", f"{fix}; did you forget `return`? ({nothing})")


def coverage_fault(active: Sequence[int], gpu: Sequence[int], cpu: Sequence[int],
                   deferred: Sequence[int] = ()) -> str:
    """What is wrong with computing ``gpu`` on the GPU, ``cpu`` on the CPU and ``deferred`` after the layer when
    ``active`` are routed ("" when each routed expert is computed exactly once, on one side)."""
    seen: dict[int, str] = {}
    for side, experts in (("on the GPU", gpu), ("on the CPU", cpu), ("deferred", deferred)):
        for e in experts:
            if e in seen:
                return f"plans expert {e} twice " + (side if seen[e] == side else f"({seen[e]} and {side})")
            seen[e] = side
    routed = set(active)
    stray = [e for e in seen if e not in routed]
    if stray:
        return (f"plans expert{'s' if len(stray) > 1 else ''} {', '.join(map(str, stray))} not routed at this "
                f"layer (routed: {', '.join(map(str, active))})")
    missing = [e for e in active if e not in seen]
    if missing:
        return f"leaves out routed expert{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
    return ""


_SPLIT_FIX = "return (gpu, cpu): two lists that hold each expert of view.active once, e.g. (list(view.active), [])"
_VICTIMS_FIX = ("return at most n experts of view.cache.resident[layer], none of them in protected (in use at "
                "this layer or on its way), each once")
_POOL_FIX = ("return at most n (layer, expert) pairs, each resident (view.cache.resident[layer]) and none in "
             "protected, each once")
_CANDIDATES_FIX = "return a list of (layer, expert) pairs, layer in 0..{L} and expert in 0..{E}, each once"


def _check_split(who: str, view: LayerView, out: Any) -> tuple[list[int], list[int]]:
    if out is None:
        raise _returned_none(who, view, _SPLIT_FIX, "(list(view.active), []) puts every expert on the GPU")
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and not any(map(_is_int, out))):
        raise _fault(who, view, f"returned {_short(out)}, not a pair (gpu, cpu)", _SPLIT_FIX)
    gpu = _ints(who, view, out[0], "the GPU list", _SPLIT_FIX)
    cpu = _ints(who, view, out[1], "the CPU list", _SPLIT_FIX)
    problem = coverage_fault(view.active, gpu, cpu)
    if problem:
        raise _fault(who, view, problem, _SPLIT_FIX)
    return gpu, cpu


def _check_victims(who: str, view: LayerView, out: Any, layer: int, n: int, protected: set[int],
                   incoming: list[int] | None = None) -> list[int]:
    if out is None:
        raise _returned_none(who, view, _VICTIMS_FIX, "[] evicts nothing")
    victims = _ints(who, view, out, "its victims", _VICTIMS_FIX)
    if len(victims) > max(n, 0):
        raise _fault(who, view, f"returned {len(victims)} experts for n={n}", _VICTIMS_FIX)
    resident, seen = view.cache.resident[layer], set()
    for e in victims:
        if e in seen:
            raise _fault(who, view, f"returned expert {e} twice", _VICTIMS_FIX)
        if e in protected:
            raise _fault(who, view, f"returned expert {e}, which is protected (in use at this layer or on its way)",
                         _VICTIMS_FIX)
        if e not in resident:
            raise _fault(who, view, f"returned expert {e}, which is not resident in layer {layer}", _VICTIMS_FIX)
        seen.add(e)
    return victims


def _check_pool_victims(who: str, view: LayerView, out: Any, n: int, protected: set[tuple[int, int]],
                        layer: int) -> list[tuple[int, int]]:
    if out is None:
        raise _returned_none(who, view, _POOL_FIX, "[] evicts nothing")
    pairs = _pairs(who, view, out, "its victims", _POOL_FIX)
    if len(pairs) > max(n, 0):
        raise _fault(who, view, f"returned {len(pairs)} experts for n={n}", _POOL_FIX)
    seen: set[tuple[int, int]] = set()
    for pair in pairs:
        if pair in seen:
            raise _fault(who, view, f"returned {pair} twice", _POOL_FIX)
        if pair in protected:
            raise _fault(who, view, f"returned {pair}, which is protected", _POOL_FIX)
        if not 0 <= pair[0] < view.num_layers or pair[1] not in view.cache.resident[pair[0]]:
            raise _fault(who, view, f"returned {pair}, which is not resident", _POOL_FIX)
        seen.add(pair)
    return pairs


def _check_admission(who: str, view: LayerView, out: Any, layer: int, missing: list[int]) -> list[int]:
    fix = "return the experts of missing, each once, in the order they should get a slot"
    if out is None:
        raise _returned_none(who, view, fix, "return missing to keep their order")
    order = _ints(who, view, out, "its order", fix)
    if sorted(order) != sorted(missing):
        raise _fault(who, view, f"returned {_short(order)} for missing experts {_short(list(missing))}", fix)
    return order


def _check_candidates(who: str, view: LayerView, out: Any) -> list[tuple[int, int]]:
    layers, experts = view.num_layers, view.cache_experts()
    fix = _CANDIDATES_FIX.format(L=layers - 1, E=experts - 1)
    if out is None:
        raise _returned_none(who, view, fix, "[] prefetches nothing")
    pairs, seen = _pairs(who, view, out, "its candidates", fix), set()
    for layer, expert in pairs:
        if not 0 <= layer < layers:
            raise _fault(who, view, f"returned ({layer}, {expert}): layer {layer} outside 0..{layers - 1}", fix)
        if not 0 <= expert < experts:
            raise _fault(who, view, f"returned ({layer}, {expert}): expert {expert} outside 0..{experts - 1}", fix)
        if (layer, expert) in seen:
            raise _fault(who, view, f"returned ({layer}, {expert}) twice", fix)
        seen.add((layer, expert))
    return pairs


def _check_rewrite(who: str, view: LayerView, out: Any) -> Sequence[tuple[int, int, int]]:
    fix = (f"return a list of (token row, top-k slot, new expert), row in 0..{view.tokens - 1}, slot in "
           f"0..{view.experts.shape[1] - 1}, expert in 0..{view.cache_experts() - 1}, each (row, slot) once")
    if out is None:
        raise _returned_none(who, view, fix, "[] rewrites nothing")
    if isinstance(out, Substitutions):
        return out
    if _iterable(out):
        out = list(out)  # read twice below: a generator once
    problem = _rewrites_fault(view, out, "its rewrites")
    if problem:
        raise _fault(who, view, problem, fix)
    return [(int(row), int(slot), int(e)) for row, slot, e in out]


def _check_choose(who: str, view: LayerView, out: Any, plan: LayerPlan) -> list[int]:
    fix = "return experts of plan.cpu (each once) whose results may arrive one layer late"
    if out is None:
        raise _returned_none(who, view, fix, "[] defers nothing")
    chosen = _ints(who, view, out, "its choice", fix)
    if len(set(chosen)) < len(chosen) or not set(chosen) <= set(plan.cpu):
        raise _fault(who, view, f"returned {_short(chosen)}, not distinct experts of plan.cpu "
                                f"{_short(list(plan.cpu))}", fix)
    return chosen


def _check_initial(who: str, view: None, out: Any, layer: int, capacity: int) -> list[int]:
    fix = "return at most capacity distinct expert ids, the experts resident before the first step"
    if out is None:
        raise _returned_none(who, None, fix, "[] starts the layer empty")
    experts = _ints(who, None, out, "its initial experts", fix)
    if len(set(experts)) < len(experts) or len(experts) > capacity:
        raise _fault(who, None, f"initial({layer}, {capacity}) returned {_short(experts)}: "
                                f"{'an expert twice' if len(set(experts)) < len(experts) else 'more than capacity'}",
                     fix)
    return experts


#: per role, each method whose result a system reads, and its check (called as check(who, view, out, *args))
_RESULT_CHECKS: dict[str, dict[str, Callable[..., Any]]] = {
    "assign": {"split": _check_split},
    "cache": {"victims": _check_victims, "pool_victims": _check_pool_victims,
              "admission_order": _check_admission, "initial": _check_initial, "touch": None, "spread": None},
    "prefetch": {"candidates": _check_candidates},
    "substitute": {"rewrite": _check_rewrite},
    "defer": {"choose": _check_choose},
}
#: methods of every role checked for their own errors only
_COMMON_CHECKS: dict[str, Callable[..., Any] | None] = {"configure": None, "for_model": None}

_READ_ONLY_FIX = ("a view is read-only, the engine plans and runs the layer from it: keep state in the component's "
                  "own fields, and copy what you would change (sorted(view.active), set(view.cache.resident[layer]))")


class _ViewSnapshot:
    """What a view held before a policy's call, to tell whether the call changed it: its routing, this layer's
    resident and in-flight experts as sets, every layer's as counts (cheap enough to take at every call)."""

    __slots__ = ("fields", "copies", "resident", "in_flight", "counts")

    def __init__(self, view: LayerView) -> None:
        cache = view.cache
        self.fields = (view.experts, view.active, view.counts, view.arrivals, view.cache)
        self.copies = (view.experts.copy(), list(view.active), list(view.counts), dict(view.arrivals))
        self.resident, self.in_flight = set(cache.resident[view.layer]), set(cache.in_flight[view.layer])
        self.counts = ([len(r) for r in cache.resident], [len(f) for f in cache.in_flight])

    def changed(self, view: LayerView) -> str:
        """The first part of ``view`` that is not as it was ("" when none)."""
        names = ("view.experts", "view.active", "view.counts", "view.arrivals", "view.cache")
        now = (view.experts, view.active, view.counts, view.arrivals, view.cache)
        for name, before, after in zip(names, self.fields, now):
            if before is not after:
                return f"replaced {name}"
        experts, active, counts, arrivals = self.copies
        if not np.array_equal(view.experts, experts):
            return "changed view.experts"
        for name, before, after in zip(names[1:4], (active, counts, arrivals),
                                       (view.active, view.counts, view.arrivals)):
            if before != after:
                return f"changed {name}"
        cache = view.cache
        for name, sets, here, counts in (("resident", cache.resident, self.resident, self.counts[0]),
                                         ("in_flight", cache.in_flight, self.in_flight, self.counts[1])):
            if sets[view.layer] != here:
                return f"changed view.cache.{name}[{view.layer}]"
            for layer, (held, count) in enumerate(zip(sets, counts)):
                if len(held) != count:
                    return f"changed view.cache.{name}[{layer}]"
        return ""


def users_frame(err: BaseException) -> traceback.FrameSummary | None:
    """Where ``err`` was raised in the user's code: the deepest frame outside moesim, Python and its packages
    (else the deepest frame; None without a traceback)."""
    frames = traceback.extract_tb(err.__traceback__)
    prefixes = tuple({os.path.join(p, "") for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    moesim_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
    own = [f for f in frames if not f.filename.startswith("<frozen")
           and not os.path.abspath(f.filename).startswith((moesim_dir, *prefixes))]
    return (own or frames)[-1] if frames else None


def _own_line(err: BaseException) -> str:
    frame = users_frame(err)
    return f" ({os.path.basename(frame.filename)}:{frame.lineno}, in {frame.name})" if frame else ""


def _raised(who: str, view: LayerView | None, err: Exception) -> PolicyError:
    text = " ".join(str(err).split())
    return _fault(who, view, f"raised {type(err).__name__}{': ' + text if text else ''}{_own_line(err)}",
                  f"{_unread_column(view, err) or _OWN_CODE}; its traceback: --debug on the command line, this error's __cause__ in Python")


_OWN_CODE = "the fault is in the policy's own code"


def _unread_column(view: LayerView | None, err: Exception) -> str:
    """How to get the optional trace column whose absence from ``view`` likely raised ``err`` ("" when none
    is likely): a view carries weights, scores and predictions only when a component lists them in its
    ``columns``, and a policy written from the trace's schema read ``view.weights`` as None."""
    from moesim.trace.schema import PREDICTOR_COLUMNS
    if view is None:
        return ""
    if isinstance(err, (AttributeError, TypeError)) and "NoneType" in str(err):
        absent = [name for name in ("weights", "scores") if getattr(view, name) is None]
        what = " and ".join(f"view.{name}" for name in absent) + (" are" if len(absent) > 1 else " is") + " None"
    elif isinstance(err, KeyError) and err.args and err.args[0] in PREDICTOR_COLUMNS \
            and err.args[0] not in view.predictors:
        absent = [err.args[0]]
        what = f"view.predictors has no {err.args[0]!r}"
    else:
        return ""
    if not absent:
        return ""
    return (f"{what} here: a view carries an optional trace column only when a component lists it; add "
            f"columns = {tuple(absent)!r} to the class, for a trace that has them (RunContext.columns in "
            "configure lists the trace's)")


class _CheckedMethod:
    """A user's component method as a system calls it: its errors named, the view left as it was, its result
    checked (and given to the system as plain lists of ints)."""

    __slots__ = ("component", "method", "check", "who", "names")

    def __init__(self, component: Component, role: str, method: str, check: Callable[..., Any] | None) -> None:
        import inspect
        self.component, self.method, self.check = component, method, check
        self.who = f"{role} '{component.name}' ({type(component).__name__}.{method})"
        try:  # the arguments' names, as the method calls them
            self.names = [p for p in inspect.signature(getattr(type(component), method)).parameters][1:]
        except (TypeError, ValueError):
            self.names = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        view = args[0] if args and isinstance(args[0], LayerView) else None
        before = _ViewSnapshot(view) if view is not None else None
        # lists, sets and plans handed in are the system's own (touch's ``used`` is the plan's GPU experts)
        given = [(i, _copied(a)) for i, a in enumerate(args) if isinstance(a, (list, set, LayerPlan))]
        try:
            out = getattr(type(self.component), self.method)(self.component, *args, **kwargs)
        except MoesimError:
            raise
        except Exception as err:
            raise _raised(self.who, view, err) from err
        if before is not None:
            changed = before.changed(view)
            if changed:
                raise _fault(self.who, view, changed, _READ_ONLY_FIX)
        for i, copy in given:
            if _copied(args[i]) != copy:
                name = self.names[i] if i < len(self.names) else f"#{i + 1}"
                raise _fault(self.who, view, f"changed its argument {name}",
                             "arguments are the system's own (used is the plan's GPU experts): read them, or "
                             "change a copy (list(used), set(protected))")
        if self.check is None:
            return out
        if view is None:
            return self.check(self.who, None, out, *args, **kwargs)
        return self.check(self.who, view, out, *args[1:], **kwargs)


def _copied(value: Any) -> Any:
    """A copy of a list, a set or a plan's lists, to compare with after a policy's call."""
    if isinstance(value, LayerPlan):
        return tuple(list(getattr(value, f)) for f in ("gpu", "cpu", "loads", "streamed", "prefetches", "evictions",
                                                       "writebacks", "deferred"))
    return type(value)(value)


_PLAN_FIX = "see LayerPlan (moesim.policy.base) for what each field holds; ComposedSystem.plan makes a valid plan"
#: the fix of a fault of :func:`plan_fault`, by the words it starts with (a fault left out: :data:`_PLAN_FIX`)
_PLAN_FIXES = (
    (("plans expert", "leaves out routed"), "put each expert of view.active in exactly one of plan.gpu, plan.cpu "
                                            "and plan.deferred"),
    (("GPU expert",), "add it to plan.loads (evicting a resident expert not in use, plan.evictions, when the layer "
                      "is full) or plan.streamed, or compute it on the CPU (plan.cpu)"),
    (("evicts expert", "evicts an expert"), "evict each expert once, only experts of view.cache.resident[layer] "
                                            "that the layer does not compute on the GPU"),
    (("loads", "prefetches"), "load or prefetch each expert once, only one neither resident nor on its way, no "
                              "more than the layer's free slots plus what the plan evicts (plan.evictions); "
                              "stream the rest (plan.streamed)"),
)


def plan_fix(problem: str) -> str:
    """What to do about ``problem``, a fault of :func:`plan_fault`: the fields to change, then where a valid plan
    is made."""
    for starts, fix in _PLAN_FIXES:
        if problem.startswith(starts):
            return f"{fix}; {_PLAN_FIX}"
    return _PLAN_FIX


class _CheckedPlan:
    """The plan of a system class of one's own as the engine calls it: its errors named, the view left as it
    was, and the plan checked against the invariants every plan keeps (:func:`plan_fault`)."""

    __slots__ = ("system", "who")

    def __init__(self, system: ComposedSystem) -> None:
        self.system = system
        self.who = f"system '{system.name}' ({type(system).__name__}.plan)"

    def __call__(self, view: LayerView) -> LayerPlan:
        before = _ViewSnapshot(view)
        try:
            plan = type(self.system).plan(self.system, view)
        except MoesimError:
            raise
        except Exception as err:
            raise _raised(self.who, view, err) from err
        changed = before.changed(view)
        if changed:
            raise _fault(self.who, view, changed, _READ_ONLY_FIX)
        if not isinstance(plan, LayerPlan):
            raise _fault(self.who, view, f"returned {_short(plan)}, not a LayerPlan", _PLAN_FIX)
        if _iterable(plan.substitutions) and not isinstance(plan.substitutions, (Substitutions, list)):
            plan.substitutions = list(plan.substitutions)  # checked, then applied: a generator would be read once
        problem = plan_fault(view, plan)
        if problem:
            raise _fault(self.who, view, problem, plan_fix(problem))
        return _plain(plan)


def _plain(plan: LayerPlan) -> LayerPlan:
    """``plan`` with its lists as the engine reads them, plain lists of ints and of (layer, expert) tuples: a
    numpy array passed the checks (numpy integers are ints) and then failed in the engine's ``if plan.gpu``
    with "truth value of an array is ambiguous", naming no policy."""
    for name in ("gpu", "cpu", "loads", "streamed", "deferred"):
        setattr(plan, name, [int(e) for e in getattr(plan, name)])
    for name in ("prefetches", "evictions", "writebacks"):
        setattr(plan, name, [(int(layer), int(e)) for layer, e in getattr(plan, name)])
    if not isinstance(plan.substitutions, Substitutions):
        plan.substitutions = [(int(row), int(slot), int(e)) for row, slot, e in plan.substitutions]
    return plan


def _seconds_fault(plan: LayerPlan) -> str:
    """A plan's times that would move the clock back or nowhere sensible ("" when none): every
    ``overhead_s`` and the ``prefetch_after_predict`` prediction are finite seconds, none negative."""
    overhead = plan.overhead_s
    if not isinstance(overhead, Mapping) or not all(isinstance(k, str) for k in overhead):
        return f"plan.overhead_s is {_short(overhead)}, not a dict of breakdown category to seconds"
    for category, seconds in overhead.items():
        if not _is_seconds(seconds):
            return f"plan.overhead_s[{category!r}] is {_short(seconds)}, not finite seconds >= 0"
    predict = plan.prefetch_after_predict
    if predict is not None and not _is_seconds(predict):
        return f"plan.prefetch_after_predict is {_short(predict)}, not None or finite seconds >= 0"
    return ""


def _rewrites_fault(view: LayerView, rewrites: Any, subject: str = "plan.substitutions") -> str:
    """What is wrong with routing rewrites (``subject``: a plan's ``substitutions`` or a rewrite's result; ""
    when nothing): :class:`Substitutions`, or (token row, top-k slot, new expert) triples of ints within the
    layer's routing, each (row, slot) once."""
    if isinstance(rewrites, Substitutions):
        return ""
    if not _iterable(rewrites):
        return f"{subject} ({_short(rewrites)}) are not a list of (token row, top-k slot, new expert)"
    items = list(rewrites)
    if not items:
        return ""
    bounds, seen = (view.tokens, view.experts.shape[1], view.cache_experts()), set()
    for item in items:
        if not (_iterable(item) and len(item) == 3 and all(map(_is_int, item))):
            return f"{subject} hold {_short(item)}, not a (row, slot, expert) of ints"
        entry = tuple(int(x) for x in item)
        if not all(0 <= x < bound for x, bound in zip(entry, bounds)):
            return f"{subject} hold {entry}, outside the layer's routing"
        if entry[:2] in seen:
            return f"{subject} rewrite row {entry[0]}, slot {entry[1]} twice"
        seen.add(entry[:2])
    return ""


def _is_seconds(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and 0.0 <= float(value) < float("inf")


def plan_fault(view: LayerView, plan: LayerPlan) -> str:
    """What ``plan`` breaks of what every plan keeps ("" when nothing): each routed expert computed once, on one
    side; every GPU expert resident, on its way, loaded or streamed (in the GPU's order); evictions of resident experts not in use;
    loads and prefetches of experts not there yet, within the layer's slots and the pool; write-backs only of
    evicted experts; overheads and the prediction's time finite and not negative."""
    lists = {"gpu": plan.gpu, "cpu": plan.cpu, "loads": plan.loads, "streamed": plan.streamed,
             "deferred": plan.deferred}
    for name, value in lists.items():
        if not _iterable(value) or not all(map(_is_int, value)):
            return f"plan.{name} is {_short(value)}, not a list of expert ids"
    for name in ("prefetches", "evictions", "writebacks"):
        value = getattr(plan, name)
        if not _iterable(value) or not all(_iterable(p) and len(p) == 2 and all(map(_is_int, p)) for p in value):
            return f"plan.{name} is {_short(value)}, not a list of (layer, expert) pairs"
    problem = _seconds_fault(plan)
    if problem:
        return problem
    problem = _rewrites_fault(view, plan.substitutions)
    if problem:
        return problem
    routed = view.substituted(plan.substitutions) if len(plan.substitutions) else view
    problem = coverage_fault(routed.active, plan.gpu, plan.cpu, plan.deferred)
    if problem:
        return problem
    cache, layer, layers = view.cache, view.layer, view.num_layers
    evictions = [(int(l), int(e)) for l, e in plan.evictions]
    evicted = set(evictions)
    gpu = set(plan.gpu)
    if len(evicted) < len(evictions):
        return "evicts an expert twice"
    for lay, e in evictions:
        if not 0 <= lay < layers or e not in cache.resident[lay]:
            return f"evicts expert {e} of layer {lay}, which is not resident"
        if lay == layer and e in gpu:
            return f"evicts expert {e}, which it computes on the GPU at this layer"
    if not {(int(l), int(e)) for l, e in plan.writebacks} <= evicted:
        return "writes back an expert it does not evict"
    resident, in_flight = cache.resident[layer], cache.in_flight[layer]
    loads, streamed = [int(e) for e in plan.loads], set(plan.streamed)
    if len(set(loads)) < len(loads):
        return "loads an expert twice"
    for e in loads:
        if e not in gpu:
            return f"loads expert {e}, which it does not compute on the GPU (loads are demand loads)"
        if e in in_flight or (e in resident and (layer, e) not in evicted):
            return f"loads expert {e}, which is already {'on its way' if e in in_flight else 'resident'}"
    if streamed & set(loads):
        return "both loads and streams an expert"
    # each staging buffer passes to the streamed expert ``staging_slots`` later when the GPU has run the one
    # before, so the engine needs the streamed experts among the GPU's, once each, in the GPU's order
    if [e for e in plan.gpu if e in streamed] != [int(e) for e in plan.streamed]:
        return "streams experts that are not its GPU experts, once each, in the GPU's order (plan.streamed)"
    for e in plan.gpu:
        if not ((e in resident and (layer, e) not in evicted) or e in in_flight or e in loads or e in streamed):
            return (f"GPU expert {e} is neither resident, on its way, loaded (plan.loads) nor streamed "
                    "(plan.streamed)")
    taking: dict[int, int] = {layer: len(loads)} if loads else {}
    prefetched: set[tuple[int, int]] = set()
    for lay, e in plan.prefetches:
        lay, e = int(lay), int(e)
        if not 0 <= lay < layers or not 0 <= e < view.cache_experts():
            return f"prefetches expert {e} of layer {lay}, outside the model"
        if (lay, e) in prefetched or (lay == layer and e in loads):
            return f"loads expert {e} of layer {lay} twice"
        # once the layer's GPU work is done the staging buffer is free for the next stream, so filling a slot
        # then is a copy of its own (SMoE's cache fill at the prefill's end); before it, the same bytes race twice
        if lay == layer and e in streamed and not plan.prefetch_after_gpu:
            return (f"streams expert {e} and prefetches it at the same layer, both before its GPU work: two copies "
                    "of one expert (load it into its slot with plan.loads instead)")
        if e in cache.in_flight[lay] or (e in cache.resident[lay] and (lay, e) not in evicted):
            return f"prefetches expert {e} of layer {lay}, which is already there"
        prefetched.add((lay, e))
        taking[lay] = taking.get(lay, 0) + 1
    dropped: dict[int, int] = {}
    for lay, _ in evictions:
        dropped[lay] = dropped.get(lay, 0) + 1
    # slots of the prefetches a plan cancels free up first; which of them have started is the engine's to know,
    # so count every one in flight (but the layer's GPU experts, kept as its loads): a plan beyond even that
    # stopped the engine with an assertion, an "internal error" naming no policy
    cancelled = _cancellable(cache, layer, gpu) if plan.cancel_queued_prefetches else {}
    up_to = " at most" if cancelled else ""
    for lay, count in taking.items():
        free = cache.capacity[lay] - cache.used(lay) + dropped.get(lay, 0) + cancelled.get(lay, 0)
        if count > free:
            return (f"loads {count} expert{'s' if count > 1 else ''} into layer {lay}, which has{up_to} "
                    f"{max(free, 0)} free slot{'' if free == 1 else 's'} (evict first: plan.evictions)")
    if cache.pool is not None \
            and sum(taking.values()) > cache.pool - cache.held() + len(evictions) + sum(cancelled.values()):
        return f"loads {sum(taking.values())} experts into the model-wide pool beyond its {cache.pool} slots"
    return ""


def room_fault(cache: Any, layer: int, loads: Sequence[int], prefetches: Sequence[tuple[int, int]]) -> str:
    """What ``loads`` into ``layer`` and ``prefetches`` take beyond the slots ``cache`` has free as it stands (""
    when they fit). The engine asks once a plan's ``cancel_queued_prefetches`` has dropped the prefetches no
    copy engine had started: :func:`plan_fault` can only bound the slots that frees, and a copy on the wire
    finishes and keeps its slot (without this the engine stopped with an AssertionError naming no policy)."""
    taking: dict[int, int] = {layer: len(loads)} if loads else {}
    for lay, _ in prefetches:
        taking[lay] = taking.get(lay, 0) + 1
    for lay, count in taking.items():
        free = cache.capacity[lay] - cache.used(lay)
        if count > free:
            return (f"loads {count} expert{'s' if count > 1 else ''} into layer {lay}, which has {max(free, 0)} "
                    f"free slot{'' if free == 1 else 's'} once the queued prefetches are dropped")
    if cache.pool is not None and sum(taking.values()) > cache.pool - cache.held():
        return (f"loads {sum(taking.values())} experts into the model-wide pool, which has "
                f"{max(cache.pool - cache.held(), 0)} free slots once the queued prefetches are dropped")
    return ""


def _cancellable(cache: Any, layer: int, gpu: set[int]) -> dict[int, int]:
    """Per layer, the prefetches in flight that a plan's ``cancel_queued_prefetches`` may drop: all of them, but
    those of the layer's own GPU experts."""
    out = {}
    for lay, flying in enumerate(cache.in_flight):
        count = len(flying - gpu) if lay == layer else len(flying)
        if count:
            out[lay] = count
    return out
