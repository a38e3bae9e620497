"""``speculative-moe``: Mixtral-8x7B-Instruct (FP8, vLLM) router logs of Mario928/speculative-moe.

Two record kinds, told apart by their fields:

- *processed* files (``humaneval_2_routing.jsonl``, ``gsm8k_2_routing.jsonl``):
  decode tokens only, ``dataset, problem_id, layer, token_idx, experts[2],
  gating_probs[2]``; ``token_idx`` was re-numbered 0.. per (problem, layer) upstream.
- *raw* capture (``routing_raw.jsonl``): ``token_pos`` instead of ``token_idx``,
  rows in execution order: one prefill forward (layer 0 positions 0..P-1, layer 1
  ...), then one row per layer per decode step with ``token_pos`` 0.

The upstream logger dropped every row whose two weights were exactly [0.5, 0.5]
(bf16 ties). Gaps are found and repaired as follows; every repaired row gets the
weights [0.5, 0.5] the dropped row had and, since its experts were not logged,
the experts of the same layer's previous token (the nearest earlier token that
is present; the next one for a request's first token). That choice leans towards
temporal reuse; the number of such rows is recorded in the trace's ``source``.

- raw prefill: a layer lacking a ``token_pos`` in 0..P-1 (P = longest layer): exact.
- raw decode: a step (one forward) lacking a layer in the 0..31 cycle: exact.
- raw capture cut short, or with a line repeated or out of order: a prefill lacking whole
  layers, a prefill layer lacking more than ``TIE_GAP_ROWS`` trailing positions, or a
  decode step lacking more than that many first or last layers, or more than
  ``MAX_TIES_PER_STEP`` layers in all, is refused (ties drop scattered rows; a cut drops
  the tail, a repeated or moved line splits a step in two).
- processed file alone: a layer with fewer rows than the request's longest layer
  lacks that many tokens at unknown positions; the repaired rows go at its end
  (``tie_rows_imputed_position_unknown``); tokens after the real gap stay one step
  early at that layer, as in the upstream file. A problem lacking whole layers, or a
  layer lacking more than ``max(TIE_GAP_ROWS, TIE_GAP_SHARE * tokens)`` tokens, is a
  log cut short and refused rather than padded with invented ties.
- processed file together with the raw capture of the same problem: each layer's
  processed rows are aligned to the raw decode rows (same experts and weights),
  which carry exact step numbers; processed rows between two anchors fill the steps
  the raw capture lacks, in order. The raw prefill goes in front of that request.

Requests ran one at a time upstream (batch of one prompt), so each request's
steps follow the previous request's. Positions: prefill 0..P-1, decode P+d; for a
request without a logged prefill the prompt length is unknown and decode
positions start at 0 (recorded per request in ``source.requests``).
"""

from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moesim.errors import TraceFormatError
from moesim.model.presets import load_preset
from moesim.trace.importers._common import (DECODE, PREFILL, ImportReport, RoutingRows, check_experts,
                                            get_field, get_int, get_list, new_report, order_by_weight,
                                            read_jsonl, where, write_import)

FORMAT = "speculative-moe"
MODEL = "mixtral-8x7b"
TOP_K = 2
TIE_WEIGHTS = (0.5, 0.5)
NUM_LAYERS = 32
#: a processed layer may lack this many of its request's tokens (or this share, if more) to upstream tie drops;
#: the real logs lack at most 3 of 255, so a larger gap is a file cut short or edited, not ties to re-insert
TIE_GAP_ROWS, TIE_GAP_SHARE = 4, 0.05
#: a raw decode step may lack this many of its 32 layers to tie drops (the real capture lacks at most 6)
MAX_TIES_PER_STEP = NUM_LAYERS // 4
SOURCE = {
    "repository": "https://github.com/Mario928/speculative-moe",
    "commit": "216e26eb86ee09fa46bb0e8c000be7e9758e10b6",
    "upstream_model": "neuralmagic/Mixtral-8x7B-Instruct-v0.1-FP8 on vLLM (enforce_eager, greedy, max_tokens=256)",
    "license": "none stated upstream (README: research project for academic purposes)",
    "capture": "vLLM fused_moe select_experts: top-2 ids and renormalized top-2 weights; no full softmax",
}


