"""``moesim capture``: greedy generation with hooked routers, written as a trace.

Requests run in batches of ``batch`` prompts (left-padded, in file order);
each batch is one prefill pass and then one decode pass per generated token
(the token is fed, so ``--max-new-tokens N`` gives up to N decode steps). Steps
are numbered across batches, so a trace interleaves a batch's requests
exactly as they ran. The trace file appears only when the capture completes.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from moesim.errors import ConfigError, MoesimError
from moesim.trace.capture.errors import PromptsError
from moesim.trace.capture.prompts import Prompt, load_prompts, read_prompts_file
from moesim.trace.schema import TraceMeta

DTYPES = ("auto", "float32", "bfloat16", "float16")
FLUSH_ROWS = 65_536


@dataclass
class CaptureConfig:
    """Inputs of one capture, as the command line gives them."""

    model: str
    prompts: Path
    out: Path
    max_new_tokens: int
    batch: int = 1
    calibration_prompts: Path | None = None
    dtype: str = "auto"
    device: str = "auto"

    def check(self) -> None:
        """Refuse, in one line naming the field, what the command line's options would not take (a
        CaptureConfig built in Python), before the model loads."""
        def whole(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)
        if not whole(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ConfigError(f"must be a whole number 0 or above, got {self.max_new_tokens!r}",
                              source="CaptureConfig", field="max_new_tokens",
                              fix="give the greedy tokens to generate per prompt, e.g. max_new_tokens=64")
        if not whole(self.batch) or self.batch < 1:
            raise ConfigError(f"must be a whole number 1 or above, got {self.batch!r}", source="CaptureConfig",
                              field="batch", fix="give the prompts generated together, e.g. batch=4")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}", source="CaptureConfig", field="dtype",
                              fix=f"use one of {', '.join(DTYPES)}")
        if not isinstance(self.device, str):
            raise ConfigError(f"must be a string, got {self.device!r}", source="CaptureConfig", field="device",
                              fix="use auto, cpu, cuda or cuda:N")


@dataclass
class CaptureReport:
    """What a capture wrote, how fast, and which predictor columns it has or lacks and why."""

    out: Path
    requests: int
    steps: int
    rows: int
    prefill_tokens: int
    decode_tokens: int
    seconds: float
    predictors: dict[str, str]
    calibration_tokens: int = 0
    calibration_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    #: fitted predictor state (residual vectors, next-token gates), for inspection
    state: Any = None

    @property
    def tokens_per_s(self) -> float:
        return (self.prefill_tokens + self.decode_tokens) / self.seconds if self.seconds > 0 else 0.0

    def summary_lines(self) -> list[str]:
        lines = [f"wrote {self.out}: {self.requests} requests, {self.steps} steps, {self.rows:,} rows "
                 f"({self.prefill_tokens} prefill + {self.decode_tokens} decode tokens, "
                 f"{self.tokens_per_s:,.1f} tokens/s)"]
        if self.calibration_tokens:
            lines.append(f"  calibration: {self.calibration_tokens} tokens in {self.calibration_seconds:.1f} s "
                         "(not in the trace)")
        for column, status in self.predictors.items():
            lines.append(f"  {column}: {status}")
        lines.extend(f"  note: {note}" for note in self.notes)
        return lines


# ----------------------------------------------------------------------------- prompts -> token ids
def tokenize(prompts: list[Prompt], tokenizer: Any, vocab_size: int, origin: str) -> list[list[int]]:
    """Token ids of every prompt; text prompts need the checkpoint's tokenizer."""
    out = []
    for prompt in prompts:
        if prompt.token_ids is not None:
            ids = list(prompt.token_ids)
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise PromptsError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})",
                                   source=origin, field="token_ids", row=prompt.line,
                                   fix="give ids the model's tokenizer produced")
        else:
            if tokenizer is None:
                raise PromptsError("text prompt but the checkpoint has no tokenizer", source=origin,
                                   row=prompt.line, fix="add the tokenizer files to the checkpoint directory "
                                   "or give pre-tokenised prompts as {\"token_ids\": [...]}")
            ids = list(tokenizer(prompt.text)["input_ids"])
            if not ids:
                raise PromptsError("prompt tokenises to no tokens", source=origin, row=prompt.line,
                                   fix="remove the line or give it text")
        out.append(ids)
    return out


