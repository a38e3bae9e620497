"""moesim capture without torch: the prompts file (JSONL or plain text, one-line errors naming file and row), and
the one line a missing torch extra gives."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moesim.cli import main
from moesim.trace.capture.errors import PromptsError, TorchMissingError
from moesim.trace.capture.prompts import load_prompts


# ----------------------------------------------------------------------------- no torch needed
def test_prompts_jsonl_text_and_ids(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"text": "world"}\n{"token_ids": [3, 4]}\n')
    prompts = load_prompts(path)
    assert [(p.line, p.text, p.token_ids) for p in prompts] == [(1, "hello", None), (3, "world", None),
                                                                (4, None, (3, 4))]


def test_prompts_plain_text_one_per_line(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("first prompt\n\n  second one\n")
    assert [p.text for p in load_prompts(path)] == ["first prompt", "  second one"]


@pytest.mark.parametrize("content, expected", [
    ("", "prompts file is empty"),
    ("\n  \n", "prompts file is empty"),
    ('{"prompt": "a"}\n{"prompt": \n', "row 2: not valid JSON"),
    ('{"prompt": "a"}\n{"question": "b"}\n', "row 2: row has none of the fields prompt, text"),
    ('{"prompt": ""}\n', "field 'prompt', row 1: must be a non-empty string"),
    ('{"token_ids": [1, -2]}\n', "field 'token_ids', row 1"),
    ('["a"]\n', "row 1: JSONL row is not an object"),
])
def test_prompts_errors_name_file_row_and_fix(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(PromptsError) as info:
        load_prompts(path)
    message = str(info.value)
    assert message.startswith(str(path)) and expected in message and "\n" not in message


def test_missing_torch_gives_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    from moesim.trace.capture.model import require_torch
    with pytest.raises(TorchMissingError):
        require_torch()
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    code = main(["capture", "--model", str(tmp_path), "--prompts", str(prompts), "--max-new-tokens", "2",
                 "--out", str(tmp_path / "t.parquet")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == "moesim: error: install the torch extra: pip install -e '.[torch]'"


def test_trace_package_imports_without_torch() -> None:
    import subprocess
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "import moesim.trace, moesim.trace.capture, moesim.cli; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_a_text_file_whose_first_prompt_starts_with_a_brace_is_text(tmp_path: Path) -> None:
    """prompts.txt beginning '{x} is a set' was taken for JSONL and refused as 'row 1: not valid JSON'."""
    path = tmp_path / "prompts.txt"
    path.write_text("{x} is a set\nsecond\n")
    assert [p.text for p in load_prompts(path)] == ["{x} is a set", "second"]
    path.write_text('{"prompt": "a"}\n')  # JSONL in a .txt file is still JSONL
    assert [p.text for p in load_prompts(path)] == ["a"]
    broken = tmp_path / "prompts.json"
    broken.write_text('{"prompt": "a"\n')
    with pytest.raises(PromptsError, match="row 1: not valid JSON"):
        load_prompts(broken)


@pytest.mark.parametrize("name", ["p.txt", "p.jsonl"])
def test_a_byte_order_mark_is_no_part_of_the_first_prompt(tmp_path: Path, name: str) -> None:
    """A file saved with a UTF-8 byte-order mark (Windows editors): a .jsonl was refused ('Unexpected UTF-8 BOM')
    and a .txt of JSON rows was captured as plain text, each row's JSON its prompt."""
    path = tmp_path / name
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "hello"}\r\n{"token_ids": [3, 4]}\r\n')
    assert [(p.line, p.text, p.token_ids) for p in load_prompts(path)] == [(1, "hello", None), (2, None, (3, 4))]
    plain = tmp_path / "plain.txt"
    plain.write_bytes(b"\xef\xbb\xbffirst\r\nsecond\r\n")
    assert [p.text for p in load_prompts(plain)] == ["first", "second"]


def test_lines_end_at_newlines_only(tmp_path: Path) -> None:
    """JSON strings may hold U+2028, U+0085 or a form feed raw (json.dumps(..., ensure_ascii=False) writes them
    so); str.splitlines cut such a row in two ('not valid JSON') and a text prompt holding one in two prompts."""
    import json
    texts = ["a\u2028b", "c\x85d", "page\x0cbreak", "sep\x1cx"]
    rows = tmp_path / "p.jsonl"
    rows.write_text("".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    assert [p.text for p in load_prompts(rows)] == texts
    plain = tmp_path / "p.txt"
    plain.write_text("\n".join(texts) + "\nold\rmac\n", encoding="utf-8", newline="")
    assert [(p.line, p.text) for p in load_prompts(plain)] == [(1, texts[0]), (2, texts[1]), (3, texts[2]),
                                                               (4, texts[3]), (5, "old"), (6, "mac")]


def test_a_file_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    """'not UTF-8 text' named no line: in a long file saved as Latin-1, one accented letter is hard to find."""
    path = tmp_path / "p.txt"
    path.write_bytes(b"first\nsecond\ncaf\xe9 au lait\n")
    with pytest.raises(PromptsError) as info:
        load_prompts(path)
    assert str(info.value).startswith(f"{path}, row 3: not UTF-8 text (byte 0xe9) (fix: save the prompts as UTF-8")


def test_a_trace_given_as_the_prompts_says_so(tmp_path: Path) -> None:
    """`--prompts trace.parquet` (the trace where the prompts go) said 'not UTF-8 text'."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"x": [1, 2, 3]}), path)
    with pytest.raises(PromptsError) as info:
        load_prompts(path)
    assert str(info.value).startswith(f"{path}: is a Parquet file (a trace?), not a prompts file (fix: give the")
