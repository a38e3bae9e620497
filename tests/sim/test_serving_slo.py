"""SLOs written as a user would: a limit with a unit is refused with the same limit in milliseconds."""

from __future__ import annotations

import pytest

from moesim.analysis.serving import parse_slo
from moesim.errors import ConfigError


@pytest.mark.parametrize("text, fix", [
    ("ttft_ms=0.5s", "write ttft_ms=500"),
    ("tpot_ms=100ms", "write tpot_ms=100"),
    ("ttft_ms=1,e2e_ms=2.5 s", "write e2e_ms=2500"),
    ("tpot_ms=250us", "write tpot_ms=0.25"),
])
def test_a_limit_with_a_unit_is_given_back_in_milliseconds(text, fix):
    """`--slo ttft_ms=0.5s` said only 'is not a number (fix: write e.g. ttft_ms=500)'."""
    with pytest.raises(ConfigError, match="is not a number") as err:
        parse_slo(text)
    assert f"milliseconds), the value a bare number: {fix})" in str(err.value)
    assert err.value.field == "--slo"


def test_a_limit_that_is_no_number_keeps_the_general_fix():
    with pytest.raises(ConfigError, match=r"'ttft_ms=soon' is not a number \(fix: write e.g. ttft_ms=500\)"):
        parse_slo("ttft_ms=soon")
    assert parse_slo({"ttft_ms": 500, "tpot_ms": "100"}) == {"ttft_ms": 500.0, "tpot_ms": 100.0}


@pytest.mark.parametrize("text", ["ttft_ms=-0.5s", "ttft_ms=0s", "tpot_ms=1e400ms"])
def test_a_limit_with_a_unit_that_is_no_limit_keeps_the_general_fix(text):
    """'ttft_ms=-0.5s' was answered 'write ttft_ms=-500', which the next run refuses as no positive number (0s:
    'ttft_ms=0', 1e400ms: 'tpot_ms=inf')."""
    with pytest.raises(ConfigError, match=r"is not a number \(fix: write e.g. ttft_ms=500\)"):
        parse_slo(text)
