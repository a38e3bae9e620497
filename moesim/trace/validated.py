"""A record on disk of trace files whose every column passed the validation pass.

Research replays the same trace again and again (systems, sizes, profiles), and
the full pass over a trace's optional columns costs a sizeable share of a fast
replay (``benchmarks/validate_speed.py``). A file that passed it once is
recorded by its identity: path, inode, size, modification and change times
(``st_ctime_ns`` moves on every write and cannot be set back by a user), and the
revision of the validator. Any change to the file, or a stricter validator,
makes the record miss and the file is checked again.

The record lives in ``$MOESIM_CACHE_DIR`` (default ``$XDG_CACHE_HOME/moesim``,
else ``~/.cache/moesim``); ``MOESIM_CACHE_DIR=off`` turns it off. A folder that
cannot be written only means every run checks its traces in full.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from moesim.trace.io import PathLike

#: bump when the validation pass gets stricter: files recorded before are checked again
VALIDATOR_REVISION = 1


def cache_dir() -> Path | None:
    """Where records are kept (None: turned off)."""
    chosen = os.environ.get("MOESIM_CACHE_DIR")
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off", "0", "none") else Path(chosen) / "validated"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moesim" / "validated"


def _record(path: PathLike) -> Path | None:
    folder = cache_dir()
    if folder is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    identity = "\0".join(map(str, (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                                   VALIDATOR_REVISION)))
    return folder / hashlib.sha256(os.fsencode(identity)).hexdigest()  # a name of any bytes


def was_validated(path: PathLike) -> bool:
    """Whether this very file (unchanged since) passed the whole validation pass before."""
    record = _record(path)
    return record is not None and record.exists()


def record_validated(path: PathLike) -> None:
    """Note that ``path`` passed the whole pass (silently skipped where the folder cannot be written)."""
    record = _record(path)
    if record is None:
        return
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.touch()
    except OSError:
        pass