@dataclass
class LayerRows:
    """One layer's rows of one request, in file order."""

    index: list[int] = field(default_factory=list)  # token_idx / token_pos / decode step
    experts: list[list[int]] = field(default_factory=list)
    weights: list[list[float]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)


@dataclass
class Problem:
    dataset: str
    problem_id: int
    path: Path
    decode: dict[int, LayerRows] = field(default_factory=dict)
    prefill: dict[int, LayerRows] = field(default_factory=dict)  # raw capture only
    decode_steps: int = 0  # raw capture: forwards after the prefill


# ----------------------------------------------------------------------------- parsing
def _record(obj: dict[str, Any], path: Path, line: int) -> tuple[str, int, int, list[int], list[float]]:
    dataset = str(get_field(obj, "dataset", path, line))
    problem = get_int(obj, "problem_id", path, line)
    layer = get_int(obj, "layer", path, line)
    experts = get_list(obj, "experts", TOP_K, path, line)
    weights = get_list(obj, "gating_probs", TOP_K, path, line)
    if not 0 <= layer < 32:
        raise TraceFormatError(f"layer {layer} outside [0, 32)", source=where(path, line), field="layer",
                               fix="Mixtral-8x7B has 32 MoE layers; check --format")
    return dataset, problem, layer, [int(e) for e in experts], [float(w) for w in weights]


def _parse(path: Path, problems: dict[tuple[str, int], Problem]) -> str:
    """Add the file's rows to ``problems``; return 'raw' or 'processed'."""
    kind = None
    prev: tuple[int, int] | None = None  # raw: (layer, token_pos) of the previous row of this problem
    phase_of: dict[tuple[str, int], str] = {}
    for line, obj in read_jsonl(path):
        if kind is None:
            kind = "raw" if "token_pos" in obj else "processed"
        dataset, pid, layer, experts, weights = _record(obj, path, line)
        key = (dataset, pid)
        if key not in problems:
            problems[key] = Problem(dataset, pid, path)
            prev = None
        problem = problems[key]
        if kind == "processed":
            rows = problem.decode.setdefault(layer, LayerRows())
            rows.index.append(get_int(obj, "token_idx", path, line))
        else:
            pos = get_int(obj, "token_pos", path, line)
            # a new forward starts when the layer goes back, or repeats without the position advancing
            new_forward = prev is not None and (layer < prev[0] or (layer == prev[0] and pos <= prev[1]))
            if prev is None:
                phase_of[key] = "prefill"
            elif new_forward:
                phase_of[key] = "decode"
                problem.decode_steps += 1
            if phase_of[key] == "prefill":
                rows = problem.prefill.setdefault(layer, LayerRows())
                rows.index.append(pos)
            else:
                if pos != 0:
                    raise TraceFormatError(f"decode row with token_pos {pos} after the prefill",
                                           source=where(path, line), field="token_pos",
                                           fix="the raw capture logs decode rows with token_pos 0; "
                                               "split files holding several prefills per problem")
                rows = problem.decode.setdefault(layer, LayerRows())
                rows.index.append(problem.decode_steps - 1)
            prev = (layer, pos)
        rows.experts.append(experts)
        rows.weights.append(weights)
        rows.lines.append(line)
    if kind is None:
        raise TraceFormatError("file has no records", source=str(path), field="line",
                               fix="give a non-empty *_routing.jsonl or routing_raw.jsonl")
    return kind


