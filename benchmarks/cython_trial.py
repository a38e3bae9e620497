"""Replay speed of moesim's pure-Python source against the same source compiled with Cython.

moesim stays pure Python (docs/performance.md, "Compiling the unchanged source with Cython", says why);
this script measures what compiling the unchanged modules would give. It copies the checkout's
``moesim`` package to a temporary folder, compiles the chosen modules there in place (Cython 3,
``language_level=3``, ``binding=True``, the C compiler's defaults of ``build_ext``), and times each
system's ``sim.run()`` on a DeepSeek-V3 decode trace (int4, one request, 64-token prompt) with the
pure and the compiled package in turn, each replay in a fresh process pinned to one core, best of
``--rounds``.

Needs Cython and a C compiler, neither of them a moesim dependency:

    .venv/bin/pip install cython
    .venv/bin/python benchmarks/cython_trial.py --systems smoe-flex,cpu-only --compile policy
    .venv/bin/python benchmarks/cython_trial.py --systems cpu-only --compile engine
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from replay_speed import SETTINGS, _has, synth  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: module groups: every policy module (catalogue included), or the engine and the modules it runs per layer
GROUPS = {
    "policy": lambda pkg: sorted(pkg.glob("policy/**/*.py")),
    "engine": lambda pkg: [pkg / "sim" / f"{name}.py" for name in ("engine", "bookkeeping", "transfers", "copies")],
}
TIMED = """
import sys, time
from moesim.sim.run import prepare
sim = prepare(sys.argv[1], sys.argv[2], sys.argv[3], dict(a.split("=", 1) for a in sys.argv[4:]))
start = time.perf_counter()
sim.run()
print(time.perf_counter() - start)
"""


def compile_copy(folder: Path, groups: list[str]) -> Path:
    """A copy of the moesim package under ``folder`` with the modules of ``groups`` compiled in place."""
    from Cython.Build import cythonize
    from setuptools import Extension, setup
    package = folder / "moesim"
    shutil.copytree(ROOT / "moesim", package, ignore=shutil.ignore_patterns("__pycache__"))
    sources = [path for group in groups for path in GROUPS[group](package)]
    extensions = [Extension(".".join(path.relative_to(folder).with_suffix("").parts), [str(path.relative_to(folder))])
                  for path in sources]
    here = Path.cwd()
    os.chdir(folder)
    try:
        setup(ext_modules=cythonize(extensions, language_level=3, quiet=True,
                                    compiler_directives={"binding": True}),
              script_args=["build_ext", "--inplace", "-q"])
    finally:
        os.chdir(here)
    return folder


def replay_s(trace: Path, system: str, path: Path) -> float:
    """``sim.run()`` seconds of one replay with the package found first on ``path``."""
    settings = [f"{k}={v}" for k, v in SETTINGS.items()]
    taskset = ["taskset", "-c", "0"] if sys.platform.startswith("linux") and _has("taskset") else []
    env = {**os.environ, "PYTHONPATH": str(path)}
    profile = ROOT / "hwprofiles" / "rtx4090.yaml"  # the copy has no hwprofiles/ beside it: named by path
    command = [sys.executable, "-c", TIMED, str(trace), str(profile), system, *settings]
    done = subprocess.run(taskset + command, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise RuntimeError(f"{system} with {path}: {lines[-1] if lines else done.returncode}")
    return float(done.stdout.split()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="smoe-flex,cpu-only")
    parser.add_argument("--compile", default="policy", help="comma-separated groups: policy, engine")
    parser.add_argument("--decode", type=int, default=2000, help="decode tokens of the trace")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    groups = args.compile.split(",")
    unknown = set(groups) - set(GROUPS)
    if unknown:
        parser.error(f"--compile: unknown group(s) {sorted(unknown)}; choose from {sorted(GROUPS)}")
    try:
        import Cython  # noqa: F401
    except ImportError:
        print("cython_trial.py: Cython is not installed (it is no moesim dependency): .venv/bin/pip install cython",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        trace = folder / "decode.parquet"
        synth(trace, 64, args.decode)
        print(f"compiling {', '.join(groups)} ...", file=sys.stderr, flush=True)
        (folder / "compiled").mkdir()
        compiled = compile_copy(folder / "compiled", groups)
        print(f"{'system':<20} {'pure Python':>12} {'compiled':>10} {'speed-up':>9}  (sim.run(), best of "
              f"{args.rounds}, one core)")
        for system in args.systems.split(","):
            pure, fast = [], []
            for _ in range(args.rounds):  # alternating, so a slow spell of the machine hits both sides
                pure.append(replay_s(trace, system, ROOT))
                fast.append(replay_s(trace, system, compiled))
            print(f"{system:<20} {min(pure):>10.2f} s {min(fast):>8.2f} s {min(pure) / min(fast):>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
