"""Commands that run real models and kernels: ``capture``, ``profile``, ``validate --real``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from moesim.cli.app import (HW_PROFILE, InputPath, JsonFlagCommand, check_outputs, cli, console, err_console,
                            open_output, parse_settings, preset_help, say_wrote, write_json)
from moesim.errors import MoesimError
from moesim.util import PARQUET, YAML, check_can_create, clean_stale_tmps


@cli.command("capture")
@click.option("--model", "model", required=True, metavar="PATH_OR_ID",
              help="Checkpoint directory (config.json + *.safetensors) or Hugging Face model id.")
@click.option("--prompts", required=True, type=InputPath(dir_okay=False),
              help="Prompts: JSONL (field 'prompt' or 'text', or 'token_ids') or plain text, one per line; "
                   "- reads standard input.")
@click.option("--max-new-tokens", required=True, type=click.IntRange(min=0),
              help="Greedy tokens generated (and fed back: one decode step each) per prompt.")
@click.option("--batch", default=1, show_default=True, type=click.IntRange(min=1),
              help="Prompts generated together (left-padded) in one batch.")
@click.option("--calibration-prompts", default=None, type=InputPath(dir_okay=False),
              help="Prompts for fitting pred_residual and pred_next_token (never written to the trace).")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              help="Weights dtype; auto keeps the checkpoint's.")
@click.option("--device", default="auto", show_default=True, help="auto (cuda if present), cpu, cuda, cuda:N.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output trace (.parquet).")
def capture_command(model: str, prompts: str, max_new_tokens: int, batch: int, calibration_prompts: str | None,
                    dtype: str, device: str, out: str) -> None:
    """Record a Hugging Face MoE model's router decisions under greedy generation into a trace."""
    from moesim.trace.capture import CaptureConfig, capture
    from moesim.trace.capture.model import pick_device, require_torch
    check_outputs([("--prompts", prompts), ("--calibration-prompts", calibration_prompts)], {"out": PARQUET},
                  out=out)  # tries creating the file too (check_output_path)
    require_torch()
    pick_device(device)  # a device this machine lacks fails now, before the model loads
    import huggingface_hub
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    huggingface_hub.logging.set_verbosity_error()  # no line per retry of an unreachable hub: the error says it
    config = CaptureConfig(model=model, prompts=Path(prompts), out=Path(out), max_new_tokens=max_new_tokens,
                           batch=batch, calibration_prompts=Path(calibration_prompts) if calibration_prompts
                           else None, dtype=dtype, device=device)
    from moesim.progress import Progress
    # on a terminal capture draws its own token bar; otherwise plain lines say it is alive, counting the tokens
    # every pass ran (calibration's included) as capture hears them
    with Progress("capture", unit="tokens", console=err_console, enabled=not err_console.is_terminal) as bar:
        bar.advance(0, label=f"{model} -> {out}")
        report = capture(config, progress=err_console.is_terminal,
                         on_tokens=lambda tokens, phase: bar.advance(tokens, extra=phase))
    for line in report.summary_lines():
        console.print(line, markup=False, highlight=False)


def _command_line() -> str:
    return "moesim " + " ".join(sys.argv[1:])


def _progress_labels(total: int, title: str):
    """Progress advanced once per label (:class:`moesim.progress.Progress`: a bar on a terminal, plain
    lines on stderr otherwise)."""
    from moesim.progress import Progress
    bar = Progress(title, total=total, console=err_console)

    def step(label: str) -> None:
        bar.advance(1, label=label)
    return bar, step


def _require_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise MoesimError("the real backend needs torch", field="torch",
                          fix="pip install -e '.[torch]'") from None


def _check_threads(threads: int) -> None:
    """``--threads`` at most the CPUs this process may run on: more would be timed oversubscribed (each
    thread losing its core) and recorded in the profile as that many cores."""
    from backends.devices import allowed_cpus
    cpus = len(allowed_cpus())
    if threads > cpus:
        raise MoesimError(f"{threads} threads, more than the {cpus} CPUs this process may run on",
                          field="--threads", fix=f"use --threads 1 to {cpus}, or 0 for all of them")


def _measure(models, device: str, threads: int, quick: bool, name: str, out: Path) -> Path:
    _require_torch()
    from backends.profiler import ProfileConfig, measure_profile, measurement_labels, write_profile
    from backends.torch_backend import check_device
    check_device(device)
    config = ProfileConfig(models=tuple(models), device=device, threads=threads, quick=quick,
                           command=_command_line(), name=name)
    bar, step = _progress_labels(len(measurement_labels(config)), "profile")
    with bar:
        data = measure_profile(config, progress=step)
    return write_profile(data, out)