# ----------------------------------------------------------------------------- generation driver
def special_ids(model: Any, tokenizer: Any) -> tuple[int, set[int]]:
    """(pad id, end-of-sequence ids) from the generation config, config or tokenizer."""
    vocab = int(model.config.vocab_size)
    eos: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            eos.update([value] if isinstance(value, int) else list(value))
    eos = {int(e) for e in eos if 0 <= int(e) < vocab}
    pad = getattr(model.config, "pad_token_id", None)
    if pad is None and tokenizer is not None:
        pad = tokenizer.pad_token_id
    if pad is None or not 0 <= int(pad) < vocab:
        pad = min(eos) if eos else 0
    return int(pad), eos


def run_batches(moe: Any, prompts: list[list[int]], max_new_tokens: int, batch: int, pad_id: int,
                eos_ids: set[int], on_step: Callable[[Any, list[Any]], None],
                on_batch_end: Callable[[], None] | None = None) -> None:
    """Greedy ``generate`` over prompts in batches; ``on_step(rows, layers)`` sees every real-token pass."""
    import torch
    from transformers import GenerationConfig
    from moesim.trace.capture.tap import BatchTracker, RouterTap

    # Plain greedy: neutral values so a checkpoint's generation_config.json (repetition penalty, minimum
    # length, n-gram blocking) cannot reshape the logits; generate() fills only the values left unset.
    generation = GenerationConfig(max_new_tokens=max_new_tokens + 1, do_sample=False, num_beams=1,
                                  repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0,
                                  pad_token_id=pad_id, eos_token_id=sorted(eos_ids) or None, use_cache=True)
    # min_new_tokens=0 sets the minimum length whatever min_length says (a checkpoint's min_length included), so
    # min_length is left unset; generate() still warns about a checkpoint's own max_length/min_length beside ours,
    # words about settings the caller never made: they are kept quiet while capture's generate runs.
    device = moe.device
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        tracker = BatchTracker(list(range(start, start + len(group))), group, eos_ids)
        ids, mask = tracker.padded_inputs(pad_id)

        def step(input_ids: Any, layers: list[Any], tracker: BatchTracker = tracker) -> None:
            rows = tracker.rows(input_ids, device)
            if rows.tokens:
                on_step(rows, layers)

        with RouterTap(moe.model, moe.routers, step), torch.no_grad(), _quiet_generate():
            moe.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                               generation_config=generation)
        if on_batch_end is not None:
            on_batch_end()


@contextlib.contextmanager
def _quiet_generate() -> Iterator[None]:
    """transformers' generation logger at error level while capture's own ``generate`` runs."""
    import logging
    logger = logging.getLogger("transformers.generation.utils")
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)


def _progress(enabled: bool) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                    TextColumn("{task.completed:,.0f} tokens"),
                    TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                    console=Console(stderr=True), disable=not enabled, transient=False)


#: told the tokens of every pass and the phase ("calibrating" or "capturing"): the caller's own progress
#: (the plain lines printed when stderr is no terminal and the rich bar is disabled)
TokenCallback = Callable[[int, str], None]


class TokenMeter:
    """Progress task fed with tokens per pass, showing tokens/s; ``on_tokens`` is told each pass too."""

    def __init__(self, progress: Any, description: str, total: int, on_tokens: TokenCallback | None = None) -> None:
        self.progress = progress
        self.description = description
        self.task = progress.add_task(description, total=total, rate="")
        self.on_tokens = on_tokens
        self.start = time.perf_counter()
        self.tokens = 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.progress.update(self.task, advance=tokens, rate=f"{rate:,.1f} tok/s")
        if self.on_tokens is not None:
            self.on_tokens(tokens, self.description)


def expected_tokens(prompts: list[list[int]], max_new_tokens: int) -> int:
    return sum(len(p) for p in prompts) + len(prompts) * max_new_tokens


