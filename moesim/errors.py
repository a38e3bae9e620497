"""User-facing errors.

Every error that bad input can cause is a :class:`MoesimError`: the CLI prints
its one-line message and exits with status 2, never a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Sequence


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
        #: rewrites the detail and fix, written in the command line's terms (``--set KEY=VALUE``), in the
        #: caller's (:func:`moesim.api_args.python_wording`); None: as written
        self.wording: Callable[[str], str] | None = None
        super().__init__(self._format())

    def rename_field(self, field: str) -> None:
        """Name the field as the caller knows it (the Python API's keyword for a command-line option)."""
        self.field = field
        self.args = (self._format(),)

    def name_source(self, source: str) -> None:
        """Name where the error comes from when the code that raised it could not (the line of a module of
        one's own that called ``register_system``)."""
        self.source = source
        self.args = (self._format(),)

    def reword(self, wording: Callable[[str], str]) -> None:
        """Say the detail and the fix in the caller's terms: the command line's options and ``--set`` as the
        Python API's arguments, say. ``detail`` and ``fix`` keep the words they were raised with."""
        self.wording = wording
        self.args = (self._format(),)

    def add_guess(self, guess: str) -> None:
        """Put ``guess`` ("did you mean X? ") first in the fix, for a front end that knows more choices than
        the code that raised."""
        self.fix = guess + (self.fix or "")
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
        say = self.wording or str
        text = f"{where}: {say(self.detail)}" if where else say(self.detail)
        if self.fix:
            text += f" (fix: {say(self.fix)})"
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


def slip_of(key: str, names: Sequence[str]) -> str:
    """"did you mean NAME? " for the ``names`` a keyword is a typing slip of ("" for none): as
    :func:`did_you_mean` guesses, or one letter swapped with the next, added, dropped or changed, which that
    misses in a short name (it rates ``qsp`` against ``qps`` 0.67, under its 0.7)."""
    guess = did_you_mean(key, names)
    if guess:
        return guess
    near = [name for name in names if one_slip(key, name)]
    return f"did you mean {' or '.join(near)}? " if near else ""


def one_slip(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ by one edit: two neighbouring letters swapped, or one added, dropped or
    changed."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
                                  and a[diff[1]] == b[diff[0]])
    short, long_ = sorted((a, b), key=len)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))
