"""The on-disk record of traces that passed the whole validation pass (moesim.trace.validated)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import moesim.trace.validate as validate
from moesim.errors import TraceFormatError
from moesim.trace.validated import cache_dir, was_validated
from tests.trace.test_validate import _bad_scores, _valid


@pytest.fixture
def records(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("MOESIM_CACHE_DIR", str(folder))
    monkeypatch.setattr(validate, "_CHECKED", {})  # a fresh process, as far as validation knows
    return folder


def test_a_file_that_passed_is_not_checked_again_in_a_later_process(tmp_path, records, monkeypatch):
    _valid(tmp_path)
    path = tmp_path / "valid.parquet"
    assert not was_validated(path)
    validate.checked_meta(path, ())  # required columns now, scores beside the run
    validate.settle(path)
    assert was_validated(path) and len(list((records / "validated").iterdir())) == 1
    monkeypatch.setattr(validate, "_CHECKED", {})  # the next process

    def refuse(*args, **kwargs):
        raise AssertionError("a recorded file was checked again")
    monkeypatch.setattr(validate, "validate_trace", refuse)
    monkeypatch.setattr(validate, "_check_lazy", refuse)
    meta = validate.checked_meta(path, ())
    validate.settle(path)
    assert meta.model.num_experts == 8


def test_a_file_changed_after_it_passed_is_checked_again(tmp_path, records, monkeypatch):
    _valid(tmp_path)
    good = tmp_path / "valid.parquet"
    validate.checked_meta(good)  # every column at once: recorded now
    assert was_validated(good)
    bad = _bad_scores(tmp_path, row=4, value=np.nan, name="other.parquet")
    os.replace(bad, good)  # same path, new content (and a new inode and change time)
    assert not was_validated(good)
    monkeypatch.setattr(validate, "_CHECKED", {})
    validate.checked_meta(good, ())
    with pytest.raises(TraceFormatError, match="field 'scores', row 4"):
        validate.settle(good)
    assert not was_validated(good)  # a failed file is never recorded


def test_a_failed_check_writes_no_record_and_off_turns_records_off(tmp_path, records, monkeypatch):
    bad = _bad_scores(tmp_path, row=1, value=-1.0)
    with pytest.raises(TraceFormatError):
        validate.checked_meta(bad)
    assert not records.exists() or not any((records / "validated").iterdir())
    monkeypatch.setenv("MOESIM_CACHE_DIR", "off")
    assert cache_dir() is None
    _valid(tmp_path)
    validate.checked_meta(tmp_path / "valid.parquet")
    assert not was_validated(tmp_path / "valid.parquet")


def test_an_unwritable_cache_folder_only_means_checking_again(tmp_path, records, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("MOESIM_CACHE_DIR", str(blocker))  # its 'validated' child cannot be created
    _valid(tmp_path)
    validate.checked_meta(tmp_path / "valid.parquet")
    assert not was_validated(tmp_path / "valid.parquet")