# ----------------------------------------------------------------------------- one layer of one request
@dataclass
class TokenTable:
    """A layer's routing over all tokens of a request; ``present`` False = repaired row."""

    experts: np.ndarray
    weights: np.ndarray
    present: np.ndarray

    @classmethod
    def empty(cls, tokens: int) -> "TokenTable":
        return cls(np.zeros((tokens, TOP_K), np.int16), np.zeros((tokens, TOP_K), np.float32),
                   np.zeros(tokens, bool))

    def put(self, slots: np.ndarray, experts: np.ndarray, weights: np.ndarray) -> None:
        self.experts[slots], self.weights[slots], self.present[slots] = experts, weights, True

    def fill_gaps(self) -> int:
        """Repair missing tokens from the nearest earlier present token (later one at the start)."""
        missing = int((~self.present).sum())
        if missing and self.present.any():
            idx = np.where(self.present, np.arange(len(self.present)), -1)
            idx = np.maximum.accumulate(idx)
            first = int(np.flatnonzero(self.present)[0])
            idx[idx < 0] = first
            self.experts = self.experts[idx]
            self.weights = self.weights.copy()
            self.weights[~self.present] = TIE_WEIGHTS
        return missing


def _arrays(rows: LayerRows, path: Path, report: ImportReport) -> tuple[np.ndarray, np.ndarray]:
    experts = np.asarray(rows.experts, dtype=np.int64)
    weights = np.asarray(rows.weights, dtype=np.float32)
    check_experts(experts, load_preset(MODEL), path, np.asarray(rows.lines), "experts")
    experts, weights, changed = order_by_weight(experts, weights)
    report.repaired["rows_reordered_by_weight"] += changed
    return experts, weights


def _sorted_by_index(rows: LayerRows, path: Path, what: str) -> np.ndarray:
    index = np.asarray(rows.index)
    order = np.argsort(index, kind="stable")
    dup = np.flatnonzero(np.diff(index[order]) == 0)
    if len(dup):
        line = rows.lines[int(order[dup[0] + 1])]
        raise TraceFormatError(f"{what} {index[order][dup[0]]} appears twice in one layer",
                               source=where(path, line), field=what, fix="remove the duplicated record")
    return order


def _align(raw_steps: np.ndarray, raw_keys: list[tuple], proc_keys: list[tuple],
           steps: int) -> tuple[np.ndarray, np.ndarray, Counter]:
    """Place processed rows on decode steps using the raw rows (exact steps) as anchors.

    Returns the step of each processed row (-1: dropped), a mask of raw rows no
    processed row matched, and counts.
    """
    counts: Counter = Counter()
    matcher = difflib.SequenceMatcher(a=raw_keys, b=proc_keys, autojunk=False)
    proc_step = np.full(len(proc_keys), -1, dtype=np.int64)
    raw_unmatched = np.ones(len(raw_keys), bool)
    anchors = [(-1, -1)]
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            proc_step[block.b + k] = raw_steps[block.a + k]
            raw_unmatched[block.a + k] = False
            anchors.append((block.b + k, int(raw_steps[block.a + k])))
    counts["matched"] = len(anchors) - 1
    taken = set(int(s) for s in raw_steps[raw_unmatched])
    anchors.append((len(proc_keys), None))  # type: ignore[arg-type]
    for (j1, s1), (j2, s2) in zip(anchors[:-1], anchors[1:]):
        between = list(range(j1 + 1, j2))
        if not between:
            continue
        end = s2 if s2 is not None else max(steps, s1 + 1 + len(between))
        free = [s for s in range(s1 + 1, end) if s not in taken]
        if len(between) < len(free) and s2 is not None:
            counts["placed_ambiguous"] += len(between)
        for j, s in zip(between, free):
            proc_step[j] = s
        counts["unplaced"] += max(0, len(between) - len(free))
    return proc_step, raw_unmatched, counts


# ----------------------------------------------------------------------------- requests
@dataclass
class RequestPlan:
    problem: Problem
    raw: Problem | None  # raw capture of the same problem, joined in front
    prefill_tokens: int
    decode_tokens: int
    tables: dict[int, TokenTable]
    info: dict[str, Any]


