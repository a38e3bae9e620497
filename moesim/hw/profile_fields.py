"""The field reader of hardware profiles: typed fields pulled out of a profile's YAML and checked (type, sign,
the keys each section may hold, a curve's shape and how far its time may fall), each number below the
plausibility ceiling of its kind; and the check that every number of a profile names its source.
:mod:`moesim.hw.profile` builds the profile from what this reads."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from moesim.errors import ProfileError, did_you_mean
from moesim.hw.parts import (CPU_KERNELS, GRAPH_MODES, OUTPUT_KINDS, AttentionCurve, Curve, ExpertCurve, OutputCurve,
                             RuntimeSpec)
from moesim.model.spec import DTYPE_BITS

#: How far a curve's time may fall below an earlier point's (as a factor) before the curve is refused. The
#: work grows with tokens, context and bytes, so a true time hardly falls (a library may switch to a faster
#: kernel at a larger size); a measured one also dips from noise: on a busy 2-core machine, medians
#: of `moesim profile` fell 1.9x (CPU expert FFN, 16 to 64 tokens) and 1.5x (a host copy's time net of its
#: latency, 48 to 64 KiB) where the quiet machine measured rising times. A fall beyond this factor is a typo
#: or points out of order, which interpolation would turn into a big batch (or context, or copy) cheaper
#: than a small one.
TIME_FALL_LIMIT = 4.0


@dataclass(frozen=True)
class Ceiling:
    """The most a number of one kind may be in a profile: more is a typo or another unit (ns written for µs,
    bytes for GiB, an exponent slip such as 1e308), never a machine."""

    value: float
    #: the ceiling as the error says it ("3.6e+09 µs (one hour)")
    said: str
    #: what to do about a number over it
    fix: str


#: Plausibility ceilings of a profile's numbers by kind, each far above any machine and any measurement
#: (``moesim profile`` writes times of seconds at most: a CPU expert FFN of thousands of tokens), so that
#: only a typo or a wrong unit reaches one. The largest numbers of the bundled profiles are 4.7e6 µs (a CPU
#: expert curve at 4096 tokens), 2,000 GB/s, 80 GiB, 5.4e8 bytes, 1,513 TFLOPS, 32,768 tokens of context and
#: 115 kernels per layer. Fractions (efficiencies, duplex_slowdown) are at most 1, cores and threads 65,536,
#: copy engines 64 and the PCIe generation 16 (their own bounds below).
CEILINGS = {
    "time": Ceiling(3.6e9, "3.6e+09 µs (one hour)", "write the time in µs; a larger value is a typo or "
                    "another unit"),
    "bandwidth": Ceiling(1e5, "1e+05 GB/s (100 TB/s)", "write the bandwidth in GB/s (1e9 bytes per second); "
                         "a larger value is a typo or another unit"),
    "memory": Ceiling(100 * 1024, "102400 GiB (100 TiB)", "write the memory in GiB; a larger value is a typo "
                      "or another unit"),
    "bytes": Ceiling(100 * 2**40, "1.09951e+14 bytes (100 TiB)", "write the copy size in bytes; a larger value "
                     "is a typo"),
    "compute": Ceiling(1e6, "1e+06 TFLOPS (1 exaFLOPS)", "write the peak in TFLOPS; a larger value is a typo "
                       "or another unit"),
    "count": Ceiling(1e9, "1e+09 (a billion)", "check the value; a larger count of tokens, sequences or "
                     "elements is a typo"),
    "kernels": Ceiling(1e6, "1e+06 (a million kernels per layer)", "check the value; a larger count is a typo"),
    "factor": Ceiling(1e3, "1000 (a factor)", "check the value; a factor over 1000 is a typo"),
}
#: the ceiling of a curve's axis, by its name
AXIS_CEILINGS = {"tokens": "count", "context": "count", "sequences": "count", "size_bytes": "bytes",
                 "time_us": "time", "gbps": "bandwidth"}


def _shown(value: float) -> str:
    """A number as an error shows it (an integer too large for a float as "more than 1e+308")."""
    try:
        return f"{value:g}"
    except OverflowError:
        return "more than 1e+308"


#: keys each section may hold; anything else is a typo that would otherwise be ignored silently
SECTION_KEYS = {
    "": {"schema_version", "name", "description", "gpu", "cpu", "pcie", "sync", "sources", "runtimes"},
    "gpu": {"name", "memory_gib", "reserved_gib", "launch_us", "graph_launch_us", "cuda_graph", "peak_tflops",
            "mem_bandwidth_gbps", "expert_ffn", "attention", "output", "roofline_efficiency",
            "bandwidth_efficiency", "kernels_per_layer"},
    "cpu": {"name", "cores", "dram_bandwidth_gbps", "peak_tflops", "amx_switch_tokens", "expert_ffn",
            "numa_note", "roofline_efficiency", "bandwidth_efficiency", "dram_combined_gbps"},
    "pcie": {"generation", "h2d", "d2h", "latency_us", "copy_engines", "duplex_slowdown", "bandwidth_scale"},
    "sync": {"per_layer_us"},
    "runtime": {"launch_us", "graph", "kernels_per_layer", "cpu_compute_efficiency", "cpu_bandwidth_efficiency",
                "host_us_per_step"},
}


class _Reader:
    """Pulls typed fields out of nested YAML, raising one-line errors with the dotted path."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def fail(self, key: str, message: str, fix: str) -> ProfileError:
        return ProfileError(message, source=self.origin, field=key, fix=fix)

    def section(self, data: dict, key: str) -> dict:
        value = data.get(key.split(".")[-1])
        if not isinstance(value, dict):
            raise self.fail(key, "missing section" if value is None else "must be a mapping",
                            f"add a '{key}' mapping (see hwprofiles/README.md)")
        return value

    def number(self, data: dict, key: str, *, maximum: float | str, positive: bool = True, default: Any = ...,
               integer: bool = False) -> float:
        """The number at ``key``, refused when it is no finite number, a fraction where a whole one belongs, over
        ``maximum`` (a bound, or the name of one of :data:`CEILINGS`), or not positive (``positive=False``: below
        zero)."""
        name = key.split(".")[-1]
        if name not in data:
            if default is not ...:
                return default
            raise self.fail(key, "missing field", f"add '{name}' with its source")
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, f"must be a number, got {value!r}", f"write a number for '{name}'")
        if isinstance(value, float) and not math.isfinite(value):  # an int is finite, however large
            raise self.fail(key, f"must be a finite number, got {value}", f"write a number for '{name}'")
        if integer and value != int(value):
            raise self.fail(key, f"must be a whole number, got {value}", f"write an integer for '{name}'")
        self.at_most(key, value, maximum)
        if positive and value <= 0:
            raise self.fail(key, f"must be positive, got {value}", f"use a value > 0 for '{name}'")
        if not positive and value < 0:
            raise self.fail(key, f"must not be negative, got {value}", f"use a value >= 0 for '{name}'")
        return value

    def at_most(self, key: str, value: float, maximum: float | str) -> None:
        if isinstance(maximum, str):
            ceiling = CEILINGS[maximum]
            if value > ceiling.value:
                raise self.fail(key, f"must be at most {ceiling.said}, got {_shown(value)}", ceiling.fix)
        elif value > maximum:
            raise self.fail(key, f"must be at most {maximum:g}, got {_shown(value)}", f"use a value <= {maximum:g}")

    def flag(self, data: dict, key: str, default: bool) -> bool:
        value = data.get(key.split(".")[-1], default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}", "write true or false")
        return value

    def known_keys(self, data: dict, section: str, prefix: str | None = None) -> None:
        unknown = sorted(str(k) for k in set(data) - SECTION_KEYS[section])
        if unknown:
            where = f"{prefix or section}.{unknown[0]}" if (prefix or section) else unknown[0]
            valid = sorted(SECTION_KEYS[section])
            raise self.fail(where, "unknown field",
                            f"{did_you_mean(unknown[0], valid)}valid fields here: {', '.join(valid)}")

    def text(self, data: dict, key: str, default: Any = ...) -> str:
        name = key.split(".")[-1]
        if name not in data:
            if default is not ...:
                return default
            raise self.fail(key, "missing field", f"add '{name}'")
        if isinstance(data[name], (dict, list)):
            raise self.fail(key, f"must be text, got a {type(data[name]).__name__}", f"write '{name}' as text")
        if default is ... and (data[name] is None or not str(data[name]).strip()):
            # a blank part name titled every table 'rtx4090 ( + , 10 cores, ...)'; YAML's bare 'name:' is None
            raise self.fail(key, "is empty", f"write the {'part' if '.' in key else 'profile'}'s name as '{name}'")
        return str(data[name])

    def peaks(self, data: dict, key: str, names: tuple[str, ...], what: str) -> dict[str, float]:
        """Peak TFLOPS keyed by ``names`` (dtypes, or CPU kernel families): another key would never be read."""
        peaks = self.section(data, key)
        if not peaks:
            raise self.fail(key, "is empty", "give the peak TFLOPS per dtype or kernel (e.g. bf16: 165)")
        for k in peaks:
            self.one_of(str(k), f"{key}.{k}", names, what)
        return {str(k): self.number(peaks, f"{key}.{k}", maximum="compute") for k in peaks}

    def one_of(self, value: str, key: str, names: tuple[str, ...], what: str) -> str:
        if value not in names:
            raise self.fail(key, f"unknown {what} '{value}'", f"use one of {', '.join(names)}")
        return value

    def curve(self, data: Any, key: str, x_name: str, y_name: str, extra: tuple[str, ...] = (),
              copy_latency_us: float | None = None) -> Curve:
        """A tabulated curve: ``y`` is a time (µs), or with ``copy_latency_us`` a bandwidth (GB/s) net of that
        latency, a copy of x bytes taking ``latency + x / y``."""
        if not isinstance(data, dict):
            raise self.fail(key, "must be a mapping with lists", f"give '{x_name}', '{y_name}' and 'source'")
        allowed = {x_name, y_name, "source", *extra}
        unknown = sorted(str(k) for k in set(data) - allowed)
        if unknown:
            raise self.fail(f"{key}.{unknown[0]}", "unknown field", f"valid fields here: {', '.join(sorted(allowed))}")
        xs, ys = data.get(x_name), data.get(y_name)
        if not isinstance(xs, list) or not isinstance(ys, list) or not xs:
            raise self.fail(key, f"needs non-empty lists '{x_name}' and '{y_name}'", "tabulate the curve")
        if len(xs) != len(ys):
            raise self.fail(key, f"'{x_name}' has {len(xs)} points but '{y_name}' has {len(ys)}",
                            "give one value per point")
        for name, values in ((x_name, xs), (y_name, ys)):  # the point named: it was "curve values must be ..."
            for i, v in enumerate(values):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or isinstance(v, float) and \
                        not math.isfinite(v) or v <= 0:
                    raise self.fail(f"{key}.{name}[{i}]", f"curve values must be positive numbers, got {v!r}",
                                    f"write every value of '{name}' as a number above 0")
        for name, values in ((x_name, xs), (y_name, ys)):
            for i, v in enumerate(values):
                self.at_most(f"{key}.{name}[{i}]", v, AXIS_CEILINGS[name])
        if any(b <= a for a, b in zip(xs, xs[1:])):
            raise self.fail(key, f"'{x_name}' must increase strictly", "sort the points")
        times = ys if copy_latency_us is None else [copy_latency_us + x / y * 1e-3 for x, y in zip(xs, ys)]
        self.time_hardly_falls(key, x_name, y_name, xs, times)
        if not data.get("source"):
            raise self.fail(f"{key}.source", "curve has no source", "name the spec sheet, paper table or measurement")
        return Curve(tuple(float(v) for v in xs), tuple(float(v) for v in ys), str(data["source"]))

    def time_hardly_falls(self, key: str, x_name: str, y_name: str, xs: list, times_us: list) -> None:
        """Refuse a point whose time is below an earlier point's divided by TIME_FALL_LIMIT."""
        slowest = 0
        for i in range(1, len(times_us)):
            if times_us[i] * TIME_FALL_LIMIT < times_us[slowest]:
                what = "copy time" if y_name == "gbps" else "time"
                raise self.fail(f"{key}.{y_name}[{i}]",
                                f"{what} falls from {times_us[slowest]:g} µs at {x_name} {xs[slowest]:g} to "
                                f"{times_us[i]:g} µs at {xs[i]:g}, more than {TIME_FALL_LIMIT:g}x; more work never "
                                "takes so much less time", "check the point and the order of the lists; measured "
                                f"dips of up to {TIME_FALL_LIMIT:g}x are accepted (hwprofiles/README.md)")
            if times_us[i] > times_us[slowest]:
                slowest = i

    def entries(self, items: Any, key: str) -> Iterator[tuple[str, dict]]:
        """(dotted path, mapping) of each entry of an optional list of curves."""
        if items is None:
            return
        if not isinstance(items, list):
            raise self.fail(key, "must be a list of curves", "write a YAML list")
        for i, item in enumerate(items):
            where = f"{key}[{i}]"
            if not isinstance(item, dict):
                raise self.fail(where, "must be a mapping", "see hwprofiles/README.md")
            yield where, item

    def expert_curves(self, items: Any, key: str, cpu: bool) -> tuple[ExpertCurve, ...]:
        curves = []
        for where, item in self.entries(items, key):
            kernel = str(item.get("kernel", "avx512" if cpu else "gpu"))
            if cpu:
                self.one_of(kernel, f"{where}.kernel", CPU_KERNELS, "CPU kernel")
            curves.append(ExpertCurve(
                hidden=int(self.number(item, f"{where}.hidden", integer=True, maximum="count")),
                intermediate=int(self.number(item, f"{where}.intermediate", integer=True, maximum="count")),
                # a curve is looked up by dtype: one no model can have would never be used
                dtype=self.one_of(self.text(item, f"{where}.dtype"), f"{where}.dtype", tuple(DTYPE_BITS), "dtype"),
                curve=self.curve(item, where, "tokens", "time_us",
                                 extra=("hidden", "intermediate", "dtype", "kernel", "threads")),
                kernel=kernel,
                threads=int(self.number(item, f"{where}.threads", default=0, positive=False, integer=True,
                                         maximum=1 << 16)),
            ))
        return self.once(curves, key, lambda c: (c.hidden, c.intermediate, c.dtype, c.kernel, c.threads),
                         "hidden, intermediate, dtype, kernel and threads")

    def once(self, curves: Sequence[Any], key: str, ident: Callable[[Any], tuple], what: str) -> tuple:
        """``curves``, refused when two share what the cost model looks a curve up by: it would silently use
        one of them (an expert curve: the first) and ignore the other."""
        first: dict[tuple, int] = {}
        for i, curve in enumerate(curves):
            j = first.setdefault(ident(curve), i)
            if j != i:
                raise self.fail(f"{key}[{i}]", f"a second curve with the {what} of {key}[{j}]; the cost model "
                                "looks curves up by them and would not use both",
                                "keep one of the two (or merge their points)")
        return tuple(curves)

    def attention_curves(self, items: Any, key: str) -> tuple[AttentionCurve, ...]:
        return self.once([AttentionCurve(model=self.text(item, f"{where}.model", default=""),
                                    tokens=int(self.number(item, f"{where}.tokens", integer=True, maximum="count")),
                                    curve=self.curve(item, where, "context", "time_us",
                                                     extra=("model", "tokens", "dtype")),
                                    dtype=self.one_of(self.text(item, f"{where}.dtype", default="bf16"),
                                                      f"{where}.dtype", tuple(DTYPE_BITS), "dtype"))
                          for where, item in self.entries(items, key)],
                         key, lambda c: (c.model, c.tokens), "model and tokens")  # dtype: not looked up

    def output_curves(self, items: Any, key: str) -> tuple[OutputCurve, ...]:
        return self.once([OutputCurve(kind=self.one_of(self.text(item, f"{where}.kind"), f"{where}.kind", OUTPUT_KINDS,
                                                  "output kind"),
                                 hidden=int(self.number(item, f"{where}.hidden", integer=True, maximum="count")),
                                 vocab=int(self.number(item, f"{where}.vocab", integer=True, maximum="count")),
                                 dtype=self.one_of(self.text(item, f"{where}.dtype", default="bf16"),
                                                   f"{where}.dtype", tuple(DTYPE_BITS), "dtype"),
                                 curve=self.curve(item, where, "sequences", "time_us",
                                                  extra=("kind", "hidden", "vocab", "dtype")))
                          for where, item in self.entries(items, key)],
                         key, lambda c: (c.kind, c.hidden, c.vocab, c.dtype), "kind, hidden, vocab and dtype")

    def runtimes(self, data: Any) -> dict[str, RuntimeSpec]:
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise self.fail("runtimes", "must be a mapping of runtime name to its numbers", "see hwprofiles/README.md")
        out = {}
        for name, r in data.items():
            key = f"runtimes.{name}"
            if not isinstance(r, dict):
                raise self.fail(key, "must be a mapping", "see hwprofiles/README.md")
            self.known_keys(r, "runtime", prefix=key)
            graph = "none" if r.get("graph") is None else self.text(r, f"{key}.graph")
            self.one_of(graph, f"{key}.graph", GRAPH_MODES, "graph mode")
            compute = r.get("cpu_compute_efficiency", {})
            if not isinstance(compute, dict):
                raise self.fail(f"{key}.cpu_compute_efficiency", "must be a mapping of CPU kernel to factor",
                                "write e.g. {amx: 0.25, avx512: 1.0}")
            out[str(name)] = RuntimeSpec(
                name=str(name), launch_us=self.number(r, f"{key}.launch_us", positive=False, maximum="time"),
                graph=graph,
                kernels_per_layer=int(self.number(r, f"{key}.kernels_per_layer", positive=False, default=0,
                                                  integer=True, maximum="kernels")),
                cpu_compute_efficiency={self.one_of(str(k), f"{key}.cpu_compute_efficiency.{k}", CPU_KERNELS,
                                                    "CPU kernel"):
                                        self.number(compute, f"{key}.cpu_compute_efficiency.{k}", maximum="factor")
                                        for k in compute},
                cpu_bandwidth_efficiency=self.number(r, f"{key}.cpu_bandwidth_efficiency", default=1.0,
                                                     maximum="factor"),
                host_us_per_step=self.number(r, f"{key}.host_us_per_step", positive=False, default=0.0,
                                             maximum="time"))
        return out


