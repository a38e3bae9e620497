"""A serving run's workload: the ``workload.*`` settings, checked, and the arrival times they give.

Arrival processes (``workload.arrival``):

* ``poisson``: exponential gaps at ``workload.qps``;
* ``gamma``: gamma gaps with mean ``1/qps`` and coefficient of variation ``workload.cv`` (bursty for cv > 1);
* ``trace``: the ``arrival_s`` column of ``workload.arrival_file`` (CSV or Parquet);
* ``closed``: ``workload.concurrency`` clients, each sending its next request when the previous one finishes.

:func:`split_settings` separates these (and ``scheduler[.*]``) from a replay's settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moesim.errors import ConfigError, did_you_mean
from moesim.policy.base import coerce

ARRIVALS = ("poisson", "gamma", "trace", "closed")
#: below this coefficient of variation gamma gaps are drawn as exactly 1/qps: their spread is under 1e-8 of a gap,
#: and the gamma's shape 1/cv^2 overflows far below it
REGULAR_CV = 1e-8
#: columns of an arrival file that would choose which requests arrive, which serving does not read
REQUEST_NAMING = ("request", "request_id", "source_request")
#: the latest arrival a run takes, in seconds of simulated time. The engine keeps absolute times in float64:
#: at 1e7 s one unit in the last place is 1.9e-9 s, so a 1 ms step keeps six significant digits; at 1e12 s
#: a TTFT of 190 ms came out 0.3% short, and past 1e16 s every step took 0 s
LATEST_ARRIVAL_S = 1e7
#: the arrival processes ``workload.qps`` sets the rate of
RATED_ARRIVALS = ("poisson", "gamma")
#: workload settings that only some arrival processes read
READ_BY = {"workload.qps": RATED_ARRIVALS, "workload.cv": ("gamma",), "workload.concurrency": ("closed",),
           "workload.arrival_file": ("trace",)}


@dataclass
class WorkloadConfig:
    """Arrival process and request count, reachable as ``--set workload.<name>=value``."""

    #: poisson | gamma | trace | closed
    arrival: str = "poisson"
    #: mean arrival rate, requests per second (poisson, gamma)
    qps: float = 1.0
    #: coefficient of variation of the gaps (gamma; 1 is Poisson)
    cv: float = 1.0
    #: requests sent, drawn from the traces' requests in turn
    requests: int = 100
    #: clients of a closed loop, each with one request outstanding
    concurrency: int = 1
    #: CSV or Parquet with an ``arrival_s`` column (arrival=trace)
    arrival_file: str = ""
    #: KV cache entries (tokens) for requests, used in whole blocks of the scheduler's kv_block_tokens; 0: all
    #: GPU memory the expert cache leaves
    kv_tokens: int = 0


@dataclass
class ServingSettings:
    workload: WorkloadConfig
    scheduler: str
    scheduler_params: dict[str, str]
    replay: dict[str, str]


def is_serving_key(key: str) -> bool:
    return key.startswith("workload.") or key == "scheduler" or key.startswith("scheduler.")


def check_read(settings: dict[str, str], given: list[str], names: dict[str, str] | None = None) -> None:
    """Refuse each of the workload settings ``given`` that the arrival process ``settings`` choose does not read
    (``--qps 5`` with a closed loop ran as if unset); the error names a setting as ``names`` says (an option)."""
    arrival = split_settings(settings).workload.arrival
    for key in given:
        if key in READ_BY and arrival not in READ_BY[key]:
            option = (names or {}).get(key, key)
            readers = " or ".join(f"workload.arrival={a}" for a in READ_BY[key])
            raise ConfigError(f"workload.arrival={arrival} does not read {option}, so it would change nothing",
                              field=option, fix=f"leave out {option}, or use {readers}")


def split_settings(settings: dict[str, str] | None) -> ServingSettings:
    """Separate ``workload.*`` and ``scheduler[.*]`` from the replay settings, and parse the workload."""
    workload = WorkloadConfig()
    names = {f.name: f.default for f in dataclasses.fields(WorkloadConfig)}
    scheduler, params, replay = "vllm", {}, {}
    for key, raw in (settings or {}).items():
        section, _, rest = key.partition(".")
        if section == "workload":
            if rest not in names:
                valid = [f"workload.{n}" for n in names]
                raise ConfigError(f"unknown parameter '{key}'", field="--set",
                                  fix=f"{did_you_mean(key, valid)}valid: {', '.join(valid)}")
            _above_zero(rest, raw, key)
            setattr(workload, rest, coerce(raw, names[rest], key))
        elif key == "scheduler":
            scheduler = str(raw)
        elif section == "scheduler":
            params[rest] = raw
        else:
            replay[key] = raw
    _check_workload(workload)
    return ServingSettings(workload, scheduler, params, replay)


#: workload settings valid only above zero, with a valid value to suggest: the generic check of numbers
#: asks for a value >= 0, and then 0 was refused too
ABOVE_ZERO = {"qps": "0.5", "cv": "2", "requests": "1", "concurrency": "1"}


def _above_zero(name: str, raw: Any, key: str) -> None:
    if name not in ABOVE_ZERO:
        return
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return  # not a number: coerce says so
    if not value > 0:
        raise ConfigError(f"{name} must be above 0, got {raw}", field=key, fix=f"use e.g. {ABOVE_ZERO[name]}")


def _check_workload(w: WorkloadConfig) -> None:
    if w.arrival not in ARRIVALS:
        raise ConfigError(f"unknown arrival process '{w.arrival}'", field="workload.arrival",
                          fix=f"{did_you_mean(w.arrival, ARRIVALS)}use one of {', '.join(ARRIVALS)}")
    if w.requests < 1:
        raise ConfigError("at least one request is needed", field="workload.requests", fix="use >= 1")
    if w.arrival in RATED_ARRIVALS and not w.qps > 0:
        raise ConfigError(f"qps must be positive, got {w.qps}", field="workload.qps", fix="use e.g. 0.5")
    if w.arrival == "gamma" and not w.cv > 0:
        raise ConfigError(f"cv must be positive, got {w.cv}", field="workload.cv", fix="use e.g. 2")
    if w.arrival == "closed" and w.concurrency < 1:
        raise ConfigError("a closed loop needs at least one client", field="workload.concurrency", fix="use >= 1")
    if w.arrival == "trace" and not w.arrival_file:
        raise ConfigError("arrival=trace needs a file of arrival times", field="workload.arrival_file",
                          fix="give a CSV or Parquet with an arrival_s column")
    if w.kv_tokens < 0:
        raise ConfigError("kv_tokens must be >= 0", field="workload.kv_tokens", fix="use 0 for all free memory")


def check_horizon(w: WorkloadConfig) -> None:
    """Refuse a rate whose requests would arrive over more than LATEST_ARRIVAL_S of simulated time."""
    if w.arrival in RATED_ARRIVALS and w.requests / w.qps > LATEST_ARRIVAL_S:
        raise ConfigError(f"{w.requests:,} requests at {w.qps:g} req/s arrive over about {w.requests / w.qps:.3g} s "
                          f"of simulated time, past the {LATEST_ARRIVAL_S:.0e} s within which step times keep "
                          "their digits", field="workload.qps",
                          fix=f"use a rate of at least {w.requests / LATEST_ARRIVAL_S:.3g} req/s, or fewer requests")


# ----------------------------------------------------------------------------- arrival times
def arrival_times(w: WorkloadConfig, rng: np.random.Generator) -> np.ndarray:
    """Open-loop arrival times, seconds from the start (sorted), none later than LATEST_ARRIVAL_S."""
    if w.arrival == "poisson":
        return _within_horizon(np.cumsum(rng.exponential(1.0 / w.qps, w.requests)), w)
    if w.arrival == "gamma":
        if w.cv < REGULAR_CV:  # 1/cv^2 overflowed (cv=1e-200: division by zero; 1e-154: every gap 0)
            return _within_horizon(np.arange(1, w.requests + 1) / w.qps, w)
        shape = 1.0 / (w.cv * w.cv)
        return _within_horizon(np.cumsum(rng.gamma(shape, 1.0 / (w.qps * shape), w.requests)), w)
    return _arrival_file(w)


def _within_horizon(times: np.ndarray, w: WorkloadConfig) -> np.ndarray:
    """Refuse drawn arrivals past LATEST_ARRIVAL_S (a bursty gamma draw can reach it when its mean does not)."""
    if len(times) and times[-1] > LATEST_ARRIVAL_S:
        raise ConfigError(f"the last of {w.requests:,} arrivals at {w.qps:g} req/s comes at {times[-1]:.3g} s of "
                          f"simulated time, past the {LATEST_ARRIVAL_S:.0e} s within which step times keep their "
                          "digits", field="workload.qps", fix="use a higher rate, or fewer requests")
    return times


def _arrival_file(w: WorkloadConfig) -> np.ndarray:
    path = Path(w.arrival_file)
    if not path.is_file():
        raise ConfigError("file not found", source=str(path), field="workload.arrival_file", fix="check the path")
    frame = _arrival_frame(path)
    named = [c for c in REQUEST_NAMING if c in frame]
    if named:  # request i is pool entry i mod pool size: a column choosing requests would be ignored unseen
        raise ConfigError(f"the file names requests (column '{named[0]}'), and arrival files give times only",
                          source=str(path), field=named[0],
                          fix="drop the column: request i is the traces' request i (mod their count); to serve "
                              "chosen requests, give a trace of those (moesim trace synth, or a filtered trace)")
    if "arrival_s" not in frame:  # the columns it has: ' arrival_s ' or 'arrival_s;x' look like it but are not
        found = ", ".join(repr(str(c)) for c in list(frame.columns)[:8]) or "none"
        raise ConfigError(f"no arrival_s column (its columns: {found})", source=str(path), field="arrival_s",
                          fix="name the column of arrival times, in seconds, exactly arrival_s in a comma-separated "
                              "CSV or a Parquet file")
    try:
        times = frame["arrival_s"].to_numpy(dtype=float)
    except (TypeError, ValueError):  # a word among the numbers: the user's file, not an internal error
        raise ConfigError("arrival_s holds a value that is not a number of seconds", source=str(path),
                          field="arrival_s", fix="give each request's arrival time in seconds") from None
    if not len(times):  # "0 arrivals for N requests" would suggest workload.requests <= 0, which is refused
        raise ConfigError("the file holds no arrival times", source=str(path), field="arrival_s",
                          fix="give one row per request, with its arrival time in seconds")
    if len(times) < w.requests:
        raise ConfigError(f"{len(times)} arrivals for {w.requests} requests", source=str(path), field="arrival_s",
                          fix=f"give workload.requests <= {len(times)}")
    times = times[:w.requests]
    _check_times(times, str(path))
    return times


#: the fix of an arrival file that cannot be read as a table
ARRIVAL_FILE_FIX = "give a CSV or Parquet file with an arrival_s column: each request's arrival time in seconds"


def _arrival_frame(path: Path) -> Any:
    """The table in an arrival file: Parquet when it starts as one (``PAR1``) or is named ``.parquet``, CSV
    otherwise; a file that is empty, not a table, or a Parquet file cut short is one line saying which (it said
    "unreadable (EmptyDataError)" or "(ArrowInvalid)")."""
    import pandas as pd

    def refused(what: str) -> ConfigError:
        return ConfigError(what, source=str(path), field="workload.arrival_file", fix=ARRIVAL_FILE_FIX)
    try:
        with open(path, "rb") as file:
            head = file.read(4)
    except OSError as err:
        raise refused(f"cannot be read ({err.strerror or type(err).__name__})") from None
    if not head:
        raise refused("the file is empty (0 bytes)")
    parquet = head == b"PAR1" or path.suffix.lower() == ".parquet"
    try:
        return pd.read_parquet(path) if parquet else pd.read_csv(path)
    except pd.errors.EmptyDataError:  # blank lines only
        raise refused("the file is empty (no header line, no rows)") from None
    except UnicodeDecodeError:
        raise refused("neither a Parquet file nor a CSV file (it is not text)") from None
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
        if parquet:
            raise refused("not a Parquet file, or one cut short or damaged (its footer is missing or broken)") \
                from None
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise refused(f"not a CSV file that can be read ({reason})") from None


def _check_times(times: np.ndarray, source: str) -> None:
    """Each of a file's arrival times a number of seconds from 0 to LATEST_ARRIVAL_S, in order; the first bad
    one named by its row (1 = the first time), with the fix that one needs (sorting mended no nan)."""
    bad = np.flatnonzero(~np.isfinite(times) | (times < 0) | (times > LATEST_ARRIVAL_S))
    if len(bad):
        row = int(bad[0])
        raise ConfigError(f"row {row + 1} has arrival_s={times[row]:g}", source=source, field="arrival_s",
                          fix=f"give each arrival in seconds from 0 to {LATEST_ARRIVAL_S:.0e} (past it, float64 "
                              "seconds keep too few digits for step times)")
    late = np.flatnonzero(np.diff(times) < 0)
    if len(late):
        row = int(late[0]) + 1
        raise ConfigError(f"row {row + 1}'s arrival_s={times[row]:g} is earlier than row {row}'s "
                          f"{times[row - 1]:g}", source=source, field="arrival_s",
                          fix="sort the file by arrival_s")
