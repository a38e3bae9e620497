"""Errors ``moesim capture`` raises for bad input: one line each, naming what and how to fix."""

from __future__ import annotations

from moesim.errors import MoesimError

TORCH_EXTRA_FIX = "pip install -e '.[torch]'"


class CaptureError(MoesimError):
    """A capture that cannot start or go on because of its inputs."""


class TorchMissingError(CaptureError):
    """torch or transformers is not installed."""

    def __init__(self) -> None:
        super().__init__(f"install the torch extra: {TORCH_EXTRA_FIX}")


class ModelNotFoundError(CaptureError):
    """``--model`` names neither a usable local checkpoint nor a model that could be loaded."""


class NoMoELayersError(CaptureError):
    """The architecture has no mixture-of-experts layer to trace."""


class UnsupportedRouterError(CaptureError):
    """The model has MoE layers whose router capture does not know how to read."""


class PromptsError(CaptureError):
    """A prompts file that is missing, empty or malformed."""
