"""Test-session set-up shared by every test module."""

import os
import tempfile

import pytest
from hypothesis import settings

# CI draws the same examples every run, so whether a change lands does not depend on a new random draw;
# elsewhere each run explores new ones. Loaded before the test modules import: their settings inherit it.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config) -> None:
    # records of validated traces (moesim.trace.validated) go to a folder of this session, not ~/.cache
    os.environ.setdefault("MOESIM_CACHE_DIR", tempfile.mkdtemp(prefix="moesim-cache-"))


@pytest.fixture
def own_systems():
    """Systems and components a test registers (and the modules said to register them) are gone after it."""
    from moesim.policy.systems import COMPONENTS, REGISTERED_BY, SYSTEMS
    saved = dict(SYSTEMS), dict(REGISTERED_BY), {role: dict(registry) for role, registry in COMPONENTS.items()}
    yield
    for live, before in zip((SYSTEMS, REGISTERED_BY), saved[:2]):
        live.clear()
        live.update(before)
    COMPONENTS.clear()
    COMPONENTS.update(saved[2])
