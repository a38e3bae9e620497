"""``moesim profile``: measure a hardware profile v1 on the machine at hand.

Every curve the cost model reads is measured for one or more model shapes:
expert FFN time vs tokens on the GPU (routed and, where it differs, shared
shape) and on the CPU pool, attention (with the gate) vs context at a few
token counts, host-to-device and device-to-host bandwidth vs transfer size
from pinned memory, the slowdown when both directions run at once,
kernel-launch and CPU-GPU hand-off overheads, plus the matmul and
memory-bandwidth ceilings the roofline fallback uses. The kernels timed are
the real backend's own (:mod:`backends.kernels`, :mod:`backends.devices`),
under the same thread set-up (:func:`backends.devices.host_threads`), so a
measured profile describes exactly what ``moesim validate --real`` executes.

The measurements themselves are in :mod:`backends.measurements`; this
module plans them, reports progress and lays out the profile document.
Measurement hygiene, so that profiles repeat: buffers are allocated once and
touched before timing (no page faults inside a sample), every point is
warmed up before it is timed and reported as the median of many samples,
and expert weights rotate over a pool larger than the last-level cache
(the real run reads each expert's weights from memory, not from cache).

Expert and attention curves are timed from the first launch to the end of
the last kernel, so kernel-launch time is inside them: replay with a measured
profile as ``moesim validate`` does, with ``engine.kernels_per_expert=0`` and
``engine.kernels_per_shared=0``, or launches count twice.

Before the profile is written, every curve is checked as the loader will check it
(:data:`moesim.hw.profile.TIME_FALL_LIMIT`): on a busy machine one point's median
can be many times its true time (44 ms at 1 token against 1.5 ms at 4, another
process having taken the CPUs), and the loader refuses a time that falls below
an earlier one by more than that factor. The points of such a fall, the high and
the low, are measured again while the curve's buffers are held, up to
:data:`REMEASURES` times with more samples each time (a fresh median replaces
the old; nothing is clipped or made up), each said in a note; a curve still
refused then ends the run with :class:`UnsteadyCurveError` and nothing written.
A point whose time grows more than :data:`TIME_RISE_LIMIT` times faster than its
work over an earlier point's (a busy machine's 200 ms at 128 tokens after 540 us
at 64) is measured again the same way; the loader would take it, so one still
that far out is kept as measured, with a note.

With ``device="cpu"`` the GPU stand-in is measured (a host thread, host
memory, plain memcpy between two host buffers for the "PCIe" curves); its
"GPU" expert curves are then the CPU pool's, the same kernels on the same
threads, measured once.
"""

from __future__ import annotations

import datetime as dt
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from backends.measurements import Measurements, Series, cpu_info, cpu_kernel_family, gpu_info
from moesim.errors import MoesimError
from moesim.hw.profile import PROFILE_SCHEMA_VERSION, parse_profile
from moesim.hw.profile_fields import TIME_FALL_LIMIT
from moesim.model.spec import ModelSpec
from moesim.util import atomic_write_text

@dataclass
class ProfileConfig:
    #: the model shapes whose expert and attention curves are measured (one profile serves them all)
    models: tuple[ModelSpec, ...]
    device: str = "cuda"
    #: torch threads of the CPU expert pool (0: every CPU this process may use)
    threads: int = 0
    #: timed repetitions per point at least (median taken), after the warm-up
    repeats: int = 7
    #: the command line, recorded in every source
    command: str = "moesim profile"
    #: fewer points and repetitions (tests, quick looks)
    quick: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.models, ModelSpec):
            self.models = (self.models,)
        self.models = tuple(self.models)

    def cpu_threads(self) -> int:
        from backends.devices import allowed_cpus
        return self.threads or len(allowed_cpus())


#: how many times a point of a curve the loader would refuse is measured again, with 2x, 4x, 8x the samples
REMEASURES = 3
#: a point whose time grows this many times faster than its work (tokens, context, bytes) over an earlier
#: point's is measured again too: the loader accepts it, but no kernel slows down per unit of work that much
TIME_RISE_LIMIT = 4.0


class UnsteadyCurveError(MoesimError):
    """A measured curve that the profile loader would refuse, even after its points were measured again."""


# ----------------------------------------------------------------------------- what was measured
@dataclass
class ExpertMeasure:
    model: ModelSpec
    intermediate: int
    tokens: list[int]
    time_us: list[float]
    #: how the curve was obtained, beyond the common source text
    note: str = ""


