"""What the Python API does for a Jupyter kernel: tracebacks that show the caller's cell, a progress line updated
in place, and the scratch file that lets a sweep without ``out=`` resume after a KeyboardInterrupt."""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Any

from moesim import sweep as sweep_module
from moesim.errors import MoesimError
from moesim.util import is_own_frame


def callers_traceback(err: BaseException) -> list[str]:
    """How IPython shows a bad-input error of the API (its ``_render_traceback_`` hook, bound with
    functools.partial so that the error still pickles): the caller's own lines and the one-line message, without
    the dozens of moesim frames above it (the message was all they gave, at the end of two screens). The whole
    traceback stays on the exception (``err.__traceback__``)."""
    import traceback
    lines = [line.rstrip("\n") for line in traceback.format_list(callers_frames(err.__traceback__))]
    return ["Traceback (most recent call last; moesim's own frames left out):", *lines,
            f"{type(err).__name__}: {err}" if str(err) else type(err).__name__]


def callers_frames(tb: Any) -> list[Any]:
    """The frames of ``tb`` outside moesim down to the call into it: those below it are moesim's doing, whatever
    library they are in (a policy's error showed SimPy's event loop beneath the caller's line)."""
    import traceback
    frames = []
    for frame in traceback.extract_tb(tb):
        if is_own_frame(frame.filename):
            break
        if f"{os.sep}IPython{os.sep}" not in frame.filename:  # the kernel's own exec of the cell
            frames.append(frame)
    return frames


def callers_lines(function: Any) -> Any:
    """Decorator for what a notebook calls besides :func:`moesim.replay` and its kin (a result's ``save``,
    ``plot_timeline``, :func:`moesim.load_replay`): a bad-input error shows as :func:`callers_traceback` does,
    not as the moesim frames above the one line (``run.save(3)`` showed runs.py's source around the raise)."""
    @functools.wraps(function)
    def shown_from_the_caller(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except MoesimError as err:
            err._render_traceback_ = functools.partial(callers_traceback, err)  # type: ignore[attr-defined]
            raise
    return shown_from_the_caller



def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (IPython's kernel shell; a terminal IPython is not one)."""
    import sys
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


class NotebookLine:
    """A progress stream for a notebook cell: each line replaces the one before in a single output."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.line = ""

    def write(self, text: str) -> int:
        line = text.strip()
        if line:
            from IPython.display import display
            self.line = line
            if self.handle is None:  # shown at the first line: a quick sweep leaves no empty output
                self.handle = display({"text/plain": line}, raw=True, display_id=True)
            else:
                self.handle.update({"text/plain": line}, raw=True)
        return len(text)

    def stopped(self) -> None:
        """The last line of a sweep that did not finish: its bar ends with "done" however it ended."""
        if self.line.startswith("sweep: done, "):
            self.write(self.line.replace("sweep: done, ", "sweep: stopped, ", 1))

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False



#: where sweeps without ``out=`` keep their finished points, one folder per process
SCRATCH_DIR = "moesim-sweeps"


def scratch_out(spec: Any) -> Path | None:
    """The file a sweep without ``out=`` keeps its finished points in while it runs, so that the same call after
    a KeyboardInterrupt (or an error) in this process runs only the points not finished. One file per spec and
    process; folders of processes that ended are removed. None where no such file can be written."""
    import hashlib
    import json
    import tempfile
    base = Path(tempfile.gettempdir()) / f"{SCRATCH_DIR}-{os.getuid() if hasattr(os, 'getuid') else 0}"
    try:
        base.mkdir(mode=0o700, exist_ok=True)
        remove_dead_scratch(base)
    except OSError:
        return None
    points = [(p.point_id, spec.resolve(p.trace), spec.resolve_hw(p.hw)) for p in spec.points()]
    key = hashlib.sha256(json.dumps(points).encode()).hexdigest()[:16]
    return base / str(os.getpid()) / f"sweep-{key}.parquet"


def remove_dead_scratch(base: Path) -> None:
    """Scratch folders of processes that have ended (a kernel restarted or shut down)."""
    import shutil

    from moesim.util import pid_alive
    for folder in base.iterdir():
        if folder.name.isdigit() and int(folder.name) != os.getpid() and not pid_alive(int(folder.name)):
            shutil.rmtree(folder, ignore_errors=True)


def say_kept(scratch: Path, total: int) -> None:
    """One line on stderr: how many points the stopped sweep finished, and that the same call resumes them."""
    import sys

    import pyarrow.parquet as pq
    kept = 0
    for part in scratch.with_name(scratch.name + sweep_module.PARTS_SUFFIX).glob("*.parquet"):
        with contextlib.suppress(Exception):  # a part being written when it stopped: run again
            kept += pq.read_table(part, columns=["status"])["status"].to_pylist() == ["ok"]
    if not kept:
        return
    sys.stderr.write(f"moesim.sweep stopped: the {kept} of {total} points it finished are kept; the same "
                     "call in this session runs only the others (out='results.parquet' keeps them on disk)\n")
