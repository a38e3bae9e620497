"""``vllm-qwen3-prefill``: Qwen3-30B-A3B prefill routing ids from soryxie/vllm (``token_distri_*.jsonl``).

The patched vLLM appended one line per MoE-layer call on EP/DP rank 0:
``{"topk_weights": [num_tokens, 8] (a shape, not weights), "topk_ids": [[8 ids], ...]}``.
Lines come in forwards of 48 (layer = line index mod 48, inferred: no layer field).
Only forward 2 is the real prefill batch; forwards 0-1 (warm-up request) and 3-31
(identical 4-token dummy batches of idle DP ranks) are dropped and counted. The
convenience extract ``*_prefill_forward2_ids.npz`` (``topk_ids`` [48, N, 8]) holds
forward 2 only.

Forwards 3-31 are the same dummy batch run again: one that differs from the others
has lines swapped, repeated or edited, and is refused. A swap among the lines of
forwards 0-2 cannot be seen: each layer's call there lists the same tokens and no
layer field was logged.

Each source file becomes one prefill step. Request boundaries inside the batch
are not logged, so the batch is one pseudo-request whose positions are the batch
row index (context lengths are therefore not the real ones). No weights.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from moesim.errors import TraceFormatError
from moesim.trace.importers._common import (PREFILL, ImportReport, RoutingRows, check_experts, check_ids,
                                            get_field, new_report, read_jsonl, report_read, where, write_import)

FORMAT = "vllm-qwen3-prefill"
MODEL = "qwen3-30b-a3b"
LAYERS = 48
TOP_K = 8
REAL_FORWARD = 2
SOURCE = {
    "repository": "https://github.com/soryxie/vllm",
    "commit": "0c9d1f469c2895f3d9f634b8ec39053804bd20a5",
    "commit_note": "branch songrun/profile_moe head; profile_json/token_distri_*.jsonl last changed in "
                   "568a8cb288718caa8062317324e2452a8ee44e4e",
    "upstream_model": "Qwen/Qwen3-30B-A3B-Instruct-2507 on vLLM ~0.10 (expert parallel, DP 4, enforce_eager), "
                      "EP/DP rank 0 only",
    "workload": "ShareGPT_V3 prompts, benchmark_serving.py --sharegpt-output-len 1 --request-rate inf",
    "license": "Apache-2.0 (repository license; no separate data license)",
}


def _forward2_from_jsonl(path: Path, report: ImportReport) -> tuple[np.ndarray, np.ndarray]:
    """Layer-major ids [48, N, 8] of forward 2 and the source line of each layer's first row."""
    layers: list[np.ndarray] = []
    lines: list[int] = []
    dummies: dict[int, list[tuple[int, bytes]]] = {}  # forward -> (line, its ids) of the idle ranks' batches
    count = 0
    for line, obj in read_jsonl(path):
        index = count
        count += 1
        shape = get_field(obj, "topk_weights", path, line)
        ids = get_field(obj, "topk_ids", path, line)
        if not (isinstance(shape, list) and len(shape) == 2 and shape[1] == TOP_K):
            raise TraceFormatError(f"expected the shape [num_tokens, {TOP_K}], got {shape!r}",
                                   source=where(path, line), field="topk_weights",
                                   fix="this format logs the weights' shape only; check --format")
        if not isinstance(ids, list) or len(ids) != shape[0] \
                or any(not isinstance(r, list) or len(r) != TOP_K for r in ids):
            raise TraceFormatError(f"expected {shape[0]} lists of {TOP_K} expert ids", source=where(path, line),
                                   field="topk_ids", fix="each line lists top-8 ids for every token of the call")
        forward = index // LAYERS
        if forward == REAL_FORWARD:
            layers.append(check_ids(np.asarray(ids), path, "topk_ids", line).reshape(-1, TOP_K))
            lines.append(line)
        elif forward < REAL_FORWARD:
            report.dropped["warm_up_forwards_0_1"] += len(ids)
        else:
            report.dropped["dummy_dp_batches_forwards_3_plus"] += len(ids)
            dummies.setdefault(forward, []).append((line, np.asarray(ids, np.int64).tobytes()))
    if count % LAYERS or count < (REAL_FORWARD + 1) * LAYERS:
        raise TraceFormatError(f"{count} lines is not a whole number of 48-layer forwards with at least 3",
                               source=str(path), field="line",
                               fix="use the complete token_distri_*.jsonl (32 forwards x 48 layers)")
    _refuse_odd_dummy(path, dummies)
    sizes = {len(a) for a in layers}
    if len(sizes) != 1:
        raise TraceFormatError(f"layers of forward 2 hold different token counts {sorted(sizes)}",
                               source=where(path, lines[0]), field="topk_ids",
                               fix="the file is not 48 lines per forward; use the unmodified log")
    return np.stack(layers), np.asarray(lines)


