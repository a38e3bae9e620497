"""Small helpers shared across layers: safe output files, reading YAML with one-line errors, the host memory left."""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import re
import shutil
import signal
import stat
import tempfile
from contextvars import ContextVar
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Sequence

import yaml

from moesim.errors import ConfigError, MoesimError

#: YAML documents larger than this are refused before parsing (profiles are ~20 KB, specs smaller)
YAML_MAX_BYTES = 4 * 2**20
#: nodes of a YAML document once aliases are expanded ("billion laughs" grows past this at once)
YAML_MAX_NODES = 200_000

#: the file formats moesim writes, each with the suffixes its file may be named with (the first is suggested):
#: a name promising another format (``trace.csv``) is refused rather than given Parquet
PARQUET, HTML, YAML, FIGURE = "Parquet", "HTML", "YAML", "a figure (PNG, SVG or PDF)"
OUTPUT_FORMATS: dict[str, tuple[str, ...]] = {
    PARQUET: (".parquet",),
    HTML: (".html", ".htm"),
    YAML: (".yaml", ".yml"),
    FIGURE: (".png", ".svg", ".pdf"),
}


# ----------------------------------------------------------------------------- output files
def is_special_file(path: Path) -> bool:
    """An existing path that is neither a regular file nor a folder (a device, a pipe, a socket), or that names
    an open descriptor (``/dev/stdout`` with stdout redirected to a file is that file, but replacing it by a
    rename would replace the link in /dev)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if str(path).startswith(("/dev/", "/proc/")):
        return not stat.S_ISDIR(mode)
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def clean_stale_tmps(path: Path) -> int:
    """Remove ``.NAME.PID.tmp`` (and staged ``.STEM.PID.tmp.SUFFIX``) leftovers of ``path`` whose writer
    process is gone; return how many."""
    path = Path(path)
    removed = 0
    patterns = ((f".{path.name}.", ".tmp"), (f".{path.stem}.", f".tmp{path.suffix}"))
    try:
        candidates = [(tmp, head, tail) for head, tail in patterns for tmp in path.parent.glob(f"{head}*{tail}")]
    except OSError:
        return 0
    for tmp, head, tail in candidates:
        pid_text = tmp.name[len(head):-len(tail)]
        if pid_text.isdigit() and int(pid_text) != os.getpid() and not pid_alive(int(pid_text)):
            with contextlib.suppress(OSError):
                tmp.unlink()
                removed += 1
    return removed


def yaml_beside(name_or_path: str | os.PathLike) -> Path | None:
    """``dir/name.yaml`` for a path ``dir/name`` given without its suffix, where that file exists (a profile or
    preset path typed as ``hwprofiles/rtx4090``); None for a bare name, which names a bundled file."""
    path = Path(name_or_path)
    with_yaml = path.with_name(f"{path.name}.yaml")
    return with_yaml if os.sep in str(name_or_path) and with_yaml.exists() else None


def check_output_path(path: str | os.PathLike, option: str = "--out", written_as: str | None = None) -> Path:
    """Fail now, with one line, if ``path`` cannot receive an output file (before any work is done);
    ``written_as``: its format (a key of :data:`OUTPUT_FORMATS`), which its name must end in."""
    given = os.fspath(path)
    if given == "":  # an unset shell variable (`--json "$OUT"`): Path('') would be the current folder
        raise ConfigError("the output path is empty", field=option, fix="give a file name")
    path = Path(path)
    if path.is_dir():
        raise ConfigError("the output path is a folder", source=str(path), field=option,
                          fix="give a file name inside it")
    if given.endswith("/") or given.endswith(os.sep):  # Path() drops the slash: 'out/' would write a file 'out'
        raise ConfigError("the output path ends in '/', as a folder's does, but no such folder exists",
                          source=given, field=option,
                          fix="name a file: drop the '/', or create the folder and add a file name after it")
    if written_as == PARQUET:
        try:
            given.encode("utf-8")
        except UnicodeEncodeError:  # pyarrow's writers cannot encode it
            raise ConfigError("the file name is not UTF-8 text, which the Parquet writer needs", source=given,
                              field=option, fix="give a name of UTF-8 characters") from None
    if is_special_file(path):
        if not os.access(path, os.W_OK):
            raise ConfigError("cannot write to this special file", source=str(path), field=option,
                              fix="give a writable file")
        return path
    if written_as is not None:
        check_suffix(path, option, written_as)
    parent = path.parent
    if not parent.exists():
        raise ConfigError(f"folder {parent} does not exist", source=str(path), field=option,
                          fix=f"create it first (mkdir -p {parent}) or write elsewhere")
    if not parent.is_dir():
        raise ConfigError(f"{parent} is not a folder", source=str(path), field=option, fix="give another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"folder {parent} is not writable", source=str(path), field=option,
                          fix="write to a folder you may write to")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError("the output file is read-only", source=str(path), field=option,
                          fix="remove it or write elsewhere")
    check_can_create(path, option)
    clean_stale_tmps(path)
    return path


def check_can_create(path: Path, option: str) -> None:
    """A file can be created where ``path`` will be written (for a folder output: inside the folder, or the
    nearest folder that exists above it), tried for real before any work: os.access says yes to root where
    creating fails (/proc, /sys, NFS with root squashed), and the run then failed at its end."""
    import tempfile
    if is_special_file(path):
        return
    folder = path if path.is_dir() else path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"{folder} is a file, not a folder", source=str(path), field=option,
                          fix="give a path whose folders are folders")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".moesim-write-check-"):
            pass
    except OSError as err:
        raise ConfigError(f"cannot create a file in {folder}: {err.strerror or err}", source=str(path),
                          field=option, fix="write to a folder you may write to") from None


def check_suffix(path: Path, option: str, written_as: str) -> None:
    """``path``'s name ends in a suffix of format ``written_as`` (:data:`OUTPUT_FORMATS`)."""
    suffixes = OUTPUT_FORMATS[written_as]
    if path.suffix.lower() not in suffixes:
        if path.name.lower() in suffixes:  # '.parquet': a suffix alone, a hidden file with no name before it
            raise ConfigError(f"the file name is only a suffix, '{path.name}'", source=str(path), field=option,
                              fix=f"put a name before it, e.g. out{suffixes[0]}")
        named = f"'{path.suffix}'" if path.suffix else "no suffix"
        raise ConfigError(f"this output is written as {written_as}, but its name has {named}", source=str(path),
                          field=option, fix=f"name it e.g. {path.with_suffix(suffixes[0]).name}")


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one regular file (existing or not; special files such as /dev/null never
    count: writing one twice loses nothing)."""
    a, b = Path(a), Path(b)
    if is_special_file(a) or is_special_file(b):
        return False
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def output_error(path: Path, err: OSError, option: str | None = None) -> ConfigError:
    reason = err.strerror or str(err)
    return ConfigError(f"cannot write the output: {reason}", source=str(path), field=option,
                       fix="check the path, the free space and the permissions")


#: inside :func:`staged_outputs`: the (staged file, target) pairs written so far
_STAGED: ContextVar[list[tuple[Path, Path]] | None] = ContextVar("moesim_staged_outputs", default=None)
#: inside :func:`staged_outputs`: what to say once the outputs have landed ("wrote X")
_LANDED: ContextVar[list[Callable[[], None]] | None] = ContextVar("moesim_landed_notices", default=None)


def once_landed(say: Callable[[], None]) -> None:
    """Call ``say`` (a "wrote X" line) once the block's outputs are in place: at once outside
    :func:`staged_outputs`, else after they all land, and never if a failure rolls them back."""
    pending = _LANDED.get()
    if pending is None:
        say()
    else:
        pending.append(say)


@contextlib.contextmanager
def staged_outputs() -> Iterator[None]:
    """Outputs opened with :func:`output_file` in this block are written beside their targets and moved
    into place together when the block ends without an error: a failure while writing one (a full disk, a
    plot that cannot be drawn) leaves every output of the command as it was."""
    staged: list[tuple[Path, Path]] = []
    landed: list[Callable[[], None]] = []
    token, notices = _STAGED.set(staged), _LANDED.set(landed)
    try:
        yield
    except BaseException:
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise
    else:
        for tmp, target in staged:
            try:
                os.replace(tmp, target)
            except FileNotFoundError:
                continue  # the writer wrote nothing
            except OSError as err:
                raise output_error(target, err) from None
        for say in landed:
            say()
    finally:
        _STAGED.reset(token)
        _LANDED.reset(notices)


@contextlib.contextmanager
def output_file(path: str | os.PathLike, option: str | None = None, written_as: str | None = None) -> Iterator[Path]:
    """Where a writer should put ``path``'s content: ``path`` itself, a staged file beside it inside
    :func:`staged_outputs`, or for a special file (``/dev/null``, a pipe) a temporary file whose bytes
    are then copied into it, so that no writer's atomic rename ever replaces a device node (named with
    the first suffix of format ``written_as`` when the special file's name has none of them: writers
    such as matplotlib go by it). OS errors become one-line errors."""
    path = Path(path)
    try:
        if not is_special_file(path):
            staged = _STAGED.get()
            if staged is None:
                yield path
                return
            # same folder (the rename is atomic), same suffix (writers such as matplotlib go by it)
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
            staged.append((tmp, path))
            yield tmp
            return
        with tempfile.TemporaryDirectory(prefix="moesim-out-") as folder:
            name = path.name
            if written_as and path.suffix.lower() not in OUTPUT_FORMATS[written_as]:
                name += OUTPUT_FORMATS[written_as][0]
            staged = Path(folder) / name
            yield staged
            if staged.exists():
                with open(staged, "rb") as src, open(path, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    except OSError as err:
        raise output_error(path, err, option) from None


def tmp_path_for(path: Path) -> Path:
    """Temporary sibling for writers that produce a file in several calls (stale ones are cleaned)."""
    path = Path(path)
    clean_stale_tmps(path)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill PID``) taken as a Ctrl-C is: what runs stops, cleans up and says so."""


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` in this process's main thread while the block runs (outputs
    staged are rolled back, a sweep says where its finished points are). A child forked meanwhile (a sweep's
    pool worker) that inherits the handler dies of the signal as before."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    here = os.getpid()

    def stop(signum: int, frame: Any) -> None:
        if os.getpid() != here:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT held back (delivered on leaving, not lost) in this thread and in the threads and processes it
    starts meanwhile: a helper thread started so never takes a Ctrl-C meant for the main thread, which
    would then not wake from a blocking wait until that wait ended by itself."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def atomic_writer(path: Path) -> Iterator[IO[bytes]]:
    """A binary file whose content appears at ``path`` whole, when the block ends without an error, through a
    temporary file and a rename (a special file, such as /dev/stdout, is written directly)."""
    path = Path(path)
    if is_special_file(path):
        with open(path, "wb") as fh:
            yield fh
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    try:
        with open(tmp, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename; a special file is written directly."""
    with atomic_writer(path) as fh:
        fh.write(data)
    return Path(path)


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


# ----------------------------------------------------------------------------- YAML
class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (the later one would silently win)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(None, None, "a mapping key must be a plain value",
                                                    key_node.start_mark) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key '{key}' (first at line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# YAML 1.1 (PyYAML) reads ``1e9`` and ``2.5e-1`` as text, as it wants a dot and a signed exponent; YAML 1.2
# and every user read them as numbers
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _expanded_nodes(root: yaml.Node | None) -> int:
    """Nodes of the document with every alias expanded, counted without expanding (memoised by node)."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, depth: int) -> int:
        if depth > 200:
            raise _TooDeep()
        if id(node) in sizes:
            return sizes[id(node)]
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child, depth + 1) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k, depth + 1) + size(v, depth + 1) for k, v in node.value)
        sizes[id(node)] = min(total, 10**12)
        return sizes[id(node)]
    return 0 if root is None else size(root, 0)


class _TooDeep(Exception):
    pass


def read_yaml(path: Path, error: type[MoesimError]) -> Any:
    """Parse a YAML file as plain data; every problem is one ``error`` line naming the file (and the line)."""
    path = Path(path)
    source = str(path)
    if path.is_dir():
        raise error("is a folder, not a YAML file", source=source, fix="give the path of a .yaml file")
    try:
        with open(path, "rb") as handle:  # read up to the limit: a pipe (`<(...)`) has no size to ask
            raw = handle.read(YAML_MAX_BYTES + 1)
        if len(raw) > YAML_MAX_BYTES:
            raise error(f"file is over {YAML_MAX_BYTES:,} bytes, the limit of a YAML input", source=source,
                        fix="give the right file")
    except OSError as err:
        raise error(f"cannot read: {err.strerror or err}", source=source,
                    fix="check the path and permissions") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"not UTF-8 text (byte {err.start})", source=source, fix="save the file as UTF-8") from None
    if "\x00" in text:
        raise error("contains NUL characters (a binary file?)", source=source, fix="give a YAML text file")
    loader = _StrictLoader(text)
    try:
        root = loader.get_single_node()
        if _expanded_nodes(root) > YAML_MAX_NODES:
            raise error(f"more than {YAML_MAX_NODES:,} values once aliases are expanded", source=source,
                        field="YAML aliases", fix="write the values out without nested aliases")
        return None if root is None else loader.construct_document(root)
    except _TooDeep:
        raise error("nested more than 200 levels deep", source=source, fix="flatten the document") from None
    except yaml.constructor.ConstructorError as err:
        raise error(_yaml_problem(err), source=source, fix=_yaml_fix(err)) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(err, "problem", None)
        raise error(f"not valid YAML{where}" + (f": {problem}" if problem else ""), source=source,
                    fix="fix the YAML syntax") from None
    except RecursionError:
        raise error("nested too deeply", source=source, fix="flatten the document") from None
    finally:
        loader.dispose()


def _yaml_problem(err: yaml.constructor.ConstructorError) -> str:
    mark = err.problem_mark
    where = f" at line {mark.line + 1}" if mark else ""
    problem = err.problem or "cannot be read"
    if "could not determine a constructor for the tag" in problem:
        tag = problem.split("tag", 1)[1].strip().strip("'").replace("tag:yaml.org,2002:", "!!")
        return f"tag {tag}{where} is not allowed (inputs are plain data)"
    return f"{problem}{where}"


def _yaml_fix(err: yaml.constructor.ConstructorError) -> str:
    if err.problem and "duplicate key" in err.problem:
        return "keep one of the two keys"
    return "remove the tag and write plain values"


def host_bytes_available() -> int | None:
    """Memory this process may still take: the kernel's MemAvailable, or less under a cgroup limit
    (where an out-of-memory kill comes from in a container); None where neither can be read."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            limits += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("memory.max", "memory.current"),  # cgroup v2, then v1
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = Path("/sys/fs/cgroup", limit_file).read_text().strip()
            used = int(Path("/sys/fs/cgroup", usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" or a huge number: no limit
            limits.append(max(int(limit) - used, 0))
        break
    return min(limits) if limits else None


def listed(values: Sequence[object], most: int = 8) -> str:
    """``values`` comma-separated, the first ``most`` of them and "..." past those (layer lists in one-line
    messages)."""
    return ", ".join(map(str, values[:most])) + (", ..." if len(values) > most else "")


def is_missing(value: object) -> bool:
    """Whether a figure is absent: None or NaN (a prefill-only trace's TPOT)."""
    return value is None or (isinstance(value, numbers.Real) and math.isnan(value))


def is_own_frame(filename: str) -> bool:
    """Whether a stack frame's file is moesim's own, or contextlib's (the decorators around its functions):
    the frames a user's warning or traceback leaves out to show the caller's line."""
    path = os.path.abspath(filename)
    return path.startswith(os.path.dirname(os.path.abspath(__file__)) + os.sep) \
        or path == os.path.abspath(contextlib.__file__)


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the caller's line: the first frame outside moesim, however deep below
    the API the warning is raised (a fixed ``stacklevel`` pointed into contextlib.py behind the API's error
    renaming, or into the figure helpers)."""
    import sys
    import warnings
    level, frame = 1, sys._getframe(0)
    while frame.f_back is not None and is_own_frame(frame.f_code.co_filename):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)
