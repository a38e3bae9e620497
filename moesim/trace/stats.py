"""Statistics of a router trace: shape, skew, temporal reuse, co-activation, predictor recall.

The file is read in row batches with pyarrow and processed in chunks of whole
forward passes (a step never straddles two chunks), vectorised with numpy, so
memory stays bounded by one chunk plus a small per-(request, layer) state no
matter how long the trace is.

Definitions (all per MoE layer, over every row of the trace):

- ``top10_share_by_layer``: share of all activations at the layer taken by its
  ``max(1, num_experts // 10)`` most-activated experts (skew that grows with
  depth: 000_dba2fecbbc66318b.txt Sec. III-B, Fig. 5).
- ``reuse_prev_token_by_layer``: mean over tokens of |S_t & S_prev| / |S_t|, where
  S_prev is the routed set of the same request's previous token present in the
  trace at that layer; a request's first token is left out (temporal locality,
  003_46c415738ddfa491.txt Sec. 3, Fig. 8).
- ``coactivation_top4_share``: BuddyMoE's pivot view of co-activation
  (002_95ae8307b42d2a8d.txt Sec. 3.2, Eq. 4): M(i, j) counts tokens whose routed
  set at the layer holds both i and j; for each pivot i with any co-activation, the
  share of sum_j M(i, j) covered by its 4 largest entries. The mean is taken over
  all (layer, pivot) pairs; ``coactivation_top4_share_by_layer`` over pivots.
- ``prefill_coverage``: for each (prefill step, layer), the distinct experts the
  step's n tokens route to, divided by the number uniform routing would reach on
  average, E * (1 - (1 - k / E)^n); the mean over all such pairs. 1 when every
  expert a uniform router would touch is touched; below 1 when the step leaves
  experts out (a real 2,050-token Qwen3-30B-A3B batch: 0.86, some experts of a
  layer get no token). Dividing by the uniform count makes steps of different
  sizes comparable (a 1-token step reaches k experts either way: 1). A step
  with any prefill row is a prefill step (as in ``steps``). None without one.
- ``predictor_recall``: for each predictor column present, |pred & truth| / |truth|
  summed over rows: ``pred_next_layer`` and ``pred_residual`` against the same
  token's routed set at layer + 1, ``pred_next_token`` against the same request's
  next token at the same layer. Rows without a truth (last layer, last token) are
  left out.
- ``requests_with_prompt``: requests with at least one prefill token (a trace that
  starts mid-request, or logs decode steps only, holds requests without a prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from moesim.trace.io import PathLike, _open, _phase_codes, iter_record_batches, read_meta
from moesim.trace.schema import OPTIONAL_COLUMNS, PHASES, PREDICTOR_COLUMNS, REQUIRED_COLUMNS
# the tables and sparklines of `trace inspect` and `trace compare`, re-exported: moesim.trace.stats keeps every name
from moesim.trace.stats_render import _layer_list, render_comparison, render_distances, render_stats, sparkline
from moesim.trace.validate import RowsRead, checked_meta

CHUNK_ROWS = 65_536
COACTIVATION_PEERS = 4
#: flush pending bincount indices when this many accumulate (keeps bincount calls rare)
FLUSH_INDICES = 2_000_000


# ----------------------------------------------------------------------------- reading
def _padded_lists(column: pa.Array) -> np.ndarray:
    """A list<int16> column as an (n, width) int16 matrix padded with -1."""
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.flatten().to_numpy(zero_copy_only=False).astype(np.int16)
    lengths = np.diff(offsets)
    width = int(lengths.max()) if len(lengths) else 0
    out = np.full((len(lengths), max(width, 1)), -1, dtype=np.int16)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    cols = np.arange(len(values)) - np.repeat(offsets[:-1] - offsets[0], lengths)
    out[rows, cols] = values
    return out


def _pad_to(matrix: np.ndarray, width: int) -> np.ndarray:
    if matrix.shape[1] >= width:
        return matrix
    pad = np.full((matrix.shape[0], width - matrix.shape[1]), -1, dtype=matrix.dtype)
    return np.hstack([matrix, pad])


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    out = {}
    for key in parts[0]:
        arrays = [p[key] for p in parts]
        if key in PREDICTOR_COLUMNS:
            width = max(a.shape[1] for a in arrays)
            arrays = [_pad_to(a, width) for a in arrays]
        out[key] = np.concatenate(arrays)
    return out


def _iter_chunks(path: PathLike, top_k: int, columns: list[str]) -> Iterator[dict[str, np.ndarray]]:
    """Yield dicts of numpy columns holding whole steps, about CHUNK_ROWS rows each."""
    pf = _open(path)
    pending: list[dict[str, np.ndarray]] = []
    pending_rows = 0
    for batch in iter_record_batches(pf, CHUNK_ROWS, columns):
        cols: dict[str, np.ndarray] = {}
        for name in columns:
            col = batch.column(name)
            if name == "experts":
                cols[name] = col.flatten().to_numpy(zero_copy_only=False).reshape(-1, top_k).astype(np.int64)
            elif name == "weights":
                cols[name] = col.flatten().to_numpy(zero_copy_only=False).reshape(-1, top_k)
            elif name in PREDICTOR_COLUMNS:
                cols[name] = _padded_lists(col)
            elif name == "phase":
                cols[name] = _phase_codes(col)
            else:
                cols[name] = col.to_numpy(zero_copy_only=False).astype(np.int64)
        pending.append(cols)
        pending_rows += batch.num_rows
        if pending_rows < CHUNK_ROWS:
            continue
        merged = _concat(pending)
        last_step = merged["step"][-1]
        cut = int(np.searchsorted(merged["step"], last_step, side="left"))
        if cut == 0:  # one step larger than the chunk: keep collecting
            pending, pending_rows = [merged], len(merged["step"])
            continue
        yield {k: v[:cut] for k, v in merged.items()}
        tail = {k: v[cut:] for k, v in merged.items()}
        pending, pending_rows = [tail], len(tail["step"])
    if pending_rows:
        yield _concat(pending)


# ----------------------------------------------------------------------------- helpers
def uniform_union(tokens: np.ndarray | int, num_experts: int, top_k: int) -> np.ndarray:
    """Mean distinct experts ``tokens`` tokens reach when each routes to ``top_k`` of ``num_experts`` uniformly
    at random: an expert is missed by one token with probability 1 - k / E."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** np.asarray(tokens, dtype=np.float64))


