"""A replay's results as the Python API returns them (:class:`ReplayResult`): metrics, timeline, decision log
and one row per forward pass, shown in Jupyter, drawn, saved to a folder and read back."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from moesim.errors import ConfigError
from moesim.notebook import callers_lines
from moesim.util import is_missing

#: the figures a result's one-line repr shows
REPR_METRICS = ("ttft_ms", "tpot_ms_mean", "decode_tokens_per_s", "gpu_hit_rate")
#: the figures a notebook shows of a replay (the whole row is in ``metrics``)
HTML_METRICS = ("ttft_ms", "tpot_ms_mean", "tpot_ms_p99", "decode_tokens_per_s", "makespan_s", "gpu_hit_rate",
                "pcie_h2d_bytes", "cpu_util", "gpu_util", "pcie_util", "expert_slots", "gap_to_lower_bound")
#: the frames a saved result keeps, each as ``NAME.parquet`` (absent when the replay did not keep it)
FRAMES = ("metrics", "timeline", "decisions", "steps")
#: the file of a saved result that holds what is not a frame: system, trace and the nested metrics
META_FILE = "result.json"


def step_frame(steps: Sequence[Any], decisions: Any = None) -> Any:
    """One row per forward pass (``StepRecord``): step, phase, start_s, end_s, latency_ms, tokens, requests (the
    batch's request ids), and with a decision log the count of each of its actions in the step (``gpu_hit``,
    ``gpu_load``, ``cpu``, ``prefetch``, ``evict``, ...; moesim.analysis.timeline.DECISION_ACTIONS)."""
    import pandas as pd

    from moesim.analysis.timeline import DECISION_ACTIONS
    frame = pd.DataFrame({"step": [s.step for s in steps], "phase": [s.phase for s in steps],
                          "start_s": [s.start for s in steps], "end_s": [s.end for s in steps],
                          "tokens": [s.tokens for s in steps], "requests": [list(s.requests) for s in steps]})
    frame.insert(4, "latency_ms", (frame.end_s - frame.start_s) * 1e3)
    if decisions is not None:
        counts = pd.crosstab(decisions["step"], decisions["action"].astype(str))
        counts = counts.reindex(index=frame.step, columns=list(DECISION_ACTIONS), fill_value=0)
        frame = pd.concat([frame, counts.reset_index(drop=True).astype("int64")], axis=1)
    return frame


@dataclass
class ReplayResult:
    """One replay: metrics as a one-row DataFrame, the timeline, the decision log and one row per step."""

    metrics: Any
    timeline: Any
    decisions: Any
    system: str
    trace: str
    #: the metrics dict as :func:`moesim.analysis.metrics.metrics` returns it (breakdown nested)
    raw_metrics: dict[str, Any] = field(default_factory=dict)
    #: one row per forward pass (:func:`step_frame`): latency, tokens, and its decisions counted
    steps: Any = None
    #: the profile as titles name it, with its GPU and host CPU (moesim.hw.title); '' when not known
    hw: str = ""
    #: the settings the replay was given (``--set`` keys), which its figures' titles name as the CLI's do
    settings: dict[str, Any] = field(default_factory=dict)

    def _what(self) -> str:
        """'SYSTEM on TRACE / PROFILE (GPU + CPU, ...) (key=value, ...)': what a figure of this replay is of (two
        replays with other settings drew identically titled figures)."""
        from moesim.analysis.plots import settings_note
        on = f"{self.system} on {Path(self.trace).name}"
        return (f"{on} / {self.hw}" if self.hw else on) + settings_note(self.settings)

    @callers_lines
    def plot_timeline(self, window: tuple[float, float] | None = None, path: str | os.PathLike | None = None,
                      title: str | None = None, steps: tuple[int, int] | None = None) -> Any:
        """Gantt chart of CPU, GPU and PCIe; ``window`` = (start_s, end_s) or ``steps`` = (first, last),
        default the first two steps; the title says what is shown. Displays as a PNG in Jupyter."""
        if self.timeline is None:
            raise ConfigError("this replay kept no timeline", field="timeline",
                              fix="call moesim.replay(..., timeline=True)")
        from moesim.analysis.plots import plot_gantt
        label = self._what() if title is None else title
        return plot_gantt(self.timeline, path, window=window, steps=steps, title=label)

    @callers_lines
    def plot_breakdown(self, path: str | os.PathLike | None = None) -> Any:
        """Stacked bar of where the time went (000 Sec. VI-E categories); displays as a PNG in Jupyter."""
        from moesim.analysis.plots import plot_breakdown
        return plot_breakdown([{"system": self.system, **self.raw_metrics}], path,
                              title=f"time breakdown of {self._what()}")

    @callers_lines
    def save(self, folder: str | os.PathLike) -> Path:
        """Write this result to ``folder`` (made if need be): each frame as Parquet and ``result.json``;
        :func:`load_replay` reads it back. Files of a result saved there before are replaced."""
        from moesim.util import output_error, sigint_blocked, tmp_path_for
        folder = checked_folder(folder)
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"{folder} is a file", field="folder", fix="give a folder to save the result in")
        # every file is written beside its target first and moved into place together at the end: a save
        # interrupted (Kernel > Interrupt) or failing (a full disk) while writing left an earlier result's
        # result.json beside this one's frames, which load_replay read back as one result
        staged: list[tuple[Path, Path]] = []
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for name in FRAMES:
                frame, path = getattr(self, name), folder / f"{name}.parquet"
                if frame is not None:
                    staged.append((tmp_path_for(path), path))
                    frame.to_parquet(staged[-1][0], index=False)
            meta = {"system": self.system, "trace": self.trace, "raw_metrics": self.raw_metrics, "hw": self.hw,
                    "settings": self.settings}
            staged.append((tmp_path_for(folder / META_FILE), folder / META_FILE))
            staged[-1][0].write_text(json.dumps(meta, default=_plain, indent=1))
            with sigint_blocked():  # result.json goes first and comes back last: no mix is ever loadable
                (folder / META_FILE).unlink(missing_ok=True)
                for name in FRAMES:  # an older result's frame would be read back as this one's
                    if getattr(self, name) is None:
                        (folder / f"{name}.parquet").unlink(missing_ok=True)
                for tmp, path in staged:
                    os.replace(tmp, path)
        except OSError as err:  # /proc/run raised FileNotFoundError from mkdir
            raise output_error(folder, err, "folder") from None
        finally:
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)
        return folder

    def _repr_html_(self) -> str:
        """The headline figures as a table (six significant digits), what was kept, and where the rest is: the
        whole ``metrics`` row is some 60 figures, a wall of text as a notebook's output."""
        from html import escape
        row = self.metrics.iloc[0] if len(self.metrics) else {}
        figures = [(key, f"{row[key]:.6g}") for key in HTML_METRICS if key in row and not is_missing(row[key])]
        if "decode_tokens" in row and row["decode_tokens"] == 0:  # why TPOT and decode speed are not shown
            figures.append(("decode_tokens", "0"))
        if "slot_spread" in row and isinstance(row["slot_spread"], str) and row["slot_spread"]:
            figures.append(("slot_spread", row["slot_spread"]))
        rows = "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in figures)
        kept = [name for name in ("timeline", "decisions") if getattr(self, name) is not None]
        more = f"{len(self.metrics.columns)} figures in <code>.metrics</code>, one row a step in <code>.steps</code>" + \
            "".join(f", <code>.{name}</code>" for name in kept)
        return f"<b>{escape(self.system)}</b> on {escape(Path(self.trace).name)}<table>{rows}</table>{more}"

    def __repr__(self) -> str:
        """One line for a console (the frames are a print away): what ran, its headline figures, what was kept."""
        row = self.metrics.iloc[0] if len(self.metrics) else {}
        shown = [f"{key}={row[key]:.6g}" for key in REPR_METRICS if key in row and not is_missing(row[key])]
        if "decode_tokens" in row and row["decode_tokens"] == 0:  # why TPOT and decode speed are not shown (nan)
            shown.append("decode_tokens=0")
        figures = ", ".join(shown)
        kept = [f"{name}=<{len(frame):,} rows>" for name, frame in (("timeline", self.timeline),
                                                                   ("decisions", self.decisions))
                if frame is not None]
        return f"ReplayResult(system={self.system!r}, trace={Path(self.trace).name!r}, {figures}" + \
            "".join(f", {k}" for k in kept) + ")"


