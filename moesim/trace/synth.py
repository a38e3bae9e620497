"""Synthetic router traces with realistic skew, temporal locality, co-activation and predictors.

Routing model. For request r, token t and MoE layer l the router logit of expert e is

    z[t, l, e] = skew_l * -log(1 + rank_l(e))           static popularity (Zipf)
               - COLD_OFFSET * [rank_l(e) >= E - cold]     cold tail (cold = cold_fraction * E)
               + request_bias * u[r, l, e]                this prompt's hot experts
               + cluster_strength * g[t, l, cluster_l(e)]  co-activation cluster
               + n[t, l, e]                                token noise

- ``rank_l`` is a per-layer random permutation; ``skew_l`` grows linearly from
  ``skew_first`` to ``skew_last`` because deeper layers route more unevenly
  (000_dba2fecbbc66318b.txt Sec. III-B, Fig. 5).
- The ``cold`` least popular experts of each layer (``cold_fraction``, default 0 = none) sit a fixed
  offset below the Zipf profile: real prefill batches leave some experts of a layer with no token at all,
  which a Zipf profile of the fitted exponent does not (docs/trace-format.md, "How far a synthetic trace
  stands in for a real one").
- ``u`` ~ N(0, 1) per request: the set of hot experts changes from prompt to
  prompt (000 Sec. VII-B, citing MoE-Infinity), so a short trace is more skewed
  than a corpus-wide count.
- ``g`` and ``n`` are AR(1) processes over a request's tokens with correlation
  ``token_corr``: adjacent tokens re-use experts (003_46c415738ddfa491.txt Sec. 3,
  Fig. 8). ``g`` is shared by the experts of one cluster (``cluster_size`` experts
  per cluster, a random partition per layer), so a token's set tends to come from
  one cluster and specific pairs co-activate (002_95ae8307b42d2a8d.txt Sec. 3.2).
- ``scores = softmax(score_scale * z)`` over all experts, stored as float16; the
  routed experts are the top-k of those scores, highest first; a few high and many
  low scores (004_91681cee0e4a4add.txt Sec. 2, Fig. 4). ``weights`` are the routed
  scores, renormalized to sum 1 when the model does so.
- Predictor columns (see :class:`SynthParams`) keep each true expert with
  probability ``recall_*`` and fill the rest with the next-best experts by score,
  the near-misses a real predictor makes.

Schedule: requests are served in groups of ``batch``: one prefill step per request
(all its prompt tokens: ``prompt_len``, or its entry of ``prompt_lens``), then decode
steps holding one token of every request in the group that is still decoding (its
``decode_len``, or its entry of ``decode_lens``). Every request draws from its own
random stream seeded by (seed, request), so output is byte-identical for a seed.

Default parameters come from the calibration logs only (see ``synth_params._ANCHORS``).
:func:`fit_params` (``moesim trace synth --fit REAL.parquet``) fits them to any
real trace instead: skew, previous-token reuse, co-activation, the top-1
gate weight share and the prefill coverage (cold experts), each by bisection on the parameter that drives it, on
candidate traces with the real requests' prompt and decode lengths
(:func:`request_lengths`), which the trace written then takes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from moesim.model.spec import ModelSpec
from moesim.trace.io import TraceWriter
from moesim.trace.schema import TraceMeta
from moesim.util import pid_alive
# the generator's parameters and configuration, re-exported: moesim.trace.synth keeps every name
from moesim.trace.synth_params import (COLD_OFFSET, LOGIT_LIMIT, PARAM_RANGES, SynthConfig, SynthParams,
                                       anchor_defaults, default_renormalized)
from moesim.trace.synth_routing import (DrawnRouter, Layout, RequestRouter, cold_experts, draw_routers,
                                        predicted_experts, truth_and_fillers)

#: logits generated per chunk (tokens x layers x experts); bounds memory
CHUNK_ELEMENTS = 4_000_000

def _token_rows(router: RequestRouter | DrawnRouter, config: SynthConfig, n: int) -> dict[str, np.ndarray]:
    """Arrays shaped (n tokens, L, ...) for the next ``n`` tokens of one request."""
    model, params = config.model, config.params
    k = model.top_k
    got = router.take(n)
    ranking = got["ranking"]
    experts = ranking[:, :, :k]
    weights = np.take_along_axis(got["scores"], experts.astype(np.int64), axis=2).astype(np.float32)
    if params.renormalize:
        weights /= np.maximum(weights.sum(axis=2, keepdims=True), np.float32(1e-12))
    out = {"experts": experts, "weights": weights, "scores": got["scores"]}
    vocab = model.vocab_size or 32_000
    out["token_id"] = router.pred_rng.integers(0, vocab, size=n, dtype=np.int32)
    if params.predictors:
        rng = router.pred_rng
        # next layer of the same token (the last layer's prediction is dropped when writing)
        nxt_layer = np.concatenate([ranking[:, 1:], ranking[:, -1:]], axis=1)
        truth, fill = truth_and_fillers(nxt_layer, k)
        out["pred_next_layer"] = predicted_experts(truth, fill, params.recall_next_layer, rng)
        out["pred_residual"] = predicted_experts(truth, fill, params.recall_residual, rng)
        truth, fill = truth_and_fillers(got["next_ranking"], k)
        out["pred_next_token"] = predicted_experts(truth, fill, params.recall_next_token, rng)
    return out


def _rows(blocks: dict[str, np.ndarray], requests: np.ndarray, positions: np.ndarray, steps: np.ndarray,
          phase: int, model: ModelSpec, with_scores: bool, with_preds: bool) -> dict[str, Any]:
    """Flatten (steps, L, tokens per step, ...) arrays into trace rows (step, layer, request, position)."""
    S, L, B = blocks["experts"].shape[:3]
    k = model.top_k
    data: dict[str, Any] = {
        "request": np.broadcast_to(requests[:, None, :], (S, L, B)).reshape(-1),
        "step": np.broadcast_to(steps[:, None, None], (S, L, B)).reshape(-1),
        "phase": np.full(S * L * B, phase, dtype=np.int8),
        "position": np.broadcast_to(positions[:, None, :], (S, L, B)).reshape(-1),
        "layer": np.broadcast_to(np.arange(L)[None, :, None], (S, L, B)).reshape(-1),
        "experts": blocks["experts"].reshape(-1, k),
        "weights": blocks["weights"].reshape(-1, k),
        "token_id": np.broadcast_to(blocks["token_id"][:, None, :], (S, L, B)).reshape(-1),
    }
    if with_scores:
        data["scores"] = blocks["scores"].reshape(-1, model.num_experts)
    if with_preds:
        last_layer = np.broadcast_to((np.arange(L) == L - 1)[None, :, None], (S, L, B)).reshape(-1)
        lengths = np.where(last_layer, 0, k)
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        flat = blocks["pred_next_layer"].reshape(-1, k)[~last_layer].reshape(-1)
        data["pred_next_layer"] = (offsets, flat)
        flat = blocks["pred_residual"].reshape(-1, k)[~last_layer].reshape(-1)
        data["pred_residual"] = (offsets, flat)
        full = np.arange(S * L * B + 1) * k
        data["pred_next_token"] = (full, blocks["pred_next_token"].reshape(-1))
    return data


def _tokens_per_chunk(config: SynthConfig, tokens_per_step: int) -> int:
    per_token = config.model.num_layers * (config.model.num_experts + 8) * tokens_per_step
    return max(1, CHUNK_ELEMENTS // per_token)


def _group_lengths(config: SynthConfig, group: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    """Prompt and decode tokens of the requests of one group, by request id: config.prompts() lists every
    request's, 8 bytes a request held for the whole run (1 GB for 50 million one-token requests)."""
    def length(given: Sequence[int] | None, each: int, request: int) -> int:
        return each if given is None else given[request]
    return ({r: length(config.prompt_lens, config.prompt_len, r) for r in group},
            {r: length(config.decode_lens, config.decode_len, r) for r in group})


