"""A corpus of clearly invalid inputs and the commands that must refuse each with one line and exit 2.

Each :class:`Case` is one bad input (a trace, a hardware profile, a sweep spec,
a ``--set`` value, an output path or an importer log) written under a folder,
with the command lines to run on it, the text the error line must contain (the
file or option at fault) and the output paths that must not exist afterwards.
``build(folder, seed, size)`` makes ``size`` cases, drawn from every family with
random variations (row, column, value), deterministically from ``seed``.
:func:`run_case` runs one command in this process and classifies the outcome.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow.parquet as pq
import yaml

from moesim.model.spec import ModelSpec
from moesim.trace.io import write_trace
from moesim.trace.schema import TraceMeta
from tests.factories import profile_dict
from tests.fuzz.mutations import byte_mutations, profile_mutations, trace_mutations

MODEL = ModelSpec(name="tiny", num_layers=2, num_experts=6, top_k=2, hidden_size=64, moe_intermediate_size=128,
                  num_attention_heads=2, num_kv_heads=2, head_dim=32, vocab_size=100, total_params=10_000_000)
OUTCOMES = ("clean", "accepted", "traceback", "multi_line", "unnamed", "wrong_exit", "left_output", "hang")


@dataclass
class Case:
    family: str
    name: str
    #: command lines (without the program name)
    commands: list[list[str]]
    #: text the single error line must contain (the file or option at fault)
    names: str
    #: paths that must not exist after any command
    outputs: list[Path] = field(default_factory=list)


# ----------------------------------------------------------------------------- the valid base
def valid_columns(rng: np.random.Generator, requests: int = 2, prompt: int = 3, decode: int = 3) -> dict[str, Any]:
    """A small valid trace: prefill of each request, then decode steps of all of them."""
    rows: dict[str, list] = {k: [] for k in ("step", "layer", "request", "position", "phase", "experts",
                                             "weights", "scores", "token_id")}
    steps = [("prefill", {r: range(prompt)}) for r in range(requests)]
    steps += [("decode", {r: [prompt + d] for r in range(requests)}) for d in range(decode)]
    for step, (phase, tokens) in enumerate(steps):
        for layer in range(MODEL.num_layers):
            for request in sorted(tokens):
                for position in tokens[request]:
                    scores = rng.dirichlet(np.ones(MODEL.num_experts))
                    top = np.argsort(-scores)[:MODEL.top_k]
                    w = scores[top] / scores[top].sum()
                    rows["step"].append(step)
                    rows["layer"].append(layer)
                    rows["request"].append(request)
                    rows["position"].append(position)
                    rows["phase"].append(phase)
                    rows["experts"].append(top)
                    rows["weights"].append(w)
                    rows["scores"].append(scores)
                    rows["token_id"].append(int(rng.integers(0, 100)))
    data = {k: np.array(v) for k, v in rows.items() if k != "phase"}
    data["phase"] = rows["phase"]
    return data


def write_valid(path: Path, rng: np.random.Generator) -> Path:
    return write_trace(path, valid_columns(rng), TraceMeta(model=MODEL, source={"kind": "fuzz"},
                                                           weights_renormalized=True))


# ----------------------------------------------------------------------------- the corpus
def build(folder: Path, seed: int = 0, size: int = 500) -> list[Case]:
    """``size`` bad inputs under ``folder``: every mutation at least once, then random variations."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    base = write_valid(folder / "valid.parquet", rng)
    base_table = pq.read_table(base)
    base_bytes = base.read_bytes()
    hw = folder / "hw.yaml"
    hw.write_text(yaml.safe_dump(profile_dict(pcie_gbps=1.0)))
    families: list[tuple[str, Callable[[int, np.random.Generator], Case]]] = []
    tmuts, bmuts, pmuts = trace_mutations(), byte_mutations(), profile_mutations()

    def trace_case(name: str, i: int, r: np.random.Generator) -> Case:
        path = folder / f"trace-{i:04d}-{name}.parquet"
        if name in bmuts:
            path.write_bytes(bmuts[name](base_bytes, r))
        else:
            pq.write_table(tmuts[name](base_table, r), path)
        return _trace_commands("trace", f"{name}#{i}", path, folder, hw, i)

    def profile_case(name: str, i: int, r: np.random.Generator) -> Case:
        path = folder / f"hw-{i:04d}-{name}.yaml"
        content = pmuts[name](profile_dict(pcie_gbps=1.0), r)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        out = folder / f"out-{i:04d}.json"
        spec = _spec(folder, i, hw=[str(path)], traces=[str(base)])
        return Case("profile", f"{name}#{i}", [
            ["replay", str(base), "--hw", str(path), "--system", "gpu-only-lru", "--json", str(out)],
            ["replay", str(base), "--hw", str(path), "--json", str(out)],
            ["sweep", str(spec), "--out", str(folder / f"sweep-{i:04d}.parquet"), "--workers", "1"]],
            names=str(path), outputs=[out, folder / f"sweep-{i:04d}.parquet"])

    for name in list(tmuts) + list(bmuts):
        families.append(("trace", lambda i, r, n=name: trace_case(n, i, r)))
    for name in pmuts:
        families.append(("profile", lambda i, r, n=name: profile_case(n, i, r)))
    for maker in (_set_cases, _spec_cases, _output_cases, _import_cases, _path_cases):
        for name, make in maker(folder, base, hw).items():
            families.append((name.split(":")[0], lambda i, r, m=make, n=name: m(i, r)))
    cases = []
    order = list(range(len(families)))
    rng.shuffle(order)  # a smaller corpus still draws from every family
    while len(cases) < size:
        for k in order:
            if len(cases) >= size:
                break
            cases.append(families[k][1](len(cases), np.random.default_rng([seed, len(cases)])))
        rng.shuffle(order)
    return cases


