"""A sweep's rows hold, for every parameter column, the value each point ran with: a point that leaves a parameter
at its default shows that default, not an empty cell, where the parameter applies to its system
(moesim/sweep/defaults.py)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from moesim.sweep import load_spec, run_sweep
from tests.factories import write_spec
from tests.policy.test_imports import forget  # noqa: F401 (a fixture)

#: a next-layer prefetch of one's own with a parameter ``n`` (default {default}), and two systems built on it
POLICY = textwrap.dedent('''
    from dataclasses import dataclass

    from moesim.policy.prefetch import Prefetch
    from moesim.policy.systems import SystemSpec, register_component, register_system


    @register_component
    @dataclass
    class NextFew_{stem}(Prefetch):
        name = "next-few-{stem}"
        phases = ("decode",)
        #: experts prefetched into the next layer per step (this layer's, lowest first)
        n: int = {default}

        def candidates(self, view):
            target = view.layer + 1
            if target >= view.num_layers:
                return []
            cached = view.cache.resident[target] | set(view.cache.in_flight[target])
            used = sorted({{int(e) for e in view.experts.ravel()}})  # this layer's experts, as a guess
            return [(target, e) for e in used if e not in cached][: self.n]


    for name in ("{stem}-a", "{stem}-b"):
        register_system(name, SystemSpec("LRU with a next-layer prefetch of n experts", cache="lru", assign="gpu",
                                         prefetch="next-few-{stem}"))
''')


def _policy(folder: Path, stem: str, default: int) -> str:
    (folder / f"{stem}.py").write_text(POLICY.format(stem=stem, default=default))
    return f"{stem}.py"


def _by_system(frame: pd.DataFrame, system: str) -> pd.DataFrame:
    return frame[frame["system"] == system]


def test_a_point_that_leaves_a_parameter_at_its_default_shows_the_value_it_ran_with(files, forget):
    """Issue: rows of points that left prefetch.n at its default had an empty prefetch.n cell, so nothing said
    which n produced them and `moesim plot` told them apart from (or averaged them with) the rows that set the
    same n. Now each holds the value its system ran with, and defaults_filled names the cells so filled; a
    system without the parameter keeps an empty cell."""
    module = _policy(files, "pn", default=2)
    spec = load_spec(write_spec(
        files, systems=["pn-a", "pn-b", "smoe", "gpu-only-lru"], **{"import": [module]},
        per_system={"pn-a": {"grid": {"prefetch.n": [1, 2]},
                             "set": {"hw.pcie.bandwidth_scale": 0.5, "engine.staging_slots": 3, "cache": "belady"}},
                    "gpu-only-lru": {"set": {"cache.slots": 6}}}))
    out = files / "r.parquet"
    frame, summary = run_sweep(spec, out, workers=1)
    assert summary.failed == 0 and len(frame) == 5
    stored = pd.read_parquet(out)
    for rows in (frame, stored):
        # the default of one's own (2, the same value as the point that spells it), a catalogue "-1: the paper's
        # count for the model" as it resolved (000 Table I has no count for the tiny model: DeepSeek-V3's 2), and
        # nothing for a system whose prefetch has no n
        assert _by_system(rows, "pn-a")["prefetch.n"].tolist() == [1, 2]
        assert _by_system(rows, "pn-b")["prefetch.n"].tolist() == [2]
        assert _by_system(rows, "smoe")["prefetch.n"].tolist() == [2]
        assert math.isnan(_by_system(rows, "gpu-only-lru")["prefetch.n"].item())
        others = rows[rows["system"] != "pn-a"]
        assert others["hw.pcie.bandwidth_scale"].tolist() == [1.0] * 3  # the profile omits it: its default
        assert others["engine.staging_slots"].tolist() == [2] * 3
        assert others["cache"].tolist() == ["lru", "smoe-lfu", "lru"]  # the component each ran
        # the experts each point's memory plan held; gpu-only-lru set its own
        assert rows["cache.slots"].tolist() == [*rows["expert_slots"][:4], 6]
        # in the order of the spec's columns (write_spec sorts its keys)
        assert rows["defaults_filled"].tolist() == [
            "cache.slots", "cache.slots",
            "cache.slots; cache; engine.staging_slots; hw.pcie.bandwidth_scale; prefetch.n",
            "cache.slots; cache; engine.staging_slots; hw.pcie.bandwidth_scale; prefetch.n",
            "cache; engine.staging_slots; hw.pcie.bandwidth_scale"]
    # one type per column in the file
    types = {f.name: str(f.type).replace("large_", "") for f in pq.read_schema(out)}
    assert (types["prefetch.n"], types["engine.staging_slots"], types["cache"], types["defaults_filled"]) == \
        ("double", "int64", "string", "string")
    # the ids are those of the settings as written: the same file resumes without running anything
    again, summary = run_sweep(spec, out, workers=1)
    assert summary.ran == 0
    pd.testing.assert_frame_equal(again, frame)


def test_a_resumed_older_file_and_another_specs_rows_are_filled_where_they_ran_with_todays_code(files, forget):
    """The trial: a sweep of lru-popnext at its default n, then the same output resumed with a per_system grid
    over prefetch.n. The first sweep's rows, outside the second spec, kept an empty prefetch.n, and a figure
    averaged them with n=1, 2, 4 as if they were another value. Now they show the n they ran with, as do the
    rows of a file written before this fix once it is resumed, where the rows' recorded inputs (trace, profile,
    code of one's own) are today's; rows that ran with other code stay as they are."""
    module = _policy(files, "tr", default=2)
    out = files / "r.parquet"
    first = write_spec(files, systems=["tr-b", "gpu-only-lru"], **{"import": [module]})
    before, _ = run_sweep(load_spec(first), out, workers=1)
    assert "prefetch.n" not in before  # no point of that spec sets it
    spec = load_spec(write_spec(files, systems=["tr-b", "gpu-only-lru"], **{"import": [module]},
                                per_system={"tr-b": {"grid": {"prefetch.n": [1, 2, 3]}}}))
    _, summary = run_sweep(spec, out, workers=1)
    assert (summary.ran, summary.others) == (3, 1)  # gpu-only-lru's point is in both
    stored = pd.read_parquet(out)
    default = stored[(stored["system"] == "tr-b") & (stored["defaults_filled"] == "prefetch.n")]
    assert default["prefetch.n"].tolist() == [2]  # the first spec's point, outside this one
    explicit = stored[(stored["system"] == "tr-b") & (stored["prefetch.n"] == 2) & (stored["defaults_filled"] == "")]
    assert default["tpot_ms_mean"].item() == explicit["tpot_ms_mean"].item()  # the same replay
    # grouped by n, the default row joins n=2 (it was a group of its own)
    assert stored[stored["system"] == "tr-b"].groupby("prefetch.n").size().to_dict() == {1: 1, 2: 2, 3: 1}

    # a file written before the fix: no defaults_filled, empty cells; resumed, it runs nothing and is filled
    table = pq.read_table(out)
    older = table.drop(["defaults_filled"]).to_pandas()
    older.loc[older["point_id"] == default["point_id"].item(), "prefetch.n"] = None
    older.to_parquet(out)
    _, summary = run_sweep(spec, out, workers=1)
    assert summary.ran == 0
    refilled = pd.read_parquet(out).set_index("point_id")
    assert refilled.loc[default["point_id"].item(), ["prefetch.n", "defaults_filled"]].tolist() == [2, "prefetch.n"]

    # the policy's default edited from 2 to 3: the first spec's row ran with 2, and is not filled with 3
    older.to_parquet(out)
    _policy(files, "tr", default=3)
    run_sweep(spec, out, workers=1)
    kept = pd.read_parquet(out).set_index("point_id").loc[default["point_id"].item()]
    assert pd.isna(kept["prefetch.n"]) and pd.isna(kept["defaults_filled"])


def test_what_a_filled_cell_holds_for_serving_portfolio_and_model_dependent_parameters(files):
    """Serving settings only in serving rows, and only those the arrival process reads; a system's own defaults; a
    portfolio bound's value where its schedules share one; memory.expert_dtype left empty is the dtype of the
    point's model; a profile field that is no single value (a mapping) has none."""
    from moesim.sweep.defaults import Defaults
    trace, hw = str(files / "t.parquet"), str(files / "hw.yaml")
    values = Defaults().values
    keys = ["workload.qps", "workload.requests", "workload.concurrency", "scheduler", "memory.expert_dtype",
            "hw.cpu.cores", "hw.gpu.peak_tflops", "substitute.tau"]
    closed = values("gpu-only-lru", {"workload.arrival": "closed"}, keys, row={}, trace_path=trace, hw_path=hw)
    assert closed == {"workload.requests": 100, "workload.concurrency": 1, "scheduler": "vllm",
                      "memory.expert_dtype": "bf16", "hw.cpu.cores": 8}
    replay = values("gpu-only-lru", {}, keys, row={}, trace_path=trace, hw_path=hw)
    assert replay == {"memory.expert_dtype": "bf16", "hw.cpu.cores": 8}
    assert values("buddymoe", {}, ["substitute.tau"], row={}, trace_path=trace, hw_path=hw) == \
        {"substitute.tau": -1.0}
    oracle = values("oracle", {}, ["engine.staging_slots", "cache", "assign"], row={}, trace_path=trace,
                    hw_path=hw)
    assert oracle == {"engine.staging_slots": 2}  # its schedules run belady, static-hot and belady caches


