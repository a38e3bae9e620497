"""moesim: compare MoE expert-offloading policies on one GPU plus a CPU.

Traces of real router decisions are replayed through a discrete-event model
of CPU cores, GPU streams, PCIe and GPU memory (``moesim.sim``), or executed
on real kernels (``backends``), under policies from ``moesim.policy``.
"""

__version__ = "0.1.0"
