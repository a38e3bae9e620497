"""Export a timeline in the Chrome Trace Event Format, for ui.perfetto.dev and chrome://tracing.

The format is a JSON object whose ``traceEvents`` list holds:

* one complete event (``"ph": "X"``) per timeline row, ``ts`` and ``dur`` in
  microseconds, named like ``L12 E37 expert (4 tok)``, with step, layer,
  expert and tokens under ``args``;
* one process per resource group (PCIe, GPU, CPU) and one thread per lane,
  named by metadata events (``"ph": "M"``) and ordered by ``*_sort_index``
  like the Gantt chart of :mod:`moesim.analysis.plots` (PCIe on top);
* a global instant event (``"ph": "i"``) and a ``step`` counter sample
  (``"ph": "C"``) where each forward pass starts.

Viewers require the complete events of one thread to nest; two copy engines
logged on one lane overlap without nesting, so overlapping spans of a lane are
spread over extra threads (``... #2``) instead of being dropped by the viewer.
Times are written in whole nanoseconds, the resolution viewers read; a span that
starts less than :data:`SLACK_NS` before the previous one on its lane ends is
floating-point noise of the engine's sums (a step's first span starts where the
last one ended), not a second track: it is written as starting where that one ends.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd

from moesim.analysis.timeline import check_timeline, in_steps
from moesim.util import atomic_writer

#: process id and display order of each resource group
PROCESSES = {"pcie": (1, "PCIe (host to device)"), "gpu": (2, "GPU"), "cpu": (3, "CPU")}
#: the PCIe process's name when its copy engines also write evicted experts back (mixtral-offloading)
PCIE_BOTH_WAYS = "PCIe (host to device; writeback: device to host)"
LANE_NAMES = {"pcie": "copy engine", "gpu": "stream", "cpu": "expert pool"}
#: thread ids are unique across processes: pid * TID_STRIDE + track index
TID_STRIDE = 1000
#: overlap (ns) on one lane below which two spans are back to back: rounding of sums of seconds
SLACK_NS = 1


def _ns(seconds: np.ndarray) -> np.ndarray:
    """Seconds to whole nanoseconds, the resolution of the JSON (``ts`` in microseconds, 3 decimals)."""
    return np.rint(np.asarray(seconds, dtype=float) * 1e9).astype(np.int64)


def _us(nanoseconds: int) -> float:
    """Whole nanoseconds as microseconds (exact to the nanosecond, so the JSON stays short)."""
    return nanoseconds / 1000


def event_name(kind: str, layer: int, expert: int, tokens: int) -> str:
    """``L12 E37 expert (4 tok)``; work outside the MoE layers (layer -1: embedding, LM head) has no ``L``."""
    where = (f"L{layer} " if layer >= 0 else "") + (f"E{expert} " if expert >= 0 else "")
    return f"{where}{kind} ({tokens} tok)" if tokens > 0 else f"{where}{kind}"


def _pack_tracks(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Greedy interval partitioning of spans in whole ns: the smallest track index where each span does not
    overlap by more than ``SLACK_NS``. A span within the slack is moved to start where its track is free
    (``start`` and ``end`` are updated in place), so no two spans of a track overlap in the JSON."""
    order = np.argsort(start, kind="stable")
    track = np.zeros(len(start), dtype=np.int64)
    track_end: list[int] = []
    for i in order.tolist():
        for t, busy_until in enumerate(track_end):
            if start[i] >= busy_until - SLACK_NS:
                start[i] = max(start[i], busy_until)
                end[i] = max(end[i], start[i])
                break
        else:
            t = len(track_end)
            track_end.append(0)
        track[i] = t
        track_end[t] = int(end[i])
    return track


