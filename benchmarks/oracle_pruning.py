"""How far the oracle's branch and bound runs each member, and why: its floors against its real steps.

The oracle (moesim.sim.portfolio) stops a member once its lower bound on every
metric exceeds the best member's value. The bound is the member's real steps so
far plus floors for the rest (moesim.sim.floors), so a member whose floors are
far below its real step times runs far before it can be stopped, however bad it
is. For each member this prints where the pruned run stopped it and the wall
time it took there, then, from a run of every member to the end
(``engine.prune=false``), its mean decode step against the mean of its floors
(the TPOT floor with the window terms): the share the floors cover says how
much of the oracle's time a tighter floor could save.

    .venv/bin/python benchmarks/oracle_pruning.py                  # DeepSeek-V3 int4, 64 + 2,000 tokens
    .venv/bin/python benchmarks/oracle_pruning.py --trace T.parquet --hw a100-40g
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from replay_speed import SETTINGS, synth

from moesim.errors import ConfigError
from moesim.sim.portfolio import racing_members
from moesim.sim.run import prepare_members, run_members
from moesim.sim.shape import TraceShape
from moesim.trace.io import keeping_decoded


def pruned_run(trace: str, hw: str, settings: dict[str, str]) -> tuple[float, dict]:
    """The oracle as it runs by default: its wall time and, per member, (steps run, wall seconds, TPOT ms)."""
    with keeping_decoded():
        sims, reused, skipped = prepare_members(trace, hw, "oracle", settings)
        start = time.perf_counter()
        result = run_members(trace, "oracle", sims, reused, skipped, settings=settings)
        wall = time.perf_counter() - start
    steps = len(result.steps)
    rows = {name: (p.step, p.wall_s, None) for name, p in result.pruned.items()}
    for name, values in result.members.items():
        if name not in result.pruned:
            rows[name] = (steps, None, values["tpot_ms_mean"])
    return wall, rows


def floors_against_steps(trace: str, hw: str, settings: dict[str, str]
                         ) -> tuple[dict[str, tuple[float, float, float]], dict[str, str]]:
    """Per member run to the end: (wall seconds, mean TPOT ms, TPOT floor ms from step 0); and the members
    that cannot run on the trace, with the reason."""
    out = {}
    with keeping_decoded():
        sims, _, skipped = prepare_members(trace, hw, "oracle", {**settings, "engine.prune": "false"})
        shape = TraceShape.of(trace, next(iter(sims.values())).model.num_experts)
        entries = float(shape.decode_weight.sum())
        for member in racing_members(sims, shape, (), skipped):
            start = time.perf_counter()
            try:
                member.advance(len(shape.rows), lambda: False)
            except ConfigError as err:  # left out, as the oracle leaves it out (a column the trace lacks)
                skipped[member.name] = str(err)
                member.sim.stop_reading()
                continue
            wall = time.perf_counter() - start + member.wall_s
            tpot = member.decode_sum / entries * 1e3
            out[member.name] = (wall, tpot, float(member.left_tpot[0]) / entries * 1e3)
    return out, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default="", help="trace (default: DeepSeek-V3, 64-token prompt + 2,000 decode)")
    parser.add_argument("--hw", default="rtx4090")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace
        settings = dict(SETTINGS) if not trace else {}
        if not trace:
            trace = str(Path(tmp) / "decode.parquet")
            synth(Path(trace), 64, 2000)
        wall, pruned = pruned_run(trace, args.hw, settings)
        full, skipped = floors_against_steps(trace, args.hw, settings)
    total_full = sum(w for w, _, _ in full.values())
    print(f"oracle on {args.trace or 'DeepSeek-V3 int4, 64 + 2,000 tokens'} ({args.hw}): {wall:.2f} s with "
          f"branch and bound, {total_full:.2f} s running every member to the end")
    print(f"  {'member':<18} {'stopped after':>14} {'wall s':>7} {'TPOT ms':>9} {'floor ms':>9} {'floor/TPOT':>10}")
    for name, (wall_s, tpot, floor) in sorted(full.items(), key=lambda kv: -pruned[kv[0]][0]):
        step, pruned_wall, _ = pruned[name]
        steps_text = f"{step} steps"
        shown_wall = pruned_wall if pruned_wall is not None else wall_s
        print(f"  {name:<18} {steps_text:>14} {shown_wall:7.2f} {tpot:9.2f} {floor:9.2f} {floor / tpot:10.2f}")
    for name, reason in sorted(skipped.items()):
        print(f"  {name:<18} left out: {reason}")


if __name__ == "__main__":
    main()
