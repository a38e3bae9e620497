"""Hardware profile v1: YAML schema, loading and validation.

A profile holds curves (time or bandwidth tabulated over a size range), not
constants; :mod:`moesim.hw.cost` interpolates them log-log and falls back to a
roofline from the peak numbers, flagging the fallback. Every number names its
source: curves carry an inline ``source``; scalar fields are covered by the
``sources`` mapping, whose keys are dotted paths or prefixes of them
(``gpu.memory_gib`` or ``gpu``). Each field is read and checked by
:mod:`moesim.hw.profile_fields`; this module holds the profile, its overrides
and its loading.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moesim.errors import ProfileError, close_choices, did_you_mean
from moesim.hw.parts import CPU_KERNELS, CPUSpec, GPUSpec, PCIeSpec, RuntimeSpec, SyncSpec
from moesim.hw.profile_fields import TIME_FALL_LIMIT  # noqa: F401  (documented here: hwprofiles/README.md)
from moesim.hw.profile_fields import _checked_sources, _Reader
from moesim.model.spec import DTYPE_BITS
from moesim.util import read_yaml, yaml_beside

PROFILE_SCHEMA_VERSION = 1
PROFILE_DIR = Path(__file__).resolve().parents[2] / "hwprofiles"


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
        # "not in FILE" read as if the field did not exist; it is one the profile leaves at its default
        where = f"{self.path or self.name}'s own: {own}" if own is not None else \
            f"{self.path or self.name} does not set it"
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


def _mapping_text(value: str) -> Any:
    """A ``--set`` value for a mapping field (``{amx: 0.5}``) read as YAML; anything else is left as written,
    for the profile's own check to refuse."""
    import yaml
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    return parsed if isinstance(parsed, dict) else value


OPTIONAL_SCALARS = {"pcie.bandwidth_scale", "gpu.roofline_efficiency", "cpu.roofline_efficiency",
                    "gpu.bandwidth_efficiency", "cpu.bandwidth_efficiency", "cpu.dram_combined_gbps",
                    "gpu.kernels_per_layer"}
#: mappings whose keys are names (CPU kernels, dtypes): ``--set`` may add a key the profile does not list
OPEN_MAPPINGS = ("cpu_compute_efficiency", "peak_tflops")


# ----------------------------------------------------------------------------- parsing
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
