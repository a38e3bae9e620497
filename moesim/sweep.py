"""Sweeps: many replays over traces, hardware profiles, systems and any ``--set`` parameter.

A sweep spec (YAML file or dict)::

    traces: [traces/mixtral-8x7b-humaneval.parquet]   # or `trace:`; relative to the spec file's folder
    hw: [a100-40g, h100-pcie]                         # profile names or YAML paths
    systems: [gpu-only-lru, static-hot]               # or `system:`; `all` = every listed system
    seeds: [0]                                        # or `seed:` (default 0)
    model: mixtral-8x7b                               # optional: check traces against this preset
    set: {engine.staging_slots: 2}                    # fixed for every point
    grid:                                             # cartesian product
      cache.slots_per_layer: [1, 2, 3]
    zip:                                              # varied together (equal-length lists), crossed with the rest
      - {hw.pcie.bandwidth_scale: [0.5, 1.0], engine.kernels_per_expert: [3, 1]}

Keys may use ``__`` for ``.`` (``cache__slots_per_layer``). Every point is a
(trace, hw, system, seed, settings) combination; its id is a hash of those
parameters as written in the spec (the spec file's location and the current
folder do not enter it, nor does the trace file's content).

Results are tidy: one row per point with every parameter and metric as a
column (``breakdown_ms`` becomes ``breakdown_<category>_ms``, notes are joined
by "; "), plus ``point_id``, ``status`` (``ok`` or ``error``), ``error``,
``point_wall_s``, ``finished_at``, ``worker``, and ``trace_path``/``hw_path``
(the files as resolved when the point ran).

Storage, robust to ``kill -9``: each finished point is written as its own
Parquet file ``OUT.parts/<point_id>.parquet`` (temporary file, fsync, rename),
so a point is either complete on disk or absent. The combined file ``OUT`` is
rewritten atomically from time to time and at the end; once it holds every
row the parts folder is removed. A rerun reads ``OUT`` and any parts, skips the
points whose status is ``ok`` and runs the rest (failed points are retried).
Rows of points outside the current spec are kept, so extending a grid only
runs the new points; start a fresh file to drop old ones. A lock file in the
parts folder stops two sweeps from writing the same output at once.

Engines: ``local`` runs points in a process pool (``workers`` processes,
default all cores; one worker runs them in this process, which also sees
systems registered at run time); ``ray`` runs them as Ray tasks on a local Ray
instance or an existing cluster (``address``). With Ray, each trace file
is put in the object store once and copied to local disk once per machine (and
validated once per worker process); each profile is parsed once by the driver
and shared through the object store as the parsed object. On one machine the
local pool is the better choice: Ray adds worker start-up and scheduling. On a cluster, every node needs moesim (and
any catalog module the systems come from) installed; other files a setting
names (``cache.calibration=PATH``) must exist at that path on the nodes.

Note: ``moesim.sweep`` is the function :func:`moesim.api.sweep`; import this
module's names with ``from moesim.sweep import ...``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable


from moesim.errors import ConfigError, MoesimError
from moesim.util import clean_stale_tmps, pid_alive, read_yaml

SPEC_KEYS = ("trace", "traces", "hw", "system", "systems", "seed", "seeds", "model", "set", "grid", "zip")
DEFAULT_HW = "rtx4090"
ENGINES = ("local", "ray")
#: columns that depend on when and where a point ran, not on its parameters
WALL_CLOCK_COLUMNS = ("sim_wall_s", "point_wall_s", "finished_at", "worker")
#: where the trace and profile were found when the point ran (for replaying a point again, e.g. a Gantt chart)
LOCATION_COLUMNS = ("trace_path", "hw_path")
#: seconds between rewrites of the combined output while a sweep runs
FLUSH_EVERY_S = 5.0
PARTS_SUFFIX = ".parts"
#: Parquet key-value metadata of results and part files
SWEEP_METADATA = {b"moesim_sweep": json.dumps({"version": 1}).encode()}


# ----------------------------------------------------------------------------- points
@dataclass(frozen=True)
class Point:
    """One replay of a sweep; ``trace`` and ``hw`` as written in the spec."""

    trace: str
    hw: str
    system: str
    seed: int = 0
    model: str | None = None
    #: ``--set`` keys and values (typed as in the spec), sorted by key
    settings: tuple[tuple[str, Any], ...] = ()

    @property
    def point_id(self) -> str:
        key = {"trace": self.trace, "hw": self.hw, "system": self.system, "seed": self.seed,
               "model": self.model, "settings": self.settings_str()}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def settings_str(self) -> dict[str, str]:
        """Settings as the strings ``--set`` would pass."""
        return {k: setting_str(v) for k, v in self.settings}

    def columns(self) -> dict[str, Any]:
        out: dict[str, Any] = {"point_id": self.point_id, "trace": self.trace, "hw": self.hw,
                               "system": self.system, "seed": self.seed}
        if self.model is not None:
            out["model"] = self.model
        out.update(self.settings)
        return out


def setting_str(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def normalize_key(key: str) -> str:
    """``cache__slots_per_layer`` -> ``cache.slots_per_layer`` (Python-friendly spelling)."""
    return str(key).replace("__", ".")


# ----------------------------------------------------------------------------- spec
@dataclass
class SweepSpec:
    """A parsed sweep spec: the axes, and the folder relative paths resolve against."""

    traces: list[str]
    hw: list[str]
    systems: list[str]
    seeds: list[int] = field(default_factory=lambda: [0])
    model: str | None = None
    fixed: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    zips: list[dict[str, list[Any]]] = field(default_factory=list)
    base_dir: Path = field(default_factory=Path.cwd)
    source: str = "sweep spec"

    def points(self) -> list[Point]:
        """Every point, in spec order (traces outermost), duplicates dropped."""
        axes = [[{k: v} for v in values] for k, values in self.grid.items()]
        axes += [[dict(zip(group, row)) for row in zip(*group.values())] for group in self.zips]
        seen: dict[str, Point] = {}
        for trace, hw, system, seed in itertools.product(self.traces, self.hw, self.systems, self.seeds):
            for combo in itertools.product(*axes):
                settings = dict(self.fixed)
                for part in combo:
                    settings.update(part)
                point = Point(trace, hw, system, seed, self.model, tuple(sorted(settings.items())))
                seen.setdefault(point.point_id, point)
        return list(seen.values())

    def parameter_keys(self) -> list[str]:
        """``--set`` keys in spec order: fixed, grid, then zipped."""
        keys = list(self.fixed) + list(self.grid)
        for group in self.zips:
            keys += list(group)
        return keys

    def resolve(self, path: str) -> str:
        """A trace or profile path relative to the spec's folder (profile names stay names)."""
        p = Path(path).expanduser()
        if p.is_absolute():
            return str(p)
        return str(self.base_dir / p)

    def resolve_hw(self, hw: str) -> str:
        if hw.endswith((".yaml", ".yml")) or "/" in hw:
            return self.resolve(hw)
        return hw