def _plan_processed(problem: Problem, raw: Problem | None, report: ImportReport) -> RequestPlan:
    layers = sorted(problem.decode)
    counts = {layer: len(problem.decode[layer].index) for layer in layers}
    info: dict[str, Any] = {"dataset": problem.dataset, "problem_id": problem.problem_id,
                            "decode_file": problem.path.name}
    prefill = _prefill_len(raw) if raw else 0
    decode = max(counts.values())
    alignment: Counter = Counter()
    placed: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for layer in layers:
        rows = problem.decode[layer]
        order = _sorted_by_index(rows, problem.path, "token_idx")
        experts, weights = _arrays(rows, problem.path, report)
        experts, weights = experts[order], weights[order]
        if raw is None or layer not in raw.decode:
            placed[layer] = (np.arange(len(order)), experts, weights)
            continue
        raw_rows = raw.decode[layer]
        raw_e, raw_w = _arrays(raw_rows, raw.path, report)
        raw_steps = np.asarray(raw_rows.index)
        key = lambda e, w: (int(e[0]), int(e[1]), round(float(w[0]), 4))  # noqa: E731
        steps, raw_unmatched, counts_l = _align(raw_steps, [key(e, w) for e, w in zip(raw_e, raw_w)],
                                                 [key(e, w) for e, w in zip(experts, weights)], raw.decode_steps)
        alignment.update(counts_l)
        alignment["raw_rows"] += len(raw_steps)
        keep = steps >= 0
        report.dropped["unaligned_processed_rows"] += int((~keep).sum())
        slots = np.concatenate([steps[keep], raw_steps[raw_unmatched]])
        placed[layer] = (slots, np.concatenate([experts[keep], raw_e[raw_unmatched]]),
                         np.concatenate([weights[keep], raw_w[raw_unmatched]]))
        report.repaired["raw_rows_used_where_processed_lacks_them"] += int(raw_unmatched.sum())
        decode = max(decode, int(slots.max()) + 1 if len(slots) else 0, raw.decode_steps)
    _refuse_incomplete(problem, counts, max(counts.values()))  # after the rows' own checks, which name a line
    tables = {}
    for layer, (slots, experts, weights) in placed.items():
        table = TokenTable.empty(prefill + decode)
        table.put(prefill + slots, experts, weights)
        tables[layer] = table
    if raw is not None:
        _put_prefill(raw, tables, prefill, report)
        processed_rows = sum(counts.values())
        info.update(prefill_file=raw.path.name, alignment={
            "raw_decode_rows": alignment["raw_rows"], "processed_decode_rows": processed_rows,
            "raw_rows_matched_in_order": alignment["matched"],
            "share_of_raw_rows_matched": round(alignment["matched"] / max(alignment["raw_rows"], 1), 4),
            "share_of_processed_rows_matched": round(alignment["matched"] / max(processed_rows, 1), 4),
            "processed_rows_placed_ambiguously": alignment["placed_ambiguous"],
            "processed_rows_unplaced": alignment["unplaced"]})
    reason = "tie_rows_imputed" if raw is not None else "tie_rows_imputed_position_unknown"
    return _finish(problem, raw, prefill, decode, tables, info, reason, report)


def _refuse_incomplete(problem: Problem, counts: dict[int, int], decode: int) -> None:
    """A processed log cut short (or with rows removed) would have its missing rows re-inserted as ties:
    refuse a problem lacking whole layers, or a layer lacking more tokens than tie drops explain."""
    last_line = max(max(rows.lines) for rows in problem.decode.values())
    absent = [layer for layer in range(NUM_LAYERS) if layer not in counts]
    if absent:
        raise TraceFormatError(f"{problem.dataset} problem {problem.problem_id} has no rows for MoE layer(s) "
                               f"{_span(absent)} (its last row is line {last_line}): the log is cut short",
                               source=str(problem.path), field="layer",
                               fix=f"use the complete log; each problem logs all {NUM_LAYERS} layers")
    allowed = max(TIE_GAP_ROWS, round(TIE_GAP_SHARE * decode))
    for layer, count in counts.items():
        if decode - count > allowed:
            raise TraceFormatError(f"{problem.dataset} problem {problem.problem_id} has {count} decode rows at layer "
                                   f"{layer} against {decode} at its longest layer; upstream tie drops explain at "
                                   f"most {allowed}: the log is cut short or rows were removed",
                                   source=where(problem.path, problem.decode[layer].lines[-1]), field="token_idx",
                                   fix="use the complete log")


def _span(layers: list[int]) -> str:
    """Sorted layer numbers as runs ("18-31", "3, 5")."""
    runs, start = [], layers[0]
    for prev, cur in zip(layers, layers[1:] + [None]):
        if cur != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(runs)


