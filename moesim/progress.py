"""Progress of long commands on stderr, whether or not stderr is a terminal.

On a terminal: a rich progress bar (transient). Otherwise (piped, redirected,
a CI log): plain lines, the first once the work has run ``interval_s``
seconds, then one every ``interval_s`` seconds, written by a timer thread so
that a single long step (one large measurement) still shows the command is
alive; a last line says how it ended. Quick commands print nothing when piped.

``MOESIM_PROGRESS_INTERVAL`` (seconds) overrides the default interval of the
plain lines, e.g. ``0`` prints one line per advance.

    with Progress("sweep", total=len(points)) as bar:
        for point in points:
            ...
            bar.advance(1, label=point.system)
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from typing import Any, TextIO

from moesim.util import sigint_blocked

#: seconds between plain progress lines when stderr is not a terminal
DEFAULT_INTERVAL_S = 10.0


def plain_interval() -> float:
    """Seconds between plain progress lines: ``MOESIM_PROGRESS_INTERVAL``, or the default (with a warning
    when the variable is set to something that is no number of seconds)."""
    raw = os.environ.get("MOESIM_PROGRESS_INTERVAL", "")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value >= 0 and math.isfinite(value):
        return value
    if raw.strip() and raw not in _NOTED and sys.stderr is not None:  # said once a process, on stderr beside
        _NOTED.add(raw)                                                 # the progress itself
        sys.stderr.write(f"moesim: note: MOESIM_PROGRESS_INTERVAL={raw!r} is not a number of seconds: progress "
                         f"lines every {DEFAULT_INTERVAL_S:g} s\n")
    return DEFAULT_INTERVAL_S


#: values of MOESIM_PROGRESS_INTERVAL already noted as not a number of seconds
_NOTED: set[str] = set()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """Progress of ``total`` units of work (``None``: unknown) titled ``title``.

    ``tty`` forces the mode (default: whether ``stream`` is a terminal);
    ``enabled=False`` prints nothing at all.
    """

    def __init__(self, title: str, total: float | None = None, *, unit: str = "", stream: TextIO | None = None,
                 tty: bool | None = None, interval_s: float | None = None, enabled: bool = True,
                 console: Any = None, done_before: float = 0) -> None:
        self.title = title
        self.total = total
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        # started with stderr closed (`2>&-`): Python's sys.stderr is None, and the work goes on unreported
        self.enabled = enabled and self.stream is not None
        self.tty = (self.enabled and self.stream.isatty()) if tty is None else tty
        self.interval_s = plain_interval() if interval_s is None else interval_s
        self.console = console
        self.done_before = float(done_before)
        self.done = self.done_before
        self.label = ""
        self.extra = ""
        self.lines = 0
        self._start = time.monotonic()
        self._last_line = self._start
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar: Any = None
        self._task: Any = None

    # -- life cycle -----------------------------------------------------------------
    def __enter__(self) -> "Progress":
        self.start()
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        self.stop(ok=kind is None)

    def start(self) -> None:
        self._start = self._last_line = time.monotonic()
        if not self.enabled:
            return
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn
            from rich.progress import TimeRemainingColumn
            console = self.console or Console(file=self.stream)
            # the label names files and systems: printed as it is, never read as rich markup
            columns = [TextColumn(self.title, style="bold", markup=False), BarColumn(),
                       TextColumn("{task.fields[count]}", markup=False), TextColumn("{task.description}", markup=False),
                       TimeElapsedColumn()]
            if self.total:
                columns.append(TimeRemainingColumn())
            self._bar = RichProgress(*columns, console=console, transient=True)
            with sigint_blocked():  # its refresh thread never takes the main thread's Ctrl-C
                self._bar.start()
            # completed, not advanced: rich's speed (time left) counts only the advances
            self._task = self._bar.add_task("", total=self.total, completed=self.done_before, count=self._count())
        elif self.interval_s > 0:
            self._thread = threading.Thread(target=self._tick, name=f"progress-{self.title}", daemon=True)
            with sigint_blocked():
                self._thread.start()

    def stop(self, ok: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self.enabled and not self.tty and self.lines:
            end = "done" if ok else "stopped"
            self._write(f"{self.title}: {end}, {self._count()} in {_duration(self._elapsed())}")

    # -- reporting ------------------------------------------------------------------
    def advance(self, amount: float = 1, label: str | None = None, extra: str | None = None) -> None:
        """``amount`` more units done; ``label`` names what is being worked on now."""
        with self._lock:
            self.done += amount
            if label is not None:
                self.label = label
            if extra is not None:
                self.extra = extra
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, advance=amount, description=self._suffix(), count=self._count())
        elif not self.tty and time.monotonic() - self._last_line >= self.interval_s:
            self._line()

    def _tick(self) -> None:
        while not self._stop.wait(min(self.interval_s, 1.0)):
            if time.monotonic() - self._last_line >= self.interval_s:
                self._line()

    def _line(self) -> None:
        text = f"{self.title}: {self._count()}"
        if self.total and self.done > self.done_before:
            left = self._elapsed() * (self.total - self.done) / (self.done - self.done_before)
            text += f", {_duration(self._elapsed())} elapsed, about {_duration(left)} left"
        else:
            text += f", {_duration(self._elapsed())} elapsed"
        suffix = self._suffix()
        self._write(text + (f" ({suffix})" if suffix else ""))

    def _write(self, text: str) -> None:
        with self._lock:
            self._last_line = time.monotonic()
            self.lines += 1
            try:
                self.stream.write(text + "\n")
                self.stream.flush()
            except (OSError, ValueError):  # a closed pipe must not end the work
                pass

    # -- formatting -----------------------------------------------------------------
    def _count(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        done = f"{self.done:,.0f}"
        if self.total:
            return f"{done}/{self.total:,.0f}{unit} ({self.done / self.total:.0%})"
        return f"{done}{unit}"

    def _suffix(self) -> str:
        return ", ".join(p for p in (self.label, self.extra) if p)

    def _elapsed(self) -> float:
        return time.monotonic() - self._start