def load_spec(spec: str | os.PathLike | dict[str, Any]) -> SweepSpec:
    """Parse a spec file or dict; every mistake is one :class:`ConfigError` line naming the key."""
    if isinstance(spec, dict):
        return parse_spec(spec, source="sweep spec", base_dir=Path.cwd())
    path = Path(spec)
    if not path.is_file():
        raise ConfigError("sweep spec not found", source=str(path), fix="check the path")
    data = read_yaml(path, ConfigError)
    return parse_spec(data, source=str(path), base_dir=path.resolve().parent)


def parse_spec(data: Any, *, source: str, base_dir: Path) -> SweepSpec:
    if not isinstance(data, dict):
        raise ConfigError("a sweep spec is a mapping", source=source,
                          fix="write keys such as traces:, systems:, hw:, grid: (see `moesim sweep --help`)")
    unknown = [k for k in data if k not in SPEC_KEYS]
    if unknown:
        raise ConfigError(f"unknown key '{unknown[0]}'", source=source, field=str(unknown[0]),
                          fix=f"valid keys: {', '.join(SPEC_KEYS)}; put --set parameters under grid:, zip: or set:")

    def axis(singular: str, plural: str, default: list[Any] | None) -> list[Any]:
        if singular != plural and singular in data and plural in data:
            raise ConfigError(f"both '{singular}' and '{plural}' given", source=source, field=plural,
                              fix="keep one of them")
        value = data.get(plural, data.get(singular, default))
        if value is None:
            raise ConfigError(f"'{plural}' is missing", source=source, field=plural,
                              fix=f"add e.g. {plural}: [...]")
        values = value if isinstance(value, list) else [value]
        if not values:
            raise ConfigError(f"'{plural}' is empty", source=source, field=plural, fix="list at least one value")
        return values

    traces = [str(t) for t in axis("trace", "traces", None)]
    hws = [str(h) for h in axis("hw", "hw", [DEFAULT_HW])]
    systems = [str(s) for s in axis("system", "systems", None)]
    seeds = axis("seed", "seeds", [0])
    for i, seed in enumerate(seeds):
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise ConfigError(f"seed {seed!r} is not an integer in [0, 2**63)", source=source, field="seeds",
                              row=i, fix="use whole numbers from 0 to 9223372036854775807")
    model = data.get("model")
    fixed = _settings_map(data.get("set") or {}, "set", source)
    grid = {k: _values(v, f"grid.{k}", source) for k, v in _settings_map(data.get("grid") or {}, "grid",
                                                                          source).items()}
    zips_raw = data.get("zip") or []
    zips_raw = [zips_raw] if isinstance(zips_raw, dict) else zips_raw
    if not isinstance(zips_raw, list):
        raise ConfigError("'zip' must be a mapping or a list of mappings", source=source, field="zip",
                          fix="write zip: {key: [..], other: [..]} with equal-length lists")
    zips = []
    for i, group in enumerate(zips_raw):
        group = {k: _values(v, f"zip.{k}", source) for k, v in _settings_map(group, f"zip[{i}]", source).items()}
        lengths = {k: len(v) for k, v in group.items()}
        if len(set(lengths.values())) > 1:
            raise ConfigError(f"zipped lists differ in length ({lengths})", source=source, field=f"zip[{i}]",
                              fix="give every key of a zip group the same number of values")
        if group:
            zips.append(group)
    spec = SweepSpec(traces=traces, hw=hws, systems=_expand_systems(systems, source), seeds=seeds,
                     model=str(model) if model is not None else None, fixed=fixed, grid=grid, zips=zips,
                     base_dir=base_dir, source=source)
    _check_disjoint(spec)
    return spec


