"""Fixtures of the trace tests: ``hf``, the torch extra for the capture tests (test_capture*.py)."""

import pytest


@pytest.fixture(scope="module")
def hf():
    """Skip cleanly without the torch extra; run tiny models on one thread (no contention on 2 cores)."""
    torch_ = pytest.importorskip("torch")
    transformers_ = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    before = torch_.get_num_threads()
    torch_.set_num_threads(1)
    transformers_.logging.set_verbosity_error()
    transformers_.logging.disable_progress_bar()
    yield
    torch_.set_num_threads(before)
