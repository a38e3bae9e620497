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
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator


from moesim.errors import ProfileError
from moesim.util import read_yaml

PROFILE_SCHEMA_VERSION = 1
PROFILE_DIR = Path(__file__).resolve().parents[2] / "hwprofiles"


@dataclass(frozen=True)
class Curve:
    """``y`` tabulated at increasing ``x`` (tokens, or bytes), with the document it came from."""

    x: tuple[float, ...]
    y: tuple[float, ...]
    source: str


@dataclass(frozen=True)
class ExpertCurve:
    """Time (µs) of one expert FFN of a given shape vs tokens routed to it."""

    hidden: int
    intermediate: int
    dtype: str
    curve: Curve
    kernel: str = "gpu"  # "gpu", or the CPU kernel family: "avx512" | "amx"
    threads: int = 0  # CPU threads the curve was measured with (0 = the profile's cores)


@dataclass(frozen=True)
class AttentionCurve:
    """Time (µs) of one attention layer (projections, gate, SDPA) of ``model`` vs context, at ``tokens`` tokens.

    Attention cost depends on the model's dimensions, so each curve names the
    model preset it was measured or derived for; a curve without ``model``
    ("") applies to any model that has no curve of its own.
    """

    model: str
    tokens: int
    curve: Curve  # x = context length


class _Roofline:
    """The roofline fallback's efficiencies, shared by the GPU and the CPU sections."""

    roofline_efficiency: float
    bandwidth_efficiency: float | None

    @property
    def effective_bandwidth_efficiency(self) -> float:
        return self.roofline_efficiency if self.bandwidth_efficiency is None else self.bandwidth_efficiency


@dataclass(frozen=True)
class GPUSpec(_Roofline):
    name: str
    memory_gib: float
    reserved_gib: float
    launch_us: float
    graph_launch_us: float
    cuda_graph: bool
    peak_tflops: dict[str, float]
    mem_bandwidth_gbps: float
    expert_ffn: tuple[ExpertCurve, ...] = ()
    attention: tuple[AttentionCurve, ...] = ()
    #: achievable fraction of ``peak_tflops`` for the roofline fallback
    roofline_efficiency: float = 0.6
    #: achievable fraction of ``mem_bandwidth_gbps`` (None: same as roofline_efficiency)
    bandwidth_efficiency: float | None = None


@dataclass(frozen=True)
class CPUSpec(_Roofline):
    name: str
    cores: int
    dram_bandwidth_gbps: float
    peak_tflops: dict[str, float]  # per kernel family: avx512, amx
    amx_switch_tokens: int | None  # tokens per expert from which AMX is used; None = no AMX
    expert_ffn: tuple[ExpertCurve, ...] = ()
    numa_note: str = ""
    #: achievable fraction of ``peak_tflops`` (1.0 when the peaks are measured kernel ceilings)
    roofline_efficiency: float = 0.5
    #: achievable fraction of ``dram_bandwidth_gbps`` (None: same as roofline_efficiency)
    bandwidth_efficiency: float | None = None


@dataclass(frozen=True)
class PCIeSpec:
    generation: int
    h2d: Curve  # x = bytes, y = GB/s
    d2h: Curve
    latency_us: float
    copy_engines: int
    #: bandwidth factor when H2D and D2H run at once
    duplex_slowdown: float
    bandwidth_scale: float = 1.0


@dataclass(frozen=True)
class SyncSpec:
    per_layer_us: float  # CPU-GPU submit + synchronize when a layer hands work to the CPU


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

    @property
    def gpu_memory_bytes(self) -> int:
        return int(self.gpu.memory_gib * 2**30)

    @property
    def gpu_reserved_bytes(self) -> int:
        return int(self.gpu.reserved_gib * 2**30)

    def with_overrides(self, overrides: dict[str, Any]) -> "HardwareProfile":
        """A copy with dotted-path overrides applied (``pcie.bandwidth_scale``, ``cpu.cores``, ...)."""
        if not overrides:
            return self
        raw = copy.deepcopy(self.raw)
        for key, value in overrides.items():
            parts = key.split(".")
            node = raw
            for part in parts[:-1]:
                if not isinstance(node.get(part), dict):
                    raise ProfileError("no such profile field", source=self.path or self.name, field=key,
                                       fix=f"valid top-level sections: {', '.join(sorted(self.raw))}")
                node = node[part]
            if parts[-1] not in node and key not in OPTIONAL_SCALARS:
                raise ProfileError("no such profile field", source=self.path or self.name, field=key,
                                   fix=f"fields here: {', '.join(sorted(node))}")
            current = node.get(parts[-1])
            if isinstance(value, str) and isinstance(current, (bool, int, float)):
                value = _like(value, current, key, self.path or self.name)
            node[parts[-1]] = value
            raw.setdefault("sources", {})[key] = "command-line override"
        return parse_profile(raw, origin=self.path or self.name)


