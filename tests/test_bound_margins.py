"""benchmarks/bound_margins.py runs, and on its random cases no system comes below its own lower bound."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bound_margins_runs_and_no_bound_is_beaten():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bound_margins.py"), "--cases", "3",
                           "--no-mixtral"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    found = re.search(r"smallest ratio of a system to its own lower bound: ([0-9.]+)", done.stdout)
    assert found is not None, done.stdout
    assert float(found.group(1)) >= 1.0