def _overlap(truth: np.ndarray, guess: np.ndarray) -> np.ndarray:
    """Per row, how many of ``truth``'s ids (-1 = none) appear in ``guess`` (-1 padded)."""
    hit = (truth[:, :, None] == guess[:, None, :]) & (truth[:, :, None] >= 0)
    return hit.any(axis=2).sum(axis=1)


@dataclass
class _RequestSpans:
    """Every request of a trace with the step of its last row, from a pass over three narrow columns before
    the statistics: a request's state is freed once its last step is counted, so the statistics hold the
    requests in flight, not every request of the trace."""

    ids: np.ndarray  # sorted request ids
    last_step: np.ndarray  # the step of each one's last row
    prompted: int  # requests with a prefill row

    @classmethod
    def read(cls, path: PathLike) -> "_RequestSpans":
        ids, last, prompted = [], [], []
        for batch in iter_record_batches(_open(path), CHUNK_ROWS * 4, ["request", "step", "phase"]):
            request = batch.column("request").to_numpy(zero_copy_only=False).astype(np.int64)
            step = batch.column("step").to_numpy(zero_copy_only=False).astype(np.int64)
            batch_ids, batch_last = _last_of_each(request, step)
            ids.append(batch_ids)
            last.append(batch_last)
            prompted.append(np.unique(request[_phase_codes(batch.column("phase")) == 0]))
        if not ids:
            return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), 0)
        all_ids, all_last = _last_of_each(np.concatenate(ids), np.concatenate(last))
        return cls(all_ids, all_last, len(np.unique(np.concatenate(prompted))))


