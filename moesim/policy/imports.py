"""Policies of one's own, imported by name for the command line and sweep specs.

A user's module registers its components and systems when imported
(``register_component``, ``register_system``), as a notebook cell does.
``moesim --import my_policies.py replay ...`` and a sweep spec's ``import:``
list import such modules before any system name is looked up. Sweep workers
are forked from the process that imported them, so they see the same systems.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from moesim.errors import ConfigError, MoesimError
from moesim.policy.checked import users_frame

#: what every refusal suggests
_HOW = "give a Python file (my_policies.py) or an importable module name (my_package.policies)"
#: what this process imported, as (file or module name, folder it was found from): for processes that are
#: not forked from it (Ray's workers) to import the same
_IMPORTED: list[tuple[str, str]] = []


def import_policies(names: Sequence[str], *, base_dir: Path | None = None, field: str = "--import",
                    source: str | None = None) -> list[str]:
    """Import each of ``names`` (a ``.py`` file, relative to ``base_dir``, or a module name) once; return
    the modules' names. A file is imported under its stem, with its folder on ``sys.path`` as ``python
    FILE`` would have it, so that it may import its neighbours."""
    folder = base_dir or Path.cwd()
    modules = []
    for name in names:
        modules.append(_import_one(name, folder, field, source))
        entry = (str((folder / Path(name).expanduser()).resolve()) if _is_path(name) else name, str(folder))
        if entry not in _IMPORTED:
            _IMPORTED.append(entry)
    return modules


def imported() -> list[tuple[str, str]]:
    """What :func:`import_policies` imported in this process, for :func:`import_again` in another one."""
    return list(_IMPORTED)


def import_again(entries: Sequence[tuple[str, str]]) -> None:
    """Import in this process what :func:`imported` listed in another (modules imported already are kept)."""
    for name, folder in entries:
        import_policies([name], base_dir=Path(folder))


def modules_of(objects: Sequence[object]) -> list[tuple[str, str]]:
    """:func:`import_again` entries for the modules that define ``objects`` (classes of one's own), each
    with the folder it is imported from: a process that unpickles such a class by reference imports its
    module first, and one imported with a plain ``import my_policies`` went through no
    :func:`import_policies`. ``__main__`` (a notebook's cells) and moesim's own modules are left out:
    pickling carries the first's classes by value, and every process has the second."""
    entries: list[tuple[str, str]] = []
    for obj in objects:
        name = getattr(obj, "__module__", "") or ""
        file = getattr(sys.modules.get(name), "__file__", None)
        if name == "__main__" or name.partition(".")[0] == "moesim" or not file:
            continue
        path = Path(file).resolve()
        # the folder its top-level package (or the module itself) sits in
        root = path.parents[name.count(".") + (path.stem == "__init__")]
        entry = (name, str(root))
        if entry not in entries:
            entries.append(entry)
    return entries


def _is_path(name: str) -> bool:
    return name.endswith(".py") or os.sep in name or (os.altsep is not None and os.altsep in name)


def _import_one(name: str, base_dir: Path, field: str, source: str | None) -> str:
    if not name.strip():
        raise ConfigError("an empty module name", source=source, field=field, fix=_HOW)
    if _is_path(name):
        return _import_file((base_dir / Path(name).expanduser()).resolve(), name, field, source)
    return _import_module(name, base_dir, field, source)


def _import_file(path: Path, given: str, field: str, source: str | None) -> str:
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "not found"
        raise ConfigError(f"'{given}': {what}", source=source, field=field, fix=f"check the path; {_HOW}")
    module_name = path.stem
    if not module_name.isidentifier():
        raise ConfigError(f"'{given}': '{module_name}' is no Python module name", source=source, field=field,
                          fix="rename the file to letters, digits and underscores, e.g. my_policies.py")
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        if getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == path:
            return module_name  # imported already (the same command line naming it twice, a notebook)
        raise ConfigError(f"'{given}': a module named '{module_name}' is imported already "
                          f"({getattr(loaded, '__file__', None) or 'built in'})", source=source, field=field,
                          fix="rename the file so that its name is its own")
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None  # a .py file always has a source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # pickling by reference finds the module's classes (sweep workers)
    try:
        spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[module_name]
        _refuse_failed(err, given, field, source)
    return module_name


def _import_module(name: str, base_dir: Path, field: str, source: str | None) -> str:
    folder = str(base_dir)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # as `python -m` finds modules of the current folder
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and (name == err.name or name.startswith(err.name + ".")):
            raise ConfigError(f"no module named '{name}'", source=source, field=field,
                              fix=f"{_HOW}; a module name is looked up on PYTHONPATH and in {folder}") from None
        _refuse_failed(err, name, field, source)
    except BaseException as err:
        _refuse_failed(err, name, field, source)
    return name


def _refuse_failed(err: BaseException, given: str, field: str, source: str | None) -> None:
    """One line for an import that raised: moesim's own one-line errors as they are, others with the file
    and line of the user's code that raised them."""
    if isinstance(err, (KeyboardInterrupt, SystemExit)):
        raise err
    if isinstance(err, MoesimError):  # register_system refusing a catalogue name, say
        frame = users_frame(err)
        if err.source is None and frame is not None:  # the refusal named no file: the line that made it
            err.name_source(f"{Path(frame.filename).name}:{frame.lineno}")
        raise err
    where = _where(err)
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    run = f"python {given}" if _is_path(given) else f"python -c 'import {given}'"
    raise ConfigError(f"importing '{given}' failed{where}: {text}", source=source, field=field,
                      fix=f"`{run}` shows the traceback") from err


def _where(err: BaseException) -> str:
    """' at FILE:LINE' in the user's module (a SyntaxError's own place)."""
    if isinstance(err, SyntaxError) and err.filename:
        return f" at {Path(err.filename).name}:{err.lineno}"
    frame = users_frame(err)
    return f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