def _refuse_raw_cut_short(raw: Problem) -> None:
    """A raw capture cut at a line boundary, or with a line repeated or out of order, parsed cleanly and its
    missing rows became invented ties: cut in the prefill (logged layer by layer), it lacks the last layers or
    the last layer's last positions; cut in the decode, the last step lacks its last layers; a repeated line
    splits one decode step in two, one lacking the last layers, the other the first. Ties drop scattered rows
    (at most 3 trailing ones in the real log, never a step's first layer), so a run longer than
    ``TIE_GAP_ROWS`` at either end of a layer's positions or a step's layers is refused."""
    last_line = max(max(rows.lines) for rows in (*raw.prefill.values(), *raw.decode.values()))
    what = f"{raw.dataset} problem {raw.problem_id}"
    fix = f"use the complete log; the raw capture logs all {NUM_LAYERS} layers of every forward, once, in order"
    absent = [layer for layer in range(NUM_LAYERS) if layer not in raw.prefill]
    if absent:
        raise TraceFormatError(f"{what}'s prefill has no rows for MoE layer(s) {_span(absent)} (its last row is "
                               f"line {last_line}): the log is cut short", source=str(raw.path), field="layer",
                               fix=fix)
    last_pos = _prefill_len(raw) - 1
    for layer, rows in raw.prefill.items():
        if last_pos - max(rows.index) > TIE_GAP_ROWS:
            raise TraceFormatError(f"{what}'s prefill ends at token_pos {max(rows.index)} at layer {layer} against "
                                   f"{last_pos} at its longest layer: the log is cut short",
                                   source=where(raw.path, rows.lines[-1]), field="token_pos", fix=fix)
    present = np.zeros((raw.decode_steps, NUM_LAYERS), bool)
    first_line = np.full(raw.decode_steps, np.iinfo(np.int64).max)
    for layer, rows in raw.decode.items():
        present[rows.index, layer] = True
        np.minimum.at(first_line, rows.index, rows.lines)
    for step, layers in enumerate(present):
        logged = np.flatnonzero(layers)
        lacking = list(range(logged[-1] + 1, NUM_LAYERS)) or list(range(logged[0]))
        if len(lacking) > TIE_GAP_ROWS:
            end = "last" if lacking[-1] == NUM_LAYERS - 1 else "first"
            why = ("the log is cut short" if step == raw.decode_steps - 1 and end == "last"
                   else "a line is repeated or out of order")
            raise TraceFormatError(f"{what}'s decode step {step} has no rows for its {end} MoE layer(s) "
                                   f"{_span(lacking)}: {why}", source=where(raw.path, int(first_line[step])),
                                   field="layer", fix=fix)
        lacking = np.flatnonzero(~layers).tolist()
        if len(lacking) > MAX_TIES_PER_STEP:  # two lines swapped across a step boundary leave a step of two rows
            raise TraceFormatError(f"{what}'s decode step {step} has no rows for {len(lacking)} of its "
                                   f"{NUM_LAYERS} MoE layers ({_span(lacking)}): a line is repeated or out of order",
                                   source=where(raw.path, int(first_line[step])), field="layer", fix=fix)


def _prefill_len(raw: Problem) -> int:
    return max(max(rows.index) for rows in raw.prefill.values()) + 1


def _put_prefill(raw: Problem, tables: dict[int, TokenTable], prefill: int, report: ImportReport) -> None:
    for layer, rows in raw.prefill.items():
        order = _sorted_by_index(rows, raw.path, "token_pos")
        experts, weights = _arrays(rows, raw.path, report)
        if layer not in tables:
            tables[layer] = TokenTable.empty(prefill + raw.decode_steps)
        tables[layer].put(np.asarray(rows.index)[order], experts[order], weights[order])


