"""Test-session set-up shared by every test module."""

import os
import tempfile

from hypothesis import settings

# CI draws the same examples every run, so whether a change lands does not depend on a new random draw;
# elsewhere each run explores new ones. Loaded before the test modules import: their settings inherit it.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config) -> None:
    # records of validated traces (moesim.trace.validated) go to a folder of this session, not ~/.cache
    os.environ.setdefault("MOESIM_CACHE_DIR", tempfile.mkdtemp(prefix="moesim-cache-"))