#: logits (tokens x layers x (experts + clusters)) of the short requests whose routing is drawn together
#: (:func:`draw_routers`); a request longer than this is drawn on its own, a few tokens at a time. Small:
#: a one-token DeepSeek-V3 request (33k logits) is arithmetic, not Python overhead, and blocks of 1 MB arrays
#: made it slower (page faults of each freed temporary: 2 s of system time in 8.5 s); 40 Mixtral-8x7B ones fit
DRAWN_ELEMENTS = 1 << 15
#: groups of one block at most (requests too long to be drawn together add no logits to a block)
DRAWN_GROUPS = 1024


def _group_blocks(config: SynthConfig, layout: Layout) -> Iterator[list[tuple[list[int], dict[int, int],
                                                                                dict[int, int]]]]:
    """The groups of requests in order, with their prompt and decode lengths, in blocks of consecutive groups
    (:data:`DRAWN_GROUPS` at most) whose short requests hold up to :data:`DRAWN_ELEMENTS` logits in all."""
    per_token = config.model.num_layers * (config.model.num_experts + layout.num_clusters)
    block, elements = [], 0
    for first in range(0, config.requests, config.batch):
        group = list(range(first, min(first + config.batch, config.requests)))
        prompts, decodes = _group_lengths(config, group)
        size = sum(n for r in group if (n := (prompts[r] + decodes[r]) * per_token) <= DRAWN_ELEMENTS)
        if block and (elements + size > DRAWN_ELEMENTS or len(block) >= DRAWN_GROUPS):
            yield block
            block, elements = [], 0
        block.append((group, prompts, decodes))
        elements += size
    if block:
        yield block