@dataclass
class Measured:
    """Every number one profiling run measured, with the machine's identity: the input of :func:`profile_document`."""

    config: ProfileConfig
    host: str
    date: str
    cpu: dict[str, Any]
    gpu: dict[str, Any]
    threads: int
    gpu_experts: list[ExpertMeasure] = field(default_factory=list)
    cpu_experts: list[ExpertMeasure] = field(default_factory=list)
    #: (model name, attention kind, tokens, contexts, µs)
    attention: list[tuple[str, str, int, list[int], list[float]]] = field(default_factory=list)
    #: (hidden, vocab, sequences, LM head µs, sampling µs) per output shape
    output: list[tuple[int, int, list[int], list[float], list[float]]] = field(default_factory=list)
    gpu_tflops: float = 0.0
    gpu_gbps: float = 0.0
    cpu_tflops: float = 0.0
    cpu_gbps: float = 0.0
    copy_sizes: list[int] = field(default_factory=list)
    h2d_latency_us: float = 0.0
    h2d_gbps: list[float] = field(default_factory=list)
    d2h_latency_us: float = 0.0
    d2h_gbps: list[float] = field(default_factory=list)
    duplex: float = 1.0
    launch_us: float = 0.0
    handoff_us: float = 0.0

    @property
    def family(self) -> str:
        return cpu_kernel_family(self.cpu["isa"])

    @property
    def source(self) -> str:
        return f"measured by moesim profile on {self.host} {self.date}: {self.config.command}"


def _shapes(config: ProfileConfig) -> list[tuple[ModelSpec, int, str]]:
    """(model, intermediate, label) of every distinct GPU FFN shape: routed experts, shared ones, and the FFN of
    dense decoder layers (the simulator's ``dense_ffn`` reads the curve of that width)."""
    seen, out = set(), []
    for m in config.models:
        dense = m.dense_intermediate_size if m.num_dense_layers else 0
        for intermediate, kind in ((m.moe_intermediate_size, "experts"), (m.shared_intermediate_size, "shared"),
                                   (dense, "dense")):
            key = (m.hidden_size, intermediate, m.expert_matrices)
            if intermediate and key not in seen:
                seen.add(key)
                out.append((m, intermediate, f"{kind} {m.name} {m.hidden_size}x{intermediate}"))
    return out


def _distinct(config: ProfileConfig, key: Callable[[ModelSpec], tuple]) -> list[ModelSpec]:
    """The first model of each distinct ``key`` (a shape), in the configured order."""
    first: dict[tuple, ModelSpec] = {}
    for m in config.models:
        first.setdefault(key(m), m)
    return list(first.values())


def _routed_shapes(config: ProfileConfig) -> list[ModelSpec]:
    return _distinct(config, lambda m: (m.hidden_size, m.moe_intermediate_size, m.expert_matrices))


def _output_shapes(config: ProfileConfig) -> list[ModelSpec]:
    """One model per distinct (hidden, vocab) output shape that has a vocabulary."""
    return [m for m in _distinct(config, lambda m: (m.hidden_size, m.vocab_size)) if m.vocab_size]


def measurement_labels(config: ProfileConfig) -> list[str]:
    """The progress labels :func:`measure` reports, in order."""
    labels = [f"CPU expert FFN {m.name}" for m in _routed_shapes(config)]
    if config.device == "cuda":
        labels += [f"GPU {label}" for _, _, label in _shapes(config)]
    else:  # the stand-in's routed curve is the CPU pool's; only other (shared) shapes are timed again
        routed = {(m.hidden_size, m.moe_intermediate_size, m.expert_matrices) for m in config.models}
        labels += [f"GPU stand-in {label}" for m, i, label in _shapes(config)
                   if (m.hidden_size, i, m.expert_matrices) not in routed]
    labels += [f"attention {m.name}" for m in config.models]
    labels += [f"LM head and sampling {m.name}" for m in _output_shapes(config)]
    return labels + ["matmul and memory ceilings", "host-to-device copies", "device-to-host copies",
                     "both directions at once", "launch and hand-off overheads"]


def _note_on_stderr(text: str) -> None:
    sys.stderr.write(f"moesim: note: {text}\n")
    sys.stderr.flush()


