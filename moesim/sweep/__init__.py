"""Sweeps: many replays over traces, hardware profiles, systems and any ``--set`` parameter.

A sweep spec (YAML file or dict)::

    traces: [traces/mixtral-8x7b-humaneval.parquet]   # or `trace:`; relative to the spec file's folder
    hw: [a100-40g, h100-pcie]                         # profile names or YAML paths
    systems: [gpu-only-lru, static-hot]               # or `system:`; `all` = every listed system
    seeds: [0]                                        # or `seed:` (default 0)
    model: mixtral-8x7b                               # optional: check traces against this preset
    import: [my_policies.py]                          # optional: modules registering systems of one's own
    set: {engine.staging_slots: 2}                    # fixed for every point
    grid:                                             # cartesian product
      cache.slots_per_layer: [1, 2, 3]
    zip:                                              # varied together (equal-length lists), crossed with the rest
      - {hw.pcie.bandwidth_scale: [0.5, 1.0], engine.kernels_per_expert: [3, 1]}
    per_system:                                       # parameters only some systems take
      smoe: {grid: {prefetch.n: [1, 2]}}              # crossed with the rest, for smoe's points only
      my-system: {set: {cache.alpha: 0.9}}

``per_system`` lets systems of one's own and the catalogue's share a sweep
although their parameters differ: a key under ``set`` or ``grid`` applies to
every system, and one that a system does not take stops the sweep before it
runs; a key under ``per_system.NAME`` applies to that system's points only (the
other systems' rows show the value they ran with where they take the parameter,
and are empty where they do not: see below).

Keys may use ``__`` for ``.`` (``cache__slots_per_layer``). Every point is a
(trace, hw, system, seed, settings) combination; its id is a hash of those
parameters as written in the spec (the spec file's location and the current
folder do not enter it, nor do the files' contents: see ``input_fingerprint``).
A trace or profile file written two ways in one spec (``t.parquet`` and
``./t.parquet``, its absolute path, a symlink to it; ``rtx4090`` and its
bundled file's path) is one file: its points run once, under its first spelling.

Results are tidy: one row per point with every parameter and metric as a
column (``breakdown_ms`` becomes ``breakdown_<category>_ms``, notes are joined
by "; ", the point's physical lower bound becomes ``lower_bound_<key>`` beside
``gap_to_lower_bound``, NaN for a serving point), plus ``point_id``, ``status`` (``ok`` or ``error``), ``error``,
``defaults_filled``,
``point_wall_s``, ``finished_at``, ``worker``, ``trace_path``/``hw_path``
(the files as resolved when the point ran) and ``input_fingerprint`` (the
profile file's content hash and the trace file's size and modification time,
hashed, when the sweep started; files a setting names, such as
``cache.calibration=PATH``, do not enter it).

A parameter column holds, in the row of a point that does not set it, the
value that point ran with (:mod:`moesim.sweep.defaults`): its system's default
(``prefetch.n`` of a prefetch whose ``n`` defaults to 2 reads 2, as in the row of
a point that spells ``prefetch.n: 2``), the profile's value for ``hw.*``, the
experts its memory plan held for ``cache.slots``; a "-1: the paper's value for
the model" default, left or spelled out in the spec, reads the value it resolved
to for the point (-1 where the component keeps no single value, such as
BuddyMoE's per-layer ``substitute.tau``). The cell stays empty where the parameter does not apply to the
point's system (its components have no such parameter; ``workload.*`` in a
replayed point's row), and for ``cache.slots_per_layer`` (see ``slot_spread``).
``defaults_filled`` names the row's cells so filled ("; " between keys, "" when
none): the others hold what the spec set. A point's id stays a hash of what the
spec sets. Rows already in ``OUT`` (a file of an older moesim, or another spec's
points) are filled on a resume too, where they ran with the trace, profile and
code of one's own of now (their input fingerprint is today's); others keep their
empty cells, and ``defaults_filled`` is empty (null) in rows never filled.

Storage, robust to ``kill -9``: each finished point is written as its own
Parquet file ``OUT.parts/<point_id>.parquet`` (temporary file, fsync, rename),
so a point is either complete on disk or absent. The combined file ``OUT`` is
rewritten atomically from time to time and at the end; once it holds every
row the parts folder is removed. A rerun reads ``OUT`` and any parts, skips the
points whose status is ``ok`` and whose input fingerprint is unchanged, and
runs the rest: failed points, and points whose trace or profile file changed
since, or whose code of one's own did (``point.with_own_code``: the files and
the loaded bytecode of a system or component not the catalogue's, and the
module-level constants its methods read, hashed)
(rows of results written before fingerprints were recorded count as changed:
the rerun cannot tell, so it runs them again rather than keep results that may
be stale). A refused output (not a sweep result) is left as
it was, with no parts folder. Rows of points outside the current spec are kept, so extending a grid only
runs the new points; start a fresh file to drop old ones. A lock file in the
parts folder stops two sweeps from writing the same output at once.

Engines: ``local`` runs points in a process pool (``workers`` processes,
default all cores; one worker runs them in this process, which also sees
systems registered at run time). Its workers ignore SIGINT: on Ctrl-C the
sweep process cancels the points not started, terminates the workers and
keeps what finished. A worker that dies (``kill -9``, the OOM killer) breaks
the pool: the pool is rebuilt for the points not finished, and the point that
worker was running is retried once, then recorded as failed naming the dead
workers (the other workers' points, stopped by the breaking pool, simply run
again). ``ray`` runs them as Ray tasks on a local Ray
instance or an existing cluster (``address``); Ray too runs a point whose
worker died once more, and the summary counts those points. With Ray, each trace file
is put in the object store once and copied to local disk once per machine (and
validated once per worker process); each profile is parsed once by the driver
and shared through the object store as the parsed object. On one machine the
local pool is the better choice: Ray adds worker start-up and scheduling. On a cluster, every node needs moesim (and
any catalog module the systems come from) installed; other files a setting
names (``cache.calibration=PATH``) must exist at that path on the nodes.

Note: ``moesim.sweep`` is the function :func:`moesim.api.sweep`; import this
module's names with ``from moesim.sweep import ...``.
"""