def _batches(config: SynthConfig, layout: Layout) -> Iterator[dict[str, Any]]:
    """Trace rows in order, one block of steps at a time."""
    per_token = config.model.num_layers * (config.model.num_experts + layout.num_clusters)
    step = 0
    for block in _group_blocks(config, layout):
        # short requests (one-token ones: each alone was mostly Python overhead) are drawn together
        short = {r: prompts[r] + decodes[r] for group, prompts, decodes in block for r in group
                 if (prompts[r] + decodes[r]) * per_token <= DRAWN_ELEMENTS}
        drawn = draw_routers(config, layout, short)
        for group, prompts, decodes in block:
            routers = [drawn[r] if r in drawn else RequestRouter(config, layout, r, prompts[r] + decodes[r])
                       for r in group]
            yield from _group_rows(config, group, routers, prompts, decodes, step)
            step += len(group) + max(decodes[r] for r in group)


def _group_rows(config: SynthConfig, group: list[int], routers: list[RequestRouter | DrawnRouter],
                prompts: dict[int, int], decodes: dict[int, int], step: int) -> Iterator[dict[str, Any]]:
    """One group's rows: a prefill step per request, then the group's decode steps."""
    for request, router in zip(group, routers):
        yield _prefill_rows(config, router, request, prompts[request], step)
        step += 1
    yield from _decode_rows(config, group, routers, prompts, decodes, step)


def _prefill_rows(config: SynthConfig, router: RequestRouter | DrawnRouter, request: int, n: int, step: int) -> dict[str, Any]:
    """The one prefill step of a request, all ``n`` prompt tokens."""
    # a prefill step is written whole (rows are layer-major), so its routing is generated
    # in token chunks and kept in compact form (int16 ids, float16 scores)
    chunk = _tokens_per_chunk(config, 1)
    parts = [_token_rows(router, config, min(chunk, n - start)) for start in range(0, n, chunk)]
    block = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
    blocks = {key: np.swapaxes(value, 0, 1)[None] for key, value in block.items() if key != "token_id"}
    blocks["token_id"] = block["token_id"][None]
    return _rows(blocks, np.full((1, n), request), np.arange(n)[None], np.array([step]), 0,
                 config.model, config.scores, config.params.predictors)


