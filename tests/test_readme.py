"""README.md's examples run as written: the Python block and every command of "Using it" that can run here."""

from __future__ import annotations

import os
import re
import shlex
import warnings
from pathlib import Path

import pytest

import moesim
from moesim.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

#: commands of the "Using it" block that cannot run in the test suite, and why
NEEDS = {
    "moesim capture": "needs a Hugging Face checkpoint",
    "moesim validate --real": "executes real kernels for minutes (docs/validation/README.md)",
    "moesim trace compare A.parquet": "placeholder file names",
    "moesim trace validate FILE.parquet": "placeholder file name",
    "moesim sweep spec.yaml": "the README shows no spec.yaml (`moesim sweep --help` does, tested in test_sweep)",
    "moesim plot results.parquet": "needs the sweep above (tested in test_workflows)",
    "moesim report results.parquet": "needs the sweep above (tested in test_html_report)",
}


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def python_block() -> str:
    (block,) = [b for b in blocks("python") if "moesim.replay" in b]
    return block


def using_it_commands() -> list[str]:
    """Each `moesim ...` line of the block under "## Using it", continuations joined, comments dropped."""
    section = README.split("## Using it", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, flags=re.S).group(1)
    joined = block.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("moesim "):
            out.append(re.sub(r"\s*\[[^\]]*\]", "", line))  # [--json]: optional parts left out
    return out


def made_folders() -> list[str]:
    """Folders the "Using it" block creates with `mkdir -p` before its commands write there."""
    block = re.search(r"```sh\n(.*?)```", README.split("## Using it", 1)[1], flags=re.S).group(1)
    return [f for line in block.splitlines() if line.startswith("mkdir -p ") for f in line.split()[2:]]


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A folder laid out like the repository's (traces/ and ../shared beside it), outputs kept in tmp."""
    work = tmp_path / "repo"
    work.mkdir()
    (work / "traces").symlink_to(ROOT / "traces")
    (work / "hwprofiles").symlink_to(ROOT / "hwprofiles")
    shared = ROOT.parent / "shared"
    if shared.is_dir():
        (tmp_path / "shared").symlink_to(shared)
    for folder in made_folders():  # the block's `mkdir -p` lines, as a reader runs them
        (work / folder).mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(work)
    return work


def test_readme_commands_are_found():
    commands = using_it_commands()
    assert any(c.startswith("moesim replay") for c in commands) and len(commands) >= 12
    assert "moesim.sweep" in python_block()


@pytest.mark.slow
def test_readme_python_example_runs_as_written(sandbox):
    namespace: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(python_block(), "README.md", "exec"), namespace)  # noqa: S102 - our own README
    run, table = namespace["run"], namespace["table"]
    assert len(run.metrics) == 1 and run.metrics.iloc[0]["slots_per_layer"] == 2
    decode = run.steps[run.steps["phase"] == "decode"]
    assert decode["latency_ms"].mean() == pytest.approx(run.metrics.iloc[0]["tpot_ms_mean"], rel=1e-6)
    again = moesim.load_replay("out/lru-run")
    assert again.metrics.equals(run.metrics) and len(again.steps) == len(run.steps)
    assert len(table) == 4  # 2 systems x 2 cache sizes
    failed = table[table["status"] != "ok"]
    if len(failed):  # failed points are never silent
        assert any("sweep points failed" in str(w.message) for w in caught)


def _commands() -> list[str]:
    return using_it_commands()


@pytest.mark.slow
@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c.split()[:3]))
def test_readme_cli_example_runs_as_written(sandbox, command, capsys):
    for prefix, reason in NEEDS.items():
        if command.startswith(prefix):
            pytest.skip(reason)
    args = shlex.split(command)[1:]
    if any(a.startswith("../shared/") and not Path(a).exists() for a in args):
        pytest.skip("the real traces of ../shared are not beside this checkout")
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    for i, arg in enumerate(args):  # every file the command names as an output exists
        if arg in ("--json", "--timeline", "--decisions", "--chrome-trace", "--plot", "--out") and args[i + 1] != "-":
            assert (sandbox / args[i + 1]).is_file(), args[i + 1]
    assert os.listdir(sandbox)


#: folders of the repository itself (an out/ left by an earlier run is not one: a fresh clone lacks it)
REPO_FOLDERS = {"traces", "hwprofiles", "docs", "benchmarks", "notebooks"}
OUTPUT_FLAGS = ("--json", "--timeline", "--decisions", "--chrome-trace", "--plot", "--out", "--requests-out",
                "--requests-plot")


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                        for p in (ROOT / "docs").rglob("*.md"))])
def test_doc_commands_write_only_into_folders_that_exist_or_the_page_makes(page):
    """A page's shell blocks, run in order from a fresh clone, write an output only into a folder the
    repository has or a `mkdir -p` of that page made before (docs/serving.md wrote to out/ without one)."""
    text = (ROOT / page).read_text()
    made: set[str] = set()
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("mkdir -p "):
                made.update(f.rstrip("/") for f in line.split()[2:])
                continue
            words = line.split()
            for flag, value in zip(words, words[1:]):
                if flag in OUTPUT_FLAGS and value != "-" and "/" in value.rstrip("/") and \
                        not value.startswith(("/", "$", "..")):
                    folder = value.rstrip("/").rsplit("/", 1)[0]
                    tracked = folder.split("/")[0] in REPO_FOLDERS and (ROOT / folder).is_dir()
                    assert folder in made or tracked, \
                        f"{page}: {flag} {value} writes into {folder}/, which no earlier `mkdir -p` makes"