@cli.command("profile")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cuda: this GPU; cpu: the CPU-only stand-in (no GPU needed).")
@click.option("--model", "model_names", required=True, multiple=True,
              help=preset_help("Model preset name or preset YAML: a shape measured (repeat for several shapes)."))
@click.option("--threads", default=0, show_default=True, type=click.IntRange(min=0),
              help="Torch threads of the CPU expert pool (0: every core).")
@click.option("--quick", is_flag=True, help="Fewer points and repetitions (a quick look, not a reference).")
@click.option("--name", default="", help="Profile name (default: HOST-DEVICE).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output profile YAML.")
def profile_command(device: str, model_names: tuple[str, ...], threads: int, quick: bool, name: str,
                    out: str) -> None:
    """Measure a hardware profile v1 (every curve the cost model reads) for one or more model shapes."""
    check_outputs([("--model", name) for name in model_names], {"out": YAML}, out=out)
    _check_threads(threads)
    if not name.isprintable():
        raise MoesimError(f"profile name {name!r} has a line break or other control character", field="--name",
                          fix="give a name on one line, e.g. --name h100-lab")
    from moesim.model.presets import load_preset
    models = [load_preset(model_name) for model_name in model_names]
    names = [model.name for model in models]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:  # measured twice, its attention curves would be in the profile twice
        raise MoesimError(f"model {', '.join(twice)} given more than once", field="--model",
                          fix="give each model shape once")
    path = _measure(models, device, threads, quick, name, Path(out))
    say_wrote(console, f"wrote {path} (load it with --hw {path} or --profile {path})")


def _executable_systems(systems: str) -> list[str]:
    """The systems of ``--systems``, each one that real kernels can execute: checked before a profile is
    measured (minutes), so that a wrong name fails at once."""
    from moesim.sim.run import members
    names = [s.strip() for s in systems.split(",") if s.strip()]
    example = "e.g. --systems cpu-only,gpu-only-lru,static-hot (`moesim systems` lists them)"
    if not names:
        raise MoesimError("no system given", field="--systems", fix=example)
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:  # the report holds one entry per system: a second run would replace the first one's files
        raise MoesimError(f"{', '.join(twice)} given more than once", field="--systems",
                          fix=f"name each system once: --systems {','.join(dict.fromkeys(names))}")
    for name in names:
        if name == "all":
            raise MoesimError("validate runs the systems it is given by name, not 'all'", field="--systems",
                              fix=example)
        try:
            schedules = members(name)
        except MoesimError as err:
            err.rename_field("--systems")
            raise
        if schedules != (name,):
            raise MoesimError(f"'{name}' is a bound over several schedules, not one executable system",
                              field="--systems", fix=f"validate its members one by one: {','.join(schedules)}")
    return names


#: hw.* settings that act on both executors: they size the memory plan, which the real run is set up with too
BOTH_EXECUTORS_HW = ("hw.gpu.memory_gib", "hw.gpu.reserved_gib")


def _warn_simulated_hardware_settings(parsed: dict[str, str]) -> None:
    """One line on stderr for ``--set hw.*`` parameters other than the memory plan's: they change the simulated
    side's costs only (the real run runs on this machine's hardware as it is), so the errors then compare the
    measured run with another machine. A warning, not a refusal, as for a GPU profile on the CPU stand-in."""
    cost_only = [key for key in parsed if key.startswith("hw.") and key not in BOTH_EXECUTORS_HW]
    if cost_only:
        err_console.print(f"moesim: warning: --set {', '.join(f'{key}={parsed[key]}' for key in cost_only)} changes "
                          "the simulated hardware only (the real run runs on this machine as it is), so the errors "
                          "compare the measured run with another machine (leave out the hw.* settings; only "
                          f"{' and '.join(BOTH_EXECUTORS_HW)}, which size the memory plan, act on both)",
                          markup=False, highlight=False, soft_wrap=True)


def _note_earlier_systems(out_dir: Path, names: list[str]) -> None:
    """One line on stderr naming OUT's folders of systems an earlier validate run wrote there and this one did
    not run: the report no longer covers them, and beside the new ones they read as its own."""
    earlier = sorted(p.name for p in out_dir.iterdir() if p.is_dir() and p.name not in names
                     and any((p / f"{side}-decisions.parquet").exists() for side in ("real", "sim")))
    if earlier:
        err_console.print(f"moesim: note: {out_dir} also holds {', '.join(f'{name}/' for name in earlier)} of an "
                          "earlier run, which this report does not cover (remove them, or use another --out)",
                          markup=False, highlight=False, soft_wrap=True)