def _spec(folder: Path, i: int, **spec: Any) -> Path:
    path = folder / f"spec-{i:04d}.yaml"
    path.write_text(yaml.safe_dump({"systems": ["gpu-only-lru"], "hw": [str(folder / "hw.yaml")], **spec}))
    return path


def _trace_commands(family: str, name: str, path: Path, folder: Path, hw: Path, i: int) -> Case:
    out = folder / f"out-{i:04d}.json"
    sweep_out = folder / f"sweep-{i:04d}.parquet"
    spec = _spec(folder, i, traces=[str(path)])
    return Case(family, name, [
        ["trace", "validate", str(path)], ["trace", "inspect", str(path)],
        ["replay", str(path), "--hw", str(hw), "--system", "gpu-only-lru", "--json", str(out)],
        ["replay", str(path), "--hw", str(hw), "--json", str(out)],
        ["sweep", str(spec), "--out", str(sweep_out), "--workers", "1"]],
        names=str(path), outputs=[out, sweep_out])


def _set_cases(folder: Path, base: Path, hw: Path) -> dict[str, Callable[[int, np.random.Generator], Case]]:
    values = ["memory.workspace_gib=-1000", "hw.pcie.bandwidth_scale=nan", "hw.pcie.bandwidth_scale=inf",
              "hw.pcie.bandwidth_scale=-1", "engine.kernels_per_expert=-1", "hw.cpu.cores=2.5", "hw.cpu.cores=0",
              "cache.slots_per_layer=99", "cache.slots_per_layer=-1", "cache.slots_per_layer=1.5",
              "engine.staging_slots=0", "engine.staging_slots=1e99", "memory.workspace_gib=nan",
              "memory.workspace_gib=inf", "memory.non_expert_dtype=fp3", "engine.nonexistent=1", "noequals",
              "hw.gpu.memory_gib=-1", "hw.gpu.roofline_efficiency=5", "hw.nosuch.field=1",
              "engine.kernels_per_expert=99999999999999999999", "engine.timeline=maybe", "hw.gpu.cuda_graph=2"]

    def make(value: str) -> Callable:
        def case(i: int, r: np.random.Generator) -> Case:
            out = folder / f"out-{i:04d}.json"
            key = value.split("=")[0]
            spec_value = value.split("=", 1)[1] if "=" in value else None
            spec = _spec(folder, i, traces=[str(base)], set={key: spec_value}) if spec_value is not None \
                else None
            commands = [["replay", str(base), "--hw", str(hw), "--system", "gpu-only-lru", "--set", value,
                         "--json", str(out)],
                        ["replay", str(base), "--hw", str(hw), "--set", value, "--json", str(out)]]
            if spec is not None:
                commands.append(["sweep", str(spec), "--out", str(folder / f"sweep-{i:04d}.parquet"),
                                 "--workers", "1"])
            return Case("set", f"{value}#{i}", commands, names=key.removeprefix("hw."),
                        outputs=[out, folder / f"sweep-{i:04d}.parquet"])
        return case
    return {f"set:{v}": make(v) for v in values}