def _decode_rows(config: SynthConfig, group: list[int], routers: list[RequestRouter | DrawnRouter], prompts: Mapping[int, int],
                 decodes: Mapping[int, int], first_step: int) -> Iterator[dict[str, Any]]:
    """The decode steps of one group, from ``first_step``: each holds one token of every request still
    decoding, so the group runs as many steps as its longest request decodes and a request that has
    decoded all its tokens leaves the steps after it (as a served batch loses a finished request)."""
    start = 0
    for end in sorted({decodes[r] for r in group if decodes[r] > 0}):  # the same requests decode in [start, end)
        members = [i for i, r in enumerate(group) if decodes[r] >= end]
        requests = np.array([group[i] for i in members])
        offsets = np.array([prompts[r] for r in requests])
        chunk = _tokens_per_chunk(config, len(members))
        for at in range(start, end, chunk):
            n = min(chunk, end - at)
            per_request = [_token_rows(routers[i], config, n) for i in members]
            # (steps=n, L, B, ...) from B arrays of (n, L, ...)
            blocks = {key: np.stack([p[key] for p in per_request], axis=2) for key in per_request[0]
                      if key != "token_id"}
            blocks["token_id"] = np.stack([p["token_id"] for p in per_request], axis=1)
            positions = offsets[None, :] + at + np.arange(n)[:, None]
            yield _rows(blocks, np.broadcast_to(requests[None, :], (n, len(members))), positions,
                        first_step + at + np.arange(n), 1, config.model, config.scores, config.params.predictors)
        start = end


def synthesize(config: SynthConfig, out: Path | str, progress: Callable[[int], None] | None = None) -> Path:
    """Write the synthetic trace described by ``config`` to ``out`` (atomically); return its path.
    ``progress`` is called with the number of rows of each block written (:func:`synth_rows` in all)."""
    config.params.check(config.model.num_experts)
    layout = Layout.draw(config.model, config.params, np.random.default_rng([config.seed, 0]))
    meta = TraceMeta(model=config.model, source=config.source(),
                     weights_renormalized=config.params.renormalize)
    columns = ["weights", "token_id"] + (["scores"] if config.scores else [])
    if config.params.predictors:
        columns += ["pred_next_layer", "pred_residual", "pred_next_token"]
    with TraceWriter(out, meta, columns) as writer:
        for data in _batches(config, layout):
            writer.write(data)
            if progress is not None:
                progress(len(data["step"]))
    return Path(out)


def synth_rows(config: SynthConfig) -> int:
    """Rows of the trace ``config`` describes: one per token of every request at every MoE layer."""
    prompts = config.prompt_len * config.requests if config.prompt_lens is None else sum(config.prompt_lens)
    decodes = config.decode_len * config.requests if config.decode_lens is None else sum(config.decode_lens)
    return (prompts + decodes) * config.model.num_layers


# ----------------------------------------------------------------------------- fitting to a real trace
#: statistics of :func:`moesim.trace.stats.trace_stats` the generator models, and the parameter that moves
#: each (all increase with their parameter but those of :data:`FIT_FALLING`), in the order they are fitted:
#: cold experts also raise skew, clusters raise skew and reuse, skew raises reuse, so skew and reuse come
#: last and end each round matched
FIT_TARGETS = (("prefill_coverage", "cold_fraction"), ("coactivation_top4_share", "cluster_strength"),
               ("weight_top1_share", "score_scale"),
               ("top10_share", "skew"), ("reuse_prev_token", "token_corr"))