def _like(text: str, current: bool | int | float, key: str, origin: str) -> bool | int | float:
    """A command-line string converted to the type of the value it replaces."""
    try:
        if isinstance(current, bool):
            if text.lower() not in ("true", "false"):
                raise ValueError(text)
            return text.lower() == "true"
        return type(current)(text)
    except ValueError:
        raise ProfileError(f"'{text}' is not a valid {type(current).__name__}", source=origin, field=key,
                           fix=f"give a {type(current).__name__} like {current!r}") from None


OPTIONAL_SCALARS = {"pcie.bandwidth_scale", "gpu.roofline_efficiency", "cpu.roofline_efficiency",
                    "gpu.bandwidth_efficiency", "cpu.bandwidth_efficiency"}

#: keys each section may hold; anything else is a typo that would otherwise be ignored silently
SECTION_KEYS = {
    "": {"schema_version", "name", "description", "gpu", "cpu", "pcie", "sync", "sources"},
    "gpu": {"name", "memory_gib", "reserved_gib", "launch_us", "graph_launch_us", "cuda_graph", "peak_tflops",
            "mem_bandwidth_gbps", "expert_ffn", "attention", "roofline_efficiency", "bandwidth_efficiency"},
    "cpu": {"name", "cores", "dram_bandwidth_gbps", "peak_tflops", "amx_switch_tokens", "expert_ffn",
            "numa_note", "roofline_efficiency", "bandwidth_efficiency"},
    "pcie": {"generation", "h2d", "d2h", "latency_us", "copy_engines", "duplex_slowdown", "bandwidth_scale"},
    "sync": {"per_layer_us"},
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

    def number(self, data: dict, key: str, *, positive: bool = True, default: Any = ...,
               maximum: float | None = None, integer: bool = False) -> float:
        name = key.split(".")[-1]
        if name not in data:
            if default is not ...:
                return default
            raise self.fail(key, "missing field", f"add '{name}' with its source")
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, f"must be a number, got {value!r}", f"write a number for '{name}'")
        if not math.isfinite(value):
            raise self.fail(key, f"must be a finite number, got {value}", f"write a number for '{name}'")
        if integer and value != int(value):
            raise self.fail(key, f"must be a whole number, got {value}", f"write an integer for '{name}'")
        if maximum is not None and value > maximum:
            raise self.fail(key, f"must be at most {maximum:g}, got {value}", f"use a value <= {maximum:g}")
        if positive and value <= 0:
            raise self.fail(key, f"must be positive, got {value}", f"use a value > 0 for '{name}'")
        if not positive and value < 0:
            raise self.fail(key, f"must not be negative, got {value}", f"use a value >= 0 for '{name}'")
        return value

    def flag(self, data: dict, key: str, default: bool) -> bool:
        value = data.get(key.split(".")[-1], default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}", "write true or false")
        return value

    def known_keys(self, data: dict, section: str) -> None:
        unknown = sorted(str(k) for k in set(data) - SECTION_KEYS[section])
        if unknown:
            where = f"{section}.{unknown[0]}" if section else unknown[0]
            raise self.fail(where, "unknown field", f"valid fields here: {', '.join(sorted(SECTION_KEYS[section]))}")

    def text(self, data: dict, key: str, default: Any = ...) -> str:
        name = key.split(".")[-1]
        if name not in data:
            if default is not ...:
                return default
            raise self.fail(key, "missing field", f"add '{name}'")
        if isinstance(data[name], (dict, list)):
            raise self.fail(key, f"must be text, got a {type(data[name]).__name__}", f"write '{name}' as text")
        return str(data[name])

    def peaks(self, data: dict, key: str) -> dict[str, float]:
        peaks = self.section(data, key)
        if not peaks:
            raise self.fail(key, "is empty", "give the peak TFLOPS per dtype or kernel (e.g. bf16: 165)")
        return {str(k): self.number(peaks, f"{key}.{k}") for k in peaks}

    def curve(self, data: Any, key: str, x_name: str, y_name: str, extra: tuple[str, ...] = ()) -> Curve:
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
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
               for v in xs + ys):
            raise self.fail(key, "curve values must be positive numbers", "fix the tabulated values")
        if any(b <= a for a, b in zip(xs, xs[1:])):
            raise self.fail(key, f"'{x_name}' must increase strictly", "sort the points")
        if not data.get("source"):
            raise self.fail(f"{key}.source", "curve has no source", "name the spec sheet, paper table or measurement")
        return Curve(tuple(float(v) for v in xs), tuple(float(v) for v in ys), str(data["source"]))

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
            if cpu and kernel not in ("avx512", "amx", "avx2"):
                raise self.fail(f"{where}.kernel", f"unknown CPU kernel '{kernel}'", "use avx512, amx or avx2")
            curves.append(ExpertCurve(
                hidden=int(self.number(item, f"{where}.hidden", integer=True)),
                intermediate=int(self.number(item, f"{where}.intermediate", integer=True)),
                dtype=self.text(item, f"{where}.dtype"),
                curve=self.curve(item, where, "tokens", "time_us",
                                 extra=("hidden", "intermediate", "dtype", "kernel", "threads")),
                kernel=kernel,
                threads=int(self.number(item, f"{where}.threads", default=0, positive=False, integer=True)),
            ))
        return tuple(curves)

    def attention_curves(self, items: Any, key: str) -> tuple[AttentionCurve, ...]:
        return tuple(AttentionCurve(model=self.text(item, f"{where}.model", default=""),
                                    tokens=int(self.number(item, f"{where}.tokens", integer=True)),
                                    curve=self.curve(item, where, "context", "time_us", extra=("model", "tokens")))
                     for where, item in self.entries(items, key))


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