def test_a_default_the_run_resolves_is_recorded_as_what_it_resolved_to(files):
    """Issue: parameters whose default -1 means "the paper's value" or "derived" were recorded as -1 in the
    rows of points that left them, so a figure or table put those points at -1 on its axis. Worked case, the tiny
    model (top-2, 2 layers, 6 experts; 003 gives no sizes for it, so DALI takes its Mixtral ones, prefetch size 1
    and u_size 1): a DALI point with prefetch.size=2 ran with a prefetch buffer of twice that, 4 slots, beside a
    stored point that set cache.prefetch_slots=6; a point of the DALI system at its defaults, a buffer of 2."""
    out = files / "r.parquet"
    run_sweep(load_spec(write_spec(files, systems=["dali"], set={"cache.prefetch_slots": 6, "prefetch.size": 2})),
              out, workers=1)
    spec = load_spec(write_spec(files, systems=["dali", "smoe"], per_system={"dali": {"set": {"prefetch.size": 2}}}))
    frame, summary = run_sweep(spec, out, workers=1)
    assert (summary.ran, summary.failed, summary.others) == (2, 0, 1)
    for rows in (frame, pd.read_parquet(out)):
        dali = rows[(rows["system"] == "dali") & (rows["defaults_filled"] != "")]
        assert dali[["prefetch.size", "cache.prefetch_slots", "defaults_filled"]].values.tolist() == \
            [[2, 4, "cache.prefetch_slots"]]
        assert _by_system(rows, "smoe")[["prefetch.size", "cache.prefetch_slots"]].isna().all(axis=None)

    from moesim.sweep.defaults import Defaults
    trace, hw = str(files / "t.parquet"), str(files / "hw.yaml")
    values = Defaults().values
    keys = ["prefetch.size", "cache.u_size", "cache.prefetch_slots"]
    assert values("dali", {}, keys, row={}, trace_path=trace, hw_path=hw) == \
        {"prefetch.size": 1, "cache.u_size": 1, "cache.prefetch_slots": 2}
    # next-layer's "-1: the model's top_k"; ktrans-deferral's count keeps 2 of top-2 immediate: none deferred
    assert values("buddymoe", {}, ["prefetch.size"], row={}, trace_path=trace, hw_path=hw) == {"prefetch.size": 2}
    assert values("ktransformers-ed", {}, ["defer.deferred"], row={}, trace_path=trace, hw_path=hw) == \
        {"defer.deferred": 0}
    # no single value told: a per-layer threshold, a count the memory plan decides
    assert values("buddymoe", {}, ["substitute.tau"], row={}, trace_path=trace, hw_path=hw) == {"substitute.tau": -1.0}
    assert values("llamacpp", {}, ["cache.n_cpu_moe"], row={}, trace_path=trace, hw_path=hw) == {"cache.n_cpu_moe": -1}


