"""Assignment components: for each activated expert, GPU or CPU."""

from __future__ import annotations

from bisect import bisect
from dataclasses import dataclass, field

from moesim.policy.base import Component, LayerView, RunContext


class Assignment(Component):
    role = "assign"

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        """(gpu experts, cpu experts) for ``view.active``."""
        raise NotImplementedError


@dataclass
class AllCPU(Assignment):
    """Every routed expert on the CPU; attention and shared experts stay on the GPU (001 Sec. 3)."""

    name = "cpu"

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        return [], list(view.active)


@dataclass
class AllGPU(Assignment):
    """Every routed expert on the GPU, loading whatever is missing."""

    name = "gpu"

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        return list(view.active), []


@dataclass
class ResidentOnGPU(Assignment):
    """Resident experts on the GPU, the rest on the CPU: no transfers on the critical path (Fiddler-style)."""

    name = "resident"

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        resident = view.cache.resident[view.layer]
        gpu = [e for e in view.active if e in resident]
        cpu = [e for e in view.active if e not in resident]
        return gpu, cpu


@dataclass
class SplitCosts:
    """Per-expert times of one layer, computed once so that many splits can be estimated cheaply."""

    now: float
    gpu: dict[int, float]
    cpu: dict[int, float]
    #: when each expert's weights are on the GPU if nothing new is loaded (None: must be loaded)
    ready: dict[int, float | None]
    load: float
    shared: float
    sync: float
    link_free: list[float]

    @classmethod
    def of(cls, view: LayerView, copy_engines: int = 1,
           per_tokens: dict[int, tuple[float, float]] | None = None) -> "SplitCosts":
        """``per_tokens``: a memo of (gpu_expert(n), cpu_expert(n)) by tokens ``n`` kept by the caller."""
        costs = view.costs
        resident = view.cache.resident[view.layer]
        engines = sorted([view.now] * copy_engines)
        for at in sorted(view.arrivals.values()):
            engines[0] = max(engines[0], at)
            engines.sort()
        shared = costs.gpu_shared(view.tokens) + view.shared_launch_s if costs.model.shared_intermediate_size else 0.0
        memo = {} if per_tokens is None else per_tokens
        launch = view.expert_launch_s
        gpu, cpu = {}, {}
        for e, n in zip(view.active, view.counts):
            pair = memo.get(n)
            if pair is None:
                pair = memo[n] = (costs.gpu_expert(n), costs.cpu_expert(n))
            gpu[e] = pair[0] + launch
            cpu[e] = pair[1]
        now, arrivals = view.now, view.arrivals
        return cls(now=now, gpu=gpu, cpu=cpu,
                   ready={e: now if e in resident else arrivals.get(e) for e in view.active},
                   load=costs.expert_load, shared=shared, sync=costs.sync_s, link_free=engines)

    def _arrival(self, expert: int, engines: list[float]) -> float:
        """When ``expert``'s weights are on the GPU: known if resident or arriving, else after one more
        load on the copy engine free first (``engines``, kept sorted, is updated)."""
        at = self.ready[expert]
        if at is None:
            engines[0] += self.load
            at = engines[0]
            if len(engines) > 1:
                engines.sort()
        return at

    def estimate(self, gpu: list[int], cpu: list[int]) -> float:
        """Time from plan to layer end, as the engine would run the split.

        GPU experts resident or arriving run in arrival order; missing ones are
        loaded over the copy engines after the transfers already known.
        """
        engines = list(self.link_free)
        ready: list[tuple[float, int]] = []
        for e in gpu:
            ready.append((self._arrival(e, engines), e))
        ready.sort()
        gpu_t = self.now + self.shared
        for at, e in ready:
            gpu_t = (gpu_t if gpu_t > at else at) + self.gpu[e]
        cpu_t = self.now + self.sync + sum(map(self.cpu.__getitem__, cpu)) if cpu else self.now
        return max(gpu_t, cpu_t) - self.now

    def prefix_estimates(self, order: list[int], lengths: list[int]) -> list[float]:
        """``estimate(order[:i], order[i:])`` for each ``i`` of ``lengths`` (ascending), the same numbers:
        the loads of a prefix are those of the shorter prefix plus its new experts, so each expert's arrival
        is computed once and kept in arrival order."""
        engines = list(self.link_free)
        ready: list[tuple[float, int]] = []
        #: the GPU stream's time after each expert of ``ready``: only what follows a new expert changes
        chain: list[float] = []
        out: list[float] = []
        done = 0
        now, shared, gpu, cpu = self.now, self.shared, self.gpu, self.cpu
        for i in lengths:
            first = len(ready)
            for e in order[done:i]:
                item = (self._arrival(e, engines), e)
                p = bisect(ready, item)
                ready.insert(p, item)
                first = min(first, p)
            done = i
            del chain[first:]
            gpu_t = chain[-1] if chain else now + shared
            for at, e in ready[first:]:
                gpu_t = (gpu_t if gpu_t > at else at) + gpu[e]
                chain.append(gpu_t)
            cpu_t = now + self.sync + sum(map(cpu.__getitem__, order[i:])) if i < len(order) else now
            out.append(max(gpu_t, cpu_t) - now)
        return out


