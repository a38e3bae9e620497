"""The routing model of moesim.trace.synth: per-layer tables drawn once from the seed (:class:`Layout`), and
each request's router logits, scores, routed experts and predictor rows (:class:`RequestRouter`, one request a
few tokens at a time; :func:`draw_routers`, many short requests at once, the same numbers). The model and
its parameters are described in moesim.trace.synth's docstring."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from moesim.model.spec import ModelSpec
from moesim.trace.synth_params import COLD_OFFSET, SynthConfig, SynthParams


@dataclass
class Layout:
    """Per-layer static tables drawn once from the seed."""

    log_pop: np.ndarray  # (L, E) skew_l * -log(1 + rank)
    cluster_of: np.ndarray  # (L, E) cluster index
    num_clusters: int

    @classmethod
    def draw(cls, model: ModelSpec, params: SynthParams, rng: np.random.Generator) -> "Layout":
        L, E = model.num_layers, model.num_experts
        ranks = np.argsort(rng.random((L, E)), axis=1)
        depth = np.linspace(0.0, 1.0, L) if L > 1 else np.zeros(1)
        skew = params.skew_first + (params.skew_last - params.skew_first) * depth
        log_pop = -skew[:, None] * np.log1p(ranks)
        log_pop[ranks >= E - cold_experts(params.cold_fraction, E)] -= COLD_OFFSET
        size = params.cluster_size or 1
        num_clusters = -(-E // size)
        cluster_of = np.argsort(rng.random((L, E)), axis=1) // size
        return cls(log_pop=log_pop, cluster_of=cluster_of, num_clusters=num_clusters)


def cold_experts(fraction: float, num_experts: int) -> int:
    """Experts per layer that :attr:`SynthParams.cold_fraction` makes cold (the least popular ranks)."""
    return min(num_experts, int(round(fraction * num_experts)))


class RequestRouter:
    """Routing of one request's tokens, generated in order with one token of look-ahead."""

    def __init__(self, config: SynthConfig, layout: Layout, request: int, length: int) -> None:
        self.model, self.params, self.layout = config.model, config.params, layout
        self.rng, self.pred_rng = request_rngs(config, request)
        self.base, self.noise, self.cluster = request_start(self.rng, config, layout)
        self.remaining = length
        self.buffer: list[dict[str, np.ndarray]] = []
        self.buffered = 0

    def _logits(self, n: int) -> np.ndarray:
        L, E, C = self.model.num_layers, self.model.num_experts, self.layout.num_clusters
        eps = self.rng.standard_normal((n, L, E + C))
        out = np.empty((n, L, E))
        for t in range(n):  # AR(1): the only sequential part, one (L, E) update per token
            self.noise, self.cluster, out[t] = ar1_step(self.params, self.layout, self.base, self.noise,
                                                         self.cluster, eps[t])
        return out

    def _generate(self, n: int) -> dict[str, np.ndarray]:
        return scores_and_ranking(self._logits(n), self.params, self.model)

    def take(self, n: int) -> dict[str, np.ndarray]:
        """The next ``n`` tokens: scores (n, L, E), ranking (n, L, 2k) and the next token's experts."""
        want = min(n + 1, self.buffered + self.remaining)
        while self.buffered < want:
            step = min(want - self.buffered, self.remaining)
            self.buffer.append(self._generate(step))
            self.buffered += step
            self.remaining -= step
        merged = {key: np.concatenate([b[key] for b in self.buffer]) for key in self.buffer[0]}
        nxt = merged["ranking"][1:n + 1]
        if len(nxt) < n:  # the request's last token: no next token, predict its own set
            nxt = np.concatenate([nxt, merged["ranking"][n - 1:n]])
        out = {key: value[:n] for key, value in merged.items()}
        out["next_ranking"] = nxt
        rest = {key: value[n:] for key, value in merged.items()}
        self.buffer = [rest] if len(rest["ranking"]) else []
        self.buffered = len(rest["ranking"])
        return out


def request_rngs(config: SynthConfig, request: int) -> tuple[np.random.Generator, np.random.Generator]:
    """A request's own random streams: routing, and predictors and token ids."""
    return np.random.default_rng([config.seed, 1, request]), np.random.default_rng([config.seed, 2, request])


