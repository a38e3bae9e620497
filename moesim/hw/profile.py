"""Hardware profile v1: YAML schema, loading and validation.

A profile holds curves (time or bandwidth tabulated over a size range), not
constants; :mod:`moesim.hw.cost` interpolates them log-log and falls back to a
roofline from the peak numbers, flagging the fallback. Every number names its
source: curves carry an inline ``source``; scalar fields are covered by the
``sources`` mapping, whose keys are dotted paths or prefixes of them
(``gpu.memory_gib`` or ``gpu``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from moesim.errors import ProfileError, close_choices, did_you_mean
from moesim.hw.parts import (CPU_KERNELS, GRAPH_MODES, OUTPUT_KINDS, AttentionCurve, CPUSpec, Curve, ExpertCurve,
                             GPUSpec, OutputCurve, PCIeSpec, RuntimeSpec, SyncSpec)
from moesim.model.spec import DTYPE_BITS
from moesim.util import read_yaml, yaml_beside

PROFILE_SCHEMA_VERSION = 1
PROFILE_DIR = Path(__file__).resolve().parents[2] / "hwprofiles"

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


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    gpu: GPUSpec
    cpu: CPUSpec
    pcie: PCIeSpec
    sync: SyncSpec
    sources: dict[str, str]
    description: str = ""
    path: str = ""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    runtimes: dict[str, RuntimeSpec] = field(default_factory=dict)
    #: the profile as loaded, before command-line overrides (None: this is it); curves are scaled by
    #: the roofline under the overridden numbers over the roofline under these
    base: "HardwareProfile | None" = field(default=None, compare=False, repr=False)

    @property
    def original(self) -> "HardwareProfile":
        return self.base or self

    @property
    def dram_combined_gbps(self) -> float:
        """Achievable host-DRAM bandwidth shared by CPU kernels and H2D copies, GB/s."""
        cpu = self.cpu
        if cpu.dram_combined_gbps is not None:
            return cpu.dram_combined_gbps
        return cpu.dram_bandwidth_gbps * cpu.effective_bandwidth_efficiency

    def runtime(self, name: str) -> RuntimeSpec:
        """The named runtime's costs.

        ``generic`` is built from the gpu section (launch_us, cuda_graph, kernels_per_layer) with the
        CPU curves as they are; ``ideal`` (the bounds' runtime) launches nothing and does no host work.
        """
        if name == "ideal":
            return RuntimeSpec(name="ideal", launch_us=0.0)
        if name in self.runtimes:
            return self.runtimes[name]
        if name == "generic" or not self.runtimes:
            return RuntimeSpec(name="generic", launch_us=self.gpu.launch_us,
                               graph="kernel" if self.gpu.cuda_graph else "none",
                               kernels_per_layer=self.gpu.kernels_per_layer)
        raise ProfileError(f"no runtime '{name}'", source=self.path or self.name, field=f"runtimes.{name}",
                           fix=f"use one of: generic, ideal, {', '.join(sorted(self.runtimes))}")

    @property
    def gpu_memory_bytes(self) -> int:
        return int(self.gpu.memory_gib * 2**30)

    @property
    def gpu_reserved_bytes(self) -> int:
        return int(self.gpu.reserved_gib * 2**30)

    def with_overrides(self, overrides: dict[str, Any], source: str = "command-line override") -> "HardwareProfile":
        """A copy with dotted-path overrides applied (``pcie.bandwidth_scale``, ``cpu.cores``, ...);
        ``source`` is recorded under ``sources`` for each (a fitted number names what it was fitted to)."""
        if not overrides:
            return self
        raw = copy.deepcopy(self.raw)
        origin = self.path or self.name
        for key, value in overrides.items():
            # an override the profile has no use for is named as the --set parameter the user gave (the API and
            # sweeps rename it to their own key), not as a field of the file, which has no such field
            said = f"parameter 'hw.{key}'={value}"
            inert = _inert(key)
            if inert:
                raise ProfileError(f"{said}: {key} of {origin} cannot be overridden: {inert}", field="--set",
                                   fix="override a number the costs are computed from (hwprofiles/README.md)")
            parts = key.split(".")
            node = raw
            # a section on the way that is not there (or a top-level name that is none of the sections)
            for i, part in enumerate(parts[:-1] if len(parts) > 1 or parts[0] in node else parts):
                if not isinstance(node.get(part), dict):
                    within = ".".join(["hw", *parts[:i]])
                    sections = sorted(k for k, v in node.items() if isinstance(v, dict)
                                      and not _inert(".".join([*parts[:i], k])))
                    guesses = [".".join([within, guess, *parts[i + 1:]]) for guess in close_choices(part, sections)]
                    raise ProfileError(f"{said}: no such profile field in {origin}", field="--set",
                                       fix=_guessed(guesses) + f"sections of {within}: {', '.join(sections)}")
                node = node[part]
            open_mapping = len(parts) > 1 and parts[-2] in OPEN_MAPPINGS  # a new kernel or dtype is a new key
            if parts[-1] not in node and key not in OPTIONAL_SCALARS and not open_mapping:
                section = ".".join(parts[:-1])
                fields = sorted(name for name in {*node, *(k.rpartition(".")[2] for k in OPTIONAL_SCALARS
                                                           if k.rpartition(".")[0] == section)}
                                if not _inert(f"{section}.{name}"))
                guesses = [f"hw.{section}.{guess}" for guess in close_choices(parts[-1], fields)]
                raise ProfileError(f"{said}: no such profile field in {origin}", field="--set",
                                   fix=_guessed(guesses) + f"fields of hw.{section}: {', '.join(fields)}")
            current = node.get(parts[-1])
            if isinstance(value, str) and (isinstance(current, dict) or parts[-1] in OPEN_MAPPINGS):
                value = _mapping_text(value)
            elif isinstance(value, str) and (isinstance(current, (bool, int, float)) or open_mapping):
                current = 1.0 if open_mapping and current is None else current
                try:
                    value = _like(value, current, key, self.path or self.name)
                except ProfileError as err:
                    raise self._override_error(err, overrides) from None
            node[parts[-1]] = value
            raw.setdefault("sources", {})[key] = source
        try:
            profile = parse_profile(raw, origin=self.path or self.name)
        except ProfileError as err:
            raise self._override_error(err, overrides) from None
        return dataclasses.replace(profile, base=self.original)

    def _override_error(self, err: ProfileError, overrides: dict[str, Any]) -> ProfileError:
        """``err`` of the profile parsed with ``overrides``: when an override set the value refused, the
        override is named (as a ``--set`` parameter: the API and sweeps rename it to their own key), not
        the file, which holds another value."""
        # the override that set the field, or the mapping holding it ({amx: 0.5} for ...cpu_compute_efficiency)
        key = err.field if err.field in overrides else \
            next((k for k in overrides if str(err.field).startswith(f"{k}.")), None)
        if err.field == "gpu.reserved_gib" and key is None and "gpu.memory_gib" in overrides:
            key = "gpu.memory_gib"  # reserved >= memory: the memory the override shrank
        if key is None:
            return err
        own = _lookup(self.raw, key)
        where = f"{self.path or self.name}'s own: {own}" if own is not None else f"not in {self.path or self.name}"
        fix = err.fix
        if key == "gpu.memory_gib" and err.field == "gpu.reserved_gib":  # the memory is below what is reserved
            fix = f"give hw.{key} more than the {_lookup(self.raw, 'gpu.reserved_gib')} GiB reserved, or reserve less"
        inner = "" if key == err.field or err.field == "gpu.reserved_gib" else f"{err.field}: "
        return ProfileError(f"parameter 'hw.{key}'={overrides[key]} ({where}): {inner}{err.detail}", field="--set",
                            fix=fix)


def _guessed(keys: list[str]) -> str:
    """"did you mean KEY? " for the keys an unknown override looks like a slip of ("" for none)."""
    return f"did you mean {' or '.join(keys)}? " if keys else ""


def _lookup(raw: dict[str, Any], key: str) -> Any:
    """The value at dotted ``key`` of a profile's raw mapping (None when absent)."""
    node: Any = raw
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


#: fields no cost is computed from, and why an override of them would change nothing
INERT_FIELDS = {
    "schema_version": "the file format's version",
    "name": "a label", "description": "a label", "gpu.name": "a label", "cpu.name": "a label",
    "cpu.numa_note": "a note; NUMA effects are in the runtimes' cpu_bandwidth_efficiency",
    "pcie.generation": "a label; the h2d/d2h curves and pcie.bandwidth_scale carry the bandwidth",
    "pcie.d2h": "a curve (it times mixtral-offloading's write-backs); scale it with pcie.bandwidth_scale",
    "pcie.duplex_slowdown": "the only device-to-host copies (mixtral-offloading's write-backs) follow their load on "
    "the same copy engine, so H2D never runs duplex",
    "sources": "documentation", "gpu.expert_ffn": "a list of curves (edit the profile YAML)",
    "gpu.attention": "a list of curves (edit the profile YAML)", "gpu.output": "a list of curves (edit the profile "
    "YAML)", "cpu.expert_ffn": "a list of curves (edit the "
    "profile YAML)", "pcie.h2d": "a curve; scale it with pcie.bandwidth_scale",
}


def _inert(key: str) -> str:
    """Why overriding ``key`` would change no cost ('' when it acts)."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        why = INERT_FIELDS.get(".".join(parts[:i]))
        if why:
            return why
    return ""


def _like(text: str, current: bool | int | float, key: str, origin: str) -> bool | int | float:
    """A command-line string converted to the type of the value it replaces."""
    try:
        if isinstance(current, bool):
            if text.lower() not in ("true", "false"):
                raise ValueError(text)
            return text.lower() == "true"
        number = float(text)  # a profile's 24 and 24.0 are the same size: any number replaces either
        return int(number) if isinstance(current, int) and number.is_integer() else number
    except ValueError:
        kind = "true or false" if isinstance(current, bool) else "a number"
        raise ProfileError(f"'{text}' is not {kind}", source=origin, field=key,
                           fix=f"give {kind}, like {current!r}") from None


OPTIONAL_SCALARS = {"pcie.bandwidth_scale", "gpu.roofline_efficiency", "cpu.roofline_efficiency",
                    "gpu.bandwidth_efficiency", "cpu.bandwidth_efficiency", "cpu.dram_combined_gbps",
                    "gpu.kernels_per_layer"}
#: mappings whose keys are names (CPU kernels, dtypes): ``--set`` may add a key the profile does not list
OPEN_MAPPINGS = ("cpu_compute_efficiency", "peak_tflops")

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


# ----------------------------------------------------------------------------- parsing
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
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or isinstance(v, float) and not math.isfinite(v)
               or v <= 0 for v in xs + ys):
            raise self.fail(key, "curve values must be positive numbers", "fix the tabulated values")
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


def _mapping_text(value: str) -> Any:
    """A ``--set`` value for a mapping field (``{amx: 0.5}``) read as YAML; anything else is left as written,
    for the profile's own check to refuse."""
    import yaml
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    return parsed if isinstance(parsed, dict) else value


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


def parse_profile(data: Any, *, origin: str) -> HardwareProfile:
    r = _Reader(origin)
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a YAML {type(data).__name__}"
        raise ProfileError(f"a profile must be a YAML mapping, got {got}", source=origin,
                           fix="write sections schema_version, name, gpu, cpu, pcie, sync and sources "
                               "(hwprofiles/README.md; start from a shipped profile)")
    version = data.get("schema_version")
    if isinstance(version, bool) or version != PROFILE_SCHEMA_VERSION:
        raise r.fail("schema_version", f"unknown or missing schema_version {version!r}",
                     f"set schema_version: {PROFILE_SCHEMA_VERSION}")
    # every field's shape is checked before the sources: a list where a section belongs has no numbers to source
    profile = _parse_sections(r, data, origin)
    return dataclasses.replace(profile, sources=_checked_sources(r, data))


def _parse_sections(r: _Reader, data: dict, origin: str) -> HardwareProfile:
    r.known_keys(data, "")
    g = r.section(data, "gpu")
    r.known_keys(g, "gpu")
    gpu = GPUSpec(
        name=r.text(g, "gpu.name"),
        memory_gib=r.number(g, "gpu.memory_gib", maximum="memory"),
        reserved_gib=r.number(g, "gpu.reserved_gib", positive=False, maximum="memory"),
        launch_us=r.number(g, "gpu.launch_us", positive=False, maximum="time"),
        graph_launch_us=r.number(g, "gpu.graph_launch_us", positive=False, maximum="time"),
        cuda_graph=r.flag(g, "gpu.cuda_graph", False),
        peak_tflops=r.peaks(g, "gpu.peak_tflops", tuple(DTYPE_BITS), "dtype"),
        mem_bandwidth_gbps=r.number(g, "gpu.mem_bandwidth_gbps", maximum="bandwidth"),
        expert_ffn=r.expert_curves(g.get("expert_ffn"), "gpu.expert_ffn", cpu=False),
        attention=r.attention_curves(g.get("attention"), "gpu.attention"),
        output=r.output_curves(g.get("output"), "gpu.output"),
        roofline_efficiency=r.number(g, "gpu.roofline_efficiency", default=0.6, maximum=1.0),
        bandwidth_efficiency=r.number(g, "gpu.bandwidth_efficiency", default=None, maximum=1.0),
        kernels_per_layer=int(r.number(g, "gpu.kernels_per_layer", positive=False, default=0, integer=True,
                                        maximum="kernels")),
    )
    if gpu.reserved_gib >= gpu.memory_gib:
        raise r.fail("gpu.reserved_gib", f"{gpu.reserved_gib} GiB reserved of {gpu.memory_gib} GiB",
                     "reserve less than the GPU's memory")
    if "bf16" not in gpu.peak_tflops:
        raise r.fail("gpu.peak_tflops.bf16", "missing field", "add the dense bf16 peak from the spec sheet")
    c = r.section(data, "cpu")
    r.known_keys(c, "cpu")
    switch = c.get("amx_switch_tokens")
    cpu = CPUSpec(
        name=r.text(c, "cpu.name"),
        cores=int(r.number(c, "cpu.cores", integer=True, maximum=1 << 16)),
        dram_bandwidth_gbps=r.number(c, "cpu.dram_bandwidth_gbps", maximum="bandwidth"),
        peak_tflops=r.peaks(c, "cpu.peak_tflops", CPU_KERNELS, "CPU kernel"),
        amx_switch_tokens=None if switch is None else int(r.number(c, "cpu.amx_switch_tokens", integer=True,
                                                                                  maximum="count")),
        expert_ffn=r.expert_curves(c.get("expert_ffn"), "cpu.expert_ffn", cpu=True),
        numa_note=r.text(c, "cpu.numa_note", default=""),
        roofline_efficiency=r.number(c, "cpu.roofline_efficiency", default=0.5, maximum=1.0),
        bandwidth_efficiency=r.number(c, "cpu.bandwidth_efficiency", default=None, maximum=1.0),
        dram_combined_gbps=r.number(c, "cpu.dram_combined_gbps", default=None, maximum="bandwidth"),
    )
    if switch is not None and "amx" not in cpu.peak_tflops:
        raise r.fail("cpu.peak_tflops.amx", "amx_switch_tokens is set but there is no AMX peak",
                     "add cpu.peak_tflops.amx or set amx_switch_tokens: null")
    p = r.section(data, "pcie")
    r.known_keys(p, "pcie")
    latency_us = r.number(p, "pcie.latency_us", positive=False, maximum="time")
    pcie = PCIeSpec(
        generation=int(r.number(p, "pcie.generation", integer=True, maximum=16)),
        h2d=r.curve(p.get("h2d"), "pcie.h2d", "size_bytes", "gbps", copy_latency_us=latency_us),
        d2h=r.curve(p.get("d2h"), "pcie.d2h", "size_bytes", "gbps", copy_latency_us=latency_us),
        latency_us=latency_us,
        copy_engines=int(r.number(p, "pcie.copy_engines", integer=True, maximum=64)),
        duplex_slowdown=r.number(p, "pcie.duplex_slowdown", maximum=1.0),
        bandwidth_scale=r.number(p, "pcie.bandwidth_scale", default=1.0, maximum="factor"),
    )
    s = r.section(data, "sync")
    r.known_keys(s, "sync")
    sync = SyncSpec(per_layer_us=r.number(s, "sync.per_layer_us", positive=False, maximum="time"))
    runtimes = r.runtimes(data.get("runtimes"))
    kernels = set(cpu.peak_tflops) | {c.kernel for c in cpu.expert_ffn}
    for name, runtime in runtimes.items():
        for kernel in runtime.cpu_compute_efficiency:
            if kernel not in kernels:
                raise r.fail(f"runtimes.{name}.cpu_compute_efficiency.{kernel}",
                             f"this CPU has no '{kernel}' kernel, so the factor would change nothing",
                             f"use one of {', '.join(sorted(kernels))}")
    return HardwareProfile(name=r.text(data, "name"), gpu=gpu, cpu=cpu, pcie=pcie, sync=sync,
                           sources={}, description=str(data.get("description", "")),
                           path=origin, raw=data, runtimes=runtimes)


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def profile_path(name_or_path: str | Path) -> Path:
    """The YAML file behind a profile name (``hwprofiles/NAME.yaml``) or path (which may not exist); a path
    with a folder and without its ``.yaml`` (``hwprofiles/rtx4090``) is the file with it, where that exists."""
    path = Path(name_or_path)
    if path.exists() or path.suffix:
        return path
    return yaml_beside(name_or_path) or PROFILE_DIR / f"{name_or_path}.yaml"


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """Load ``hwprofiles/NAME.yaml`` by name, or any profile YAML by path."""
    path = profile_path(name_or_path)
    if not path.exists():
        # a path's file name may be a slip of a bundled profile's (hwprofiles/rtx4091.yaml)
        guess = did_you_mean(str(name_or_path), available_profiles()) or did_you_mean(path.stem, available_profiles())
        raise ProfileError("hardware profile not found", source=str(name_or_path),
                           fix=f"{guess}use a path or one of: {', '.join(available_profiles())}")
    data = read_yaml(path, ProfileError)
    return parse_profile(data, origin=str(path))
