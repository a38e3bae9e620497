"""Fixtures of the sweep tests."""

import pytest

from tests.factories import write_sweep_files


@pytest.fixture
def files(tmp_path):
    """A tiny trace and profile next to where the spec will be (relative paths resolve against its folder)."""
    write_sweep_files(tmp_path, seed=5)
    return tmp_path
