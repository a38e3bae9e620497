"""``moesim capture``: record a real model's router decisions into a trace.

Importing this package needs neither torch nor transformers; :func:`capture`
raises :class:`TorchMissingError` (one line: install the torch extra) when
they are absent. Supported architectures: Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V2/V3, OLMoE and GPT-OSS, through the router modules of
transformers 5.
"""

from __future__ import annotations

from moesim.trace.capture.arch import ARCHITECTURES, config_to_spec
from moesim.trace.capture.errors import (CaptureError, ModelNotFoundError, NoMoELayersError, PromptsError,
                                         TorchMissingError, UnsupportedRouterError)
from moesim.trace.capture.prompts import Prompt, load_prompts
from moesim.trace.capture.run import CaptureConfig, CaptureReport, capture

__all__ = ["ARCHITECTURES", "CaptureConfig", "CaptureError", "CaptureReport", "ModelNotFoundError",
           "NoMoELayersError", "Prompt", "PromptsError", "TorchMissingError", "UnsupportedRouterError",
           "capture", "config_to_spec", "load_prompts"]