def _settings_map(value: Any, where: str, source: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"'{where}' must be a mapping of --set keys", source=source, field=where,
                          fix="write e.g. cache.slots_per_layer: [1, 2, 4]")
    return {normalize_key(k): v for k, v in value.items()}


def _values(value: Any, where: str, source: str) -> list[Any]:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ConfigError("empty list of values", source=source, field=where, fix="list at least one value")
    for i, v in enumerate(values):
        if isinstance(v, (dict, list)) or v is None:
            raise ConfigError(f"value {v!r} is not a number or string", source=source, field=where, row=i,
                              fix="list plain values, e.g. [1, 2, 4]")
    return values


def _expand_systems(systems: list[str], source: str) -> list[str]:
    from moesim.policy.systems import SYSTEMS, system_names
    out: list[str] = []
    for name in systems:
        if name == "all":
            out += system_names()
        elif name in SYSTEMS:
            out.append(name)
        else:
            raise ConfigError(f"unknown system '{name}'", source=source, field="systems",
                              fix=f"use one of: {', '.join(SYSTEMS)}, all")
    return list(dict.fromkeys(out))


def _check_disjoint(spec: SweepSpec) -> None:
    seen: dict[str, str] = {}
    sections = [("set", spec.fixed), ("grid", spec.grid)] + [(f"zip[{i}]", g) for i, g in enumerate(spec.zips)]
    for section, keys in sections:
        for key in keys:
            if key in seen:
                raise ConfigError(f"'{key}' appears in both {seen[key]} and {section}", source=spec.source,
                                  field=key, fix="vary each parameter in one place only")
            seen[key] = section