def measure(config: ProfileConfig, progress: Callable[[str], None] | None = None,
            note: Callable[[str], None] | None = None) -> Measured:
    """Measure every curve and number of a hardware profile v1 on this machine.

    ``progress`` gets one label per stage (:func:`measurement_labels`); ``note`` a line for each point
    measured again (default: stderr). Raises :class:`UnsteadyCurveError` for a curve the loader would refuse.
    """
    from backends.devices import host_threads
    say = progress or (lambda _label: None)
    tell = note or _note_on_stderr
    threads = config.cpu_threads()
    out = Measured(config=config, host=platform.node() or "unknown-host",
                   date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"), cpu=cpu_info(),
                   gpu=gpu_info(config.device), threads=threads)
    with host_threads(threads):
        meas = Measurements(config)

        def steady(series: Series, key: str, label: str, x_name: str) -> list[float]:
            _steady(meas, [(series, key, label)], x_name, tell)
            return list(series.values)
        for m in _routed_shapes(config):
            say(f"CPU expert FFN {m.name}")
            key = f"cpu.expert_ffn[{len(out.cpu_experts)}].time_us"
            times = steady(meas.expert_curve(m, m.moe_intermediate_size, False), key,
                           f"CPU expert FFN {m.name} {m.hidden_size}x{m.moe_intermediate_size}", "tokens")
            out.cpu_experts.append(ExpertMeasure(m, m.moe_intermediate_size, list(meas.expert_tokens), times,
                                                 meas.rotation_note(m, m.moe_intermediate_size)))
        cpu_by_shape = {(e.model.hidden_size, e.intermediate, e.model.expert_matrices): e for e in out.cpu_experts}
        for m, intermediate, label in _shapes(config):
            same = cpu_by_shape.get((m.hidden_size, intermediate, m.expert_matrices))
            if not meas.cuda and same is not None:
                out.gpu_experts.append(ExpertMeasure(m, intermediate, same.tokens, same.time_us,
                                                     f"{same.note}; GPU stand-in: the CPU pool's curve, same "
                                                     "kernels and threads"))
                continue
            say(f"GPU stand-in {label}" if not meas.cuda else f"GPU {label}")
            key = f"gpu.expert_ffn[{len(out.gpu_experts)}].time_us"
            times = steady(meas.expert_curve(m, intermediate, True), key,
                           f"GPU{' stand-in' if not meas.cuda else ''} {label}", "tokens")
            out.gpu_experts.append(ExpertMeasure(m, intermediate, list(meas.expert_tokens), times,
                                                 meas.rotation_note(m, intermediate)))
        for m in config.models:
            say(f"attention {m.name}")
            for tokens, series in meas.attention_curves(m):
                key = f"gpu.attention[{len(out.attention)}].time_us"
                times = steady(series, key, f"attention {m.name} at {tokens} tokens", "context")
                out.attention.append((m.name, m.attention, tokens, list(series.xs), times))
        for m in _output_shapes(config):
            say(f"LM head and sampling {m.name}")
            head, sampling = meas.output_curves(m)
            first = 2 * len(out.output)  # one lm_head and one sampling entry per output shape
            steady(head, f"gpu.output[{first}].time_us", f"LM head {m.name}", "sequences")
            steady(sampling, f"gpu.output[{first + 1}].time_us", f"sampling {m.name}", "sequences")
            out.output.append((m.hidden_size, m.vocab_size, list(meas.output_sequences), list(head.values),
                               list(sampling.values)))
        say("matmul and memory ceilings")
        out.cpu_tflops, out.cpu_gbps = meas.matmul_tflops(False), meas.copy_gbps(False)
        if meas.cuda:
            out.gpu_tflops, out.gpu_gbps = meas.matmul_tflops(True), meas.copy_gbps(True)
        else:  # the stand-in's ceilings are the host's
            out.gpu_tflops, out.gpu_gbps = out.cpu_tflops, out.cpu_gbps
        out.copy_sizes = list(meas.copy_sizes)
        say("host-to-device copies")
        out.h2d_latency_us, h2d = meas.copy_curve(True)
        say("device-to-host copies")
        out.d2h_latency_us, d2h = meas.copy_curve(False)
        # both copy curves are checked with the latency the profile will have: the mean of the two
        copies = [(h2d, "pcie.h2d.gbps", "host-to-device copies"), (d2h, "pcie.d2h.gbps", "device-to-host copies")]
        _steady(meas, copies, "size_bytes", tell, (out.h2d_latency_us + out.d2h_latency_us) / 2)
        out.h2d_gbps, out.d2h_gbps = list(h2d.values), list(d2h.values)
        say("both directions at once")
        out.duplex = meas.duplex_slowdown()
        say("launch and hand-off overheads")
        out.launch_us = meas.launch_us()
        out.handoff_us = meas.handoff_us(max(m.hidden_size for m in config.models))
    return out


