"""Every key of the metrics, and of `moesim replay --json`, is documented with a unit and a meaning."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from moesim.analysis.metrics import METRIC_DOCS, metrics
from moesim.cli import main
from moesim.sim.run import simulate
from tests.factories import profile_dict, random_routing, tiny_model, tiny_profile, write_tiny_trace


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    model = tiny_model(layers=2, experts=6, top_k=2)
    routing = random_routing(np.random.default_rng(3), model, requests=1, prompt=4, decode=4)
    return str(write_tiny_trace(tmp_path_factory.mktemp("t") / "t.parquet", model, routing))


@pytest.mark.parametrize("system", ["gpu-only-lru", "smoe", "oracle"])
def test_every_metric_key_is_documented(trace, system):
    keys = set(metrics(simulate(trace, tiny_profile(), system, {"cache.slots_per_layer": "2"})))
    assert keys - set(METRIC_DOCS) == set()


def test_every_key_of_the_replay_json_is_documented(trace, tmp_path, capsys):
    hw = tmp_path / "hw.yaml"
    hw.write_text(yaml.safe_dump(profile_dict(pcie_gbps=1.0)))
    out = tmp_path / "m.json"
    assert main(["replay", trace, "--hw", str(hw), "--system", "all", "--json", str(out)]) == 0
    by_system = json.loads(out.read_text())
    keys = set().union(*by_system.values())
    assert "skipped" in keys and "lower_bound" in keys  # importance lacks scores: skipped
    assert keys - set(METRIC_DOCS) == set()


def test_help_metrics_lists_every_key_with_its_unit(capsys):
    assert main(["replay", "--help-metrics"]) == 0
    out = capsys.readouterr().out
    for key, doc in METRIC_DOCS.items():
        assert key in out and doc.meaning.split()[0] in out
    assert all(doc.meaning for doc in METRIC_DOCS.values())


def test_prefetch_metrics_say_what_a_prefetch_used_on_the_cpu_counts_as(tmp_path):
    """A prefetch routed while still copying and computed on the CPU (resident-only assignment) counts as used
    by prefetch_precision and not as late: the docs said "used" and "still copying when needed", which read as
    the opposite of both (a policy of one's own that sends in-flight experts to the CPU showed 55% precision
    with next to no late prefetches, while most copies landed after their use)."""
    model = tiny_model(layers=2, experts=4, top_k=1)
    trace = write_tiny_trace(tmp_path / "t.parquet", model, [{"phase": "decode", "tokens": {0: (0, [[[0]], [[1]]])}}])
    # 1 slot a layer; at layer 0 the perfect prefetch copies layer 1's expert 1 (491 ms at 100 kB/s), far too late
    on_cpu = metrics(simulate(str(trace), tiny_profile(), "gpu-only-lru",
                              {"cache.slots_per_layer": "1", "assign": "resident", "prefetch": "perfect"}))
    assert (on_cpu["prefetches"], on_cpu["late_prefetches"], on_cpu["prefetch_precision"]) == (1, 0, 1.0)
    assert on_cpu["gpu_share_of_activations"] == 0.5  # expert 1 ran on the CPU
    waited = metrics(simulate(str(trace), tiny_profile(), "gpu-only-lru",
                              {"cache.slots_per_layer": "1", "prefetch": "perfect"}))
    assert (waited["late_prefetches"], waited["prefetch_precision"]) == (1, 1.0)  # the GPU waited for the copy
    assert "computed on the CPU while its prefetch copies is not counted" in METRIC_DOCS["late_prefetches"].meaning
    assert "wherever they ran and whether or not their copy had landed" in METRIC_DOCS["prefetch_precision"].meaning


def test_prefetch_precision_counts_the_copies_that_ran(tmp_path, own_systems):
    """Two prefetches of layer 1 issued at layer 0 on a slow link (evicting two of its resident experts): (1, 4)
    starts, (1, 5) waits behind it. Layer 1 routes expert 5 (used while its copy waited; computed on the CPU) and
    cancels the queued copies, so (1, 5) is dropped. Of the copies that ran, only (1, 4)'s, none was used:
    precision 0. It read used / prefetches (0.5), counting a copy that never ran; dividing by the copies that ran
    alone would give 1 / 1."""
    from moesim.policy.systems import ComposedSystem, SystemSpec, register_system

    class TwoThenCancel(ComposedSystem):
        def plan(self, view):
            plan = super().plan(view)
            if view.layer == 0:
                plan.evictions = [(1, e) for e in sorted(view.cache.resident[1])[:2]]
                plan.prefetches = [(1, 4), (1, 5)]
            else:
                plan.cancel_queued_prefetches = True
            return plan

    register_system("two-then-cancel", SystemSpec("prefetch two, cancel the waiting one", cache="lru",
                                                  assign="resident", system_class=TwoThenCancel))
    model = tiny_model(layers=2, experts=8, top_k=1)
    trace = write_tiny_trace(tmp_path / "t.parquet", model, [{"phase": "decode", "tokens": {0: (0, [[[0]], [[5]]])}}])
    result = simulate(str(trace), tiny_profile(), "two-then-cancel", {"cache.slots_per_layer": "2"})
    counted = metrics(result)
    c = result.counters
    assert (c.prefetches, c.prefetch_used, c.cancelled_prefetches, c.cancelled_used) == (2, 1, 1, 1)
    assert counted["prefetch_precision"] == 0.0
    assert "over the prefetches not cancelled" in METRIC_DOCS["prefetch_precision"].meaning
