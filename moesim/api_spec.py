"""A sweep spec given to :func:`moesim.sweep` as a dict, read as its YAML would be (a tuple, range, numpy array
or Series of values as a list, a numpy number as a Python one, a per-layer list as the string ``--set``
reads), and the sweep's results with one type per column, as its results file holds them."""

from __future__ import annotations

import os
from typing import Any, Mapping

from moesim import sweep as sweep_module
from moesim.util import is_missing

#: keys of a sweep spec whose value is a list of values (of runs, not of one value)
SPEC_AXES = ("trace", "traces", "hw", "system", "systems", "seed", "seeds")


def plain_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A dict spec as its YAML would read: the values of an axis, of a ``grid`` or ``zip`` key given as a tuple,
    a range, a numpy array or a Series become a list (each was taken as one value: '[16 32]' is not a valid int),
    numpy numbers Python ones (a numpy seed was refused as no integer)."""
    out = dict(spec)
    for key in SPEC_AXES:
        if key in out:
            out[key] = plain_values(out[key])
    if isinstance(out.get("set"), Mapping):  # one value each: a list or array there is per-layer slots
        out["set"] = {k: setting_list(plain_number(v)) for k, v in out["set"].items()}
    if isinstance(out.get("grid"), Mapping):
        out["grid"] = settings_values(out["grid"])
    zips = out.get("zip")
    if isinstance(zips, Mapping):
        out["zip"] = settings_values(zips)
    elif isinstance(zips, (list, tuple)):
        out["zip"] = [settings_values(g) if isinstance(g, Mapping) else g for g in zips]
    if isinstance(out.get("per_system"), Mapping):  # each system's own set: and grid:, read as the spec's
        out["per_system"] = {name: plain_spec(own) if isinstance(own, Mapping) else own
                             for name, own in out["per_system"].items()}
    return out


def settings_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """A ``grid`` or ``zip`` mapping's lists of values; a value that is itself a list (per-layer slots, as
    :func:`replay` takes them) as the string ``--set`` reads (the spec refused it as no number or string)."""
    out: dict[str, Any] = {}
    for key, given in values.items():
        plain = plain_values(given)
        out[key] = [setting_list(v) for v in plain] if isinstance(plain, list) else plain
    return out


def setting_list(value: Any) -> Any:
    if getattr(value, "ndim", 0) > 0 or isinstance(value, (list, tuple)):
        return "[" + ",".join(str(plain_number(v)) for v in value) + "]"
    return value


def plain_values(value: Any) -> Any:
    if getattr(value, "ndim", 0) > 0:  # a numpy array or a Series
        return value.tolist()
    if isinstance(value, (tuple, range)):
        return [plain_number(v) for v in value]
    if isinstance(value, list):
        return [plain_number(v) for v in value]
    return plain_number(value)


def plain_number(value: Any) -> Any:
    """A numpy scalar as the Python number it holds, a ``pathlib.Path`` as its string (a calibration trace or an
    arrival file: the results file refused the Path with pyarrow's ArrowInvalid once every point had run);
    anything else as it is."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value.item() if getattr(value, "ndim", None) == 0 and hasattr(value, "item") else value


def one_type_per_column(frame: Any) -> Any:
    """``frame`` with each column that mixes kinds of values (``cache.slots_per_layer`` swept over ``2`` and
    ``"[2,1,...]"``) as strings, as the sweep's own results file holds it: ``frame.to_parquet`` refused such a
    column (ArrowInvalid), and a resumed sweep, read back from its file, gave strings where a fresh one gave
    both. A column of floats and missing values, or of missing values alone, is float64, as a fresh sweep gives
    it: the finished points a resumed sweep kept held None where a fresh one held NaN (``prefetch_precision`` of
    systems that never prefetch was an object column of None)."""
    for name in frame.columns:
        if frame[name].dtype == object:
            kinds = {type(v) for v in frame[name] if not is_missing(v)}
            if len(kinds) > 1:
                frame[name] = [None if is_missing(v) else sweep_module.setting_str(v) for v in frame[name]]
            elif all(issubclass(kind, float) for kind in kinds):
                frame[name] = frame[name].astype("float64")
    return frame
