"""Parameters of the synthetic trace generator (:mod:`moesim.trace.synth`): their per-model defaults, taken from
the calibration logs, their ranges, and the configuration of one synthetic trace."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from moesim.errors import ConfigError, did_you_mean
from moesim.model.presets import load_preset
from moesim.model.spec import ModelSpec

# Default generator parameters at two calibration anchors, interpolated linearly in
# log2(num_experts / top_k) and clamped outside [4, 16] (the documented per-preset rule);
# cluster_size defaults to top_k (see SynthParams.for_model). Fitted on calibration files only:
# "coarse" (E/k = 4), Mixtral-8x7B: speculative-moe humaneval_2_routing.jsonl (top-10% share 0.184,
#   previous-token reuse 0.401, co-activation top-4 share 0.848, top-1 weight share 0.716) and
#   routing_raw.jsonl (0.185, 0.397, 0.831, 0.715); corpus skew from OLMoE-routing-stats
#   mistral/expert_counts arxiv/book/c4 (top-1 share 0.144 averaged over layers 0/7/15), which a long
#   many-request synthetic trace reproduces (0.145) while a 2-request one is more skewed (0.185),
#   hence a strong request_bias and weak static skew.
# "fine" (E/k = 16), Qwen3-30B-A3B: soryxie token_distri_8 prefill batch (top-10% share 0.386, first
#   layer 0.227, reuse 0.457, co-activation 0.346; synthetic 2 x 1025-token prefill: 0.35, 0.23, 0.44,
#   0.33). score_scale is set so that the FLAME-MoE-290M shape (E/k = 10.7) gets the top-1 share of its
#   top-6 scores measured in the flame npz (0.327). FLAME's own skew (0.128) and reuse (0.105, barely
#   above chance) are far below every other model, so they are not fitted.
_ANCHORS: dict[str, dict[str, float]] = {
    "coarse": {"skew_first": 0.1, "skew_last": 0.2, "request_bias": 0.7, "cluster_strength": 2.0,
               "token_corr": 0.3, "score_scale": 1.2},
    "fine": {"skew_first": 0.5, "skew_last": 1.6, "request_bias": 0.8, "cluster_strength": 2.5,
             "token_corr": 0.7, "score_scale": 0.3},
}
_ANCHOR_RATIO = {"coarse": 4.0, "fine": 16.0}

#: Whether the model renormalizes its top-k gate weights (Hugging Face config ``norm_topk_prob``
#: or modeling code): Mixtral renormalizes in MixtralSparseMoeBlock; DeepSeek-V2/V3 and Qwen3
#: set norm_topk_prob true; OLMoE, Qwen1.5-MoE and Qwen2-MoE set it false. Prefix match on name.
_RENORMALIZED = {"mixtral": True, "deepseek-v3": True, "deepseek-v2": False, "qwen3": True,
                 "qwen1.5": False, "qwen2": False, "olmoe": False, "flame": False}


def default_renormalized(model: ModelSpec) -> bool:
    for prefix, value in _RENORMALIZED.items():
        if model.name.lower().startswith(prefix):
            return value
    return True


def anchor_defaults(num_experts: int, top_k: int) -> dict[str, float]:
    """Routing parameters for a model shape: the anchors interpolated in log2(E / k)."""
    lo, hi = math.log2(_ANCHOR_RATIO["coarse"]), math.log2(_ANCHOR_RATIO["fine"])
    x = min(max(math.log2(num_experts / top_k), lo), hi)
    frac = (x - lo) / (hi - lo)
    return {key: round(_ANCHORS["coarse"][key] + frac * (_ANCHORS["fine"][key] - _ANCHORS["coarse"][key]), 4)
            for key in _ANCHORS["coarse"]}


#: Largest logit-scale parameter (skew, request_bias, cluster_strength, score_scale). Scores are stored as
#: float16, whose smallest positive value is about e^-17: once logit gaps pass 17 every expert but the top
#: one scores 0. At 100 one term outweighs the others (defaults 0.1 to 2.5) far past that point, so larger
#: values change nothing but the risk of float64 logits overflowing (1e308 gave nan scores, which replay
#: refuses).
LOGIT_LIMIT = 100.0

#: logit offset of a cold expert (:attr:`SynthParams.cold_fraction`), measured on the Qwen3-30B-A3B calibration
#: trace (soryxie token_distri_8, one 2,050-token prefill batch), the other parameters as fitted to it: at 6 and
#: above a cold expert is all but dead, so the prefill coverage (moesim.trace.stats) of a 1,024-token step and
#: of a 2,050-token step agree within 0.3% (0.861, 0.863 with 14% of the experts cold) and a fit on shortened
#: candidates holds at the real length, and the cold share that fits the coverage (0.14) is the share of that
#: batch's experts with no token at all (0.138). At 3 they still take a token now and then: 0.909 and 0.931.
COLD_OFFSET = 8.0


@dataclass
class SynthParams:
    """Generator parameters, settable with ``--set key=value``; :data:`PARAM_RANGES` holds their ranges."""

    #: Zipf exponent of expert popularity at the first MoE layer (0 to 100; 0: every expert equally popular)
    skew_first: float = 0.3
    #: Zipf exponent of expert popularity at the last MoE layer (0 to 100)
    skew_last: float = 0.6
    #: std of a request's own per-expert logit offset (prompt-specific hot experts; 0 to 100)
    request_bias: float = 0.5
    #: experts per co-activation cluster (0 to the model's experts; 0 = one per expert, no clusters)
    cluster_size: int = 0
    #: std of the logit component shared by a cluster (0 to 100)
    cluster_strength: float = 0.6
    #: AR(1) correlation of a request's logit noise from one token to the next (0 to 1)
    token_corr: float = 0.5
    #: logit multiplier inside the score softmax (larger = a few high scores, many low; above 0, at most 100)
    score_scale: float = 1.0
    #: recall of pred_next_layer: HybriMoE's layer-wise predictor, 72.6% on DeepSeek and
    #: 77.6% on Qwen (003_46c415738ddfa491.txt Table 5, average column)
    recall_next_layer: float = 0.75
    #: recall of pred_residual: DALI's residual-corrected predictor, 79.5% and 93.3% (003 Table 5)
    recall_residual: float = 0.86
    #: recall of pred_next_token: SMoE's token-wise predictor is less accurate per layer than
    #: layer-wise prediction (000_dba2fecbbc66318b.txt Sec. IV-D, Fig. 3)
    recall_next_token: float = 0.6
    #: share of each layer's experts, the least popular by static rank, whose logits are lowered by 8
    #: (COLD_OFFSET): experts a whole prefill batch leaves (nearly) unused, a tail heavier than the Zipf
    #: profile gives (0 to 1; 0 = off, which keeps every trace synthesized before it byte-identical; the
    #: fit sets it from the real trace's prefill coverage, for models of 32 experts or more)
    cold_fraction: float = 0.0
    #: renormalize the top-k weights to sum 1 (default: the model's convention)
    renormalize: bool = True
    #: write the predictor columns (false: leave them out)
    predictors: bool = True

    @classmethod
    def for_model(cls, model: ModelSpec) -> "SynthParams":
        """Defaults for a model: anchors by expert granularity, one cluster per routed set (top_k experts)."""
        values: dict[str, Any] = dict(anchor_defaults(model.num_experts, model.top_k))
        values["cluster_size"] = model.top_k
        values["renormalize"] = default_renormalized(model)
        return cls(**values)

    def check(self, num_experts: int) -> None:
        """Refuse a value outside its range (nan and inf included: no comparison admits them)."""
        for name, (low, high, low_allowed) in PARAM_RANGES.items():
            value = getattr(self, name)
            if not (low <= value <= high if low_allowed else low < value <= high):
                span = f"{'[' if low_allowed else '('}{low:g}, {high:g}]"
                raise ConfigError(f"must lie in {span}, got {value}", field=name,
                                  fix=f"--set {name}=VALUE with VALUE in {span}")
        if not 0 <= self.cluster_size <= num_experts:
            raise ConfigError(f"must lie in [0, {num_experts}] (the model's experts), got {self.cluster_size}",
                              field="cluster_size", fix=f"--set cluster_size=VALUE with VALUE in [0, {num_experts}]")


#: valid values of each float parameter of :class:`SynthParams`: (lowest, highest, whether the lowest is
#: allowed); correlations and recalls are probabilities, the rest logit scales (see LOGIT_LIMIT). A
#: score_scale of 0 makes every score equal, so the routed experts would be picked by a sort's tie order.
PARAM_RANGES: dict[str, tuple[float, float, bool]] = {
    "skew_first": (0.0, LOGIT_LIMIT, True), "skew_last": (0.0, LOGIT_LIMIT, True),
    "request_bias": (0.0, LOGIT_LIMIT, True), "cluster_strength": (0.0, LOGIT_LIMIT, True),
    "score_scale": (0.0, LOGIT_LIMIT, False), "token_corr": (0.0, 1.0, True),
    "cold_fraction": (0.0, 1.0, True), "recall_next_layer": (0.0, 1.0, True), "recall_residual": (0.0, 1.0, True), "recall_next_token": (0.0, 1.0, True),
}


def _coerce(name: str, text: str, kind: type) -> Any:
    try:
        if kind is bool:
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return lowered in ("true", "1", "yes")
        return kind(text)
    except ValueError:
        raise ConfigError(f"'{text}' is not {_a(kind)}", field=name, fix=f"--set {name}=<{kind.__name__}>") from None


def _a(kind: type) -> str:
    return f"{'an' if kind.__name__[0] in 'aeiou' else 'a'} {kind.__name__}"


def _setting(name: str, value: Any, kind: type) -> Any:
    """A generator parameter as its type: text as ``--set`` gives it, or a Python value that is one of that
    type (2.5 for an int was cut to 2, and 0.5 for a bool read as true, silently)."""
    if isinstance(value, str):
        return _coerce(name, value, kind)
    if kind is bool:
        fits = isinstance(value, (bool, np.bool_)) or (_whole(value) and value in (0, 1))
    elif kind is int:
        fits = _whole(value)
    else:
        fits = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if not fits:
        raise ConfigError(f"{value!r} is not {_a(kind)}", field=name, fix=f"give {name} {_a(kind)}")
    return kind(value)


def _whole(value: Any) -> bool:
    """An integer (not a bool), or a float without a fraction."""
    if isinstance(value, (bool, np.bool_)):
        return False
    return isinstance(value, numbers.Integral) or (isinstance(value, numbers.Real) and float(value).is_integer())


@dataclass
class SynthConfig:
    """Everything that determines a synthetic trace."""

    model: ModelSpec
    requests: int = 1
    prompt_len: int = 128
    decode_len: int = 128
    batch: int = 1
    seed: int = 0
    scores: bool = True
    params: SynthParams = field(default_factory=SynthParams)
    #: the real trace the parameters were fitted to (``trace synth --fit``), recorded in the metadata
    fitted_to: str = ""
    #: prompt tokens of each request, in request order (None: every request gets ``prompt_len``)
    prompt_lens: list[int] | None = None
    #: decode tokens of each request, in request order (None: every request gets ``decode_len``)
    decode_lens: list[int] | None = None

    def prompts(self) -> list[int]:
        """Prompt tokens of every request."""
        return list(self.prompt_lens) if self.prompt_lens is not None else [self.prompt_len] * self.requests

    def decodes(self) -> list[int]:
        """Decode tokens of every request."""
        return list(self.decode_lens) if self.decode_lens is not None else [self.decode_len] * self.requests

    @classmethod
    def from_settings(cls, *, model: str | ModelSpec, requests: int = 1, prompt_len: int = 128,
                      decode_len: int = 128, batch: int = 1, seed: int = 0,
                      settings: Mapping[str, Any] | None = None, scores: bool = True,
                      prompt_lens: Sequence[int] | None = None,
                      decode_lens: Sequence[int] | None = None) -> "SynthConfig":
        """Build a config from a preset name (or spec) and ``--set`` overrides of :class:`SynthParams`.
        ``prompt_lens`` and ``decode_lens``, one entry per request, replace ``prompt_len`` and ``decode_len``."""
        spec = load_preset(model) if isinstance(model, str) else model
        params = SynthParams.for_model(spec)
        kinds = {f.name: f.type for f in dataclasses.fields(SynthParams)}
        types = {"float": float, "int": int, "bool": bool}
        for key, value in (settings or {}).items():
            if key not in kinds:
                raise ConfigError(f"unknown generator parameter '{key}'", field=key,
                                  fix=f"{did_you_mean(key, kinds)}valid keys: {', '.join(sorted(kinds))}")
            kind = types[str(kinds[key])]
            setattr(params, key, _setting(key, value, kind))
        params.check(spec.num_experts)
        for name, value in (("requests", requests), ("prompt_len", prompt_len), ("batch", batch), ("seed", seed),
                            ("decode_len", decode_len)):
            if not _whole(value):  # requests="2" failed with a TypeError from the comparison below
                raise ConfigError(f"must be a whole number, got {value!r}", field=name, fix=f"e.g. {name}=2")
        for name, value in (("requests", requests), ("prompt_len", prompt_len), ("batch", batch)):
            if value < 1:
                raise ConfigError(f"must be at least 1, got {value}", field=name)
        if seed < 0:
            raise ConfigError(f"must not be negative, got {seed}", field="seed", fix="--seed 0")
        if decode_len < 0:
            raise ConfigError(f"must not be negative, got {decode_len}", field="decode_len")
        config = cls(model=spec, requests=int(requests), prompt_len=int(prompt_len), decode_len=int(decode_len),
                     batch=int(batch), seed=int(seed), scores=scores, params=params)
        if prompt_lens is not None:
            config.prompt_lens = checked_lengths(prompt_lens, "prompt_lens", 1, int(requests))
        if decode_lens is not None:
            config.decode_lens = checked_lengths(decode_lens, "decode_lens", 0, int(requests))
        return config

    def _recorded_params(self) -> dict[str, Any]:
        """The parameters for the metadata; cold_fraction only when set, so a trace without cold experts
        keeps the metadata (and bytes) it had before the parameter existed."""
        params = dataclasses.asdict(self.params)
        if not params["cold_fraction"]:
            del params["cold_fraction"]
        return params

    def source(self) -> dict[str, Any]:
        # the per-request lists only when given, so a trace of equal lengths keeps its metadata (and bytes)
        lengths = {name: list(values) for name, values in (("prompt_lens", self.prompt_lens),
                                                           ("decode_lens", self.decode_lens)) if values is not None}
        return {"kind": "synthetic", "generator": "moesim.trace.synth", "model": self.model.name,
                "requests": self.requests, "prompt_len": self.prompt_len, "decode_len": self.decode_len,
                "batch": self.batch, "seed": self.seed, "params": self._recorded_params(),
                **lengths, **({"fitted_to": self.fitted_to} if self.fitted_to else {})}


def checked_lengths(values: Sequence[Any], name: str, minimum: int, requests: int | None = None,
                    field: str | None = None) -> list[int]:
    """Per-request token counts as ints: whole numbers, at least ``minimum``, one per request when ``requests``
    is given. ``field`` names them in the error (the CLI's option; default ``name``)."""
    field = field or name
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, (Sequence, np.ndarray)):
        raise ConfigError(f"must be a list of whole numbers, got {values!r}", field=field, fix=_lengths_fix(field))
    if not len(values):
        raise ConfigError("is empty", field=field, fix=_lengths_fix(field))
    for index, value in enumerate(values):
        if not _whole(value):
            raise ConfigError(f"entry {index + 1} is not a whole number: {value!r}", field=field,
                              fix=_lengths_fix(field))
        if value < minimum:
            raise ConfigError(f"entry {index + 1} is {value}, below {minimum}", field=field,
                              fix=f"give every request at least {minimum} token{'s' if minimum != 1 else ''}")
    if requests is not None and len(values) != requests:
        raise ConfigError(f"has {len(values)} entries for {requests} requests", field=field,
                          fix=f"give one length per request ({requests}), or ask for {len(values)} requests")
    return [int(value) for value in values]


def _lengths_fix(field: str) -> str:
    return f"one whole number per request, e.g. {field} 12,300,40" if field.startswith("--") else \
        f"one whole number per request, e.g. {field}=[12, 300, 40]"