def _refuse_odd_dummy(path: Path, dummies: dict[int, list[tuple[int, bytes]]]) -> None:
    """The idle DP ranks ran one dummy batch in forwards 3+, and each of its 48 layer calls logged the same ids
    every time: a forward that differs from the one most of them hold has lines swapped, repeated or edited (two
    lines swapped inside a forward imported without a word)."""
    if len(dummies) < 3:  # no majority to hold a forward against
        return
    usual, _ = Counter(tuple(ids for _, ids in calls) for calls in dummies.values()).most_common(1)[0]
    for forward, calls in sorted(dummies.items()):
        differ = [layer for layer, (_, ids) in enumerate(calls) if ids != usual[layer]]
        if not differ:
            continue
        line = calls[differ[0]][0]
        if len(differ) == 2 and calls[differ[0]][1] == usual[differ[1]] and calls[differ[1]][1] == usual[differ[0]]:
            what = f"lines {line} and {calls[differ[1]][0]} are swapped (layers {differ[0]} and {differ[1]})"
        else:
            more = f" and {len(differ) - 1} more layers" if len(differ) > 1 else ""
            what = f"layer {differ[0]} (line {line}){more} differ{'' if more else 's'}"
        raise TraceFormatError(f"forward {forward} is not the dummy batch the other forwards 3-{max(dummies)} all "
                               f"repeat: {what}", source=where(path, line), field="topk_ids",
                               fix="lines are swapped, repeated or edited; use the unmodified token_distri_*.jsonl")


def _forward2_from_npz(path: Path) -> np.ndarray:
    try:
        data = np.load(path)
        ids = data["topk_ids"]
        report_read(path.stat().st_size, path)
    except KeyError:
        raise TraceFormatError("npz has no 'topk_ids' array", source=str(path), field="topk_ids",
                               fix="use token_distri_*_prefill_forward2_ids.npz") from None
    except (OSError, ValueError):
        raise TraceFormatError("not a readable npz file", source=str(path), fix="give the .npz extract or the .jsonl") from None
    if ids.ndim != 3 or ids.shape[0] != LAYERS or ids.shape[2] != TOP_K:
        raise TraceFormatError(f"topk_ids has shape {ids.shape}, expected [48, N, 8]", source=str(path),
                               field="topk_ids", fix="use the forward-2 extract of a Qwen3-30B-A3B log")
    return check_ids(ids, path, "topk_ids")


def _refuse_same_batch(path: Path, ids: np.ndarray, seen: dict[Path, np.ndarray]) -> None:
    """A log and its npz extract (``token_distri_8*`` names both) hold one prefill batch: imported together it
    became two requests with the same routing."""
    for other, other_ids in seen.items():
        if np.array_equal(ids, other_ids):
            raise TraceFormatError(f"holds the same prefill batch as {other.name} (the npz extract is the log's "
                                   "forward 2)", source=str(path), field="topk_ids",
                                   fix="give the .jsonl log or its npz extract, not both")
    seen[path] = ids


def import_files(sources: list[Path], out: Path) -> ImportReport:
    report, model = new_report(FORMAT, out, MODEL)
    rows = RoutingRows(top_k=TOP_K, with_weights=False)
    batches = []
    seen: dict[Path, np.ndarray] = {}
    for request, path in enumerate(sources):
        if path.suffix == ".npz":
            ids = _forward2_from_npz(path)
            lines = None
            report.notes.append(f"{path.name}: the npz extract holds forward 2 only; warm-up and dummy forwards "
                                "were dropped when it was made")
        else:
            ids, lines = _forward2_from_jsonl(path, report)
        for layer in range(LAYERS):
            if lines is not None:  # the line of this layer's call, which lists every token's ids
                check_experts(ids[layer], model, path, np.full(ids.shape[1], lines[layer]), "topk_ids")
            else:  # the npz extract: the token (row) of this layer
                check_experts(ids[layer], model, Path(f"{path} layer {layer}"), np.arange(ids.shape[1]), "topk_ids",
                              unit="token")
            rows.add(request=request, step=request, phase=PREFILL, position=np.arange(ids.shape[1]),
                     layer=layer, experts=ids[layer])
        _refuse_same_batch(path, ids, seen)
        batches.append({"file": path.name, "tokens": int(ids.shape[1])})
    report.notes.append("request boundaries inside the prefill batch are unknown: one pseudo-request per file, "
                        "positions are batch row indices")
    source = {**SOURCE, "files": [p.name for p in sources], "prefill_batches": batches,
              "layer_inference": "layer = line index mod 48 (not recorded upstream)",
              "weights": "not logged (ids only)"}
    return write_import(out, rows, model, report, source, weights_renormalized=False)
