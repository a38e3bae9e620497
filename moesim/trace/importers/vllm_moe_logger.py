"""``vllm-moe-logger``: Qwen1.5-MoE-A2.7B-Chat single-layer logs of weiran0129/vLLM-MoE-Logger.

Each ``moe_layer{L}.jsonl`` is a separate deterministic run logging one layer:
line 1 is a meta record, then ``{"type": "route", "token_idx": row in the current
forward, "layer", "topk_ids"[4], "topk_weights"[4]}``. ``token_idx`` restarting
at 0 marks a new forward. Forwards: 8192-row memory-profiling dummy, 256-row
dummy, 65-row warm-up (all three dropped and counted), the batched prefill of the
25 prompts, then decode steps of 25 shrinking to 11 rows. The files are joined
by line number (identical forward structure is checked, the join itself is an
inference). Weights are softmax probabilities over 60 experts, not renormalized.

A log without decode forward (cut in its prefill), or whose decode batches ever
grow (a repeated or lost line), is refused. A log of one layer cut inside its last
decode batch (or at a forward boundary in its decode) cannot be told from a run
whose requests stopped sooner: nothing records how many rows a forward holds or
when a request ends. Joined with the other layers' logs, it differs from them.

Neither prompt boundaries in the prefill batch nor the decode slot-to-request
mapping were logged: the prefill is one pseudo-request 0 (positions = batch row),
decode slot s is request 1 + s with positions counting generated tokens. Slot
identity across steps is vLLM's batch order and may not follow one request.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moesim.errors import TraceFormatError
from moesim.trace.importers._common import (DECODE, PREFILL, ImportReport, RoutingRows, check_experts,
                                            check_logger_meta, get_int, get_list, new_report, order_by_weight,
                                            read_jsonl, where, write_import)

FORMAT = "vllm-moe-logger"
MODEL = "qwen1.5-moe-a2.7b"
#: what the meta record's model_id holds (lower case) in this format's logs, and the model itself
MODEL_ID_WORDS, UPSTREAM_MODEL_ID = "qwen1.5-moe", "Qwen/Qwen1.5-MoE-A2.7B-Chat"
TOP_K = 4
#: forwards before the real prefill, by upstream README: (reason, rows)
LEADING_FORWARDS = (("profiling_dummy", 8192), ("dummy", 256), ("warm_up", 65))
SOURCE = {
    "repository": "https://github.com/weiran0129/vLLM-MoE-Logger",
    "commit": "2c3c87c10e045aea0c495044d9b4f94cf16675b2",
    "upstream_model": "Qwen/Qwen1.5-MoE-A2.7B-Chat on vLLM 0.11.2.dev (enforce_eager, greedy, max_tokens=128), "
                      "25 GSM8K test prompts submitted together",
    "license": "none stated upstream",
}


class LayerLog:
    """One file: its layer, rows and forward sizes."""

    def __init__(self, path: Path, model) -> None:
        self.path = path
        layers, experts, weights, index, lines = [], [], [], [], []
        for line, obj in read_jsonl(path):
            if obj.get("type") == "meta":
                check_logger_meta(obj, path, line, FORMAT, MODEL_ID_WORDS, UPSTREAM_MODEL_ID, TOP_K)
                continue
            layers.append(get_int(obj, "layer", path, line))
            index.append(get_int(obj, "token_idx", path, line))
            experts.append(get_list(obj, "topk_ids", TOP_K, path, line))
            weights.append(get_list(obj, "topk_weights", TOP_K, path, line))
            lines.append(line)
        if not layers:
            raise TraceFormatError("no route records", source=str(path), field="type",
                                   fix="give a moe_layer*.jsonl log")
        self.lines = np.asarray(lines)
        found = sorted(set(layers))
        if len(found) != 1:
            raise TraceFormatError(f"logs layers {found}; expected one layer per file", source=str(path),
                                   field="layer", fix="each run of this logger records one layer")
        self.layer = found[0]
        if not 0 <= self.layer < model.num_layers:
            raise TraceFormatError(f"layer {self.layer} outside [0, {model.num_layers})",
                                   source=where(path, lines[0]), field="layer", fix="check --format")
        self.experts, self.weights, self.reordered = order_by_weight(np.asarray(experts, np.int64),
                                                                     np.asarray(weights, np.float32))
        check_experts(self.experts, model, path, self.lines, "topk_ids")
        index = np.asarray(index)
        self.starts = np.flatnonzero(index == 0)
        if not len(self.starts) or self.starts[0] != 0:
            raise TraceFormatError("first route row does not start a forward (token_idx 0)",
                                   source=where(path, lines[0]), field="token_idx", fix="use the complete log")
        self.sizes = np.diff(np.r_[self.starts, len(index)])
        expected = np.concatenate([np.arange(n) for n in self.sizes])
        bad = np.flatnonzero(index != expected)
        if len(bad):
            raise TraceFormatError(f"token_idx {index[bad[0]]}, expected {expected[bad[0]]}",
                                   source=where(path, lines[bad[0]]), field="token_idx",
                                   fix="token_idx must count 0.. within each forward")


def _first_difference(sizes: np.ndarray, other: np.ndarray, name: str) -> str:
    """Where two runs' forward sizes part (their first forwards agree: dummies, warm-up, prefill)."""
    common = min(len(sizes), len(other))
    differ = np.flatnonzero(sizes[:common] != other[:common])
    if len(differ):
        i = int(differ[0])
        return f"forward {i} has {sizes[i]} rows here, {other[i]} in {name}"
    return f"{len(sizes)} forwards here, {len(other)} in {name} (the shorter log is cut short)"