def check_spec(spec: SweepSpec, points: list[Point]) -> None:
    """Fail now, with one line, on anything that would make every point of a kind fail.

    Missing or malformed traces, unknown profiles, unknown ``--set`` keys or
    values of the wrong type. A cache that does not fit on one GPU is not a
    spec error: it fails its points only, which are recorded with the reason.
    """
    from moesim.hw.profile import load_profile
    from moesim.model.presets import load_preset
    from moesim.sim.run import members, parse_settings
    from moesim.policy.systems import build_system
    from moesim.trace.validate import checked_meta

    models = {}
    for i, trace in enumerate(spec.traces):
        path = spec.resolve(trace)
        if not Path(path).is_file():
            raise ConfigError(f"trace '{trace}' not found (looked at {path})", source=spec.source, field="traces",
                              row=i, fix="give a path relative to the spec file's folder, or an absolute one")
        models[trace] = checked_meta(path).model  # the whole validation pass, once, before any point runs
    if spec.model:
        _reraise(lambda: load_preset(spec.model), spec, "model")
    profiles = {hw: _reraise(lambda hw=hw: load_profile(spec.resolve_hw(hw)), spec, "hw") for hw in spec.hw}
    checked: set[tuple] = set()
    for point in points:
        settings = point.settings_str()
        if any(k.startswith("workload.") or k.partition(".")[0] == "scheduler" for k in settings):
            from moesim.sim.serving import split_settings  # a serving point: the rest are replay settings
            settings = _reraise(lambda: split_settings(settings).replay, spec, None)
        key = (point.hw, point.system, tuple(sorted(settings.items())))
        if key in checked:
            continue
        checked.add(key)
        parsed = _reraise(lambda: parse_settings(settings), spec, None)
        _reraise(lambda: profiles[point.hw].with_overrides(parsed.hw), spec, None)
        quotas = parsed.cache.slots_per_layer or []
        for model in {models[t] for t in spec.traces}:
            if any(q > model.num_experts for q in quotas):  # more slots than experts: wrong on any GPU
                raise ConfigError(f"cache.slots_per_layer={max(quotas)} outside [0, {model.num_experts}] "
                                  f"({model.name} has {model.num_experts} experts per layer)", source=spec.source,
                                  field="cache.slots_per_layer", fix=f"use 0..{model.num_experts}")
        for member in members(point.system):
            _reraise(lambda m=member: build_system(m, dict(parsed.system)), spec, None)


def _reraise(call: Callable[[], Any], spec: SweepSpec, field_: str | None) -> Any:
    try:
        return call()
    except MoesimError as err:
        where = f" ({err.source})" if err.source and err.source != spec.source else ""
        raise ConfigError(f"{err.detail}{where}", source=spec.source, field=field_ or err.field,
                          row=err.row, fix=err.fix) from None


# ----------------------------------------------------------------------------- running one point
def flatten_metrics(m: dict[str, Any]) -> dict[str, Any]:
    """A metrics dict as flat columns: breakdown per category, lists joined, ``system`` dropped."""
    out: dict[str, Any] = {}
    for key, value in m.items():
        if key == "system":
            continue
        if key == "breakdown_ms":
            out.update({f"breakdown_{cat}_ms": float(v) for cat, v in value.items()})
        elif isinstance(value, (list, tuple)):
            out[key] = "; ".join(str(v) for v in value)
        else:
            out[key] = value
    return out


def run_point(point: Point, trace_path: str, hw: Any) -> dict[str, Any]:
    """Replay one point; a failure becomes a row with ``status='error'`` and the reason, never an exception."""
    started = time.perf_counter()
    row = point.columns()
    try:
        from moesim.analysis.metrics import metrics
        from moesim.sim.run import simulate
        profile = cached_profile(hw) if isinstance(hw, str) else hw
        if any(k.startswith("workload.") or k.partition(".")[0] == "scheduler" for k in point.settings_str()):
            from moesim.analysis.serving import serving_row  # sweeps over workload.* serve instead of replaying
            row.update(status="ok", error="", **serving_row([trace_path], profile, point.system,
                                                            point.settings_str(), model_preset=point.model,
                                                            seed=point.seed))
        else:
            result = simulate(trace_path, profile, point.system, point.settings_str(),
                              model_preset=point.model, seed=point.seed, timeline=False, decisions=False)
            row.update(status="ok", error="", **flatten_metrics(metrics(result)))
    except Exception as err:  # noqa: BLE001 - a failing point is recorded, it must not stop the others
        row.update(status="error", error=describe_error(err))
    row.update(point_wall_s=time.perf_counter() - started,
               finished_at=datetime.now(timezone.utc).isoformat(timespec="microseconds"),
               worker=f"{socket.gethostname()}:{os.getpid()}")
    return row


