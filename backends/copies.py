"""Weight copies of a real run (the real backend, :mod:`backends.torch_backend`): demand loads, staging
copies and prefetches on the copy engine, their cancellation, their retirement into the cache state, and the
arrival estimates a plan sees."""

from __future__ import annotations

from backends.devices import Transfer, Work
from moesim.policy.base import LayerPlan


class WeightCopies:
    """The transfer part of :class:`backends.torch_backend.RealExecutor`."""

    def _arrivals(self, layer: int, in_flight: set[int], now: float) -> dict[int, float]:
        """Estimated arrival of this layer's in-flight experts: the queue ahead of each, at the profile's load time."""
        load = self.costs.expert_load
        t = now + (load if self.pcie.running is not None else 0.0)
        out = {}
        for transfer in self.pcie.queued():
            t += self.costs.d2h(self.costs.expert_bytes) if transfer.kind == "writeback" else load
            if transfer.layer == layer and transfer.expert in in_flight and transfer.kind != "stage":
                out[transfer.expert] = t
        for e in in_flight:
            out.setdefault(e, now + load)
        return out

    def _load(self, layer: int, expert: int, kind: str, step: int, not_before: Work | None = None) -> Transfer:
        self.cache.start_load(layer, expert)
        slot, previous_user = self.weights.take(layer, expert)
        transfer = self.pcie.submit(slot, self.weights.host[layer, expert], priority=1 if kind == "prefetch" else 0,
                                    kind=kind, layer=layer, expert=expert, step=step, after=previous_user,
                                    not_before=not_before)
        self.in_flight[(layer, expert)] = transfer
        self.transfers.append(transfer)
        return transfer

    def _loads(self, layer: int, experts: list[int], writebacks: list[tuple[int, int]], step: int) -> None:
        """A plan's demand loads, each followed on the copy engine by its write-back (``LayerPlan.writebacks``,
        mixtral-offloading's swap), the i-th after the i-th load, the others after the loads, as the
        simulator queues them. A write-back is a device-to-host copy of an expert's bytes into a host scratch
        buffer: the evicted expert's weights are the host copy's already (and its slot may be the load's), so
        what it copies is the slot the load filled, after that load; with no load, any slot."""
        for e, evicted in zip(experts, writebacks):
            load = self._load(layer, e, "load", step)
            self._writeback(evicted, step, load.dst, load)
        for e in experts[len(writebacks):]:
            self._load(layer, e, "load", step)
        for evicted in writebacks[len(experts):]:
            self._writeback(evicted, step, self.weights.pool[0], None)

    def _writeback(self, evicted: tuple[int, int], step: int, source, behind: Transfer | None) -> None:
        if behind is not None:  # on the engine right after its load, nothing between them
            transfer = self.pcie.submit_tail(self.weights.writeback_buffer(), source, behind, kind="writeback",
                                             layer=evicted[0], expert=evicted[1], step=step)
        else:
            transfer = self.pcie.submit(self.weights.writeback_buffer(), source, priority=0, kind="writeback",
                                        layer=evicted[0], expert=evicted[1], step=step)
        self.transfers.append(transfer)

    def _stage(self, layer: int, expert: int, index: int, step: int) -> Transfer:
        buffer = index % self.staging_slots
        transfer = self.pcie.submit(self.weights.staging[buffer], self.weights.host[layer, expert], priority=0,
                                    kind="stage", layer=layer, expert=expert, step=step,
                                    after=self.weights.staging_use.get(buffer))
        self.transfers.append(transfer)
        return transfer

    def _retire(self) -> None:
        """Make completed loads resident, as the simulator does when it reaches a plan.

        The simulator plans a layer when its attention ends, and so does the host (it waits for that attention
        first). A copy that earlier launched compute waits for has landed by then, so it counts as complete
        (``awaited``) whatever its own flag says: a layer must not see the previous layers' demand loads in
        flight, or a model-wide pool (moe-infinity) could not evict them."""
        for key, transfer in list(self.in_flight.items()):
            if transfer.awaited or transfer.done():
                self.cache.finish_load(*key)
                del self.in_flight[key]

    def _prefetch(self, plan: LayerPlan, s: int, layer: int, not_before: Work | None = None) -> None:
        for lay, e in plan.prefetches:
            self._load(lay, e, "prefetch", s, not_before)
            self.prefetched[lay].add(e)
            self.decisions.append((s, layer, e, "prefetch", lay))

    def _cancel_prefetches(self, keep: frozenset, step: int, layer: int) -> None:
        """Drop prefetches still queued (but those in ``keep``); their slots free up again (004 Sec. 5.2), and
        the decision log says so (``cancel``) at ``step`` and ``layer``, the plan that dropped them."""
        for transfer in self.pcie.cancel("prefetch", keep):
            key = (transfer.layer, transfer.expert)
            self.decisions.append((step, layer, transfer.expert, "cancel", transfer.layer))
            self.in_flight.pop(key, None)
            self.cache.in_flight[transfer.layer].discard(transfer.expert)
            self.weights.drop(*key)
            self.prefetched[transfer.layer].discard(transfer.expert)
            self._forget(transfer)
            self.counters.cancelled_prefetches += 1

    def _forget(self, transfer: Transfer) -> None:
        """Take ``transfer`` out of the run's copies. A queued prefetch is among the last submitted, so the
        search runs from the end: list.remove searched a long run's copies from its first, per cancel."""
        transfers = self.transfers
        for i in range(len(transfers) - 1, -1, -1):
            if transfers[i] is transfer:
                del transfers[i]
                return
