"""The steps every member of a portfolio replays (:class:`TraceShape`) and its windows of consecutive decode
steps (:class:`Windows`): what the members' records and floors (moesim.sim.floors) depend on, read once."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from moesim.policy.base import active_experts
from moesim.trace.io import iter_steps
from moesim.trace.schema import PHASES

#: window lengths (decode steps) of the capacity floors
WINDOW_STEPS = (1, 2, 4, 8, 16, 32, 64)
#: routed decode experts beyond which the window floors are left out (their tables take ~50 bytes per expert)
WINDOW_USES_MAX = 4_000_000


@dataclass
class TraceShape:
    """The steps every member replays: what their records and floors depend on."""

    phases: list[str]
    #: per step: requests in it (its first layer's)
    requests: list[list[int]]
    #: per step: trace rows (what a progress bar counts)
    rows: list[int]
    #: per step: (tokens, context, sequences, phase) as the engine's ``run_step`` derives them
    work: list[tuple[int, int, int, str]]
    #: per step: ((layer tokens, token counts of its routed experts), how many MoE layers have them)
    layers: list[tuple[tuple[tuple[int, tuple[int, ...]], int], ...]]
    #: the trace read (placed floors read its routing again)
    path: str = ""
    #: (layer, expert) pairs routed in each decode step, as ``layer * num_experts + expert`` (None: too many)
    decode_pairs: list[np.ndarray] | None = None
    num_experts: int = 0
    num_layers: int = 0
    _alike: dict[tuple, list[int]] | None = field(default=None, repr=False)

    def alike(self) -> dict[tuple, list[int]]:
        """Steps of one kind of layer (every decode step), by (kind, phase): each is its head and tail plus
        ``m`` alike layers, so floors take them at once."""
        if self._alike is None:
            self._alike = {}
            for i, (work, kinds) in enumerate(zip(self.work, self.layers)):
                if len(kinds) == 1:
                    self._alike.setdefault((kinds[0], work[3]), []).append(i)
        return self._alike

    @classmethod
    def of(cls, trace: str, num_experts: int) -> TraceShape:
        out = cls([], [], [], [], [], path=trace, decode_pairs=[], num_experts=num_experts)
        uses = 0
        for step in iter_steps(trace, columns=()):
            first = slice(int(step.layer_bounds[0]), int(step.layer_bounds[1]))
            tokens = first.stop - first.start
            phase = PHASES[int(step.phase.min())]
            requests = step.request[first] if tokens == 1 else np.unique(step.request[first])
            out.phases.append(phase)
            out.requests.append(requests.tolist())
            out.rows.append(step.rows)
            out.work.append((tokens, int(step.position[first].max()) + 1, len(requests) if tokens > 1 else 1,
                             phase))
            if len(step.layer_bounds) == step.rows + 1:  # a row per layer (a decode step): one kind
                # the validated trace row has distinct experts
                out.layers.append((((1, (1,) * step.experts.shape[1]), step.rows),) if step.rows else ())
            else:
                kinds: Counter = Counter()
                for _, rows in step.layers():
                    experts = step.experts[rows]
                    if rows.stop - rows.start == 1:
                        kinds[(1, (1,) * experts.shape[1])] += 1
                    else:
                        kinds[(rows.stop - rows.start, tuple(sorted(active_experts(experts, num_experts)[1])))] += 1
                out.layers.append(tuple(sorted(kinds.items())))
            out.num_layers = max(out.num_layers, int(step.layer.max()) + 1 if step.rows else 0)
            if out.decode_pairs is not None:
                pairs = (step.layer.astype(np.int64)[:, None] * num_experts + step.experts).ravel() \
                    if phase == "decode" else np.zeros(0, dtype=np.int64)
                uses += pairs.size
                out.decode_pairs.append(pairs)
                if uses > WINDOW_USES_MAX:
                    out.decode_pairs = None
        return out

    @property
    def decode_weight(self) -> np.ndarray:
        """Per step: its entries in the mean TPOT (requests of a decode step, else 0)."""
        return np.array([len(r) if p == "decode" else 0 for p, r in zip(self.phases, self.requests)], dtype=float)

    def spans(self) -> dict[int, tuple[int, int]]:
        """Request -> (first, last) step of its prefill, in the order TTFT averages them."""
        out: dict[int, list[int]] = {}
        for i, (phase, reqs) in enumerate(zip(self.phases, self.requests)):
            if phase == "prefill":
                for r in reqs:
                    out.setdefault(r, [i, i])[1] = i
        return {r: (a, b) for r, (a, b) in out.items()}


@dataclass
class Windows:
    """Windows of consecutive decode steps and the distinct (layer, expert) pairs each routes, per layer."""

    #: per window length: (first step of each window, one past its last step, distinct pairs per layer)
    by_length: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    _fewest: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def fewest(self, length: int, weight: np.ndarray) -> np.ndarray:
        """Each window of ``length`` steps: its smallest step weight (``TraceShape.decode_weight`` of the
        shape these windows come from: fewest TPOT entries in a step), kept for every member."""
        value = self._fewest.get(length)
        if value is None:
            starts, ends, _ = self.by_length[length]
            value = self._fewest[length] = np.array([weight[a:b].min() for a, b in zip(starts, ends)])
        return value

    @classmethod
    def of(cls, shape: TraceShape) -> Windows:
        out = cls()
        if shape.decode_pairs is None or not shape.num_layers:
            return out
        sizes = np.array([p.size for p in shape.decode_pairs])
        if not sizes.sum():
            return out
        pairs = np.concatenate(shape.decode_pairs)
        steps = np.repeat(np.arange(len(sizes)), sizes)
        order = np.lexsort((steps, pairs))  # by pair, then step: a pair's uses in step order
        pairs, steps = pairs[order], steps[order]
        layer = pairs // shape.num_experts
        runs = decode_runs(shape.phases)
        for length in WINDOW_STEPS:
            starts, ends, window_of = _windows(runs, length, len(shape.phases))
            if not len(starts):
                continue
            win = window_of[steps]
            new = np.ones(len(pairs), dtype=bool)
            new[1:] = (pairs[1:] != pairs[:-1]) | (win[1:] != win[:-1])
            distinct = np.bincount(win[new] * shape.num_layers + layer[new],
                                   minlength=len(starts) * shape.num_layers).reshape(len(starts), shape.num_layers)
            out.by_length[length] = (starts, ends, distinct)
        return out


def decode_runs(phases: list[str]) -> list[tuple[int, int]]:
    """Maximal runs [start, end) of consecutive decode steps."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, phase in enumerate(phases + ["end"]):
        if phase == "decode":
            start = i if start is None else start
        elif start is not None:
            runs.append((start, i))
            start = None
    return runs


def _windows(runs: list[tuple[int, int]], length: int, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each run cut into windows of ``length`` steps from its start: (starts, ends, window of each step or -1)."""
    starts = [s for a, b in runs for s in range(a, b, length)]
    ends = [min(s + length, b) for a, b in runs for s in range(a, b, length)]
    window_of = np.full(steps, -1, dtype=np.int64)
    for i, (s, e) in enumerate(zip(starts, ends)):
        window_of[s:e] = i
    return np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64), window_of