# ----------------------------------------------------------------------------- curves the loader accepts
def refused_pairs(times_us: list[float]) -> list[tuple[int, int]]:
    """(earlier, later) index pairs of a curve whose later time is below the earlier one divided by
    :data:`TIME_FALL_LIMIT`: the loader refuses the curve at each such later point."""
    return [(j, i) for i in range(1, len(times_us)) for j in range(i)
            if times_us[i] * TIME_FALL_LIMIT < times_us[j]]


def jump_pairs(times_us: list[float], xs: list[int]) -> list[tuple[int, int]]:
    """(later, earlier) index pairs of a curve whose later time exceeds the earlier one scaled by the work, times
    :data:`TIME_RISE_LIMIT` (a later point's high end first, as :func:`refused_pairs` puts a fall's)."""
    return [(i, j) for i in range(1, len(times_us)) for j in range(i)
            if xs[j] > 0 and times_us[i] > times_us[j] * xs[i] / xs[j] * TIME_RISE_LIMIT]


def _profile_times(values: list[float], xs: list[int], latency_us: float | None) -> list[float]:
    """The times the loader checks: of the rounded values as written, copy times from bandwidths."""
    if latency_us is None:
        return _round(list(values))
    latency = _round(latency_us)
    return [latency + x / gbps * 1e-3 for x, gbps in zip(xs, _round(list(values)))]


def _us(value: float) -> str:
    return f"{value:.4g} µs" if value < 1e4 else f"{value:.0f} µs"


def _steady(meas: Measurements, curves: list[tuple[Series, str, str]], x_name: str, note: Callable[[str], None],
            latency_us: float | None = None) -> None:
    """Measure the points of a refused fall again until the loader would accept every curve, at most
    :data:`REMEASURES` rounds with more samples each; raise :class:`UnsteadyCurveError` if still refused.

    A round measures the high end of each fall again (a busy machine inflates a point), then the low end of
    each fall that is left (a point can be too low as well); each point at most once a round.
    """
    def times(series: Series) -> list[float]:
        return _profile_times(series.values, series.xs, latency_us)

    def listed(series: Series, t: list[float], pairs: list[tuple[int, int]], word: str) -> str:
        """The first two pairs as "T at X {word} T at X", each pair in its own order, and how many more."""
        shown = ", ".join(f"{_us(t[a])} at {x_name} {series.xs[a]} {word} {_us(t[b])} at {x_name} {series.xs[b]}"
                          for a, b in pairs[:2])
        return shown + (f" and {len(pairs) - 2} more" if len(pairs) > 2 else "")

    def why(series: Series, t: list[float], i: int) -> str:
        fell = [pair for pair in refused_pairs(t) if i in pair]
        if fell:
            return f"{listed(series, t, fell, f'over {TIME_FALL_LIMIT:g}x')}: the loader would refuse the curve"
        rose = [pair for pair in jump_pairs(t, series.xs) if i in pair]
        return (f"{listed(series, t, rose, 'after')}: more than {TIME_RISE_LIMIT:g}x faster than the work grows, "
                "which no kernel does")

    def suspect(series: Series, t: list[float]) -> list[tuple[int, int]]:
        """(high, low) ends of each fall the loader refuses and of each rise no kernel makes."""
        return refused_pairs(t) + jump_pairs(t, series.xs)

    for attempt in range(1, REMEASURES + 1):
        if not any(suspect(series, times(series)) for series, _, _ in curves):
            return
        for series, key, label in curves:
            done: set[int] = set()
            for end in (0, 1):  # the high ends, then the low ends of the falls and rises left
                t = times(series)
                pairs = suspect(series, t)
                for i in sorted({pair[end] for pair in pairs} - done):
                    reason = why(series, t, i)
                    with meas.timer.patient(2 ** attempt):
                        series.values[i] = series.again(i)
                    done.add(i)
                    note(f"{label} ({key}): measured {x_name} {series.xs[i]} again ({attempt} of {REMEASURES}, "
                         f"{2 ** attempt}x the samples): {_us(times(series)[i])}, was {_us(t[i])} ({reason})")
    for series, key, label in curves:
        t = times(series)
        rose = jump_pairs(t, series.xs)
        if rose:  # the loader takes it: kept as measured, and said
            note(f"{label} ({key}): {listed(series, t, rose, 'after')}, more than {TIME_RISE_LIMIT:g}x faster "
                 f"than the work grows after measuring again {REMEASURES} times; kept as measured (a machine this "
                 "busy inflates the profile: rerun on a quieter one, or with fewer --threads)")
        pairs = refused_pairs(t)
        if pairs:
            raise UnsteadyCurveError(
                f"{label}: {listed(series, t, pairs, 'against')}, more than {TIME_FALL_LIMIT:g}x apart after "
                f"measuring them again {REMEASURES} times; the loader would refuse the profile, nothing written",
                field=key,
                fix="rerun on a quieter machine (other work inflates single points), or with fewer --threads, "
                    "e.g. --threads 1")