def _plan_raw(raw: Problem, report: ImportReport) -> RequestPlan:
    prefill, decode = _prefill_len(raw), raw.decode_steps
    tables: dict[int, TokenTable] = {}
    for layer, rows in raw.decode.items():
        experts, weights = _arrays(rows, raw.path, report)
        tables[layer] = TokenTable.empty(prefill + decode)
        tables[layer].put(prefill + np.asarray(rows.index), experts, weights)
    _put_prefill(raw, tables, prefill, report)
    info = {"dataset": raw.dataset, "problem_id": raw.problem_id, "prefill_file": raw.path.name,
            "decode_file": raw.path.name}
    return _finish(raw, raw, prefill, decode, tables, info, "tie_rows_imputed", report)


def _finish(problem: Problem, raw: Problem | None, prefill: int, decode: int, tables: dict[int, TokenTable],
            info: dict[str, Any], reason: str, report: ImportReport) -> RequestPlan:
    for table in tables.values():
        missing = table.fill_gaps()
        if raw is not None:
            report.repaired["tie_rows_imputed_prefill"] += int((~table.present[:prefill]).sum())
            missing -= int((~table.present[:prefill]).sum())
        report.repaired[reason] += missing
    info.update(prefill_tokens=prefill if raw is not None else None, decode_tokens=decode,
                repaired_rows=int(sum((~t.present).sum() for t in tables.values())))
    return RequestPlan(problem, raw, prefill, decode, tables, info)


def _emit(plans: list[RequestPlan], rows: RoutingRows) -> None:
    step = 0
    for request, plan in enumerate(plans):
        plan.info["request"] = request
        plan.info["first_step"] = step
        tokens = plan.prefill_tokens + plan.decode_tokens
        positions = np.arange(tokens)
        token_step = np.where(positions < plan.prefill_tokens, step,
                              step + (plan.prefill_tokens > 0) + positions - plan.prefill_tokens)
        for layer, table in sorted(plan.tables.items()):
            pre = slice(0, plan.prefill_tokens)
            dec = slice(plan.prefill_tokens, tokens)
            if plan.prefill_tokens:
                rows.add(request=request, step=token_step[pre], phase=PREFILL, position=positions[pre],
                         layer=layer, experts=table.experts[pre], weights=table.weights[pre])
            rows.add(request=request, step=token_step[dec], phase=DECODE, position=positions[dec],
                     layer=layer, experts=table.experts[dec], weights=table.weights[dec])
        step += (plan.prefill_tokens > 0) + plan.decode_tokens


def import_files(sources: list[Path], out: Path) -> ImportReport:
    report, model = new_report(FORMAT, out, MODEL)
    processed: dict[tuple[str, int], Problem] = {}
    raw: dict[tuple[str, int], Problem] = {}
    for path in sources:
        found: dict[tuple[str, int], Problem] = {}
        kind = _parse(path, found)
        target = raw if kind == "raw" else processed
        if kind == "raw":
            for problem in found.values():
                _refuse_raw_cut_short(problem)
        for key, problem in found.items():
            if key in target:
                raise TraceFormatError(f"{problem.dataset} problem {problem.problem_id} also in "
                                       f"{target[key].path.name}", source=str(path), field="problem_id",
                                       fix="give each problem's log once")
            target[key] = problem
    plans = [_plan_processed(p, raw.get(key), report) for key, p in processed.items()]
    plans += [_plan_raw(r, report) for key, r in raw.items() if key not in processed]
    rows = RoutingRows(top_k=TOP_K, with_weights=True)
    _emit(plans, rows)
    for plan in plans:
        if plan.raw is None:
            plan.info["note"] = "no prefill logged: prompt length unknown, decode positions start at 0"
    if any(p.raw is None for p in plans):
        report.notes.append("requests without a logged prefill start at position 0 (prompt length unknown)")
    if report.repaired.get("tie_rows_imputed_position_unknown"):
        report.notes.append("rows dropped upstream at unknown positions were re-inserted at the end of their "
                            "layer; tokens after the real gap stay one step early at that layer")
    source = {**SOURCE, "files": [p.name for p in sources], "requests": [p.info for p in plans],
              "repair_rule": "dropped [0.5, 0.5] rows re-inserted with weights [0.5, 0.5] and the experts of "
                             "the same layer's previous token (experts were not logged)"}
    return write_import(out, rows, model, report, source, weights_renormalized=True)
