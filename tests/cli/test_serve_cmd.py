"""`moesim serve-sim` input checks made before any run: the rates of --qps."""

from __future__ import annotations

import pytest

from moesim.cli import main
from tests.test_serving_cli import files  # noqa: F401 - the fixture: a tiny trace and profile


@pytest.fixture
def no_runs(monkeypatch):
    """The serving runs the command started (none, for input it refuses)."""
    import moesim.sim.serving
    runs = []
    monkeypatch.setattr(moesim.sim.serving, "serve", lambda *args, **kwargs: runs.append(args))
    return runs


@pytest.mark.parametrize("rate", ["0", "-1", "nan", "abc", "1e308", "1e13"])
def test_a_rate_out_of_range_says_the_range(files, capsys, no_runs, rate):  # noqa: F811
    """'1e308' is positive and finite, yet was refused with "give positive finite rates", which it is."""
    trace, hw = files
    assert main(["serve-sim", trace, "--hw", hw, "--qps", rate]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"moesim: error: field '--qps': '{rate}' is not a rate in requests/s "
                   "(fix: give positive finite rates up to 1.09951e+12, e.g. 0.5,1,2)")
    assert no_runs == []
