"""moesim: compare MoE expert-offloading policies on one GPU plus a CPU.

Traces of real router decisions are replayed through a discrete-event model
of CPU cores, GPU streams, PCIe and GPU memory (``moesim.sim``), or executed
on real kernels (``backends``), under policies from ``moesim.policy``.

From Python or Jupyter: ``moesim.replay(trace, hw=..., system=..., **params)``
``moesim.sweep(spec)`` and ``moesim.systems(name)`` (see :mod:`moesim.api`). ``moesim.sweep`` is that
function; the sweep machinery is imported with ``from moesim.sweep import ...``.
"""

__version__ = "0.1.0"

# moesim.api imports the moesim.sweep module first, so the function bound here keeps the name
from moesim.api import bundled_trace, load_replay, replay, slice_trace, sweep  # noqa: E402
from moesim.api import serve, systems  # noqa: E402

__all__ = ["bundled_trace", "load_replay", "replay", "serve", "slice_trace", "sweep", "systems", "__version__"]