#: per process: (profile file, its mtime and size) -> parsed profile; parsing the YAML costs about 0.1 s,
#: as much as replaying a short trace
_PROFILES: dict[tuple[str, int, int], Any] = {}


def cached_profile(hw: str) -> Any:
    """The profile named or pointed to by ``hw``, parsed once per process while its file is unchanged."""
    from moesim.hw.profile import load_profile
    path = Path(_profile_file(hw))
    if not path.is_file():
        return load_profile(hw)  # raises the usual one-line error
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _PROFILES:
        _PROFILES[key] = load_profile(path)
    return _PROFILES[key]


def describe_error(err: BaseException) -> str:
    """One line: a user error's own message, or the exception type, message and where it was raised."""
    if isinstance(err, MoesimError):
        return str(err)
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}".replace("\n", " ")


def error_row(point: Point, message: str) -> dict[str, Any]:
    return {**point.columns(), "status": "error", "error": message,
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="microseconds")}


# ----------------------------------------------------------------------------- results on disk
class ResultStore:
    """Finished rows by point id, mirrored to ``OUT`` and ``OUT.parts/`` when ``out`` is given."""

    def __init__(self, out: str | os.PathLike | None) -> None:
        self.out = Path(out) if out is not None else None
        self.rows: dict[str, dict[str, Any]] = {}
        self._lock_fd: int | None = None
        self._flushed_at = time.monotonic()
        self._dirty = False
        if self.out is not None:
            self._check_out()
            self._lock()
            self._load()

    @property
    def parts_dir(self) -> Path:
        assert self.out is not None
        return self.out.with_name(self.out.name + PARTS_SUFFIX)

    def done_ids(self) -> set[str]:
        return {pid for pid, row in self.rows.items() if row.get("status") == "ok"}

    def add(self, row: dict[str, Any]) -> None:
        self.rows[row["point_id"]] = row
        if self.out is None:
            return
        import pyarrow as pa
        part = pa.Table.from_pylist([row]).replace_schema_metadata(SWEEP_METADATA)
        _write_parquet_atomic(part, self.parts_dir / f"{row['point_id']}.parquet")
        self._dirty = True
        if time.monotonic() - self._flushed_at > FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        """Rewrite ``OUT`` from every row known (atomically)."""
        if self.out is None or not self.rows:
            return
        clean_stale_tmps(self.out)  # of sweeps killed while they rewrote it
        _write_parquet_atomic(_arrow_table(self.frame()), self.out)
        self._flushed_at = time.monotonic()
        self._dirty = False

    def close(self, complete: bool) -> None:
        """Final rewrite; with ``complete``, ``OUT`` then holds every row and the parts go."""
        if self.out is None:
            return
        try:
            if self._dirty or not self.out.exists():
                self.flush()
            if complete and self.parts_dir.exists():
                for part in self.parts_dir.glob("*.parquet"):
                    part.unlink()
        finally:
            self._unlock(remove_dir=complete)

    def frame(self, ids: Iterable[str] | None = None) -> Any:
        import pandas as pd
        rows = list(self.rows.values()) if ids is None else [self.rows[i] for i in ids if i in self.rows]
        return pd.DataFrame(rows)

    # -- internals
    def _check_out(self) -> None:
        assert self.out is not None
        if self.out.suffix.lower() != ".parquet":
            raise ConfigError("the sweep output must be a .parquet file", source=str(self.out), field="--out",
                              fix="end the file name with .parquet")
        if self.out.is_dir():
            raise ConfigError("the sweep output is a folder", source=str(self.out), field="--out",
                              fix="give a file name ending in .parquet")

    def _lock(self) -> None:
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # not POSIX: no protection against two writers
            return
        lock = self.parts_dir / ".lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = _lock_owner(fd)
            os.close(fd)
            if owner is not None and owner[0] == socket.gethostname() and not pid_alive(owner[1]):
                # its owner is gone (processes it left behind still hold the old file): take over
                lock.unlink(missing_ok=True)
                return self._lock()
            who = f" (pid {owner[1]} on {owner[0]})" if owner else ""
            raise ConfigError(f"another sweep is writing this output{who}", source=str(self.out), field="--out",
                              fix="wait for it to finish, or write to another file") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        _INHERITED_FDS.append(fd)

    def _unlock(self, remove_dir: bool) -> None:
        if self._lock_fd is None:
            return
        if remove_dir:
            (self.parts_dir / ".lock").unlink(missing_ok=True)
            for tmp in self.parts_dir.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
            try:
                self.parts_dir.rmdir()
            except OSError:
                pass  # something else lives there; leave it
        if self._lock_fd in _INHERITED_FDS:
            _INHERITED_FDS.remove(self._lock_fd)
        os.close(self._lock_fd)
        self._lock_fd = None

    def _load(self) -> None:
        import pyarrow.parquet as pq
        assert self.out is not None
        if self.out.exists():
            try:
                table = pq.read_table(self.out)
            except Exception:  # noqa: BLE001 - any unreadable file gets the same one-line answer
                raise ConfigError("not a readable Parquet file", source=str(self.out), field="--out",
                                  fix="write the sweep to another file") from None
            if "point_id" not in table.column_names:
                raise ConfigError("not a sweep result (no 'point_id' column)", source=str(self.out),
                                  field="--out", fix="write the sweep to another file")
            for row in table.to_pylist():
                self.rows[row["point_id"]] = row
        for part in sorted(self.parts_dir.glob("*.parquet")):
            try:
                rows = pq.read_table(part).to_pylist()
            except Exception:  # noqa: BLE001 - cannot happen with atomic renames; recompute if it does
                part.unlink(missing_ok=True)
                continue
            for row in rows:
                self.rows[row["point_id"]] = row


