"""Test-session set-up shared by every test module."""

import os
import tempfile


def pytest_configure(config) -> None:
    # records of validated traces (moesim.trace.validated) go to a folder of this session, not ~/.cache
    os.environ.setdefault("MOESIM_CACHE_DIR", tempfile.mkdtemp(prefix="moesim-cache-"))
