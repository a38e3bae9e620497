"""Small helpers shared across layers: atomic writes and reading YAML with one-line errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def tmp_path_for(path: Path) -> Path:
    """Temporary sibling for writers that produce a file in several calls."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def read_yaml(path: Path, error: type[Exception]) -> Any:
    """Parse a YAML file; a syntax error becomes ``error`` naming the file and the line."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise error(f"not valid YAML{where}", source=str(path), fix="fix the YAML syntax") from None