#: fewest experts for which the fit sets cold_fraction: below it one expert is too coarse a step of it
COLD_MIN_EXPERTS = 32
#: fitted parameters whose statistic falls as they rise (more cold experts: a prefill step reaches fewer)
FIT_FALLING = frozenset({"cold_fraction"})
#: search range of each fitted parameter ("skew" scales skew_first and skew_last together). cold_fraction:
#: at most half the experts cold (the Qwen3-30B-A3B calibration batch leaves 13.8% of them without a token)
FIT_RANGES = {"cold_fraction": (0.0, 0.5), "skew": (0.0, 4.0), "token_corr": (0.0, 0.99),
              "cluster_strength": (0.0, 8.0),
              "score_scale": (0.02, 12.0), "request_bias": (0.0, 3.0)}
#: tokens of the candidate traces the fit compares (a longer real trace is matched in proportions, scaled
#: down, to keep the fit quick; the fitted lengths, :attr:`FitResult.prompt_lens` and ``decode_lens``, stay the
#: real trace's)
FIT_MAX_TOKENS = 1024


@dataclass
class FitResult:
    """Parameters fitted to a real trace, with the statistics they reach against the real ones."""

    params: SynthParams
    #: requests, prompt_len, decode_len and batch of the real trace (means per request, rounded; never scaled
    #: down, whatever the candidate traces the fit compared held, see :func:`fit_lengths`)
    shape: dict[str, int]
    target: dict[str, float]
    fitted: dict[str, float]
    evaluations: int
    notes: list[str] = field(default_factory=list)
    #: prompt tokens of each real request in order of request id, as logged (0: no prefill row)
    real_prompt_lens: list[int] = field(default_factory=list)
    #: prompt tokens of each synthetic request: the real ones, a request without prompt given the mean prompt
    #: (see :func:`filled_prompts`)
    prompt_lens: list[int] = field(default_factory=list)
    #: decode tokens of each real request in order of request id
    decode_lens: list[int] = field(default_factory=list)

    def relative_errors(self) -> dict[str, float]:
        return {k: abs(self.fitted[k] - v) / abs(v) for k, v in self.target.items() if v and k in self.fitted}

    def settings(self) -> dict[str, str]:
        """The fitted parameters as ``--set`` strings."""
        return {k: str(v).lower() if isinstance(v, bool) else str(v)
                for k, v in dataclasses.asdict(self.params).items()}

    def lengths(self, requests: int) -> tuple[list[int], list[int]]:
        """Prompt and decode tokens of ``requests`` synthetic requests: the real requests' in order, taken
        again from the first when more are asked for (as ``serve-sim`` draws requests from a trace)."""
        return _repeated(self.prompt_lens, requests), _repeated(self.decode_lens, requests)


def _repeated(values: list[int], count: int) -> list[int]:
    return [values[i % len(values)] for i in range(count)]


def request_lengths(path: Path | str) -> tuple[list[int], list[int]]:
    """Prompt and decode tokens of each request of a trace, in order of request id (the order ``serve-sim``
    takes them in): its distinct positions of each phase, over every layer logged (a token one layer's log
    dropped is still counted from the others)."""
    from moesim.trace.io import _open, _phase_codes
    keys = []
    for batch in _open(path).iter_batches(columns=["request", "position", "phase"], batch_size=1 << 20):
        request = batch.column("request").to_numpy().astype(np.int64)
        position = batch.column("position").to_numpy().astype(np.int64)
        decode = (_phase_codes(batch.column("phase")) != 0).astype(np.int64)
        # one int64 per token: int32 request in the high 32 bits, position (int32, >= 0) and phase below
        keys.append(np.unique((request << 32) | (position << 1) | decode))
    tokens = np.unique(np.concatenate(keys)) if keys else np.zeros(0, dtype=np.int64)
    request, decode = tokens >> 32, tokens & 1
    ids = np.unique(request)
    prompts = np.bincount(np.searchsorted(ids, request[decode == 0]), minlength=len(ids))
    decodes = np.bincount(np.searchsorted(ids, request[decode == 1]), minlength=len(ids))
    return prompts.tolist(), decodes.tolist()


