"""Prompt files for ``moesim capture``.

Two formats: JSONL, one object per line with a ``prompt`` or ``text`` string
(or ``token_ids``/``input_ids``, a list of vocabulary ids, for pre-tokenised
prompts), and plain text, one prompt per line. A file is JSONL when its name
ends in ``.jsonl`` or its first non-blank line starts with ``{`` (in a ``.txt``
file: is a JSON object). Blank lines
are skipped in both formats; row numbers in errors are 1-based line numbers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from moesim.trace.capture.errors import PromptsError

TEXT_FIELDS = ("prompt", "text")
ID_FIELDS = ("token_ids", "input_ids")


@dataclass(frozen=True)
class Prompt:
    """One prompt: text to tokenise, or token ids taken as they are."""

    line: int
    text: str | None = None
    token_ids: tuple[int, ...] | None = None


def read_prompts_file(path: str | Path) -> bytes:
    """The bytes of a prompts file, read once: a pipe (``--prompts /dev/stdin`` or ``-``, ``<(jq ...)``) has no
    second reading."""
    if str(path) == "-":  # standard input, as '-' means standard output for --json
        import sys
        return sys.stdin.buffer.read()
    path = Path(path)
    if path.is_dir():
        raise PromptsError("is a folder, not a prompts file", source=str(path), fix="give the prompts file in it")
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PromptsError("prompts file not found", source=str(path), fix="check the path") from None
    except OSError as err:
        raise PromptsError(f"cannot read the prompts file ({err.strerror or err})", source=str(path),
                           fix="check the path and its permissions") from None


def load_prompts(path: str | Path, data: bytes | None = None) -> list[Prompt]:
    """Parse a prompts file (``data``: its bytes, when already read); raise :class:`PromptsError` naming the
    line of the first problem."""
    path = Path(path)
    if data is None:
        data = read_prompts_file(path)
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is no part of the first prompt; lines end at
        # "\n", "\r\n" or "\r" only: str.splitlines also splits at U+2028, U+0085, form feeds and more, which
        # JSON strings may hold raw (json.dumps(..., ensure_ascii=False)) and a text prompt may contain
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        if data.startswith(b"PAR1"):  # a trace (or other Parquet file) given where the prompts go
            raise PromptsError("is a Parquet file (a trace?), not a prompts file", source=str(path),
                               fix="give the prompts as JSONL or plain text, one per line") from None
        line = data.count(b"\n", 0, err.start) + 1  # the line of the first byte that is no UTF-8
        raise PromptsError(f"not UTF-8 text (byte 0x{data[err.start]:02x})", source=str(path), row=line,
                           fix="save the prompts as UTF-8 JSONL or plain text (e.g. iconv -f latin1 -t utf-8)") \
            from None
    lines = re.split(r"\r\n|\r|\n", text)
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise PromptsError("prompts file is empty", source=str(path),
                           fix="write one prompt per line (plain text) or one JSON object per line")
    if not _is_jsonl(path, numbered[0][1]):
        return [Prompt(line=n, text=line) for n, line in numbered]
    return [_json_prompt(path, n, line) for n, line in numbered]


def _is_jsonl(path: Path, first: str) -> bool:
    """JSONL: named .jsonl, or its first prompt starts with '{'; but a .txt file whose first line is no JSON
    object is plain text ('{x} is a set' is a prompt, not a broken row)."""
    if path.suffix.lower() == ".jsonl":
        return True
    if not first.lstrip().startswith("{"):
        return False
    if path.suffix.lower() != ".txt":
        return True
    try:
        return isinstance(json.loads(first), dict)
    except ValueError:
        return False


def _json_prompt(path: Path, row: int, line: str) -> Prompt:
    fix = 'write one object per line, e.g. {"prompt": "..."} or, pre-tokenised, {"token_ids": [1, 2, 3]}'
    try:
        obj = json.loads(line)
    except ValueError as err:
        raise PromptsError(f"not valid JSON ({err.msg})", source=str(path), row=row, fix=fix) from None
    if not isinstance(obj, dict):
        raise PromptsError("JSONL row is not an object", source=str(path), row=row, fix=fix)
    for key in TEXT_FIELDS:
        if key in obj:
            value = obj[key]
            if not isinstance(value, str) or not value:
                raise PromptsError("must be a non-empty string", source=str(path), field=key, row=row, fix=fix)
            return Prompt(line=row, text=value)
    for key in ID_FIELDS:
        if key in obj:
            value = obj[key]
            ok = isinstance(value, list) and value and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
            if not ok:
                raise PromptsError("must be a non-empty list of non-negative token ids", source=str(path),
                                   field=key, row=row, fix="give vocabulary ids, e.g. [1, 415, 2936]")
            return Prompt(line=row, token_ids=tuple(value))
    raise PromptsError(f"row has none of the fields {', '.join(TEXT_FIELDS + ID_FIELDS)}", source=str(path),
                       row=row, fix=fix)