# ----------------------------------------------------------------------------- capture
def calibrate(moe: Any, prompts: list[list[int]], max_new_tokens: int, batch: int, pad_id: int,
              eos_ids: set[int], progress: Any, on_tokens: TokenCallback | None = None) -> Any:
    """Run the calibration prompts (never written) and fit the predictors on them."""
    from moesim.trace.capture.predict import CalibrationCollector
    collector = CalibrationCollector(moe.spec.num_layers, moe.spec.hidden_size)
    meter = TokenMeter(progress, "calibrating", expected_tokens(prompts, max_new_tokens), on_tokens)

    def on_step(rows: Any, layers: list[Any]) -> None:
        collector.consume(rows, layers)
        meter.add(rows.tokens)

    run_batches(moe, prompts, max_new_tokens, batch, pad_id, eos_ids, on_step, collector.end_batch)
    return collector.fit(moe.routers)


def capture_loaded(moe: Any, prompts: list[list[int]], out: Path, max_new_tokens: int, *, batch: int = 1,
                   calibration: list[list[int]] | None = None, source: dict[str, Any] | None = None,
                   tokenizer: Any = None, progress: bool = False,
                   on_tokens: TokenCallback | None = None) -> CaptureReport:
    """Capture a trace from an already loaded :class:`~moesim.trace.capture.model.MoEModel`; ``progress`` draws
    a rich token bar, ``on_tokens`` hears every pass's tokens (calibration included)."""
    from moesim.trace.capture.predict import TraceRows
    from moesim.trace.io import TraceWriter

    pad_id, eos_ids = special_ids(moe.model, tokenizer)
    with _progress(progress) as bar:
        begin = time.perf_counter()
        predictors = (calibrate(moe, calibration, max_new_tokens, batch, pad_id, eos_ids, bar, on_tokens)
                      if calibration else None)
        calibration_seconds = time.perf_counter() - begin
        builder = TraceRows(moe.routers, moe.arch.scores_function, predictors)
        status = predictor_status(predictors, calibration is not None, moe.spec.num_layers)
        meta = trace_metadata(moe, {"max_new_tokens": max_new_tokens, "batch": batch,
                                    "eos_token_ids": sorted(eos_ids), "predictors": status,
                                    "calibration_tokens": predictors.calibration_tokens if predictors else 0,
                                    **(source or {})})
        meter = TokenMeter(bar, "capturing", expected_tokens(prompts, max_new_tokens), on_tokens)
        begin = time.perf_counter()
        with TraceWriter(out, meta, builder.columns) as writer:
            buffer = StepBuffer(writer)

            def on_step(rows: Any, layers: list[Any]) -> None:
                buffer.add(builder.build(buffer.steps, rows, layers), rows)
                meter.add(rows.tokens)

            run_batches(moe, prompts, max_new_tokens, batch, pad_id, eos_ids, on_step)
            buffer.flush()
    return CaptureReport(out=Path(out), requests=len(prompts), steps=buffer.steps, rows=buffer.rows,
                         prefill_tokens=buffer.tokens[0], decode_tokens=buffer.tokens[1],
                         seconds=time.perf_counter() - begin, predictors=status,
                         calibration_tokens=predictors.calibration_tokens if predictors else 0,
                         calibration_seconds=calibration_seconds, state=predictors)


def trace_metadata(moe: Any, run: dict[str, Any]) -> TraceMeta:
    """The trace's ``moesim`` metadata: model spec, routing rules, run settings, versions."""
    import torch
    import transformers
    config = moe.model.config
    source = {
        "kind": "captured", "decoding": "greedy", "model_type": moe.arch.model_type,
        "moe_decoder_layers": moe.decoder_layers, "scores": moe.arch.scores_function,
        "weights": moe.arch.weights_rule(config), "routed_scaling_factor": moe.arch.routed_scaling_factor(config),
        # the model's dtype, not the router's: DeepSeek keeps its router weight in float32 in any model dtype
        # (_keep_in_fp32_modules_strict in transformers' modeling_deepseek_v2/v3.py)
        "dtype": str(moe.model.dtype).replace("torch.", ""), "device": str(moe.device),
        "torch": torch.__version__, "transformers": transformers.__version__,
        # where each number of the model metadata came from (the expert dtype assumed for a float32 config, say):
        # the trace's model metadata keeps no sources of its own (ModelSpec.to_dict drops them)
        "model_sources": dict(moe.spec.sources), **run,
    }
    return TraceMeta(model=moe.spec, source=source, weights_renormalized=moe.arch.renormalized(config))