def _plain(value: Any) -> Any:
    """A numpy number as the Python one it holds, for JSON."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


@callers_lines
def load_replay(folder: str | os.PathLike) -> ReplayResult:
    """The :class:`ReplayResult` that :meth:`ReplayResult.save` wrote to ``folder``."""
    import pandas as pd
    folder = checked_folder(folder)
    meta_path = folder / META_FILE
    if not folder.exists():
        raise ConfigError(f"{folder}: no such folder (looked at {folder.absolute()})", field="folder",
                          fix="check the path: a relative one starts at the working folder")
    if not meta_path.is_file():
        raise ConfigError(f"{folder} holds no saved replay (no {META_FILE})", field="folder",
                          fix="give a folder that ReplayResult.save wrote")
    try:  # another tool's result.json, or a save cut short, raised a JSONDecodeError, a KeyError or ArrowInvalid
        meta = json.loads(meta_path.read_text())
        fields = {key: meta[key] for key in ("system", "trace", "raw_metrics")}
        fields["hw"] = str(meta.get("hw") or "")  # saved before results named their machine: not known
        fields["settings"] = dict(meta.get("settings") or {})  # saved before results kept them: none named
        frames = {name: pd.read_parquet(folder / f"{name}.parquet") if (folder / f"{name}.parquet").is_file()
                  else None for name in FRAMES}
    except (ValueError, TypeError, KeyError, OSError) as err:
        what = f"no '{err.args[0]}'" if isinstance(err, KeyError) else str(err).splitlines()[0]
        raise ConfigError(f"{folder} holds no replay that ReplayResult.save wrote ({what})", field="folder",
                          fix="give a folder that ReplayResult.save wrote, or save the result there again") from err
    return ReplayResult(**{**frames, "steps": steps_as_made(frames["steps"])}, **fields)


def steps_as_made(steps: Any) -> Any:
    """A step frame read back from Parquet with its ``requests`` as lists of ints, as :func:`step_frame` makes
    them (Parquet gave numpy arrays: ``steps.equals`` told a loaded result from the one saved, and
    ``requests[0] == [0]`` compared element-wise)."""
    if steps is not None and "requests" in steps.columns:
        steps["requests"] = [[int(r) for r in ids] for ids in steps["requests"]]
    return steps


def checked_folder(folder: Any) -> Path:
    """``folder`` as a Path; one line for anything else (``save(5)`` raised a TypeError from pathlib)."""
    if not isinstance(folder, (str, os.PathLike)):
        raise ConfigError(f"folder must be a folder's path, got {folder!r}", field="folder",
                          fix="e.g. 'out/lru-run'")
    return Path(folder)
