"""Model presets: YAML files in ``presets/``, every number with its source.

A preset file holds the :class:`ModelSpec` fields plus ``sources``, a mapping
from field name (or ``"*"`` for all fields of one config file) to the document
the number comes from. A preset of one's own (``--model my.yaml``) is held to the
same rule: a number that no key and no ``"*"`` covers is refused, naming it.
"""

from __future__ import annotations

import dataclasses
import os
from functools import lru_cache
from pathlib import Path

from moesim.errors import ConfigError, did_you_mean
from moesim.model.spec import ModelSpec
from moesim.util import read_yaml, yaml_beside

PRESET_DIR = Path(__file__).with_name("presets")


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name_or_path: str) -> Path:
    """The YAML file behind a preset name or path (which may not exist)."""
    path = Path(name_or_path)
    # A name such as "qwen1.5-moe-a2.7b" has a dot, so only a YAML suffix marks a path.
    if path.suffix in (".yaml", ".yml"):
        return path
    return yaml_beside(name_or_path) or PRESET_DIR / f"{name_or_path}.yaml"


@lru_cache(maxsize=None)
def load_preset(name_or_path: str) -> ModelSpec:
    """Load a preset by name (``mixtral-8x7b``) or from a YAML path (``presets/x.yaml``, or ``presets/x``
    where ``presets/x.yaml`` exists)."""
    path = preset_path(name_or_path)
    if not path.exists() and Path(name_or_path).is_file():  # a file, but not a preset's (a trace, a log)
        raise ConfigError("not a model preset: a preset is a YAML file (.yaml or .yml)", source=str(name_or_path),
                          field="--model", fix=f"give a preset YAML, or one of {', '.join(available_presets())}")
    if not path.exists():
        choices = f"use one of {', '.join(available_presets())} or a preset YAML path"
        if path.parent != PRESET_DIR or os.sep in str(name_or_path):
            raise ConfigError("model preset file not found", source=str(name_or_path), field="--model",
                              fix=f"{did_you_mean(Path(name_or_path).stem, available_presets())}check the path, "
                                  f"or {choices}")
        raise ConfigError(f"unknown model preset '{name_or_path}'", field="--model",
                          fix=f"{did_you_mean(str(name_or_path), available_presets())}{choices}")
    data = read_yaml(path, ConfigError)
    if not isinstance(data, dict):
        raise ConfigError("a preset must be a YAML mapping", source=str(path))
    sources = checked_sources(data.pop("sources", None), str(path))
    check_every_number_sourced(data, sources, str(path))
    spec = ModelSpec.from_dict(data, origin=str(path))
    spec.check_total_params(str(path))
    object.__setattr__(spec, "sources", sources)
    return spec


def check_every_number_sourced(data: dict, sources: dict[str, str], origin: str) -> None:
    """Refuse a preset with a number no source names: every number of a preset names where it comes from,
    by its own key or by ``"*"``."""
    if "*" in sources:
        return
    unsourced = [key for key, value in data.items()
                 if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in sources]
    if unsourced:
        raise ConfigError(f"no source for {', '.join(unsourced)}", source=origin, field="sources",
                          fix=f"name the document each comes from (sources: {{{unsourced[0]}: \"config.json\"}}), "
                              'or one for every field with sources: {"*": "org/model config.json"}')


SOURCES_FIX = ('map each number to the document it comes from, e.g. sources: {"*": "org/model config.json", '
               'total_params: "model card"}')


def checked_sources(sources: object, origin: str) -> dict[str, str]:
    """The preset's ``sources``: a mapping whose keys are fields (or ``"*"``, all of them) and whose values
    name a document (:func:`check_every_number_sourced` checks that each number has one)."""
    if not sources:
        raise ConfigError("preset has no sources", source=origin, field="sources",
                          fix="name the config file or paper table for every number")
    if not isinstance(sources, dict):
        raise ConfigError(f"must be a mapping from field to source, got {type(sources).__name__}",
                          source=origin, field="sources", fix=SOURCES_FIX)
    fields = {f.name for f in dataclasses.fields(ModelSpec)} - {"sources"}
    for key, text in sources.items():
        if key != "*" and key not in fields:
            raise ConfigError(f"names no model field: '{key}'", source=origin, field=f"sources.{key}",
                              fix=f"{did_you_mean(str(key), fields)}use a field of the preset, or '*' for all")
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"must name a document, got {text!r}", source=origin, field=f"sources.{key}",
                              fix="write where the number comes from (config.json, model card, paper table)")
    return {str(key): text for key, text in sources.items()}