def _spec_cases(folder: Path, base: Path, hw: Path) -> dict[str, Callable[[int, np.random.Generator], Case]]:
    bad: dict[str, Any] = {
        "huge_seed": {"seeds": [2**70]}, "negative_seed": {"seeds": [-1]}, "float_seed": {"seeds": [1.5]},
        "unknown_key": {"sytems": ["x"]}, "unknown_system": {"systems": ["nope"]},
        "missing_trace": {"traces": ["nope.parquet"]}, "grid_nan": {"grid": {"memory.workspace_gib": [float("nan")]}},
        "grid_negative": {"grid": {"cache.slots_per_layer": [-1, 1]}}, "grid_empty": {"grid": {"x": []}},
        "grid_not_mapping": {"grid": [1, 2]}, "zip_lengths": {"zip": [{"a.b": [1, 2], "c.d": [1]}]},
        "set_unknown": {"set": {"engine.nope": 1}}, "set_list": {"set": {"engine.staging_slots": [[1]]}},
        "hw_missing": {"hw": ["nope.yaml"]}, "model_unknown": {"model": "nope-model"},
        "not_mapping": None, "systems_empty": {"systems": []},
    }

    def make(name: str, body: Any) -> Callable:
        def case(i: int, r: np.random.Generator) -> Case:
            path = folder / f"spec-{i:04d}.yaml"
            if body is None:
                path.write_text("- just\n- a list\n")
            else:
                path.write_text(yaml.safe_dump({"traces": [str(base)], "systems": ["gpu-only-lru"],
                                                "hw": [str(hw)], **body}))
            out = folder / f"sweep-{i:04d}.parquet"
            return Case("spec", f"{name}#{i}", [["sweep", str(path), "--out", str(out), "--workers", "1"]],
                        names=str(path), outputs=[out])
        return case
    return {f"spec:{k}": make(k, v) for k, v in bad.items()}


def _output_cases(folder: Path, base: Path, hw: Path) -> dict[str, Callable[[int, np.random.Generator], Case]]:
    options = ["--json", "--timeline", "--decisions", "--chrome-trace", "--plot"]
    ro = folder / "read-only"
    ro.mkdir(exist_ok=True)
    os.chmod(ro, 0o555)

    def make(kind: str) -> Callable:
        def case(i: int, r: np.random.Generator) -> Case:
            option = options[int(r.integers(len(options)))]
            target = {"dir": folder, "missing_parent": folder / f"missing-{i}" / "x.out",
                      "read_only": ro / f"x-{i}.out", "file_as_parent": base / "x.out"}[kind]
            commands = [["replay", str(base), "--hw", str(hw), "--system", "gpu-only-lru", option, str(target)],
                        ["trace", "synth", "--model", "mixtral-8x7b", "--decode-len", "1", "--prompt-len", "1",
                         "--out", str(target)],
                        ["trace", "import", "--format", "cerebras-olmoe", str(hw), "--out", str(target)],
                        ["sweep", str(_spec(folder, i, traces=[str(base)])), "--out",
                         str(target.with_suffix(".parquet")) if kind != "dir" else str(folder)]]
            return Case("output", f"{kind}{option}#{i}", commands, names=str(target.parent if kind != "dir"
                                                                                 else target))
        return case
    kinds = ["dir", "missing_parent", "file_as_parent"] + (["read_only"] if os.geteuid() != 0 else [])
    return {f"output:{k}": make(k) for k in kinds}