def _numeric_paths(data: Any, prefix: str = "") -> list[str]:
    """Dotted paths of scalar numbers outside curves (curves carry their own source)."""
    if isinstance(data, dict):
        if "source" in data:
            return []
        out = []
        for key, value in data.items():
            if key in ("sources", "schema_version"):
                continue
            out += _numeric_paths(value, f"{prefix}.{key}" if prefix else str(key))
        return out
    if isinstance(data, list):
        return [p for i, v in enumerate(data) for p in _numeric_paths(v, f"{prefix}[{i}]")]
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return [prefix]
    return []


def _has_source(path: str, sources: dict[str, str]) -> bool:
    parts = path.replace("[", ".[").split(".")
    return any(".".join(parts[:i]).replace(".[", "[") in sources for i in range(1, len(parts) + 1))


def _checked_sources(r: _Reader, data: dict) -> dict[str, str]:
    """The ``sources`` mapping, once every number of the profile has a key in it."""
    sources = data.get("sources")
    if not isinstance(sources, dict) or not sources:
        raise r.fail("sources", "profile has no sources", "map each number (or its section) to its source")
    for path in _numeric_paths(data):
        if not _has_source(path, sources):
            raise r.fail(path, "number has no source", f"add '{path}' (or a prefix of it) under 'sources'")
    return dict(sources)