def filled_prompts(prompts: list[int]) -> list[int]:
    """Real prompt lengths for synthetic requests. A request without prefill rows had its prompt left out of
    the trace (no request runs on an empty prompt), so it gets the mean of the prompts logged (rounded, as
    :func:`trace_shape`'s prompt_len), or 1 token, the generator's shortest, when none was."""
    logged = [n for n in prompts if n > 0]
    mean = max(1, round(sum(logged) / len(logged))) if logged else 1
    return [n if n > 0 else mean for n in prompts]


def trace_shape(stats: Mapping[str, Any]) -> dict[str, int]:
    """Requests, prompt and decode tokens per request and decode batch of a trace, from its statistics.

    The prompt length is the mean over the requests that have a prompt: a request without prefill rows
    had its prompt left out of the trace (no request runs on an empty prompt), so counting it as a 0-token
    prompt would shorten every synthetic prompt. A request that decoded nothing did decode 0 tokens, so
    the decode length is the mean over all requests."""
    requests = max(int(stats["requests"]), 1)
    prompted = int(stats.get("requests_with_prompt", requests))
    prefill = int(stats["tokens_by_phase"]["prefill"])
    decode = int(stats["tokens_by_phase"]["decode"])
    decode_steps = int(stats["steps"]["decode"])
    batch = max(1, round(decode / decode_steps)) if decode_steps else 1
    return {"requests": requests, "prompt_len": max(1, round(prefill / prompted)) if prompted else 1,
            "decode_len": round(decode / requests), "batch": min(batch, requests)}


def fit_lengths(prompts: list[int], decodes: list[int]) -> tuple[list[int], list[int]]:
    """The request lengths of the candidate traces a fit compares: ``prompts`` and ``decodes`` themselves, or,
    beyond :data:`FIT_MAX_TOKENS` tokens in all, each scaled down in proportion (the same requests, batch and
    spread of lengths, fewer tokens per request; every prompt keeps at least 1 token)."""
    total = sum(prompts) + sum(decodes)
    if total <= FIT_MAX_TOKENS:
        return list(prompts), list(decodes)
    scale = FIT_MAX_TOKENS / total
    return [max(1, round(n * scale)) for n in prompts], [round(n * scale) for n in decodes]


def _spread(values: list[int]) -> str:
    low, high = min(values), max(values)
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


def _scaling_notes(prompts: list[int], decodes: list[int], compared: tuple[list[int], list[int]]) -> list[str]:
    """What the fit compared when the real trace is too long to draw candidates of its length quickly."""
    if compared == (prompts, decodes):
        return []
    note = (f"the candidate traces the fit compared have the real requests' lengths scaled down to "
            f"{FIT_MAX_TOKENS:,} tokens in all to keep the fit quick: prompts of {_spread(compared[0])} tokens and "
            f"{_spread(compared[1])} decode tokens per request, for the real {_spread(prompts)} and "
            f"{_spread(decodes)}; the trace written has the real lengths")
    return [note]


def _prompt_notes(real_prompts: list[int], prompts: list[int]) -> list[str]:
    """What a synthetic request's prompt stands for when its real request has none."""
    requests, missing = len(real_prompts), [r for r, n in enumerate(real_prompts) if n == 0]
    if not missing:
        return []
    if len(missing) == requests:
        return [f"none of the trace's {requests} requests has a prompt (0 prefill tokens): the synthetic requests "
                "get a 1-token prompt, the shortest the generator writes"]
    have = {True: "has", False: "have"}
    prompted = requests - len(missing)
    theirs = "its synthetic request gets" if len(missing) == 1 else "their synthetic requests get"
    return [f"{len(missing)} of the trace's {requests} requests {have[len(missing) == 1]} no prompt (0 prefill "
            f"tokens): {theirs} the mean prompt of the {prompted} that {have[prompted == 1]} one "
            f"({prompts[missing[0]]} tokens); every other request keeps its own prompt length"]