from __future__ import annotations

from moesim.sweep.spec import (DEFAULT_HW, SPEC_KEYS, Point, SweepSpec, check_spec, full_key_guess, load_spec,
                               normalize_key, parse_spec, setting_str)
from moesim.sweep.point import (WORKER_DIED, cached_profile, describe_error, error_row, flatten_metrics,
                               input_fingerprint, run_point)
from moesim.sweep.store import FLUSH_EVERY_S, PARTS_SUFFIX, SWEEP_METADATA, ResultStore
from moesim.sweep.engines import (ENGINES, INPUT_COLUMNS, LOCATION_COLUMNS, RETRIES_AFTER_WORKER_DEATH,
                                  WALL_CLOCK_COLUMNS, ProgressBar, SweepSummary, default_workers, die_with_parent,
                                  run_sweep)
from moesim.sweep.ray_engine import ShippedFile, local_copy, require_ray

__all__ = ["DEFAULT_HW", "ENGINES", "FLUSH_EVERY_S", "INPUT_COLUMNS", "LOCATION_COLUMNS", "PARTS_SUFFIX",
           "RETRIES_AFTER_WORKER_DEATH", "SPEC_KEYS", "SWEEP_METADATA", "WALL_CLOCK_COLUMNS", "WORKER_DIED", "Point",
           "ProgressBar", "ResultStore", "ShippedFile", "SweepSpec", "SweepSummary", "cached_profile", "check_spec",
           "default_workers", "describe_error", "die_with_parent", "error_row", "flatten_metrics",
           "full_key_guess", "input_fingerprint", "load_spec", "local_copy", "normalize_key", "parse_spec",
           "require_ray", "run_point", "run_sweep", "setting_str"]