def _lock_owner(fd: int) -> tuple[str, int] | None:
    """(host, pid) recorded in a lock file, if any."""
    try:
        host, pid = os.pread(fd, 300, 0).decode().split()
        return host, int(pid)
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _arrow_table(frame: Any) -> Any:
    """A pyarrow table of ``frame``; object columns mixing types (4 and "auto") become strings."""
    import pyarrow as pa
    frame = frame.copy()
    for col in frame.columns:
        if frame[col].dtype == object:
            kinds = {type(v) for v in frame[col] if v is not None and not (isinstance(v, float) and math.isnan(v))}
            if len(kinds) > 1:
                frame[col] = [None if v is None or (isinstance(v, float) and math.isnan(v)) else setting_str(v)
                              for v in frame[col]]
    return pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata(SWEEP_METADATA)


def _write_parquet_atomic(table: Any, path: Path) -> None:
    """Temporary sibling, fsync, rename: ``path`` holds the old file or the whole new one."""
    import pyarrow.parquet as pq
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- engines
@dataclass
class SweepSummary:
    points: int
    skipped: int
    ran: int
    failed: int
    wall_s: float


def run_sweep(spec: SweepSpec, out: str | os.PathLike | None = None, *, workers: int | None = None,
              engine: str = "local", address: str | None = None, progress: bool = False,
              console: Any = None) -> tuple[Any, SweepSummary]:
    """Run every point of ``spec`` not yet finished in ``out``; return (frame of the spec's points, summary)."""
    if engine not in ENGINES:
        raise ConfigError(f"unknown engine '{engine}'", field="--engine", fix=f"use one of: {', '.join(ENGINES)}")
    if address and engine != "ray":
        raise ConfigError("--address needs --engine ray", field="--address", fix="add --engine ray")
    if workers is not None and workers < 1:
        raise ConfigError(f"workers={workers}", field="--workers", fix="use 1 or more")
    if engine == "ray":
        require_ray()
    points = spec.points()
    check_spec(spec, points)
    started = time.perf_counter()
    store = ResultStore(out)
    bar = ProgressBar(progress, console)
    complete = False
    failed = 0
    try:
        done = store.done_ids()
        todo = [p for p in points if p.point_id not in done]

        by_id = {p.point_id: p for p in todo}

        def finished(row: dict[str, Any]) -> None:
            nonlocal failed
            point = by_id[row["point_id"]]
            row.update(trace_path=spec.resolve(point.trace), hw_path=spec.resolve_hw(point.hw))
            store.add(row)
            failed += row["status"] != "ok"
            bar.advance(failed)

        if todo:
            runner = _run_ray if engine == "ray" else _run_local
            runner(spec, todo, workers or default_workers(), address,
                   lambda: bar.start(len(points), len(points) - len(todo)), finished)
        complete = True
    finally:
        bar.stop()
        store.close(complete=complete)
    frame = _ordered(store.frame([p.point_id for p in points]), spec)
    summary = SweepSummary(points=len(points), skipped=len(points) - len(todo), ran=len(todo), failed=failed,
                           wall_s=time.perf_counter() - started)
    return frame, summary