# ----------------------------------------------------------------------------- the profile document
def profile_document(x: Measured) -> dict[str, Any]:
    """The hardware profile v1 mapping of a measurement: the one place that lays out the YAML.

    A new schema field is one more entry here (with its ``sources`` line) and,
    where it is measured, one more field of :class:`Measured`.
    """
    config, cpu, gpu, measured, family = x.config, x.cpu, x.gpu, x.source, x.family
    cuda = config.device == "cuda"
    names = ", ".join(m.name for m in config.models)
    reserved = max(gpu["memory_bytes"] - gpu["free_bytes"], 0) / 2**30
    cpu_curves = [_expert_entry(e, measured) | {"kernel": family, "threads": x.threads} for e in x.cpu_experts]
    for curve in cpu_curves:
        curve["source"] += f" (torch CPU matmuls on {x.threads} threads; kernel family from the ISA flags)"
    return {
        "schema_version": PROFILE_SCHEMA_VERSION,
        "name": config.name or f"{x.host}-{config.device}",
        "description": (f"{gpu['name']} (driver {gpu['driver']}) + {cpu['model']} ({cpu['cores']} cores, "
                        f"ISA {' '.join(cpu['isa']) or 'none listed'}); measured {x.date} on {x.host} for "
                        f"{names}: {config.command}"),
        "gpu": {
            "name": gpu["name"], "memory_gib": _round(gpu["memory_bytes"] / 2**30),
            "reserved_gib": _round(reserved), "launch_us": _round(x.launch_us), "graph_launch_us": _round(x.launch_us),
            "cuda_graph": False, "peak_tflops": {"bf16": _round(x.gpu_tflops)},
            "mem_bandwidth_gbps": _round(x.gpu_gbps), "roofline_efficiency": 1.0, "bandwidth_efficiency": 1.0,
            "expert_ffn": [_expert_entry(e, measured) for e in x.gpu_experts],
            "attention": [{"model": model, "tokens": t, "context": c, "time_us": _round(us),
                           "source": f"{measured} (attention block with gate, {kind}, batch 1)"}
                          for model, kind, t, c, us in x.attention],
            "output": [{"kind": kind, "hidden": hidden, "vocab": vocab, "dtype": config.models[0].expert_dtype,
                        "sequences": sequences, "time_us": _round(us), "source": f"{measured} ({what})"}
                       for hidden, vocab, sequences, head_us, sampling_us in x.output
                       for kind, us, what in (("lm_head", head_us, "final norm and LM head of each sequence's "
                                                                   "last token"),
                                              ("sampling", sampling_us, "softmax and argmax over fp32 logits"))],
        },
        "cpu": {
            "name": cpu["model"], "cores": x.threads, "dram_bandwidth_gbps": _round(x.cpu_gbps),
            "peak_tflops": {family: _round(x.cpu_tflops)}, "amx_switch_tokens": 1 if family == "amx" else None,
            "roofline_efficiency": 1.0, "bandwidth_efficiency": 1.0, "expert_ffn": cpu_curves,
        },
        "pcie": {
            "generation": gpu["pcie_generation"],
            "h2d": {"size_bytes": x.copy_sizes, "gbps": _round(x.h2d_gbps),
                    "source": f"{measured} (pinned host memory, bandwidth net of pcie.latency_us)" if cuda else
                    f"{measured} (GPU stand-in: host memcpy, net of pcie.latency_us)"},
            "d2h": {"size_bytes": x.copy_sizes, "gbps": _round(x.d2h_gbps),
                    "source": f"{measured} (net of pcie.latency_us)"},
            "latency_us": _round((x.h2d_latency_us + x.d2h_latency_us) / 2), "copy_engines": 1,
            "duplex_slowdown": _round(x.duplex),
        },
        "sync": {"per_layer_us": _round(x.handoff_us)},
        "sources": {
            "gpu": measured, "cpu": measured, "pcie": measured, "sync": measured,
            "gpu.memory_gib": f"{measured} (torch.cuda.mem_get_info total)" if cuda
            else f"{measured} (/proc/meminfo MemTotal: the stand-in's memory is host memory)",
            "gpu.reserved_gib": f"{measured} (memory in use before the run)",
            "gpu.launch_us": f"{measured} (host time per small-kernel launch; expert and attention curves "
                             "already include launches: replay with engine.kernels_per_expert=0)",
            "gpu.graph_launch_us": f"{measured} (no CUDA graphs: same as launch_us)",
            "gpu.peak_tflops": f"{measured} (bf16 matmul, 8192^3)" if cuda and not config.quick
            else f"{measured} (bf16 matmul, 1024^3{'' if cuda else ', on the host: the stand-in is the CPU'})",
            "gpu.roofline_efficiency": "1.0: gpu.peak_tflops is a measured matmul ceiling",
            "gpu.bandwidth_efficiency": "1.0: gpu.mem_bandwidth_gbps is a measured copy bandwidth",
            "cpu.cores": f"{measured} (torch threads of the CPU expert pool; machine has {cpu['cores']} cores)",
            "cpu.amx_switch_tokens": f"{measured} (ISA flags {' '.join(cpu['isa'])}: one kernel family for "
                                     "every token count, as torch picks it)",
            "cpu.roofline_efficiency": "1.0: cpu.peak_tflops is a measured matmul ceiling",
            "cpu.bandwidth_efficiency": "1.0: cpu.dram_bandwidth_gbps is a measured copy bandwidth",
            "pcie.generation": f"{measured} (nvidia-smi pcie.link.gen.current)" if cuda
            else "1: placeholder, no PCIe link in CPU-only mode (the cost model does not read it)",
            "pcie.copy_engines": "1: the real backend issues every copy on one copy stream, one at a time",
            "pcie.duplex_slowdown": f"{measured} (H2D with a D2H of the same size at once, over H2D alone)",
            "sync.per_layer_us": f"{measured} (activations to the host, an empty CPU job, back and added)",
        },
    }