def _with(params: SynthParams, name: str, value: float, base: SynthParams, num_experts: int) -> SynthParams:
    if name == "cold_fraction":  # a whole number of cold experts, said as the share it is
        return dataclasses.replace(params, cold_fraction=round(cold_experts(value, num_experts) / num_experts, 6))
    if name == "skew":  # keep the anchors' growth with depth, scale its level
        level = max(base.skew_last, 1e-9)
        return dataclasses.replace(params, skew_first=round(base.skew_first / level * value, 6),
                                   skew_last=round(value, 6))
    return dataclasses.replace(params, **{name: round(value, 6)})


#: the temporary folder of one fit's candidate traces: this prefix, then the fitting process's id
FIT_FOLDER_PREFIX = "moesim-fit-"


def _remove_dead_fits() -> None:
    """Remove the candidate folders of fits whose process is gone (killed with -9: its folder stayed)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{FIT_FOLDER_PREFIX}*-*"):
        pid = folder.name[len(FIT_FOLDER_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def fit_params(real: Path | str, *, seed: int = 0, rounds: int = 6, steps: int = 8, tolerance: float = 0.05,
               progress: Callable[[str], None] | None = None) -> FitResult:
    """Fit the routing parameters of :class:`SynthParams` so that a synthetic trace of ``real``'s model and
    shape reaches ``real``'s statistics (:data:`FIT_TARGETS`).

    Each statistic rises (or, :data:`FIT_FALLING`, falls) with one parameter, so each is fitted by bisection
    over :data:`FIT_RANGES` (``steps`` halvings) with the others fixed, round after round (the parameters interact: clusters
    also add reuse and skew, skew adds co-activation) until every statistic is within ``tolerance``
    (relative) or ``rounds`` rounds have run. Every candidate is judged on a trace drawn with the same ``seed``,
    so the comparison is between parameters, not draws. When the trace is less skewed than the
    generator at zero static skew, ``request_bias`` is lowered instead. Predictor recalls are copied from
    the real trace's measured recalls; the weight convention from its metadata. The candidates have the real
    requests' lengths (:func:`fit_lengths`: scaled down in proportion past :data:`FIT_MAX_TOKENS`), since a few
    long requests weigh more in the statistics than many short ones. ``progress`` is called with the parameter
    being fitted after each candidate trace.
    """

    from moesim.trace.stats import trace_stats
    from moesim.trace.io import read_meta
    real_stats = trace_stats(real)
    meta = read_meta(real)
    model = meta.model
    shape = trace_shape(real_stats)
    real_prompts, decodes = request_lengths(real)
    prompts = filled_prompts(real_prompts)
    compared = fit_lengths(prompts, decodes)  # the candidates' lengths: a long trace's scaled down
    base = SynthParams.for_model(model)
    base.renormalize = bool(real_stats.get("weights_renormalized", base.renormalize))
    for column, recall in real_stats["predictor_recall"].items():
        if recall is not None:
            setattr(base, "recall_" + column.removeprefix("pred_"), round(float(recall), 4))
    target = {stat: float(real_stats[stat]) for stat, _ in FIT_TARGETS if real_stats.get(stat) is not None}
    notes: list[str] = []
    if model.num_experts < COLD_MIN_EXPERTS and "prefill_coverage" in target:
        # one cold expert of 8 moves a short prefill's coverage by more than the fit's tolerance either way
        del target["prefill_coverage"]
        notes.append(f"prefill_coverage not fitted: a cold expert is 1/{model.num_experts} of the model's experts, "
                     f"too coarse a step below {COLD_MIN_EXPERTS} experts (cold_fraction stays "
                     f"{base.cold_fraction:g})")
    logged = meta.source.get("layers_present") if isinstance(meta.source, dict) else None
    if isinstance(logged, list) and 0 < len(logged) < model.num_layers:
        notes.append(f"the trace logs {len(logged)} of the model's {model.num_layers} MoE layers: the fit matches "
                     f"their statistics with the mean over all {model.num_layers} synthetic layers, so how skew grows "
                     "from the first layer to the last (skew_first, skew_last) is not what the trace shows")
    notes.extend(_prompt_notes(real_prompts, prompts))
    notes.extend(_scaling_notes(prompts, decodes, compared))
    evaluations = 0
    _remove_dead_fits()
    with tempfile.TemporaryDirectory(prefix=f"{FIT_FOLDER_PREFIX}{os.getpid()}-") as folder:
        def measure(params: SynthParams, name: str = "check") -> dict[str, Any]:
            nonlocal evaluations
            evaluations += 1
            if progress is not None:
                progress(name)
            candidate = dataclasses.replace(params, predictors=False)
            config = SynthConfig(model=model, seed=seed, scores=False, params=candidate, requests=len(prompts),
                                 batch=shape["batch"], prompt_lens=compared[0], decode_lens=compared[1])
            return trace_stats(synthesize(config, Path(folder) / f"fit-{evaluations}.parquet"), validate=False)

        def bisect(params: SynthParams, name: str, stat: str) -> SynthParams:
            lo, hi = FIT_RANGES[name]
            for _ in range(steps):
                mid = (lo + hi) / 2 if name != "score_scale" else math.sqrt(lo * hi)
                value = measure(_with(params, name, mid, base, model.num_experts), name)[stat]
                if value is None:
                    break
                low = value > target[stat] if name in FIT_FALLING else value < target[stat]
                lo, hi = (mid, hi) if low else (lo, mid)
            return _with(params, name, (lo + hi) / 2 if name != "score_scale" else math.sqrt(lo * hi), base,
                         model.num_experts)

        params = base
        for _ in range(rounds):
            for stat, name in FIT_TARGETS:
                if stat not in target:
                    continue
                params = bisect(params, name, stat)
                if name == "skew" and params.skew_last < 0.01:
                    at_zero = measure(params)[stat]
                    if at_zero is not None and at_zero > target[stat]:
                        params = bisect(params, "request_bias", stat)
            fitted_stats = measure(params)
            if all(fitted_stats.get(k) is not None and abs(fitted_stats[k] - v) <= tolerance * abs(v)
                   for k, v in target.items()):
                break
    fitted = {stat: float(fitted_stats[stat]) for stat in target if fitted_stats.get(stat) is not None}
    for stat, name in FIT_TARGETS:  # every miss past the fit's own tolerance is said, not only large ones
        if stat in target and stat in fitted and abs(fitted[stat] - target[stat]) > tolerance * abs(target[stat]):
            off = abs(fitted[stat] - target[stat]) / abs(target[stat])
            notes.append(f"{stat}: {fitted[stat]:.3f} against {target[stat]:.3f}, {off:.1%} off (the fit stops at "
                         f"{tolerance:.0%}; {name} at the end of its range or held back by the other parameters)")
    return FitResult(params=params, shape=shape, target=target, fitted=fitted, evaluations=evaluations,
                     notes=notes, real_prompt_lens=real_prompts, prompt_lens=prompts, decode_lens=decodes)


__all__ = ["CHUNK_ELEMENTS", "COLD_MIN_EXPERTS", "COLD_OFFSET", "FIT_FALLING", "FIT_MAX_TOKENS", "FIT_RANGES", "FIT_TARGETS", "LOGIT_LIMIT",
           "PARAM_RANGES", "FitResult", "cold_experts",
           "SynthConfig", "SynthParams", "anchor_defaults", "default_renormalized", "filled_prompts", "fit_lengths",
           "fit_params", "request_lengths", "synth_rows", "synthesize", "trace_shape"]
