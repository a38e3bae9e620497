"""Parameter documentation read from dataclass sources: `#:` blocks, trailing comments, units, defaults."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from moesim.analysis.params import format_default, parameter_docs, summary, system_parameter_docs


@dataclass
class Example:
    """An example component.

    More text that is not the summary.
    """

    #: time kept free per layer
    #: (a second comment line)
    budget_ms: float = 1.5
    #: low and high bound of a range
    low: int = 1
    high: int = 9
    plain: bool = True  # trailing comment
    memory: float = 2.0  #: trailing with colon (GiB)
    undocumented: str = ""

    names: tuple[str, ...] = field(default_factory=lambda: ("a", "b"))
    _private: int = 0


def test_comments_defaults_and_units_come_from_the_source():
    docs = {d.name: d for d in parameter_docs(Example)}
    assert list(docs) == ["budget_ms", "low", "high", "plain", "memory", "undocumented", "names"]
    assert docs["budget_ms"].meaning == "time kept free per layer (a second comment line)"
    assert (docs["budget_ms"].default, docs["budget_ms"].unit, docs["budget_ms"].type) == (1.5, "ms", "float")
    assert docs["high"].meaning == docs["low"].meaning == "low and high bound of a range"  # one block, a run
    assert docs["plain"].meaning == "trailing comment" and docs["plain"].unit == ""
    assert docs["memory"].meaning == "trailing with colon (GiB)" and docs["memory"].unit == "GiB"
    assert docs["undocumented"].meaning == ""  # a trailing comment above documents only its own line
    assert docs["names"].default == ("a", "b") and docs["names"].meaning == ""


def test_summary_is_the_first_paragraph():
    assert summary(Example) == "An example component."

    @dataclass
    class Bare:
        x: int = 1
    assert summary(Bare) == ""  # dataclasses invent a signature docstring: not a description


def test_classes_without_source_still_list_their_fields():
    Made = dataclasses.make_dataclass("Made", [("x", int, dataclasses.field(default=3))])
    (doc,) = parameter_docs(Made)
    assert (doc.name, doc.default, doc.meaning) == ("x", 3, "")


def test_every_system_documents_its_component_parameters():
    """A --set parameter nobody can look up is a gap: every component parameter has a meaning."""
    from moesim.policy.systems import system_names
    missing = set()
    for name in system_names():
        for key, doc, _ in system_parameter_docs(name):
            if doc is not None and not doc.meaning:
                missing.add(key)
    assert not missing, sorted(missing)


def test_each_parameter_has_its_own_meaning():
    """A field without a comment inherits the block above only by mistake: no two parameters of a system
    that follow each other share a meaning."""
    from moesim.policy.systems import system_names
    shared = set()
    for name in system_names():
        rows = [(key, doc.meaning) for key, doc, _ in system_parameter_docs(name) if doc is not None]
        shared |= {(a, b) for (a, ma), (b, mb) in zip(rows, rows[1:]) if ma == mb}
    assert not shared, sorted(shared)


def test_state_a_component_builds_is_not_a_parameter():
    from moesim.errors import ConfigError
    from moesim.policy.systems import build_system
    keys = {key for key, doc, _ in system_parameter_docs("moe-infinity") if doc is not None}
    assert "prefetch.tracker" not in keys and "cache.tracker" not in keys and "prefetch.calibration" in keys
    with pytest.raises(ConfigError, match="tracker"):
        build_system("moe-infinity", {"prefetch.tracker": "x"})


def test_format_default():
    assert [format_default(v) for v in ("", "bf16", True, (1, 2), (), 0.5)] == ['""', "bf16", "true", "1,2",
                                                                             "(none)", "0.5"]
