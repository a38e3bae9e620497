"""The CLI's consoles: tables keep their figures whole on a narrow console."""
import io

from rich.table import Table

from moesim.cli.app import PipeConsole


def table_of(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> Table:
    table = Table()
    for name in header:
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def printed(width: int, table: Table) -> str:
    out = io.StringIO()
    console = PipeConsole(file=out, width=width, markup=False, highlight=False, color_system=None)
    console.print(table)
    return out.getvalue()


HEADER = ("system", "TTFT ms", "TPOT ms", "p99 ms", "decode tok/s", "hit rate", "PCIe GiB", "CPU/GPU/PCIe util")
ROWS = [("cpu-only", "9,946.49", "323.41", "323.43", "3.09", "0.0%", "0.00", "95%/1%/0%"),
        ("gpu-only-lru", "2,667.15", "565.36", "769.49", "1.77", "37.8%", "4,466.77", "0%/5%/95%")]


def test_narrow_console_keeps_every_figure_whole() -> None:
    text = printed(40, table_of(ROWS, HEADER))
    assert "…" not in text
    for row in ROWS:
        for cell in row:
            assert cell in text
    # header words are kept whole too (wrapped at spaces, never cut)
    for word in ("system", "TTFT", "decode", "tok/s", "CPU/GPU/PCIe"):
        assert word in text
    # as narrow as its words allow: each header wraps to its longest word
    widest = max(len(line) for line in text.splitlines())
    assert 40 < widest < len(" │ ".join(HEADER)) + 4


def test_wide_console_prints_the_table_as_rich_does() -> None:
    table = table_of(ROWS, HEADER)
    out = io.StringIO()
    plain = PipeConsole(file=out, width=200, markup=False, highlight=False, color_system=None)
    super(PipeConsole, plain).print(table)
    assert printed(200, table_of(ROWS, HEADER)) == out.getvalue()


def test_a_table_given_its_own_width_gets_it_back() -> None:
    table = table_of(ROWS, HEADER)
    table.width = 30
    text = printed(30, table)
    assert "9,946.49" in text and "…" not in text
    assert table.width == 30


def test_a_long_note_to_a_pipe_stays_one_line_and_a_terminal_wraps_it() -> None:
    """A note cut at the console's width split a sentence over lines of a log, where grep finds half of it."""
    note = "note: smoe-token: " + " ".join(["the trace has no pred_next_token column"] * 6)
    piped = io.StringIO()
    PipeConsole(file=piped, width=80, markup=False, highlight=False, color_system=None).print(note)
    assert piped.getvalue() == note + "\n"
    terminal = io.StringIO()
    PipeConsole(file=terminal, width=80, markup=False, highlight=False, color_system=None,
                force_terminal=True).print(note)
    assert len(terminal.getvalue().splitlines()) == len(note) // 80 + 1


def test_a_json_flag_takes_dev_stdout_as_it_takes_dash(tmp_path, capsys) -> None:
    """`trace inspect T --json /dev/stdout` failed with 'Got unexpected extra argument', while `replay` takes
    it; another file after the flag says to redirect instead."""
    import json
    from pathlib import Path

    from moesim.cli import main
    trace = str(Path(__file__).resolve().parents[2] / "traces" / "mixtral-8x7b-humaneval.parquet")
    assert main(["trace", "inspect", trace, "--json", "-"]) == 0
    by_dash = json.loads(capsys.readouterr().out)
    for name in ("/dev/stdout", "/dev/fd/1"):
        assert main(["trace", "inspect", trace, "--json", name]) == 0
        assert json.loads(capsys.readouterr().out) == by_dash
    assert main(["trace", "inspect", trace, "--json", "/dev/stderr"]) == 2
    assert "--json takes no file here" in capsys.readouterr().err