def _last_of_each(ids: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``ids`` (sorted) and the largest of ``steps`` of each."""
    order = np.lexsort((steps, ids))
    ids, steps = ids[order], steps[order]
    last = np.ones(len(ids), dtype=bool)
    last[:-1] = ids[1:] != ids[:-1]
    return ids[last], steps[last]


class _RequestState:
    """Last routed set (and next-token prediction) of each (request, layer) of the requests in flight.

    A request takes a slot at its first row and gives it back after its last step (:class:`_RequestSpans`),
    and ids are held in the narrowest integer that takes every expert id and the -1 of "none": the state
    of a million one-token DeepSeek-V3 requests was a 3.7 GB int64 array that only ever grew."""

    def __init__(self, num_layers: int, top_k: int, num_experts: int, spans: _RequestSpans) -> None:
        dtype = np.int8 if num_experts <= np.iinfo(np.int8).max else np.int16  # trace ids are int16
        self.spans = spans
        self.slot_by_request = np.full(len(spans.ids), -1, dtype=np.int64)
        self.experts = np.full((16, num_layers, top_k), -1, dtype=dtype)
        self.pred = np.full((16, num_layers, 1), -1, dtype=np.int16)
        self.free: list[int] = list(range(len(self.experts) - 1, -1, -1))  # taken from the end

    def slot_of(self, requests: np.ndarray) -> np.ndarray:
        unique, inverse = np.unique(requests, return_inverse=True)
        index = np.searchsorted(self.spans.ids, unique)
        slots = self.slot_by_request[index]
        new = slots < 0
        if new.any():
            slots[new] = self._take(int(new.sum()))
            self.slot_by_request[index[new]] = slots[new]
        return slots[inverse]

    def release_finished(self, requests: np.ndarray, last_step: int) -> None:
        """Free the slots of the requests among ``requests`` whose last row is at or before ``last_step``."""
        index = np.searchsorted(self.spans.ids, np.unique(requests))
        index = index[self.spans.last_step[index] <= last_step]
        slots = self.slot_by_request[index]
        slots = slots[slots >= 0]
        self.experts[slots] = -1
        self.pred[slots] = -1
        self.slot_by_request[index] = -1
        self.free.extend(slots.tolist())

    def _take(self, n: int) -> np.ndarray:
        if n > len(self.free):
            self._grow(max(n - len(self.free), len(self.experts)))
        taken, self.free = self.free[-n:], self.free[:-n]
        return np.array(taken, dtype=np.int64)

    def _grow(self, more: int) -> None:
        held = len(self.experts)
        self.experts = np.concatenate([self.experts, np.full((more, *self.experts.shape[1:]), -1,
                                                             dtype=self.experts.dtype)])
        self.pred = np.concatenate([self.pred, np.full((more, *self.pred.shape[1:]), -1, dtype=self.pred.dtype)])
        self.free = list(range(held + more - 1, held - 1, -1)) + self.free

    def widen_pred(self, width: int) -> None:
        if width > self.pred.shape[2]:
            pad = np.full((*self.pred.shape[:2], width - self.pred.shape[2]), -1, dtype=self.pred.dtype)
            self.pred = np.concatenate([self.pred, pad], axis=2)


@dataclass
class _Accumulator:
    num_layers: int
    num_experts: int
    top_k: int
    predictors: list[str]
    spans: _RequestSpans
    rows: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PHASES})
    steps: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PHASES})
    reuse_sum: np.ndarray = field(init=False)
    reuse_n: np.ndarray = field(init=False)
    union_sum: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    union_n: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PHASES})
    #: sum of union / uniform union over prefill (step, layer) pairs, and their number
    coverage_sum: float = 0.0
    coverage_n: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    truths: dict[str, int] = field(default_factory=dict)
    weight_top1_sum: float = 0.0
    weight_rows: int = 0
    _count_idx: list[np.ndarray] = field(default_factory=list)
    _pair_idx: list[np.ndarray] = field(default_factory=list)
    _pending: int = 0

    def __post_init__(self) -> None:
        L, E = self.num_layers, self.num_experts
        self.counts = np.zeros(L * E, dtype=np.int64)
        self.pairs = np.zeros(L * E * E, dtype=np.int64)
        self.reuse_sum = np.zeros(L)
        self.reuse_n = np.zeros(L, dtype=np.int64)
        self.state = _RequestState(L, self.top_k, E, self.spans)
        self.hits = {p: 0 for p in self.predictors}
        self.truths = {p: 0 for p in self.predictors}

    # -- per chunk ---------------------------------------------------------------
    def add(self, c: dict[str, np.ndarray]) -> None:
        n = len(c["step"])
        self.rows += n
        token = self._shape_counts(c)
        self._activations(c)
        self._reuse_and_next_token(c)
        self._next_layer(c, token)
        self.state.release_finished(c["request"], int(c["step"][-1]))  # a chunk holds whole steps
        if "weights" in c:
            w = c["weights"].astype(np.float64)
            total = w.sum(axis=1)
            ok = total > 0
            self.weight_top1_sum += float((w[ok, 0] / total[ok]).sum())
            self.weight_rows += int(ok.sum())

    def _shape_counts(self, c: dict[str, np.ndarray]) -> np.ndarray:
        """Count tokens and steps by phase; return each row's token index within the chunk."""
        keys = np.stack([c["step"], c["request"], c["position"]], axis=1)
        uniq, first, token = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        token = token.reshape(-1)
        for code, phase in enumerate(PHASES):
            self.tokens[phase] += int((c["phase"][first] == code).sum())
        step_id = np.cumsum(np.diff(c["step"], prepend=c["step"][0]) != 0)
        has_prefill = np.zeros(int(step_id[-1]) + 1, dtype=bool)
        has_prefill[step_id[c["phase"] == 0]] = True
        self.steps["prefill"] += int(has_prefill.sum())
        self.steps["decode"] += int((~has_prefill).sum())
        # batch union: distinct experts per (step, layer), the load an offloading system sees
        group = step_id * self.num_layers + c["layer"]
        flat_group = np.repeat(group, self.top_k)
        pairs = np.unique(flat_group * self.num_experts + c["experts"].reshape(-1))
        groups, union = np.unique(pairs // self.num_experts, return_counts=True)
        group_phase = has_prefill[groups // self.num_layers]
        for code, phase in enumerate(PHASES):
            sel = group_phase if code == 0 else ~group_phase
            self.union_sum[phase] += float(union[sel].sum())
            self.union_n[phase] += int(sel.sum())
        tokens_in_group = np.unique(group, return_counts=True)[1]  # same sorted groups as ``groups``
        coverage = union[group_phase] / uniform_union(tokens_in_group[group_phase], self.num_experts, self.top_k)
        self.coverage_sum += float(coverage.sum())
        self.coverage_n += int(group_phase.sum())
        return token

    def _activations(self, c: dict[str, np.ndarray]) -> None:
        E, k = self.num_experts, self.top_k
        ex = c["experts"]
        base = c["layer"][:, None] * E
        self._count_idx.append((base + ex).reshape(-1))
        if k > 1:
            a, b = np.nonzero(~np.eye(k, dtype=bool))
            idx = (c["layer"][:, None] * E + ex[:, a]) * E + ex[:, b]
            self._pair_idx.append(idx.reshape(-1))
        self._pending += ex.size * k
        if self._pending > FLUSH_INDICES:
            self.flush()

    def flush(self) -> None:
        if self._count_idx:
            self.counts += np.bincount(np.concatenate(self._count_idx), minlength=self.counts.size)
        if self._pair_idx:
            self.pairs += np.bincount(np.concatenate(self._pair_idx), minlength=self.pairs.size)
        self._count_idx, self._pair_idx, self._pending = [], [], 0

    def _reuse_and_next_token(self, c: dict[str, np.ndarray]) -> None:
        req, layer = c["request"], c["layer"]
        order = np.lexsort((c["position"], c["step"], layer, req))
        r, l = req[order], layer[order]
        ex = c["experts"][order]
        same = np.zeros(len(order), dtype=bool)
        same[1:] = (r[1:] == r[:-1]) & (l[1:] == l[:-1])
        prev = np.empty_like(ex)
        prev[1:] = ex[:-1]
        slot = self.state.slot_of(r)
        first = ~same
        prev[first] = self.state.experts[slot[first], l[first]]
        valid = prev[:, 0] >= 0
        reuse = _overlap(ex, prev) / self.top_k
        self.reuse_sum += np.bincount(l[valid], weights=reuse[valid], minlength=self.num_layers)
        self.reuse_n += np.bincount(l[valid], minlength=self.num_layers)
        if "pred_next_token" in c:
            pred = c["pred_next_token"][order]
            self.state.widen_pred(pred.shape[1])
            pred = _pad_to(pred, self.state.pred.shape[2])
            prev_pred = np.empty_like(pred)
            prev_pred[1:] = pred[:-1]
            prev_pred[first] = self.state.pred[slot[first], l[first]]
            self.hits["pred_next_token"] += int(_overlap(ex[valid], prev_pred[valid]).sum())
            self.truths["pred_next_token"] += int((ex[valid] >= 0).sum())
        # remember the last row of every (request, layer) group for the next chunk
        last = np.ones(len(order), dtype=bool)
        last[:-1] = ~same[1:]
        self.state.experts[slot[last], l[last]] = ex[last]
        if "pred_next_token" in c:
            self.state.pred[slot[last], l[last]] = pred[last]

    def _next_layer(self, c: dict[str, np.ndarray], token: np.ndarray) -> None:
        names = [p for p in ("pred_next_layer", "pred_residual") if p in c]
        if not names:
            return
        L = self.num_layers
        key = token * L + c["layer"]
        order = np.argsort(key, kind="stable")
        target = key + 1
        where = np.searchsorted(key[order], target)
        where = np.minimum(where, len(key) - 1)
        found = (key[order][where] == target) & (c["layer"] + 1 < L)
        truth = c["experts"][order[where[found]]]
        for name in names:
            guess = c[name][found]
            self.hits[name] += int(_overlap(truth, guess).sum())
            self.truths[name] += int(truth.size)

    # -- results -----------------------------------------------------------------
    def layer_counts(self) -> np.ndarray:
        self.flush()
        return self.counts.reshape(self.num_layers, self.num_experts)

    def coactivation(self) -> np.ndarray:
        self.flush()
        return self.pairs.reshape(self.num_layers, self.num_experts, self.num_experts)


def _top_share(counts: np.ndarray) -> list[float | None]:
    n_top = max(1, counts.shape[1] // 10)
    total = counts.sum(axis=1)
    top = -np.sort(-counts, axis=1)[:, :n_top].sum(axis=1)
    return [float(t / s) if s else None for t, s in zip(top, total)]


def _coactivation_shares(pairs: np.ndarray) -> tuple[float | None, list[float | None]]:
    peers = min(COACTIVATION_PEERS, pairs.shape[2])
    total = pairs.sum(axis=2)
    top = -np.sort(-pairs, axis=2)[:, :, :peers].sum(axis=2)
    active = total > 0
    share = np.where(active, top / np.maximum(total, 1), 0.0)
    by_layer = [float(share[l, active[l]].mean()) if active[l].any() else None for l in range(len(pairs))]
    overall = float(share[active].mean()) if active.any() else None
    return overall, by_layer


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


def _accumulate(path: PathLike, progress: RowsRead | None = None) -> tuple[Any, _Accumulator]:
    meta = read_meta(path)
    model = meta.model
    present = _open(path).schema_arrow.names
    optional = [c for c in OPTIONAL_COLUMNS if c in present and c not in ("scores", "token_id")]
    predictors = [c for c in PREDICTOR_COLUMNS if c in present]
    acc = _Accumulator(model.num_layers, model.num_experts, model.top_k, predictors, _RequestSpans.read(path))
    for chunk in _iter_chunks(path, model.top_k, list(REQUIRED_COLUMNS) + optional):
        acc.add(chunk)
        if progress is not None:
            progress(len(chunk["step"]))
    return meta, acc


def trace_stats(path: PathLike, *, validate: bool = True, progress: RowsRead | None = None) -> dict[str, Any]:
    """Statistics of the trace at ``path`` under stable, JSON-serializable keys (module docstring).

    The validation pass runs first, so a malformed file is one error naming its fault (an expert id out of
    range made the counting fail mid-way); ``validate=False`` skips it for a trace this process just wrote.
    ``progress`` is told the rows each pass reads.
    """
    if validate:
        checked_meta(path, progress=progress)
    meta, acc = _accumulate(path, progress)
    return _stats(meta, acc)


def _stats(meta: Any, acc: _Accumulator) -> dict[str, Any]:
    model = meta.model

    counts = acc.layer_counts()
    top10 = _top_share(counts)
    reuse = [float(s / n) if n else None for s, n in zip(acc.reuse_sum, acc.reuse_n)]
    coact, coact_by_layer = _coactivation_shares(acc.coactivation())
    source = meta.source.get("kind") if isinstance(meta.source, dict) else None
    stats: dict[str, Any] = {
        "model": model.name,
        "source": source,
        "rows": acc.rows,
        "tokens": sum(acc.tokens.values()),
        "tokens_by_phase": dict(acc.tokens),
        "requests": len(acc.spans.ids),
        "requests_with_prompt": acc.spans.prompted,
        "steps": dict(acc.steps),
        "layers": model.num_layers,
        "layers_present": int((counts.sum(axis=1) > 0).sum()),
        "num_experts": model.num_experts,
        "top_k": model.top_k,
        # the rest of the model's shape, which a capture records and a user checks here
        "num_shared_experts": model.num_shared_experts,
        "num_dense_layers": model.num_dense_layers,
        "weights_renormalized": meta.weights_renormalized,
        "top10_share_by_layer": top10,
        "top10_share": _mean(top10),
        "reuse_prev_token_by_layer": reuse,
        "reuse_prev_token": _mean(reuse),
        "coactivation_top4_share": coact,
        "coactivation_top4_share_by_layer": coact_by_layer,
        "unique_experts_per_layer_step": {p: (acc.union_sum[p] / acc.union_n[p] if acc.union_n[p] else None)
                                          for p in PHASES},
        "prefill_coverage": acc.coverage_sum / acc.coverage_n if acc.coverage_n else None,
        "predictor_recall": {p: (acc.hits[p] / acc.truths[p] if acc.truths[p] else None) for p in acc.predictors},
        "weight_top1_share": acc.weight_top1_sum / acc.weight_rows if acc.weight_rows else None,
    }
    return stats


# ----------------------------------------------------------------------------- distances
def js_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon divergence of two count or probability vectors, base 2 (0: same, 1: disjoint)."""
    p = np.asarray(p, dtype=float)
    q = np.asarray(q, dtype=float)
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl(a: np.ndarray) -> float:
        nz = a > 0
        return float((a[nz] * np.log2(a[nz] / m[nz])).sum())
    return max(0.0, 0.5 * kl(p) + 0.5 * kl(q))


def _per_layer(values: list[float | None]) -> dict[str, Any]:
    present = [v for v in values if v is not None]
    return {"mean": float(np.mean(present)) if present else None, "max": float(np.max(present)) if present else None,
            "by_layer": values}


def trace_distances(a: _Accumulator, b: _Accumulator) -> dict[str, Any]:
    """How far trace B's routing is from trace A's, layer by layer (expert ids must mean the same experts).

    - ``popularity_js``: Jensen-Shannon divergence (base 2, in [0, 1]) between the layer's expert
      activation distributions.
    - ``reuse_diff``: B's previous-token reuse minus A's, per layer (see the module docstring).
    - ``coactivation_tv``: total-variation distance (in [0, 1]) between the layer's normalised pair
      counts M(i, j) (002_95ae8307b42d2a8d.txt Sec. 3.2, Eq. 4): which pairs co-activate, not only how
      concentrated they are; ``coactivation_top4_diff`` is B's top-4 share minus A's, per layer.

    Layers absent from either trace are None. Traces of different expert counts are not comparable
    expert by expert: then only the reason is returned. ``layers`` holds both traces' MoE layer counts;
    when they differ, ``same_layer_count`` is False and ``notes`` says which layers were compared.
    """
    counts = _layer_counts(a, b)
    if a.num_experts != b.num_experts:
        return {"comparable": False,
                "reason": f"different expert counts ({a.num_experts} and {b.num_experts}): ids do not match",
                **counts}
    layers = min(a.num_layers, b.num_layers)
    ca, cb = a.layer_counts(), b.layer_counts()
    logged_a = [layer for layer in range(a.num_layers) if ca[layer].sum() > 0]
    logged_b = [layer for layer in range(b.num_layers) if cb[layer].sum() > 0]
    in_both = sorted(set(logged_a) & set(logged_b))
    if not in_both:  # importers' per-layer logs of different layers
        said = [_layer_list(logged) for logged in (logged_a, logged_b)]
        return {"comparable": False,
                "reason": f"no MoE layer is logged in both traces (A logs {said[0]}, B logs {said[1]})", **counts}
    pa, pb = a.coactivation(), b.coactivation()
    _, top4_a = _coactivation_shares(pa)
    _, top4_b = _coactivation_shares(pb)
    js: list[float | None] = []
    reuse: list[float | None] = []
    tv: list[float | None] = []
    top4: list[float | None] = []
    for layer in range(layers):
        both = ca[layer].sum() > 0 and cb[layer].sum() > 0
        js.append(js_divergence(ca[layer], cb[layer]) if both else None)
        ra = a.reuse_sum[layer] / a.reuse_n[layer] if a.reuse_n[layer] else None
        rb = b.reuse_sum[layer] / b.reuse_n[layer] if b.reuse_n[layer] else None
        reuse.append(float(rb - ra) if ra is not None and rb is not None else None)
        sa, sb = pa[layer].sum(), pb[layer].sum()
        tv.append(float(0.5 * np.abs(pa[layer] / sa - pb[layer] / sb).sum()) if sa and sb else None)
        ta, tb = top4_a[layer], top4_b[layer]
        top4.append(float(tb - ta) if ta is not None and tb is not None else None)
    if not counts["same_layer_count"]:
        longer = "A" if a.num_layers > b.num_layers else "B"
        left_out = _layer_span(layers, max(a.num_layers, b.num_layers))
        counts["notes"] = [counts["notes"][0] + f"; the distances set {_layer_span(0, layers)} of A against the "
                           f"same of B, index by index, and leave out {longer}'s {left_out}"]
    out = {"comparable": True, "layers_compared": layers, "layers_in_both": in_both, "popularity_js": _per_layer(js),
           "reuse_diff": _per_layer(reuse), "coactivation_tv": _per_layer(tv),
           "coactivation_top4_diff": _per_layer(top4), **counts}
    abs_reuse = [abs(v) for v in reuse if v is not None]
    out["reuse_diff"]["mean_abs"] = float(np.mean(abs_reuse)) if abs_reuse else None
    return out


def _layer_counts(a: _Accumulator, b: _Accumulator) -> dict[str, Any]:
    """Both traces' MoE layer counts, and a note when they differ (the distances go layer by layer, so
    layers past the shorter trace's have nothing to be compared with)."""
    same = a.num_layers == b.num_layers
    notes = [] if same else [f"different MoE layer counts: A has {a.num_layers}, B has {b.num_layers}"]
    return {"layers": {"a": a.num_layers, "b": b.num_layers}, "same_layer_count": same, "notes": notes}


def _layer_span(first: int, end: int) -> str:
    """Layers ``first`` to ``end - 1`` in words ("layer 3", "layers 3-5")."""
    return f"layer {first}" if end - first == 1 else f"layers {first}-{end - 1}"


def compare_traces(first: PathLike, second: PathLike, progress: RowsRead | None = None) -> dict[str, Any]:
    """Both traces' statistics (``a``, ``b``) and the distances of B from A (:func:`trace_distances`), after
    the validation pass over each (``progress``: told the rows each pass reads)."""
    checked_meta(first, progress=progress)
    checked_meta(second, progress=progress)
    meta_a, acc_a = _accumulate(first, progress)
    meta_b, acc_b = _accumulate(second, progress)
    distances = trace_distances(acc_a, acc_b)
    names = (meta_a.model.name, meta_b.model.name)
    if names[0] != names[1] and distances["comparable"]:
        # equal expert counts do not make expert 5 of one model expert 5 of another
        distances["notes"].append(f"different models: A is {names[0]}, B is {names[1]}; the distances match expert "
                                  "ids index by index, which means something only if both name the same experts")
    return {"a": _stats(meta_a, acc_a), "b": _stats(meta_b, acc_b), "distances": distances}


__all__ = ["compare_traces", "js_divergence", "render_comparison", "render_distances", "render_stats",
           "sparkline", "trace_distances", "trace_stats", "uniform_union"]