@dataclass
class BestSplit(Assignment):
    """The split with the shortest estimated layer time among a family of candidates (the oracle's choice).

    Candidates: prefixes of the experts ordered by how much the GPU saves over
    the CPU for them (cached ones first), which include all on the CPU and all on
    the GPU; and resident-on-GPU, rest-on-CPU.
    """

    name = "best"
    _copy_engines: int = 1
    #: (gpu_expert(n), cpu_expert(n)) by tokens n, for this run's cost model
    _per_tokens: dict[int, tuple[float, float]] = field(default_factory=dict)
    #: by tokens n: the CPU time of m experts of n tokens each, for m = 0..16
    _cpu_sums: dict[int, list[float]] = field(default_factory=dict)
    #: by tokens n: the layer's shared experts on the GPU (kernels only)
    _shared: dict[int, float] = field(default_factory=dict)

    def configure(self, ctx: RunContext) -> None:
        self._copy_engines = ctx.costs.profile.pcie.copy_engines
        self._per_tokens = {}
        self._cpu_sums = {}
        self._shared = {}

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        counts = view.counts
        n = len(counts)
        if 0 < n <= 16 and counts.count(counts[0]) == n:  # every decode layer
            return self._split_alike(view, counts[0])
        return self._split_any(view)

    def _split_any(self, view: LayerView) -> tuple[list[int], list[int]]:
        """The search over every candidate, with per-expert tables (any layer)."""
        table = SplitCosts.of(view, self._copy_engines, self._per_tokens)
        active = list(view.active)

        def gpu_cost(e: int) -> float:
            ready = table.ready[e]
            wait = table.load if ready is None else max(ready - table.now, 0.0)
            return wait + table.gpu[e]

        order = sorted(active, key=lambda e: (gpu_cost(e) - table.cpu[e], e))
        present = [e for e in active if table.ready[e] is not None]
        candidates = [(present, [e for e in active if e not in present])]
        lengths = self._prefix_lengths(table, order)
        candidates += [(order[:i], order[i:]) for i in lengths]
        estimates = [table.estimate(*candidates[0])] + table.prefix_estimates(order, lengths)
        best = candidates[estimates.index(min(estimates))]  # the first of the shortest, as min() over them
        return list(best[0]), list(best[1])

    def _split_alike(self, view: LayerView, tokens: int) -> tuple[list[int], list[int]]:
        """:meth:`_split_any` when every expert has ``tokens`` tokens (at most 16 experts): the same
        candidates, estimates computed by the same operations in the same order (so the same numbers and
        the same choice), with one GPU and one CPU time for all instead of per-expert tables.

        Past the valley: the prefixes stop at the first whose GPU finish reaches its CPU finish (and, for
        the resident split's numbers, not before prefix ``r``). A longer prefix's GPU chain holds the same
        experts and more, each adding ``g`` >= 0 once its weights are there, so its finish, rounded at
        every step as this one's, is no earlier; its estimate (the later of the two finishes) is then no
        smaller, and the first of the shortest is among the prefixes already estimated.
        """
        costs = view.costs
        pair = self._per_tokens.get(tokens)
        if pair is None:
            pair = self._per_tokens[tokens] = (costs.gpu_expert(tokens), costs.cpu_expert(tokens))
        g, c = pair[0] + view.expert_launch_s, pair[1]
        sums = self._cpu_sums.get(tokens)
        if sums is None:  # CPU time of m such experts, summed as SplitCosts.estimate sums it
            sums = self._cpu_sums[tokens] = [sum([c] * m) for m in range(17)]
        now, load = view.now, costs.expert_load
        shared = self._shared.get(view.tokens)
        if shared is None:
            shared = self._shared[view.tokens] = costs.gpu_shared(view.tokens)
        shared = shared + view.shared_launch_s if costs.model.shared_intermediate_size else 0.0
        base, cpu_at = now + shared, now + costs.sync_s
        resident, arrivals, active = view.cache.resident[view.layer], view.arrivals, view.active
        n = len(active)
        engines = [now] * self._copy_engines
        if not arrivals and (load + g) - c > g - c and now + load > now:
            # nothing arriving: the resident experts (in id order) then the missing ones (loaded in id order,
            # each arriving after the last), so each prefix's GPU chain is the shorter prefix's plus one expert
            present = [e for e in active if e in resident]
            missing = sorted(e for e in active if e not in resident)
            r = len(present)
            order = sorted(present) + missing
            estimates = []
            gpu_t = base
            for i in range(n + 1):
                if i:
                    at = now
                    if i > r:
                        engines[0] += load
                        at = engines[0]
                        if len(engines) > 1:
                            engines.sort()
                    gpu_t = (gpu_t if gpu_t > at else at) + g
                cpu_t = cpu_at + sums[n - i] if i < n else now
                if gpu_t >= cpu_t:
                    estimates.append(gpu_t - now)
                    if i >= r:  # past the valley: longer prefixes' estimates only grow
                        break
                else:
                    estimates.append(cpu_t - now)
            estimates.insert(0, estimates[r])  # resident on the GPU, the rest on the CPU: prefix r's numbers
            best = estimates.index(min(estimates))
            if best == 0:
                return present, [e for e in active if e not in resident]
            return order[:best - 1], order[best - 1:]
        if len(engines) == 1:  # SplitCosts.of's walk over the arrivals ends at the latest
            engines[0] = max(now, max(arrivals.values(), default=now))
        else:
            for at in sorted(arrivals.values()):
                engines[0] = max(engines[0], at)
                engines.sort()
        ready: dict[int, float | None] = {}
        keyed = []
        for e in active:
            at = now if e in resident else arrivals.get(e)
            ready[e] = at
            keyed.append((((load if at is None else max(at - now, 0.0)) + g) - c, e))
        keyed.sort()
        order = [e for _, e in keyed]
        present = [e for e in active if ready[e] is not None]
        gpu_t = base
        for at, e in sorted((ready[e], e) for e in present):  # type: ignore[type-var]
            gpu_t = (gpu_t if gpu_t > at else at) + g
        estimates = [max(gpu_t, cpu_at + sums[n - len(present)] if len(present) < n else now) - now]
        # SplitCosts.prefix_estimates over every length, with the one GPU time
        queue: list[tuple[float, int]] = []
        chain: list[float] = []
        for i in range(n + 1):
            first = len(queue)
            if i:
                e = order[i - 1]
                at = ready[e]  # type: ignore[assignment]
                if at is None:
                    engines[0] += load
                    at = engines[0]
                    if len(engines) > 1:
                        engines.sort()
                item = (at, e)
                first = bisect(queue, item)
                queue.insert(first, item)
            del chain[first:]
            gpu_t = chain[-1] if chain else base
            for at, _ in queue[first:]:
                gpu_t = (gpu_t if gpu_t > at else at) + g
                chain.append(gpu_t)
            cpu_t = cpu_at + sums[n - i] if i < n else now
            if gpu_t >= cpu_t:
                estimates.append(gpu_t - now)
                break  # past the valley
            estimates.append(cpu_t - now)
        best = estimates.index(min(estimates))
        if best == 0:
            return present, [e for e in active if ready[e] is None]
        return order[:best - 1], order[best - 1:]

    @staticmethod
    def _prefix_lengths(table: SplitCosts, order: list[int]) -> list[int]:
        """Prefix lengths worth evaluating: all of them for a few experts, else a ternary search.

        The estimate falls and then rises as experts move from the CPU to the GPU
        (CPU time shrinks, GPU time grows), so a ternary search finds its valley in
        O(log n) evaluations; both ends are always kept.
        """
        n = len(order)
        if n <= 16:
            return list(range(n + 1))
        cost = lambda i: table.estimate(order[:i], order[i:])  # noqa: E731
        lo, hi = 0, n
        while hi - lo > 3:
            a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
            if cost(a) <= cost(b):
                hi = b
            else:
                lo = a
        return sorted({0, n, *range(lo, hi + 1)})