def _warn_gpu_profile_on_cpu(profile, path: str, out_dir: Path) -> bool:
    """One line on stderr when ``--device cpu`` is given a profile of a GPU rather than of the CPU stand-in:
    the simulated side then runs on that GPU's numbers and the measured side on the CPU, so the errors
    compare two machines. A warning, not a refusal: the decisions still compare, and the run is valid.
    Returns whether it warned."""
    from backends.measurements import STAND_IN_GPU_NAME
    if profile.gpu.name == STAND_IN_GPU_NAME:
        return False
    err_console.print(f"moesim: warning: --device cpu with {path}, a profile of {profile.gpu.name}: the simulated "
                      "side uses that GPU profile while the measured side runs on the CPU stand-in, so the errors "
                      "compare different hardware (leave out --profile to measure the stand-in into "
                      f"{out_dir / 'profile.yaml'}, with --quick-profile for a quick one, or pass a profile from "
                      "`moesim profile --device cpu`)", markup=False, highlight=False, soft_wrap=True)
    return True


def _warn_roofline_estimates(results: dict, profile_path: str) -> None:
    """One line on stderr when the simulated side found no curve in ``--profile`` for some cost of this trace's
    model (a profile measured for another shape) and estimated it from the roofline: the errors then measure
    that estimate, not the simulator. (Runtime launch costs, which no measured profile holds, are left out.)"""
    estimated = sorted({what for _, sim in results.values() for what in sim.cost_fallbacks
                        if what.startswith(("gpu ", "cpu "))})
    if not estimated:
        return
    err_console.print(f"moesim: warning: {profile_path} has no curve for {'; '.join(estimated)}: the simulated side "
                      "estimated those from the roofline, so the errors say little about the simulator (leave out "
                      "--profile to measure one for this trace's model, or measure it with `moesim profile --model "
                      "<that model's preset or preset YAML>`)", markup=False, highlight=False, soft_wrap=True)


def _ranking_line(report, key: str, label: str) -> str:
    """The report's ranking by ``key``, or why there is none: a trace without decode steps has no TPOT, and
    its ranking by TPOT would read "same" for want of values."""
    from moesim.util import is_missing
    if all(is_missing(c.real[key]) and is_missing(c.sim[key]) for c in report.systems):
        return f"- (no system has a {label} on this trace)"
    return report.ranking_text(key)


def _measure_with_report(model, device: str, threads: int, quick: bool, out_dir: Path):
    """(path, profile) of a profile measured into ``OUT/profile.yaml``, which lands with the report: an
    interrupted or failed run leaves an earlier report and the profile it was computed with as they were."""
    from moesim.hw.profile import load_profile
    target = out_dir / "profile.yaml"
    with open_output(target, "--out", YAML) as staged:
        profile = load_profile(_measure([model], device, threads, quick, "", Path(staged)))
    return str(target), profile


@cli.command("validate", cls=JsonFlagCommand)
@click.option("--real", is_flag=True,
              help="Execute the trace on real torch kernels and compare with the simulator (required: the only "
                   "validation there is).")
@click.option("--trace", "trace_file", required=True, type=InputPath(dir_okay=False))
@click.option("--systems", required=True, help="Comma-separated systems, e.g. cpu-only,gpu-only-lru,static-hot.")
@click.option("--profile", "--hw", "profile_path", default=None, type=HW_PROFILE,
              help="Hardware profile of this machine (default: measure one first, into OUT/profile.yaml); "
                   "--hw, as replay names it, is the same.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cuda: this machine's GPU; cpu: the CPU stand-in (no GPU needed: the GPU's work runs on a host "
                   "thread, so the errors compare the simulator with this CPU, not with a GPU).")
@click.option("--layers", default=None, type=click.IntRange(min=1),
              help="Run only the first N MoE layers of the trace (models larger than host memory).")
@click.option("--threads", default=0, show_default=True, type=click.IntRange(min=0),
              help="Torch threads of the CPU expert pool (0: every core).")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Parameter for both executors, e.g. cache.slots_per_layer=4 (hw.* ones act on the simulated "
                   "side only, except hw.gpu.memory_gib and hw.gpu.reserved_gib).")
