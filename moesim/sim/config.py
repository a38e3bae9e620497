"""The engine's parameters (``--set engine.<name>=value``), kept apart from the engine that reads them:
the settings parser (moesim.sim.run) and the parameter listing (moesim.analysis.params) use the fields alone."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SimConfig:
    """Engine parameters, reachable as ``--set engine.<name>=value``."""

    #: kernel launches per GPU expert (gate/up GEMM, activation, down GEMM)
    kernels_per_expert: int = 3
    #: kernel launches for the shared experts of a layer
    kernels_per_shared: int = 3
    #: staging buffers for streamed experts (ping-pong: 2, 000 Alg. 1)
    staging_slots: int = 2
    #: issue copies in chunks of this many bytes, so that demand loads overtake a running prefetch at a
    #: chunk boundary (each chunk pays pcie.latency_us); 0: whole-expert copies, never preempted
    copy_chunk_bytes: int = 0
    #: record every span of GPU, CPU and copy-engine work (timeline plots, Chrome traces); costs time and memory
    timeline: bool = False
    #: log every placement, load, prefetch and eviction the plans decide (the decision log)
    decisions: bool = False
    #: check every system's plans against the invariants as they run (each routed expert computed once unless
    #: substituted or deferred, GPU experts resident or on their way, loads within the slots); policies of
    #: one's own are always checked
    check: bool = False
    #: a portfolio bound (oracle) stops a member once it provably cannot be best on any metric
    #: (moesim.sim.portfolio); false runs every member to the end, for every member's full metrics
    prune: bool = True