def _refuse_odd_decode(log: LayerLog, lead: int) -> None:
    """Every prompt was submitted at once, so decode batches only shrink: a log without decode forward was cut
    in its prefill, and a batch larger than the one before comes of a repeated ``token_idx`` 0 line (a one-row
    forward) or lost lines; either was imported without a word (a cut prefill as a shorter one)."""
    if len(log.sizes) == lead + 1:
        raise TraceFormatError(f"no decode forward after the {log.sizes[lead]}-row prefill: the log is cut short",
                               source=str(log.path), field="token_idx", fix="use the complete log")
    decode = log.sizes[lead + 1:]
    grew = np.flatnonzero(decode[1:] > decode[:-1])
    if len(grew):
        forward = lead + 2 + int(grew[0])
        raise TraceFormatError(f"decode forward {forward} has {log.sizes[forward]} rows after one of "
                               f"{log.sizes[forward - 1]}; decode batches of this run only shrink (every prompt "
                               "was submitted at once)", source=where(log.path, int(log.lines[log.starts[forward]])),
                               field="token_idx", fix="a line is repeated, missing or out of order; use the "
                                                      "complete log")


def import_files(sources: list[Path], out: Path) -> ImportReport:
    report, model = new_report(FORMAT, out, MODEL)
    logs = sorted((LayerLog(p, model) for p in sources), key=lambda log: log.layer)
    first = logs[0]
    for log in logs[1:]:
        if log.layer == first.layer:
            raise TraceFormatError(f"layer {log.layer} also in {first.path.name}", source=str(log.path),
                                   field="layer", fix="give each layer's log once")
        if not np.array_equal(log.sizes, first.sizes):
            where = _first_difference(log.sizes, first.sizes, first.path.name)
            raise TraceFormatError(f"forward structure differs from {first.path.name}: {where}", source=str(log.path),
                                   field="token_idx", fix="join only complete runs with identical forward structure")
    lead = len(LEADING_FORWARDS)
    if len(first.sizes) <= lead:
        raise TraceFormatError(f"only {len(first.sizes)} forwards; expected dummy, warm-up, prefill, decode",
                               source=str(first.path), field="token_idx", fix="use the complete log")
    _refuse_odd_decode(first, lead)
    rows = RoutingRows(top_k=TOP_K, with_weights=True)
    for log in logs:
        report.repaired["rows_reordered_by_weight"] += log.reordered
        for (reason, _), size in zip(LEADING_FORWARDS, log.sizes):
            report.dropped[reason] += int(size)
        for forward in range(lead, len(log.sizes)):
            start, size = int(log.starts[forward]), int(log.sizes[forward])
            part = slice(start, start + size)
            step = forward - lead
            if step == 0:
                rows.add(request=0, step=0, phase=PREFILL, position=np.arange(size), layer=log.layer,
                         experts=log.experts[part], weights=log.weights[part])
            else:
                rows.add(request=1 + np.arange(size), step=step, phase=DECODE, position=step - 1,
                         layer=log.layer, experts=log.experts[part], weights=log.weights[part])
    for (reason, rows_expected), size in zip(LEADING_FORWARDS, first.sizes):
        if size != rows_expected:
            report.notes.append(f"leading forward '{reason}' has {size} rows (upstream README: {rows_expected})")
    if len(logs) > 1:
        report.notes.append(f"layers {', '.join(str(log.layer) for log in logs)} joined by line number across "
                            "separate runs (identical forward sizes checked)")
    report.notes.append("prefill prompt boundaries and decode slot-to-request mapping unknown: prefill is "
                        "pseudo-request 0, decode slot s is request 1+s")
    source = {**SOURCE, "files": [log.path.name for log in logs],
              "forward_sizes": [int(s) for s in first.sizes[lead:]],
              "request_mapping": "request 0 = whole prefill batch (row order); request 1+s = decode slot s; "
                                 "decode positions count generated tokens (prompt lengths unknown)"}
    return write_import(out, rows, model, report, source, weights_renormalized=False)
