"""`moesim trace` subcommands as a user runs them: progress, output streams and exit statuses."""

from __future__ import annotations

from moesim.cli import main
from moesim.trace.io import read_meta


def test_synth_reports_progress_in_rows_on_stderr(tmp_path, capsys, monkeypatch):
    """A long synthesis (minutes for a DeepSeek-V3 trace of many thousand tokens) printed nothing until it ended."""
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "0")
    out = tmp_path / "s.parquet"
    args = ["trace", "synth", "--model", "mixtral-8x7b", "--requests", "2", "--prompt-len", "3", "--decode-len", "5",
            "--no-scores", "--out", str(out)]
    assert main(args) == 0
    captured = capsys.readouterr()
    rows = 2 * (3 + 5) * 32
    lines = [line for line in captured.err.splitlines() if line.startswith("trace synth: ")]
    assert lines and lines[-1].startswith(f"trace synth: done, {rows:,}/{rows:,} rows (100%)")
    assert captured.out.strip() == f"wrote {out}: {rows:,} rows"
    assert read_meta(out).source["requests"] == 2