@click.option("--quick-profile", is_flag=True, help="Measure the profile with fewer points (tests).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Report directory.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as JSON instead of a table (stdout; --json - the same).")
def validate_command(real: bool, trace_file: str, systems: str, profile_path: str | None, device: str,
                     layers: int | None, threads: int, settings: tuple[str, ...], quick_profile: bool, out: str,
                     as_json: bool) -> None:
    """Run the same trace and systems on real kernels and in the simulator; report errors and decision agreement."""
    from moesim.analysis.validation import (MEASURED_PROFILE_SETTINGS, ms_text, pct_text, run_validation,
                                            truncate_trace, write_report)
    from moesim.hw.profile import load_profile
    from moesim.sim.run import check_settings
    from moesim.trace.validate import checked_meta as read_meta
    if not real:
        raise MoesimError("only real-kernel validation exists", field="--real",
                          fix="pass --real (with --device cpu on a machine without a GPU: the CPU stand-in)")
    names = _executable_systems(systems)
    _check_threads(threads)
    out_dir = Path(out)
    check_can_create(out_dir, "--out")
    clean_stale_tmps(out_dir / "profile.yaml")  # what a killed run staged there is no one's now
    model = read_meta(trace_file).model
    parsed = parse_settings(settings)
    for name in names:
        check_settings(name, parsed)
    _warn_simulated_hardware_settings(parsed)
    _require_torch()
    from backends.run_config import check_device
    from backends.weights import check_host_memory
    # the device first: on a machine without a GPU, `--device cuda` (the default) said how much pinned memory
    # the experts need and which --layers would fit, and only once that was given that there is no GPU
    check_device(device)
    if layers is not None and 1 <= layers <= model.num_layers:  # truncate_trace refuses any other count
        model = model.truncated(layers)
    # before minutes of profiling (and before the truncated trace is written into OUT); on CUDA the experts are
    # pinned, which rounds the allocation up to a power of two
    check_host_memory(model, parsed.get("memory.expert_dtype") or model.expert_dtype, pinned=device == "cuda")
    if layers is not None:
        trace_file = str(truncate_trace(trace_file, layers, out_dir / f"trace-{layers}-layers.parquet"))
    if profile_path is None:
        profile_path, profile = _measure_with_report(model, device, threads, quick_profile, out_dir)
    else:
        profile = load_profile(profile_path)
    # a GPU's profile on the CPU stand-in is warned of once: that warning already says the errors compare
    # different hardware, whichever curves it lacks
    other_hardware = device == "cpu" and _warn_gpu_profile_on_cpu(profile, profile_path, out_dir)
    if "measured by moesim profile" in profile.sources.get("gpu", ""):
        parsed = {**MEASURED_PROFILE_SETTINGS, **parsed}
    bar, step = _progress_labels(2 * len(names), "validate")
    with bar:
        report, results = run_validation(trace_file, names, profile, device=device, settings=parsed,
                                         threads=threads, command=_command_line(), profile_label=profile_path,
                                         progress=step)
    if not other_hardware:
        _warn_roofline_estimates(results, profile_path)
    files = write_report(report, results, out_dir)
    _note_earlier_systems(out_dir, names)
    if as_json:
        write_json(report.to_dict(), None)
        return
    from rich.table import Table
    table = Table(title=f"{Path(trace_file).name}: simulated vs measured on {device}", title_justify="left")
    # the host's time between a layer's attention and its first expert, measured only (the simulator plans in
    # zero time): per decode step and as a share of the measured TPOT
    host = any(c.host_ms_per_decode_step is not None for c in report.systems)
    columns = ("system", "TTFT real/sim ms", "error", "TPOT real/sim ms", "error", "same decisions")
    for col in columns + (("host ms/step (of TPOT)",) if host else ()):
        table.add_column(col, justify="left" if col == "system" else "right")
    for c in report.systems:
        real, sim = c.real, c.sim
        row = [c.system, f"{ms_text(real['ttft_ms'])} / {ms_text(sim['ttft_ms'])}", pct_text(c.ttft_error_pct),
               f"{ms_text(real['tpot_ms_mean'])} / {ms_text(sim['tpot_ms_mean'])}", pct_text(c.tpot_error_pct),
               f"{c.decisions.share:.1%}"]
        if host:
            step, share = c.host_ms_per_decode_step, c.host_share_of_tpot
            row.append("-" if step is None else f"{step:.2f}" + ("" if share is None else f" ({share:.0%})"))
        table.add_row(*row)
    console.print(table)
    console.print("error: (simulated - measured) / measured" + (
        "; measured on the CPU stand-in (the GPU's work on a host thread), so the errors compare the simulator "
        "with this CPU, not with a GPU" if device == "cpu" else ""), highlight=False)
    if host:
        console.print("host ms/step: measured host time from each MoE layer's attention to its first expert "
                      "(retiring copies, the view, plan(), launches) per decode step; the simulator does not "
                      "charge it", highlight=False)
    for label, key in (("TPOT", "tpot_ms_mean"), ("TTFT", "ttft_ms")):
        console.print(f"ranking by {label}: {_ranking_line(report, key, label)}", highlight=False)
    say_wrote(console, f"wrote {files['markdown']}, {files['json']}, {files['plot']}")
