"""Importers: other tools' per-token router logs -> moesim traces (docs/trace-format.md).

``import_trace(fmt, sources, out)`` is what ``moesim trace import --format NAME``
calls; without a format, the files' first records tell it (:mod:`.detect`). Each format module reads its logs, drops rows that are not real routing
(profiling dummies, warm-up and idle batches) and repairs known logger defects,
counting every dropped or repaired row by reason in the returned
:class:`ImportReport` and in the trace's ``source`` metadata.

Single-layer and few-layer logs keep the model's own layer indices (a Qwen1.5-MoE
log of layers 0, 8, 12, 18, 23 has exactly those ``layer`` values, not 0..4);
``source.layers_present`` lists them. The reader and the validator accept such
traces: ``layer`` must lie in [0, num_layers) and rows keep trace order; nothing
requires every layer to be present in a step.
"""

from __future__ import annotations

import filecmp
import os
import pickle
import zipfile
from pathlib import Path
from typing import Callable

from moesim.errors import ConfigError, TraceFormatError, did_you_mean
from moesim.trace.importers import (cerebras_olmoe, flame_moe, qwen3_prefill, speculative_moe,
                                    vllm_moe_logger)
from moesim.trace.importers._common import ImportReport, reading_progress, refuse_aggregates
from moesim.trace.importers.detect import detect_format
from moesim.trace.io import compressed
from moesim.util import same_file

FORMATS: dict[str, Callable[[list[Path], Path], ImportReport]] = {
    speculative_moe.FORMAT: speculative_moe.import_files,
    qwen3_prefill.FORMAT: qwen3_prefill.import_files,
    flame_moe.FORMAT: flame_moe.import_files,
    vllm_moe_logger.FORMAT: vllm_moe_logger.import_files,
    cerebras_olmoe.FORMAT: cerebras_olmoe.import_files,
}
AGGREGATE_FORMATS = ("olmoe-routing-stats",)
#: formats that read an npz extract; the others read JSON lines only
NPZ_FORMATS = (flame_moe.FORMAT, qwen3_prefill.FORMAT)
#: how a zip archive (an npz is one) begins
ZIP_MAGIC = b"PK\x03\x04"


def _folder_fix(path: Path) -> str:
    """What to name instead of a folder: its log files, which the user chooses (a folder may hold the logs
    of several runs, or prompts and READMEs beside them)."""
    if not path.is_dir():
        return "check the path"
    logs = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix in (".jsonl", ".json", ".npz"))
    if not logs:
        return "name log files (.jsonl, .json, .npz); this folder holds none"
    shown = ", ".join(logs[:6]) + (f" and {len(logs) - 6} more" if len(logs) > 6 else "")
    return f"name its log files instead: {shown}"


def _refuse_compressed(path: Path) -> None:
    """A compressed log is no format's layout: say so (it was 'cannot tell which tool wrote this log', or a
    UTF-8 error at byte 1 with --format) and how to decompress it."""
    with open(path, "rb") as handle:
        packed = compressed(path, handle.read(8), "the importers read the log as its tool wrote it", "log.jsonl")
    if packed is not None:
        raise packed


#: the first line of a Git LFS pointer file (what a clone without git-lfs holds instead of a large log)
LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def _refuse_not_a_log(path: Path) -> None:
    """Refuse a Parquet file (a trace given to the importer) or a Git LFS pointer (a few lines naming the real
    file's hash and size; speculative-moe's ``*_full_routing.jsonl`` are such pointers upstream) as what they are,
    not 'cannot tell which tool wrote this log' or, with --format, 'not UTF-8' or 'line 1: not valid JSON'."""
    with open(path, "rb") as handle:
        head = handle.read(512)
    if head.startswith(b"PAR1"):  # it was 'cannot tell which tool wrote this log', or with --format 'not UTF-8'
        raise TraceFormatError("a Parquet file (a moesim trace, or another Parquet table), not a tool's routing log",
                               source=str(path), fix="a trace needs no import: moesim trace validate / inspect / "
                                                     "replay read it as it is")
    if _torch_file(path, head):
        raise TraceFormatError("a PyTorch file (torch.save), which no import format reads (DynaNDE-Simulator's "
                               "per-layer .pt files are flame-moe's source)", source=str(path),
                               fix="for FLAME-MoE, save the layers' arrays as one npz (numpy.savez: layers, "
                                   "token_ids, indices, scores) and import that with --format flame-moe")
    if not head.startswith(LFS_POINTER):
        return
    size = next((line.split()[1] for line in head.splitlines() if line.startswith(b"size ")), b"?")
    raise TraceFormatError(f"a Git LFS pointer (to a file of {size.decode(errors='replace')} bytes), not the log "
                           "itself", source=str(path),
                           fix="fetch the real file (git lfs pull in its repository, or download it) and import that")