def measure_profile(config: ProfileConfig, progress: Callable[[str], None] | None = None,
                    note: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every curve and number of a hardware profile v1; returns the YAML mapping."""
    data = profile_document(measure(config, progress, note))
    parse_profile(data, origin=config.name or "measured profile")  # what load_profile will accept
    return data


def _expert_entry(e: ExpertMeasure, measured: str) -> dict[str, Any]:
    m = e.model
    shape = f"{m.name} ({m.hidden_size}x{e.intermediate} {m.expert_dtype})"
    note = f"; {e.note}" if e.note else ""
    return {"hidden": m.hidden_size, "intermediate": e.intermediate, "dtype": m.expert_dtype,
            "tokens": list(e.tokens), "time_us": _round(list(e.time_us)),
            "source": f"{measured} (gather, FFN and weighted scatter-add of {shape}, launches included{note})"}


def _round(value: Any) -> Any:
    """Four significant digits, never zero (profile curves must be positive)."""
    if isinstance(value, list):
        return [_round(v) for v in value]
    if not value:
        return 1e-6 if isinstance(value, float) else value
    return max(float(f"{value:.4g}"), 1e-6)


def write_profile(data: dict[str, Any], path: str | Path) -> Path:
    """Write the profile YAML atomically, with the machine's identity as a comment header."""
    # every line of the description commented: a line break in it (from --name or an argument) must not
    # start YAML of its own
    text = "Hardware profile measured by `moesim profile`.\n" + data["description"]
    header = "".join(f"# {line}\n" for line in text.splitlines())
    return atomic_write_text(Path(path), header + yaml.safe_dump(data, sort_keys=False, width=120))
