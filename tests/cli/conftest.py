"""Fixtures of the `moesim replay` tests (tests/cli/test_replay_*.py)."""

import pytest

from tests.factories import write_trace_and_profile


@pytest.fixture
def files(tmp_path):
    return write_trace_and_profile(tmp_path, 3, decode=6)
