"""Damaged logs of the vllm-qwen3-prefill format: lines swapped or repeated where the format repeats itself (the
idle ranks' dummy forwards 3-31) are refused in one line naming the file, the lines and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moesim.cli import main
from moesim.errors import TraceFormatError
from moesim.trace.importers import import_trace
from tests.trace.test_importers import REAL, needs_real

LAYERS = 48


def qwen3_log(path: Path, tokens: list[int], edit=None) -> Path:
    """A token_distri log: forward f holds ``tokens[f]`` tokens; forwards 3+ repeat one dummy batch."""
    lines = []
    for forward, count in enumerate(tokens):
        for layer in range(LAYERS):
            seed = layer if forward >= 3 else forward * LAYERS + layer  # the dummy batch: the same every time
            ids = [[(seed + t + k) % 128 for k in range(8)] for t in range(count)]
            lines.append(json.dumps({"topk_weights": [count, 8], "topk_ids": ids}) + "\n")
    if edit is not None:
        lines = edit(lines)
    path.write_text("".join(lines))
    return path


def swapped(first: int, second: int):
    def edit(lines: list[str]) -> list[str]:
        lines = list(lines)
        lines[first], lines[second] = lines[second], lines[first]
        return lines
    return edit


def test_an_intact_log_imports(tmp_path):
    log = qwen3_log(tmp_path / "token_distri_8.jsonl", [3, 1, 5, 2, 2, 2])
    assert import_trace(None, [log], tmp_path / "t.parquet").prefill_steps == 1


@pytest.mark.parametrize("edit, words", [
    (swapped(4 * LAYERS + 5, 4 * LAYERS + 6),
     "line 198, field 'topk_ids': forward 4 is not the dummy batch the other forwards 3-5 all repeat: lines 198 "
     "and 199 are swapped (layers 5 and 6)"),
    (lambda lines: lines[:3 * LAYERS + 8] + [lines[3 * LAYERS + 7]] + lines[3 * LAYERS + 9:],
     "line 153, field 'topk_ids': forward 3 is not the dummy batch the other forwards 3-5 all repeat: layer 8 "
     "(line 153) differs"),
], ids=["swapped", "repeated"])
def test_a_dummy_forward_with_lines_swapped_or_repeated_is_refused(tmp_path, capsys, edit, words):
    """Two lines swapped inside one forward imported without a word."""
    log = qwen3_log(tmp_path / "token_distri_8.jsonl", [3, 1, 5, 2, 2, 2], edit)
    out = tmp_path / "t.parquet"
    with pytest.raises(TraceFormatError) as err:
        import_trace(None, [log], out)
    assert str(err.value).startswith(f"{log} {words}") and "fix: lines are swapped, repeated or edited" in str(err.value)
    assert main(["trace", "import", str(log), "--out", str(out)]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not out.exists()


@needs_real
def test_the_real_log_with_two_lines_swapped_in_a_forward_is_refused(tmp_path):
    real = REAL / "soryxie-vllm-qwen3-30b-a3b" / "token_distri_16.jsonl"
    lines = real.read_text().splitlines(keepends=True)
    log = tmp_path / real.name
    log.write_text("".join(swapped(10 * LAYERS + 20, 10 * LAYERS + 21)(lines)))
    with pytest.raises(TraceFormatError, match=r"forward 10 is not the dummy batch .* lines 501 and 502 are swapped"):
        import_trace(None, [log], tmp_path / "t.parquet")
    shutil.copy(real, log)
    assert import_trace(None, [log], tmp_path / "t.parquet").prefill_steps == 1
