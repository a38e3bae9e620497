"""``cerebras-olmoe``: OLMoE-1B-7B layer-0 vLLM routing log of KaxitPandya/cerebras-assesment2.

``moe_routes.jsonl``: line 1 meta, then ``{"type": "route", "token_idx": global
running counter, "layer": 0, "topk_ids"[8], "topk_weights"[8]}`` (renormalized
top-8). The leading rows with uniform 1/8 weights are vLLM's profiling dummy run
(2,048 upstream) and are dropped and counted.

The remaining rows are a batched prefill of 25 prompts followed by decode steps,
but neither forward nor request boundaries were logged. Rather than invent a
batch structure, the importer keeps the logged order and writes each row as its
own one-token step of request 0 (phase ``decode``, position = row index). Use
the result for layer-0 expert statistics; its steps are not the real batches.
``token_idx`` must count 1 up from row to row (a repeated, lost or moved line is
refused; a log cut at a line boundary cannot be told from a shorter run).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moesim.errors import TraceFormatError
from moesim.trace.importers._common import (DECODE, ImportReport, RoutingRows, check_experts, check_logger_meta,
                                            get_int, get_list, new_report, order_by_weight, read_jsonl, where,
                                            write_import)

FORMAT = "cerebras-olmoe"
MODEL = "olmoe-1b-7b"
#: what the meta record's model_id holds (lower case) in this format's logs, and the model itself
MODEL_ID_WORDS, UPSTREAM_MODEL_ID = "olmoe", "allenai/OLMoE-1B-7B-0924"
TOP_K = 8
SOURCE = {
    "repository": "https://github.com/KaxitPandya/cerebras-assesment2",
    "commit": "e89e8f6ff004ff03d0e4d71c730c8d21c859e95c",
    "upstream_model": "allenai/OLMoE-1B-7B-0924 on vLLM 0.6.6.post1 (T4, fp16, enforce_eager, greedy, "
                      "max_tokens=128), 25 GSM8K test prompts batched",
    "license": "none stated upstream",
}


def import_files(sources: list[Path], out: Path) -> ImportReport:
    report, model = new_report(FORMAT, out, MODEL)
    rows = RoutingRows(top_k=TOP_K, with_weights=True)
    step = 0
    for request, path in enumerate(sources):
        experts, weights, lines = [], [], []
        previous = -1
        for line, obj in read_jsonl(path):
            if obj.get("type") == "meta":
                check_logger_meta(obj, path, line, FORMAT, MODEL_ID_WORDS, UPSTREAM_MODEL_ID, TOP_K)
                continue
            layer = get_int(obj, "layer", path, line)
            if layer != 0:
                raise TraceFormatError(f"layer {layer}; this log holds layer 0 only", source=where(path, line),
                                       field="layer", fix="check --format")
            token = get_int(obj, "token_idx", path, line)
            if experts and token != previous + 1:  # a global running counter: a repeated, lost or moved line
                raise TraceFormatError(f"token_idx {token} after {previous}", source=where(path, line),
                                       field="token_idx", fix="token_idx counts rows 0, 1, 2, ...: a line is "
                                                              "repeated, missing or out of order; use the complete log")
            previous = token
            experts.append(get_list(obj, "topk_ids", TOP_K, path, line))
            weights.append(get_list(obj, "topk_weights", TOP_K, path, line))
            lines.append(line)
        if not experts:
            raise TraceFormatError("no route records", source=str(path), field="type", fix="give moe_routes.jsonl")
        w = np.asarray(weights, np.float32)
        uniform = np.all(np.abs(w - 1.0 / TOP_K) < 1e-6, axis=1)
        dummy = len(uniform) if uniform.all() else int(np.argmin(uniform))  # leading uniform run
        report.dropped["profiling_dummy"] += dummy
        e, w, changed = order_by_weight(np.asarray(experts, np.int64)[dummy:], w[dummy:])
        check_experts(e, model, path, np.asarray(lines)[dummy:], "topk_ids")
        report.repaired["rows_reordered_by_weight"] += changed
        n = len(e)
        rows.add(request=request, step=step + np.arange(n), phase=DECODE, position=np.arange(n), layer=0,
                 experts=e, weights=w)
        step += n
    report.notes.append("forward and request boundaries were not logged: each row is written as its own "
                        "one-token step in logged order; use for layer-0 statistics, not batch replay")
    source = {**SOURCE, "files": [p.name for p in sources],
              "step_structure": "one row per step in logged order (real prefill/decode batches unknown)"}
    return write_import(out, rows, model, report, source, weights_renormalized=True)