def default_workers() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _ordered(frame: Any, spec: SweepSpec) -> Any:
    """Parameters first, then status, metrics, and the wall-clock and location columns last."""
    if frame.empty:
        return frame
    head = ["point_id", "trace", "hw", "system", "seed", "model", *dict.fromkeys(spec.parameter_keys()),
            "status", "error"]
    head = [c for c in head if c in frame.columns]
    tail = [c for c in WALL_CLOCK_COLUMNS + LOCATION_COLUMNS if c in frame.columns]
    middle = [c for c in frame.columns if c not in head and c not in tail]
    return frame[head + middle + tail].reset_index(drop=True)


class ProgressBar:
    """Sweep progress on stderr with the count of failed points (:class:`moesim.progress.Progress`:
    a rich bar on a terminal, plain lines otherwise; off when ``enabled`` is false)."""

    def __init__(self, enabled: bool, console: Any = None) -> None:
        self.enabled = enabled
        self.console = console
        self._bar: Any = None

    def start(self, total: int, already: int) -> None:
        if not self.enabled:
            return
        from moesim.progress import Progress
        stream = getattr(self.console, "file", None)
        self._bar = Progress("sweep", total=total, unit="points", stream=stream, console=self.console)
        self._bar.start()
        self._bar.advance(already, extra="0 failed")

    def advance(self, failed: int) -> None:
        if self._bar is not None:
            self._bar.advance(1, extra=f"{failed} failed")

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


Finished = Callable[[dict[str, Any]], None]


def _run_local(spec: SweepSpec, points: list[Point], workers: int, address: str | None,
               started: Callable[[], None], finished: Finished) -> None:
    """Points in a process pool; one worker: in this process. Each worker decodes a trace once for all its
    points and systems (``moesim.trace.io.iter_steps`` keeps it per process)."""
    from moesim.trace.io import keeping_decoded
    jobs = [(p, spec.resolve(p.trace), spec.resolve_hw(p.hw)) for p in points]
    if workers == 1 or len(jobs) == 1:
        started()
        with keeping_decoded():
            for job in jobs:
                finished(run_point(*job))
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    import moesim.analysis.metrics  # noqa: F401 - imported once here, not in every forked worker
    import pandas  # noqa: F401
    from moesim.trace.validate import wait_for_checks
    wait_for_checks()  # no validation thread may be running when the workers fork
    # fork (on Linux) lets workers see systems registered at run time, e.g. in a notebook; the pool
    # forks all its workers at the first submit, before the progress bar starts its thread
    context = multiprocessing.get_context("fork") if sys.platform.startswith("linux") else None
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=context,
                             initializer=_worker_init, initargs=(os.getpid(), _INHERITED_FDS[:])) as pool:
        futures = {pool.submit(run_point, *job): job[0] for job in jobs}
        started()
        try:
            for future in as_completed(futures):
                try:
                    row = future.result()
                except Exception as err:  # noqa: BLE001 - e.g. a worker killed by the OS
                    row = error_row(futures[future], describe_error(err))
                finished(row)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise


#: file descriptors a forked worker must not keep open (the output lock: an orphan holding it would
#: block every resume)
_INHERITED_FDS: list[int] = []