def parse_profile(data: Any, *, origin: str) -> HardwareProfile:
    r = _Reader(origin)
    if not isinstance(data, dict):
        raise ProfileError("a profile must be a YAML mapping", source=origin)
    version = data.get("schema_version")
    if isinstance(version, bool) or version != PROFILE_SCHEMA_VERSION:
        raise r.fail("schema_version", f"unknown or missing schema_version {version!r}",
                     f"set schema_version: {PROFILE_SCHEMA_VERSION}")
    sources = data.get("sources")
    if not isinstance(sources, dict) or not sources:
        raise r.fail("sources", "profile has no sources", "map each number (or its section) to its source")
    for path in _numeric_paths(data):
        if not _has_source(path, sources):
            raise r.fail(path, "number has no source", f"add '{path}' (or a prefix of it) under 'sources'")

    r.known_keys(data, "")
    g = r.section(data, "gpu")
    r.known_keys(g, "gpu")
    gpu = GPUSpec(
        name=r.text(g, "gpu.name"),
        memory_gib=r.number(g, "gpu.memory_gib", maximum=1 << 20),
        reserved_gib=r.number(g, "gpu.reserved_gib", positive=False),
        launch_us=r.number(g, "gpu.launch_us", positive=False),
        graph_launch_us=r.number(g, "gpu.graph_launch_us", positive=False),
        cuda_graph=r.flag(g, "gpu.cuda_graph", False),
        peak_tflops=r.peaks(g, "gpu.peak_tflops"),
        mem_bandwidth_gbps=r.number(g, "gpu.mem_bandwidth_gbps"),
        expert_ffn=r.expert_curves(g.get("expert_ffn"), "gpu.expert_ffn", cpu=False),
        attention=r.attention_curves(g.get("attention"), "gpu.attention"),
        roofline_efficiency=r.number(g, "gpu.roofline_efficiency", default=0.6, maximum=1.0),
        bandwidth_efficiency=r.number(g, "gpu.bandwidth_efficiency", default=None, maximum=1.0),
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
        dram_bandwidth_gbps=r.number(c, "cpu.dram_bandwidth_gbps"),
        peak_tflops=r.peaks(c, "cpu.peak_tflops"),
        amx_switch_tokens=None if switch is None else int(r.number(c, "cpu.amx_switch_tokens", integer=True)),
        expert_ffn=r.expert_curves(c.get("expert_ffn"), "cpu.expert_ffn", cpu=True),
        numa_note=r.text(c, "cpu.numa_note", default=""),
        roofline_efficiency=r.number(c, "cpu.roofline_efficiency", default=0.5, maximum=1.0),
        bandwidth_efficiency=r.number(c, "cpu.bandwidth_efficiency", default=None, maximum=1.0),
    )
    if switch is not None and "amx" not in cpu.peak_tflops:
        raise r.fail("cpu.peak_tflops.amx", "amx_switch_tokens is set but there is no AMX peak",
                     "add cpu.peak_tflops.amx or set amx_switch_tokens: null")
    p = r.section(data, "pcie")
    r.known_keys(p, "pcie")
    pcie = PCIeSpec(
        generation=int(r.number(p, "pcie.generation", integer=True, maximum=16)),
        h2d=r.curve(p.get("h2d"), "pcie.h2d", "size_bytes", "gbps"),
        d2h=r.curve(p.get("d2h"), "pcie.d2h", "size_bytes", "gbps"),
        latency_us=r.number(p, "pcie.latency_us", positive=False),
        copy_engines=int(r.number(p, "pcie.copy_engines", integer=True, maximum=64)),
        duplex_slowdown=r.number(p, "pcie.duplex_slowdown", maximum=1.0),
        bandwidth_scale=r.number(p, "pcie.bandwidth_scale", default=1.0),
    )
    s = r.section(data, "sync")
    r.known_keys(s, "sync")
    sync = SyncSpec(per_layer_us=r.number(s, "sync.per_layer_us", positive=False))
    return HardwareProfile(name=r.text(data, "name"), gpu=gpu, cpu=cpu, pcie=pcie, sync=sync,
                           sources=dict(sources), description=str(data.get("description", "")),
                           path=origin, raw=data)


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """Load ``hwprofiles/NAME.yaml`` by name, or any profile YAML by path."""
    path = Path(name_or_path)
    if not path.exists() and not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise ProfileError("hardware profile not found", source=str(name_or_path),
                           fix=f"use a path or one of: {', '.join(available_profiles())}")
    data = read_yaml(path, ProfileError)
    return parse_profile(data, origin=str(path))