def test_a_choose_for_me_value_spelled_out_is_recorded_as_what_it_resolved_to(files):
    """Issue: a point that wrote prefetch.n: -1 ("000 Table I's count for the model") kept -1 in its row, while a
    point that left the same default read the count it resolved to; a figure over prefetch.n put the two at
    different x although they ran alike. Now both read the resolved count (the tiny model takes DeepSeek-V3's 2;
    DALI's prefetch size takes Mixtral's 1), and defaults_filled names the cell; a -1 the component resolves to no
    single value (BuddyMoE's per-layer tau) stays -1, as written and not filled."""
    spec = load_spec(write_spec(files, systems=["smoe", "dali", "buddymoe"],
                                per_system={"smoe": {"grid": {"prefetch.n": [-1, 1]}},
                                            "dali": {"set": {"prefetch.size": -1}},
                                            "buddymoe": {"set": {"substitute.tau": -1}}}))
    out = files / "r.parquet"
    frame, summary = run_sweep(spec, out, workers=1)
    assert summary.failed == 0
    for rows in (frame, pd.read_parquet(out)):
        smoe = _by_system(rows, "smoe")
        assert smoe["prefetch.n"].tolist() == [2, 1]
        assert smoe["defaults_filled"].tolist() == ["prefetch.n", ""]
        dali = _by_system(rows, "dali")
        assert dali[["prefetch.size", "defaults_filled"]].values.tolist() == [[1, "prefetch.size"]]
        buddy = _by_system(rows, "buddymoe")
        assert buddy["substitute.tau"].tolist() == [-1]
        assert buddy["defaults_filled"].tolist() == ["prefetch.size"]  # its next-layer prefetch's, not tau
    again, summary = run_sweep(spec, out, workers=1)  # the same ids: nothing runs again
    assert summary.ran == 0
    pd.testing.assert_frame_equal(again, frame)


def test_a_stored_row_that_kept_a_spelled_out_minus_one_is_resolved_on_a_resume(files):
    """A row written before the fix holds the -1 its point spelled; :meth:`Defaults.fill`, which a resume runs
    over the stored rows, records what it resolved to."""
    from moesim.sweep.defaults import Defaults, to_fill
    trace, hw = str(files / "t.parquet"), str(files / "hw.yaml")
    row = {"system": "smoe", "status": "ok", "prefetch.n": -1.0, "defaults_filled": ""}
    assert to_fill(["prefetch.n"], {"prefetch.n": "-1"}, row) == ["prefetch.n"]
    assert Defaults().fill(row, {"prefetch.n": "-1"}, ["prefetch.n"], trace_path=trace, hw_path=hw) == ["prefetch.n"]
    assert (row["prefetch.n"], row["defaults_filled"]) == (2, "prefetch.n")
    assert to_fill(["prefetch.n"], {"prefetch.n": "-1"}, row) == []  # resolved: nothing left to fill
    assert to_fill(["prefetch.n"], {"prefetch.n": "3"}, {"prefetch.n": 3}) == []  # a value as set stays
