"""User-facing errors.

Every error that bad input can cause is a :class:`MoesimError`: the CLI prints
its one-line message and exits with status 2, never a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MoesimError(Exception):
    """An error caused by user input; ``str(err)`` is one line naming where and how to fix."""

    exit_code = 2

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None,
                 row: int | None = None, fix: str | None = None) -> None:
        self.source = source
        self.field = field
        self.row = row
        self.fix = fix
        self.detail = message
        super().__init__(self._format())

    def rename_field(self, field: str) -> None:
        """Name the field as the caller knows it (the Python API's keyword for a command-line option)."""
        self.field = field
        self.args = (self._format(),)

    def _format(self) -> str:
        parts = []
        if self.source:
            parts.append(str(self.source))
        if self.field:
            parts.append(f"field '{self.field}'")
        if self.row is not None:
            parts.append(f"row {self.row}")
        where = ": ".join([", ".join(parts)]) if parts else ""
        text = f"{where}: {self.detail}" if where else self.detail
        if self.fix:
            text += f" (fix: {self.fix})"
        return text.replace("\n", " ")


class TraceFormatError(MoesimError):
    """A trace file that does not follow the trace format (docs/trace-format.md)."""


class ProfileError(MoesimError):
    """A hardware profile that does not follow the profile schema."""


class ConfigError(MoesimError):
    """An unknown system, parameter, preset, or a configuration that cannot run."""


class MissingColumnError(ConfigError):
    """A system that cannot run on a trace at all: it needs a trace column the trace lacks (``field``)."""


class UnservableError(ConfigError):
    """A system that cannot serve at all: a portfolio of schedules, or one that plans with the trace's future."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """"did you mean X? " for the choices ``name`` looks like a slip of (a prefix of them, the same letters
    with other separators, or a close spelling), "" when none does: the start of a fix that then lists
    every choice."""
    close = close_choices(name, choices)
    return f"did you mean {' or '.join(close)}? " if close else ""


def close_choices(name: str, choices: Iterable[str]) -> list[str]:
    """The (at most three) choices :func:`did_you_mean` offers for ``name``."""
    choices = list(dict.fromkeys(choices))

    def letters(text: str) -> str:
        return "".join(ch for ch in text.lower() if ch.isalnum())

    wanted = letters(name)
    contained = [c for c in choices if letters(c).startswith(wanted)] if len(wanted) >= 3 else []
    if not contained:  # the closest spellings, all of them when several tie (int5: int8 or int4)
        ratio = {c: difflib.SequenceMatcher(None, name, c).ratio() for c in choices}
        best = max(ratio.values(), default=0.0)
        contained = [c for c in choices if ratio[c] == best] if best >= 0.7 else []
    return contained[:3]