def _threads(frame: pd.DataFrame, start: np.ndarray, end: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """pid and tid of every row, and the metadata events naming them; ``start`` and ``end`` (ns) of a span
    within the slack of its track's previous one are moved to follow it."""
    pid = np.zeros(len(frame), dtype=np.int64)
    tid = np.zeros(len(frame), dtype=np.int64)
    meta: list[dict[str, Any]] = []
    resources = frame["resource"].astype(str).to_numpy()
    lanes = frame["lane"].to_numpy()
    extra = [r for r in sorted(set(resources)) if r not in PROCESSES]
    groups = {**PROCESSES, **{r: (len(PROCESSES) + 1 + i, r.upper()) for i, r in enumerate(extra)}}
    if ((resources == "pcie") & (frame["kind"].astype(str).to_numpy() == "writeback")).any():
        groups["pcie"] = (PROCESSES["pcie"][0], PCIE_BOTH_WAYS)
    for resource, (p, label) in groups.items():
        in_group = resources == resource
        if not in_group.any():
            continue
        meta.append(_meta("process_name", p, 0, {"name": label}))
        meta.append(_meta("process_sort_index", p, 0, {"sort_index": p}))
        index = 0
        for lane in np.unique(lanes[in_group]):
            rows = np.flatnonzero(in_group & (lanes == lane))
            lane_start, lane_end = start[rows], end[rows]
            tracks = _pack_tracks(lane_start, lane_end)
            start[rows], end[rows] = lane_start, lane_end
            for t in range(int(tracks.max()) + 1):
                index += 1
                thread = p * TID_STRIDE + index
                name = f"{LANE_NAMES.get(resource, 'lane')} {lane}" + (f" #{t + 1}" if t else "")
                meta.append(_meta("thread_name", p, thread, {"name": name}))
                meta.append(_meta("thread_sort_index", p, thread, {"sort_index": index}))
                pid[rows[tracks == t]] = p
                tid[rows[tracks == t]] = thread
    return pid, tid, meta


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def _step_events(starts: pd.Series) -> list[dict[str, Any]]:
    """An instant event and a counter sample where each step's first span starts (``starts``: by step)."""
    pid = PROCESSES["gpu"][0]
    events: list[dict[str, Any]] = []
    for step, start in starts.items():
        ts = _us(int(start))
        events.append({"name": f"step {int(step)}", "cat": "step", "ph": "i", "s": "g", "ts": ts,
                       "pid": pid, "tid": 0, "args": {"step": int(step)}})
        events.append({"name": "step", "cat": "step", "ph": "C", "ts": ts, "pid": pid, "tid": 0,
                       "args": {"step": int(step)}})
    return events


def _json_safe(value: Any) -> Any:
    """``meta`` as plain JSON values: numpy scalars and paths become numbers and strings."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN or infinity
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _trace_events(frame: pd.DataFrame) -> tuple[list[dict[str, Any]], Iterator[dict[str, Any]]]:
    """The metadata events, and the step markers and spans of ``frame`` one by one in time order (built as
    they are consumed: a long replay has millions)."""
    check_timeline(frame)
    frame = frame.reset_index(drop=True)
    starts, ends = _ns(frame["start_s"].to_numpy(dtype=float)), _ns(frame["end_s"].to_numpy(dtype=float))
    pid, tid, meta = _threads(frame, starts, ends)
    step_starts = pd.Series(starts, index=frame.index).groupby(frame["step"].to_numpy(), sort=True).min()
    markers = _step_events(step_starts)
    # step markers first (two per step, at its first span's start), so a stable sort keeps them ahead of it
    order = np.argsort(np.concatenate([np.repeat(step_starts.to_numpy(dtype=np.int64), 2), starts]), kind="stable")
    resource, kind = frame["resource"].astype(str).to_numpy(), frame["kind"].astype(str).to_numpy()
    ints = frame[["step", "layer", "expert", "tokens"]].to_numpy(dtype=np.int64)

    def spans() -> Iterator[dict[str, Any]]:
        for index in order.tolist():
            if index < len(markers):
                yield markers[index]
                continue
            row = index - len(markers)
            step, layer, expert, tokens = ints[row].tolist()
            start, stop = int(starts[row]), int(ends[row])
            yield {"name": event_name(kind[row], layer, expert, tokens), "cat": f"{resource[row]},{kind[row]}",
                   "ph": "X", "ts": _us(start), "dur": _us(stop - start), "pid": int(pid[row]),
                   "tid": int(tid[row]), "args": {"step": step, "layer": layer, "expert": expert, "tokens": tokens}}
    return meta, spans()


def to_chrome_trace(frame: pd.DataFrame, meta: dict[str, Any] | None = None,
                    steps: tuple[int, int] | None = None) -> dict[str, Any]:
    """The timeline ``frame`` (its ``steps`` only, when given) as a Chrome Trace Event Format object;
    ``meta`` goes under ``otherData``."""
    head, events = _trace_events(in_steps(frame, steps))
    return {"traceEvents": head + list(events), "displayTimeUnit": "ms", "otherData": _json_safe(meta or {})}


def write_chrome_trace(frame: pd.DataFrame, path: str | os.PathLike, meta: dict[str, Any] | None = None,
                       steps: tuple[int, int] | None = None) -> Path:
    """Write :func:`to_chrome_trace` as JSON, an event at a time (a whole-run trace of a long replay is
    hundreds of MB: never held as one object or string); the file appears whole at ``path`` or not at all."""
    head, events = _trace_events(in_steps(frame, steps))
    dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
    with atomic_writer(Path(path)) as fh:
        fh.write(b'{"traceEvents":[')
        for i, event in enumerate(itertools.chain(head, events)):
            fh.write((b"," if i else b"") + dumps(event).encode())
        tail = dumps(_json_safe(meta or {}))
        fh.write(f'],"displayTimeUnit":"ms","otherData":{tail}}}'.encode())
    return Path(path)
