"""Sweep results on disk: one Parquet part per finished point, the combined file rewritten atomically."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from moesim.errors import ConfigError
from moesim.sweep.spec import setting_str
from moesim.util import PARQUET, check_output_path, check_suffix, clean_stale_tmps, pid_alive

#: seconds between rewrites of the combined output while a sweep runs
FLUSH_EVERY_S = 5.0
PARTS_SUFFIX = ".parts"
#: Parquet key-value metadata of results and part files
SWEEP_METADATA = {b"moesim_sweep": json.dumps({"version": 1}).encode()}

#: file descriptors a forked worker must not keep open (the output lock: an orphan holding it would
#: block every resume)
_INHERITED_FDS: list[int] = []


class ResultStore:
    """Finished rows by point id, mirrored to ``OUT`` and ``OUT.parts/`` when ``out`` is given."""

    def __init__(self, out: str | os.PathLike | None) -> None:
        self.out = Path(out) if out is not None else None
        self.rows: dict[str, dict[str, Any]] = {}
        self._lock_fd: int | None = None
        self._flushed_at = time.monotonic()
        self._dirty = False
        #: how ``OUT`` is laid out (rows and columns), e.g. in spec order; None: as the rows came
        self.arrange: Callable[[Any], Any] | None = None
        if self.out is not None:
            self._check_out(os.fspath(out))
            self._lock()
            try:
                self._load()
            except BaseException:  # a refused output: leave nothing behind (the parts folder, if empty)
                self._unlock(remove_dir=True)
                raise

    @property
    def parts_dir(self) -> Path:
        assert self.out is not None
        return self.out.with_name(self.out.name + PARTS_SUFFIX)

    def done_ids(self) -> set[str]:
        return {pid for pid, row in self.rows.items() if row.get("status") == "ok"}

    def done_inputs(self) -> dict[str, str | None]:
        """Finished point id -> the fingerprint of the input files it ran on (None: not recorded)."""
        return {pid: self.rows[pid].get("input_fingerprint") for pid in self.done_ids()}

    def add(self, row: dict[str, Any]) -> None:
        self.rows[row["point_id"]] = row
        if self.out is None:
            return
        import pyarrow as pa
        part = pa.Table.from_pylist([row]).replace_schema_metadata(SWEEP_METADATA)
        self._write(part, self.parts_dir / f"{row['point_id']}.parquet")
        self._dirty = True
        if time.monotonic() - self._flushed_at > FLUSH_EVERY_S:
            self.flush()

    def update(self, row: dict[str, Any]) -> None:
        """A stored row with cells added (the values its point ran with), not a point run: ``OUT`` holds it from
        the next rewrite; it has no part of its own (lost in a crash, it is filled again on the next resume)."""
        self.rows[row["point_id"]] = row
        self._dirty = self.out is not None

    def flush(self) -> None:
        """Rewrite ``OUT`` from every row known (atomically)."""
        if self.out is None or not self.rows:
            return
        clean_stale_tmps(self.out)  # of sweeps killed while they rewrote it
        frame = self.frame()
        self._write(_arrow_table(self.arrange(frame) if self.arrange else frame), self.out)
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
    def _write(self, table: Any, path: Path) -> None:
        """:func:`_write_parquet_atomic`, an OS error (a full disk) one line saying what is kept."""
        try:
            _write_parquet_atomic(table, path)
        except OSError as err:
            reason = re.sub(r"^\[errno \d+\] ", "", (err.strerror or str(err)).split("Detail: ")[-1])
            raise ConfigError(f"cannot write: {reason}; every point finished before is kept in {self.parts_dir}/, "
                              "and the same command resumes", source=str(path), field="--out",
                              fix="free space (or check the permissions), then run it again") from None

    def _check_out(self, given: str) -> None:
        assert self.out is not None
        if given == "" or given.endswith(("/", os.sep)):
            # Path() makes '' the current folder ("the sweep output is a folder", from Python) and drops a '/'
            check_output_path(given, "--out")  # says which
        if self.out.is_dir():
            raise ConfigError("the sweep output is a folder", source=str(self.out), field="--out",
                              fix="give a file name ending in .parquet")
        check_suffix(self.out, "--out", PARQUET)

    def _lock(self) -> None:
        lock = self.parts_dir / ".lock"
        try:
            self.parts_dir.mkdir(parents=True, exist_ok=True)
            import fcntl
        except ImportError:  # not POSIX: no protection against two writers
            return
        except OSError as err:  # OUT.parts a file, or a folder the OS refuses (/sys, a read-only mount)
            raise self._parts_error(self.parts_dir, err) from None
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:  # .lock a folder, or OUT.parts/ not writable
            raise self._parts_error(lock, err) from None
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

    def _parts_error(self, path: Path, err: OSError) -> ConfigError:
        """The one line for a parts folder (or its lock) that cannot be made: the path and the OS's reason."""
        # "move it out of the way" only where something is in the way (/sys refuses a folder that is not there)
        move = f"move {path} out of the way, or " if path.exists() or path.is_symlink() else ""
        return ConfigError(f"cannot create {path}: {err.strerror or err}", source=str(self.out), field="--out",
                           fix=f"{move}write the sweep to a folder you may write to")

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