def _torch_file(path: Path, head: bytes) -> bool:
    """Whether ``path`` is what torch.save writes: a zip archive holding a ``data.pkl`` (it was 'cannot tell which
    tool wrote this log', or with --format 'not UTF-8 text')."""
    if not head.startswith(b"PK") or path.suffix == ".npz":
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def available_formats() -> list[str]:
    return sorted(FORMATS)


def import_trace(fmt: str | None, sources: list[Path] | Path | str, out: Path | str,
                 progress: Callable[[int, Path], None] | None = None) -> ImportReport:
    """Convert ``sources`` (log files of format ``fmt``; None: told from their first records; one path alone
    is one file) into a trace ``out``, which may be none of them. ``progress`` is called with the bytes of the
    logs read (and the file) as the import goes; an npz is reported whole once read."""
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    sources = [Path(s) for s in sources]
    if fmt in AGGREGATE_FORMATS:
        raise TraceFormatError("OLMoE-routing-stats holds aggregate expert counts per layer, not per-token "
                               "routing; no trace can be built from it", source=", ".join(map(str, sources)),
                               field="--format", fix="use it to check a trace's skew; import a per-token log")
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"unknown import format '{fmt}'", field="--format",
                          fix=f"{did_you_mean(fmt, available_formats())}use one of {', '.join(available_formats())}")
    if not sources:
        raise ConfigError("no source files given", field="sources", fix="name at least one log file")
    refuse_aggregates(sources)
    for path in sources:
        if not path.is_file():
            raise TraceFormatError("not a file", source=str(path), fix=_folder_fix(path))
        _refuse_compressed(path)
        _refuse_not_a_log(path)
    _refuse_repeated(sources)
    detected = fmt is None
    if fmt is None:
        fmt = detect_format(sources)
    _refuse_archives(fmt, sources)
    out = Path(out)
    for path in sources:
        if same_file(out, path):
            raise TraceFormatError(f"would overwrite the source log {path}", source=str(out), field="out",
                                   fix="write the trace to another file, e.g. one ending in .parquet")
    if out.exists() and out.is_dir():
        raise TraceFormatError("output path is a directory", source=str(out), field="--out",
                               fix="give a file name ending in .parquet")
    try:
        with reading_progress(progress):
            report = FORMATS[fmt](sources, out)
    except UnicodeDecodeError as err:
        raise TraceFormatError(f"not UTF-8 text (byte {err.start})", source=_which(sources),
                               fix=f"give the {fmt} log as written by its tool") from None
    except (zipfile.BadZipFile, EOFError, pickle.UnpicklingError, ValueError, OverflowError, TypeError,
            IndexError, KeyError, OSError) as err:
        if isinstance(err, OSError) and err.filename is not None and Path(err.filename) == Path(out):
            raise  # the output side; the command line names it
        raise TraceFormatError(f"cannot be read as a {fmt} log ({type(err).__name__}: "
                               f"{str(err).splitlines()[0][:120] if str(err) else ''})", source=_which(sources),
                               fix="check --format and that the files are complete") from None
    if detected:
        report.notes.append(f"format {fmt} told from the files' first records (give --format to choose another)")
    return report


def _refuse_archives(fmt: str, sources: list[Path]) -> None:
    """An npz (or any zip archive) given to a format of JSON lines is refused as what it is: it was 'line 1: not
    UTF-8 text', with the fix 'repair or delete the garbled line'."""
    if fmt in NPZ_FORMATS:
        return
    for path in sources:
        with open(path, "rb") as handle:
            if handle.read(len(ZIP_MAGIC)) == ZIP_MAGIC:
                raise TraceFormatError(f"a zip archive (an .npz extract?), not the JSON lines log {fmt} reads",
                                       source=str(path), field="--format",
                                       fix=f"give {fmt}'s .jsonl log; npz extracts are read by "
                                           f"{' and '.join(NPZ_FORMATS)} (--format)")


def _refuse_repeated(sources: list[Path]) -> None:
    """One log named twice (a path given twice, through a link, or a byte-identical copy) was imported twice:
    its routing doubled as a second request, exit 0."""
    for i, path in enumerate(sources):
        for earlier in sources[:i]:
            if same_file(path, earlier):
                raise TraceFormatError(f"the same log as {earlier}, named again", source=str(path),
                                       field="sources", fix="name each log file once")
            if path.stat().st_size == earlier.stat().st_size and filecmp.cmp(path, earlier, shallow=False):
                raise TraceFormatError(f"a copy of {earlier} (the same bytes)", source=str(path), field="sources",
                                       fix="name each log once; a copy would import its routing twice")


def _which(sources: list[Path]) -> str:
    return ", ".join(map(str, sources))


__all__ = ["FORMATS", "ImportReport", "available_formats", "import_trace"]