class StepBuffer:
    """Collects built steps and writes them in batches of about FLUSH_ROWS rows (few, large row groups)."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.pending: list[dict[str, Any]] = []
        self.pending_rows = 0
        self.steps = 0
        self.rows = 0
        self.tokens = [0, 0]  # prefill, decode

    def add(self, data: dict[str, Any], rows: Any) -> None:
        self.pending.append(data)
        self.pending_rows += len(data["layer"])
        self.steps += 1
        self.tokens[rows.phase] += rows.tokens
        if self.pending_rows >= FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.writer.write(concat_steps(self.pending))
        self.rows += self.pending_rows
        self.pending, self.pending_rows = [], 0


def concat_steps(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate built steps column by column; list columns are (offsets, values) pairs."""
    data: dict[str, Any] = {}
    for name in parts[0]:
        columns = [p[name] for p in parts]
        if isinstance(columns[0], tuple):
            shifts = np.cumsum([0] + [int(offsets[-1]) for offsets, _ in columns[:-1]])
            offsets = np.concatenate([columns[0][0]] + [off[1:] + shift for (off, _), shift
                                                        in zip(columns[1:], shifts[1:])])
            data[name] = (offsets.astype(np.int32), np.concatenate([values for _, values in columns]))
        else:
            data[name] = np.concatenate(columns)
    return data


def predictor_status(predictors: Any, calibrated: bool, num_layers: int) -> dict[str, str]:
    """Per predictor column: what it holds, or why it was left out."""
    status = {"pred_next_layer": "written (layer l+1's gate on layer l's gate input; last layer empty)"}
    if num_layers < 2:
        status["pred_next_layer"] = "written, empty (the model has one MoE layer)"
    if not calibrated:
        reason = "omitted: no --calibration-prompts"
        return {**status, "pred_residual": reason, "pred_next_token": reason}
    status["pred_residual"] = (f"written (mean residual over {predictors.calibration_tokens} calibration tokens)"
                               if predictors.residual is not None else "omitted: calibration produced no tokens")
    status["pred_next_token"] = (f"written (ridge fit on {predictors.next_token_pairs} calibration decode tokens)"
                                 if predictors.next_token is not None
                                 else "omitted: calibration produced no decode tokens (raise --max-new-tokens)")
    return status