def _import_cases(folder: Path, base: Path, hw: Path) -> dict[str, Callable[[int, np.random.Generator], Case]]:
    def route(ids: Any, weights: Any) -> dict:
        return {"type": "route", "token_idx": 0, "layer": 0, "topk_ids": ids, "topk_weights": weights}
    good_w = [0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05]
    jsonl: dict[str, Any] = {
        "id_1e20": route([1e20, 1, 2, 3, 4, 5, 6, 7], good_w), "string_ids": route(["1", 2, 3, 4, 5, 6, 7, 8], good_w),
        "fractional_ids": route([1.9, 2.2, 3, 4, 5, 6, 7, 8], good_w), "nan_weight": None,
        "negative_weight": route(list(range(8)), [-0.3] + good_w[1:]), "id_negative": route([-1] + list(range(1, 8)),
                                                                                            good_w),
        "id_out_of_range": route([64] + list(range(1, 8)), good_w), "duplicate_ids": route([1, 1, 2, 3, 4, 5, 6, 7],
                                                                                           good_w),
        "short_list": route([1, 2, 3], good_w), "ids_not_list": route("1,2,3", good_w),
        "bool_layer": {**route(list(range(8)), good_w), "layer": True},
    }

    def make_jsonl(name: str, obj: Any) -> Callable:
        def case(i: int, r: np.random.Generator) -> Case:
            path = folder / f"log-{i:04d}.jsonl"
            line = json.dumps(obj) if obj is not None else \
                '{"type": "route", "token_idx": 0, "layer": 0, "topk_ids": [0,1,2,3,4,5,6,7], ' \
                '"topk_weights": [NaN, 0.2, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05]}'
            path.write_text(line + "\n")
            out = folder / f"imp-{i:04d}.parquet"
            return Case("import", f"{name}#{i}", [["trace", "import", "--format", "cerebras-olmoe", str(path),
                                                    "--out", str(out)]], names=str(path), outputs=[out])
        return case

    def make_raw(name: str, content: bytes, fmt: str, suffix: str) -> Callable:
        def case(i: int, r: np.random.Generator) -> Case:
            path = folder / f"log-{i:04d}{suffix}"
            path.write_bytes(content)
            out = folder / f"imp-{i:04d}.parquet"
            return Case("import", f"{name}#{i}", [["trace", "import", "--format", fmt, str(path), "--out", str(out)]],
                        names=str(path), outputs=[out])
        return case

    def npz_bytes(**arrays: np.ndarray) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue()

    cases = {f"import:{k}": make_jsonl(k, v) for k, v in jsonl.items()}
    cases.update({
        "import:invalid_utf8": make_raw("invalid_utf8", b'{"type": "route", "x": "\xff\xfe"}\n', "cerebras-olmoe",
                                        ".jsonl"),
        "import:corrupt_npz": make_raw("corrupt_npz", b"PK\x03\x04garbage" * 10, "flame-moe", ".npz"),
        "import:truncated_npz": make_raw("truncated_npz", npz_bytes(layers=np.arange(2, 10))[:100], "flame-moe",
                                         ".npz"),
        "import:npz_float_ids": make_raw("npz_float_ids", npz_bytes(
            layers=np.arange(2, 4), token_ids=np.arange(3), indices=np.full((2, 3, 6), 1.5),
            scores=np.full((2, 3, 6), 0.1)), "flame-moe", ".npz"),
        "import:npz_nan_scores": make_raw("npz_nan_scores", npz_bytes(
            layers=np.arange(2, 4), token_ids=np.arange(3), indices=np.tile(np.arange(6), (2, 3, 1)),
            scores=np.full((2, 3, 6), np.nan)), "flame-moe", ".npz"),
        "import:npz_object": make_raw("npz_object", npz_bytes(topk_ids=np.array([{"a": 1}], dtype=object)),
                                      "vllm-qwen3-prefill", ".npz"),
        "import:qwen3_string_ids": make_raw("qwen3_string_ids", (json.dumps(
            {"topk_weights": [1, 8], "topk_ids": [["a"] * 8]}) + "\n").encode() * 48, "vllm-qwen3-prefill", ".jsonl"),
    })
    return cases