def request_start(rng: np.random.Generator, config: SynthConfig,
                   layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A request's static logits (popularity plus its own bias) and the AR(1) states before its first token."""
    L, E = config.model.num_layers, config.model.num_experts
    base = layout.log_pop + config.params.request_bias * rng.standard_normal((L, E))
    noise = rng.standard_normal((L, E))
    cluster = rng.standard_normal((L, layout.num_clusters))
    return base, noise, cluster


def ar1_step(params: SynthParams, layout: Layout, base: np.ndarray, noise: np.ndarray, cluster: np.ndarray,
              eps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One token's AR(1) update of the noise (..., L, E) and cluster (..., L, C) states from ``eps`` (..., L, E + C),
    and its logits; the leading axes hold requests drawn together, each element computed as for one request."""
    rho = params.token_corr
    fresh = math.sqrt(max(1.0 - rho * rho, 0.0))
    E = noise.shape[-1]
    noise = rho * noise + fresh * eps[..., :E]
    cluster = rho * cluster + fresh * eps[..., E:]
    rows = np.arange(layout.cluster_of.shape[0])[:, None]
    return noise, cluster, base + noise + params.cluster_strength * cluster[..., rows, layout.cluster_of]


def scores_and_ranking(logits: np.ndarray, params: SynthParams, model: ModelSpec) -> dict[str, np.ndarray]:
    """Scores (n, L, E) as float16 and the 2k best experts (n, L, 2k) of ``n`` tokens' logits; every (token,
    layer) row on its own, so tokens of many requests give each the bytes it gets alone."""
    k = model.top_k
    logits = logits * params.score_scale
    logits -= logits.max(axis=2, keepdims=True)
    z = np.exp(logits)
    z /= z.sum(axis=2, keepdims=True)
    scores = z.astype(np.float16)
    width = min(2 * k, model.num_experts)
    # experts ranked by their stored score; those it rounds to 0 (a large score_scale) by their logit,
    # all below the smallest nonzero score: a tie at 0 was taken in index order, routing to expert 0
    values = scores.astype(np.float64)
    zero = scores == 0
    values[zero] = logits[zero] - 1.0
    top = np.argpartition(-values, width - 1, axis=2)[:, :, :width]
    order = np.argsort(-np.take_along_axis(values, top, axis=2), axis=2, kind="stable")
    ranking = np.take_along_axis(top, order, axis=2).astype(np.int16)
    return {"scores": scores, "ranking": ranking}


class DrawnRouter:
    """A short request's routing, drawn whole beforehand together with other requests (:func:`draw_routers`):
    the same numbers :class:`RequestRouter` draws for it a few tokens at a time, taken the same way."""

    def __init__(self, pred_rng: np.random.Generator, scores: np.ndarray, ranking: np.ndarray) -> None:
        self.pred_rng = pred_rng
        self.scores, self.ranking = scores, ranking
        self.at = 0

    def take(self, n: int) -> dict[str, np.ndarray]:
        at, end = self.at, self.at + n
        nxt = self.ranking[at + 1:end + 1]
        if len(nxt) < n:  # the request's last token: no next token, predict its own set
            nxt = np.concatenate([nxt, self.ranking[end - 1:end]])
        self.at = end
        return {"scores": self.scores[at:end], "ranking": self.ranking[at:end], "next_ranking": nxt}


def draw_routers(config: SynthConfig, layout: Layout, lengths: Mapping[int, int]) -> dict[int, DrawnRouter]:
    """The routing of the requests of ``lengths`` (request: tokens), drawn in one pass per length: each request's
    random numbers come from its own streams, in the order :class:`RequestRouter` draws them (a normal
    draw of n then m numbers is the draw of n + m), and the arithmetic runs over all requests at once."""
    routers: dict[int, DrawnRouter] = {}
    by_length: dict[int, list[int]] = {}
    for request, length in lengths.items():
        by_length.setdefault(length, []).append(request)
    L, E, C = config.model.num_layers, config.model.num_experts, layout.num_clusters
    for length, requests in by_length.items():
        rngs = [request_rngs(config, r) for r in requests]
        starts = [request_start(rng, config, layout) for rng, _ in rngs]
        eps = np.stack([rng.standard_normal((length, L, E + C)) for rng, _ in rngs])
        base, noise, cluster = (np.stack(parts) for parts in zip(*starts))
        logits = np.empty((len(requests), length, L, E))
        for t in range(length):
            noise, cluster, logits[:, t] = ar1_step(config.params, layout, base, noise, cluster, eps[:, t])
        drawn = scores_and_ranking(logits.reshape(-1, L, E), config.params, config.model)
        scores = drawn["scores"].reshape(len(requests), length, L, E)
        ranking = drawn["ranking"].reshape(len(requests), length, L, -1)
        for i, (request, (_, pred_rng)) in enumerate(zip(requests, rngs)):
            routers[request] = DrawnRouter(pred_rng, scores[i], ranking[i])
    return routers


def predicted_experts(truth: np.ndarray, fillers: np.ndarray, recall: float, rng: np.random.Generator) -> np.ndarray:
    """Keep each true expert with probability ``recall``; replace the others with fillers in order."""
    dropped = rng.random(truth.shape) >= recall
    slot = np.cumsum(dropped, axis=-1) - 1
    replacement = np.take_along_axis(fillers, np.maximum(slot, 0), axis=-1)
    return np.where(dropped, replacement, truth)


def truth_and_fillers(ranking: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Split a (..., 2k) score ranking into the routed set and k near-miss fillers."""
    truth, fill = ranking[..., :k], ranking[..., k:]
    if fill.shape[-1] < k:  # fewer than 2k experts: a dropped expert may come back as a filler
        fill = np.concatenate([fill, truth[..., :k - fill.shape[-1]]], axis=-1)
    return truth, fill