def capture(config: CaptureConfig, *, progress: bool = False, on_tokens: TokenCallback | None = None) -> CaptureReport:
    """Load the model named in ``config``, capture its routing on the prompts, write the trace (``progress``,
    ``on_tokens``: as :func:`capture_loaded`)."""
    from moesim.trace.capture.model import load_config, load_model, load_tokenizer, inspect_model, require_torch
    from moesim.trace.capture.arch import config_to_spec
    from moesim.trace.validate import check_path_writable

    config.check()
    require_torch()
    with _naming_option("--prompts"):
        prompt_bytes = read_prompts_file(config.prompts)  # read once: the prompts may come through a pipe
        prompts = load_prompts(config.prompts, prompt_bytes)
    with _naming_option("--calibration-prompts"):
        calibration = load_prompts(config.calibration_prompts) if config.calibration_prompts else None
    out = check_path_writable(config.out)
    hf_config, name, local_only = load_config(config.model)
    try:
        config_to_spec(hf_config, name=_display_name(config.model))  # config-only errors before loading weights
    except MoesimError as err:
        # name the file the error is in, not the spec's display name ('qwen2' for any folder named so)
        err.name_source(str(Path(name) / "config.json") if local_only and Path(name).is_dir() else config.model)
        raise
    needs_tokenizer = any(p.text is not None for p in prompts + (calibration or []))
    tokenizer = load_tokenizer(name, local_only) if needs_tokenizer else None
    # Prompts against the vocabulary and the context before the weights load: config.json and the tokenizer
    # are all they need, and loading a large checkpoint takes minutes.
    vocab = int(hf_config.vocab_size)
    ids = tokenize(prompts, tokenizer, vocab, str(config.prompts))
    calib_ids = tokenize(calibration, tokenizer, vocab, str(config.calibration_prompts)) if calibration else None
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit:
        check_context(ids, prompts, config.max_new_tokens, int(limit), str(config.prompts))
        if calib_ids and calibration:
            check_context(calib_ids, calibration, config.max_new_tokens, int(limit), str(config.calibration_prompts))
    model = load_model(name, local_only, config.dtype, config.device)
    moe = inspect_model(model, name=_display_name(config.model))
    source = {"model": config.model, "prompts": str(config.prompts),
              "prompts_sha256": hashlib.sha256(prompt_bytes).hexdigest(),
              "calibration_prompts": str(config.calibration_prompts) if config.calibration_prompts else None}
    with trace_target(out) as target:
        report = capture_loaded(moe, ids, target, config.max_new_tokens, batch=config.batch,
                                calibration=calib_ids, source=source, tokenizer=tokenizer, progress=progress,
                                on_tokens=on_tokens)
    report.out = Path(out)
    if calib_ids:
        shared = len({tuple(p) for p in ids} & {tuple(p) for p in calib_ids})
        if shared:
            report.notes.append(f"{shared} calibration prompt(s) also appear in {config.prompts}: "
                                "predictor accuracy on this trace is optimistic")
    return report


@contextlib.contextmanager
def _naming_option(option: str) -> Iterator[None]:
    """A fault of a whole prompts file (not found, empty, not UTF-8) names the option that gave it: the
    calibration file's said 'prompts file not found' like the prompts' own."""
    try:
        yield
    except PromptsError as err:
        if err.field is None and err.row is None:
            err.rename_field(option)
        raise


@contextlib.contextmanager
def trace_target(out: Path) -> Iterator[Path]:
    """Where the trace is written: ``out`` itself (the trace writer renames its temporary file into place,
    and the next capture to ``out`` removes one a killed capture left), or, for a special file such as
    /dev/stdout or a pipe, a temporary file whose bytes are copied into it: a rename would replace it."""
    from moesim.util import PARQUET, is_special_file, output_file
    if not is_special_file(out):
        yield out
        return
    with output_file(out, "--out", PARQUET) as target:
        yield target


def check_context(ids: list[list[int]], prompts: list[Prompt], max_new_tokens: int, limit: int, source: str) -> None:
    """Refuse, in one line, a prompt whose tokens and ``max_new_tokens`` reach past the model's ``limit``
    positions (``max_position_embeddings``): the model would run on, past what it was trained for."""
    longest = max(range(len(ids)), key=lambda i: len(ids[i]), default=None)
    if longest is None or len(ids[longest]) + max_new_tokens <= limit:
        return
    tokens, line = len(ids[longest]), prompts[longest].line
    fix = (f"use --max-new-tokens {limit - tokens} or less, or shorter prompts" if tokens < limit
           else f"shorten the prompt to fewer than {limit} tokens")
    raise ConfigError(f"the prompt of line {line} has {tokens:,} tokens: with --max-new-tokens {max_new_tokens:,} "
                      f"it reaches {tokens + max_new_tokens:,} positions, past the model's {limit:,} "
                      "(max_position_embeddings)", source=source, field="--max-new-tokens", fix=fix)


def _display_name(model: str) -> str:
    """The model's name in the trace: its folder's name (the folder itself for '.', '..' or '~/ckpt/'; the
    repository's for a Hugging Face cache snapshot), or the hub id's last part."""
    path = Path(model).expanduser()
    if path.is_dir():
        path = path.resolve()
        # a Hugging Face cache snapshot, .../models--Org--Name/snapshots/<commit>: the repository's name, not
        # the commit hash
        if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
            return path.parent.parent.name.split("--")[-1].lower()
    return path.name.lower() or model