def _path_cases(folder: Path, base: Path, hw: Path) -> dict[str, Callable[[int, np.random.Generator], Case]]:
    def hw_dir(i: int, r: np.random.Generator) -> Case:
        out = folder / f"out-{i:04d}.json"
        return Case("path", f"hw_is_dir#{i}", [["replay", str(base), "--hw", str(folder), "--system",
                                                 "gpu-only-lru", "--json", str(out)]], names=str(folder),
                    outputs=[out])

    def trace_dir(i: int, r: np.random.Generator) -> Case:
        d = folder / f"dir-{i:04d}.parquet"
        d.mkdir(exist_ok=True)
        return _trace_commands("path", f"trace_is_dir#{i}", d, folder, hw, i)

    def trace_missing(i: int, r: np.random.Generator) -> Case:
        return _trace_commands("path", f"trace_missing#{i}", folder / f"nope-{i}.parquet", folder, hw, i)

    def synth_huge(i: int, r: np.random.Generator) -> Case:
        out = folder / f"synth-{i:04d}.parquet"
        n = str(int(r.choice([1099511627776, 2**31, 10**12])))
        return Case("path", f"synth_huge#{i}", [["trace", "synth", "--model", "mixtral-8x7b", "--prompt-len", n,
                                                  "--out", str(out)],
                                                 ["trace", "synth", "--model", "mixtral-8x7b", "--requests", n,
                                                  "--out", str(out)]], names="--", outputs=[out])
    return {"path:hw_dir": hw_dir, "path:trace_dir": trace_dir, "path:trace_missing": trace_missing,
            "path:synth_huge": synth_huge}


# ----------------------------------------------------------------------------- running
class _Timeout(Exception):
    pass


def run_case(case: Case, command: list[str], limit_s: float = 30.0) -> tuple[str, str]:
    """Run one command in this process; (outcome, stderr). Outcomes: see :data:`OUTCOMES`."""
    from moesim.cli import main

    def alarm(signum, frame):
        raise _Timeout()
    err, out = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(list(command))
    except _Timeout:
        return "hang", f"no answer within {limit_s} s"
    except BaseException as exc:  # noqa: BLE001 - anything escaping main() is a traceback
        return "traceback", f"{type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    text = err.getvalue()
    outcome = classify(case, code, text)
    if outcome == "accepted":  # what it wrote must not count against the next command
        for path in case.outputs:
            Path(path).unlink(missing_ok=True)
    return outcome, text


def classify(case: Case, code: int, stderr: str) -> str:
    if code == 0:
        return "accepted"
    if "Traceback" in stderr or "please report" in stderr or code == 1:
        return "traceback"
    if stderr.strip().count("\n") != 0:
        return "multi_line"
    if code != 2:
        return "wrong_exit"
    if case.names not in stderr:
        return "unnamed"
    if any(Path(p).exists() for p in case.outputs):
        return "left_output"
    return "clean"