def _worker_init(parent: int, close_fds: list[int]) -> None:
    """In each pool worker: die with the sweep process, drop its lock, keep traces decoded."""
    from moesim.trace.io import keep_decoded
    keep_decoded()
    for fd in close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    die_with_parent(parent)


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (PR_SET_PDEATHSIG); elsewhere, a
    watchdog thread polls the parent pid. Either way no worker outlives a ``kill -9`` of the sweep."""
    import signal
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                if os.getppid() != parent:  # the parent died before the call
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass
    import threading

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)
    threading.Thread(target=watch, name="moesim-parent-watch", daemon=True).start()


# -- ray
def _run_ray(spec: SweepSpec, points: list[Point], workers: int, address: str | None,
             started: Callable[[], None], finished: Finished) -> None:
    """Points as Ray tasks, one CPU each; trace and profile files put in the object store once."""
    ray = require_ray()
    started_here = not ray.is_initialized()
    if started_here:
        import logging
        kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
        try:
            if address:
                ray.init(address=address, **kwargs)
            else:
                ray.init(num_cpus=workers, **kwargs)
        except Exception as err:  # noqa: BLE001 - Ray raises many kinds; all mean the same to the user
            with_reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            raise ConfigError(f"Ray did not start: {with_reason}", field="--engine",
                              fix="run `ray stop --force` and retry, or use --engine local") from None
    try:
        remote = ray.remote(num_cpus=1)(_ray_point)
        shipped: dict[str, ShippedFile] = {}
        profiles: dict[str, Any] = {}
        pending: dict[Any, Point] = {}
        for p in points:
            trace, hw = spec.resolve(p.trace), spec.resolve_hw(p.hw)
            if trace not in shipped:
                shipped[trace] = ShippedFile.put(ray, Path(trace))
            if hw not in profiles:  # parsed once here; workers get the object, not the YAML to parse again
                profiles[hw] = ray.put(cached_profile(hw))
            pending[remote.remote(p, shipped[trace], profiles[hw])] = p
        started()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=min(len(pending), 32), timeout=0.5)
            for ref in ready:
                point = pending.pop(ref)
                try:
                    row = ray.get(ref)
                except Exception as err:  # noqa: BLE001 - a task whose worker died
                    row = error_row(point, describe_error(err))
                finished(row)
    finally:
        if started_here:
            ray.shutdown()


def require_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("the ray engine needs Ray, which is not installed", field="--engine",
                          fix="pip install 'moesim[sweep]' (ray>=2.9), or use --engine local") from None
    return ray


def _profile_file(hw: str) -> str:
    """The YAML file behind a profile name or path (Ray workers get the file, not the name)."""
    from moesim.hw.profile import PROFILE_DIR
    path = Path(hw)
    if not path.exists() and not path.suffix:
        path = PROFILE_DIR / f"{hw}.yaml"
    return str(path)


@dataclass(frozen=True)
class ShippedFile:
    """A file put in Ray's object store once; the reference sits in a list so that Ray passes it
    to tasks unresolved and a worker fetches it only when it has no copy yet."""

    name: str
    digest: str
    ref: list[Any]

    @classmethod
    def put(cls, ray: Any, path: Path) -> "ShippedFile":
        data = path.read_bytes()
        return cls(path.name, hashlib.sha256(data).hexdigest(), [ray.put(data)])


#: per worker process: content digest -> local copy
_LOCAL_COPIES: dict[str, str] = {}


def local_copy(shipped: ShippedFile, fetch: Callable[[Any], bytes]) -> str:
    """This process's copy of ``shipped``, fetched on first use only.

    Copies live in a content-addressed folder under the temporary directory,
    so workers of one machine (and later sweeps) share them.
    """
    if shipped.digest not in _LOCAL_COPIES:
        import tempfile
        folder = Path(tempfile.gettempdir()) / "moesim-sweep-files" / shipped.digest[:32]
        path = folder / shipped.name
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{shipped.name}.{os.getpid()}.tmp"
            tmp.write_bytes(fetch(shipped.ref[0]))
            os.replace(tmp, path)
        _LOCAL_COPIES[shipped.digest] = str(path)
    return _LOCAL_COPIES[shipped.digest]


def _ray_point(point: Point, trace: ShippedFile, profile: Any) -> dict[str, Any]:
    """One point in a Ray worker: the trace copied to local disk once per machine (validated and decoded
    once per worker process: ``moesim.trace.io.iter_steps`` keeps it), the profile already parsed (from the
    object store)."""
    import ray

    from moesim.trace.io import keep_decoded
    keep_decoded()
    return run_point(point, local_copy(trace, ray.get), profile)
