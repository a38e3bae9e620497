"""Hooks that see every forward pass of ``generate`` and every MoE router in it.

:class:`RouterTap` records, per forward pass, each MoE layer's gate input and
the router's own ``(logits, weights, indices)``; :class:`BatchTracker` says
which of the pass's flattened token rows are real tokens (left padding and
requests that already ended produce none) and which request, position and
token each one is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

PREFILL, DECODE = 0, 1


@dataclass
class LayerRouting:
    """One MoE layer in one forward pass: gate input rows and the router's outputs for them."""

    hidden: torch.Tensor  # (tokens, hidden)
    logits: torch.Tensor  # (tokens, num_experts)
    weights: torch.Tensor  # (tokens, top_k), as the model applies them
    indices: torch.Tensor  # (tokens, top_k)


@dataclass
class StepRows:
    """The real tokens of one forward pass, in (request, position) order."""

    phase: int
    request: np.ndarray  # int32
    position: np.ndarray  # int32
    token_id: np.ndarray  # int32
    #: flat row indices into the pass's (batch * seq) token rows; None = all rows, in order
    select: torch.Tensor | None

    @property
    def tokens(self) -> int:
        return len(self.request)


class RouterTap:
    """Forward hooks on the model and its routers; ``on_step(input_ids, layers)`` runs after each pass."""

    def __init__(self, model: Any, routers: list[Any],
                 on_step: Callable[[torch.Tensor, list[LayerRouting]], None]) -> None:
        self.model = model
        self.routers = routers
        self.on_step = on_step
        self._handles: list[Any] = []
        self._input_ids: torch.Tensor | None = None
        self._layers: list[LayerRouting | None] = []

    def __enter__(self) -> "RouterTap":
        self._handles.append(self.model.register_forward_pre_hook(self._begin, with_kwargs=True))
        for index, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._router_hook(index)))
        self._handles.append(self.model.register_forward_hook(self._end))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _begin(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids")
        self._input_ids = ids if ids is not None else (args[0] if args else None)
        self._layers = [None] * len(self.routers)

    def _router_hook(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: tuple, output: tuple) -> None:
            hidden = args[0]
            self._layers[index] = LayerRouting(hidden.reshape(-1, hidden.shape[-1]), output[0], output[1], output[2])
        return hook

    def _end(self, module: Any, args: tuple, output: Any) -> None:
        missing = [i for i, layer in enumerate(self._layers) if layer is None]
        if missing or self._input_ids is None:
            raise RuntimeError(f"forward pass ran without MoE layer(s) {missing} or without input_ids")
        self.on_step(self._input_ids, self._layers)  # type: ignore[arg-type]


class BatchTracker:
    """Request/position bookkeeping for one left-padded ``generate`` batch.

    The first pass is the prefill of every prompt; each later pass feeds one
    generated token per request. A request ends when it is fed an end-of-
    sequence token: that token and whatever ``generate`` pads it with after
    produce no rows, as a server would not run them.
    """

    def __init__(self, requests: list[int], prompts: list[list[int]], eos_ids: set[int]) -> None:
        self.requests = np.asarray(requests, dtype=np.int32)
        self.lengths = np.array([len(p) for p in prompts], dtype=np.int32)
        self.width = int(self.lengths.max())
        self.prompts = prompts
        self.eos_ids = np.array(sorted(eos_ids), dtype=np.int64)
        self.finished = np.zeros(len(prompts), dtype=bool)
        self.passes = 0

    def padded_inputs(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ``input_ids`` and ``attention_mask``."""
        ids = torch.full((len(self.prompts), self.width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(self.prompts), self.width), dtype=torch.long)
        for row, prompt in enumerate(self.prompts):
            ids[row, self.width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, self.width - len(prompt):] = 1
        return ids, mask

    def rows(self, input_ids: torch.Tensor, device: Any) -> StepRows:
        first = self.passes == 0
        self.passes += 1
        return self._prefill_rows(input_ids, device) if first else self._decode_rows(input_ids, device)

    def _prefill_rows(self, input_ids: torch.Tensor, device: Any) -> StepRows:
        if tuple(input_ids.shape) != (len(self.prompts), self.width):
            raise RuntimeError(f"prefill pass has input shape {tuple(input_ids.shape)}, "
                               f"expected {(len(self.prompts), self.width)}")
        request = np.repeat(self.requests, self.lengths)
        position = np.concatenate([np.arange(n, dtype=np.int32) for n in self.lengths])
        token_id = np.concatenate([np.asarray(p, dtype=np.int32) for p in self.prompts])
        pad = self.width - self.lengths
        select = None
        if pad.any():
            rows = np.repeat(np.arange(len(self.prompts)), self.lengths)
            flat = rows * self.width + pad[rows] + position
            select = torch.as_tensor(flat, dtype=torch.long, device=device)
        return StepRows(PREFILL, request, position, token_id, select)

    def _decode_rows(self, input_ids: torch.Tensor, device: Any) -> StepRows:
        if input_ids.shape[-1] != 1:
            raise RuntimeError(f"decode pass has {input_ids.shape[-1]} tokens per request, expected 1")
        fed = input_ids[:, -1].cpu().numpy().astype(np.int64)
        if len(self.eos_ids):
            self.finished |= np.isin(fed, self.eos_ids)
        active = np.flatnonzero(~self.finished)
        position = (self.lengths[active] + self.passes - 2).astype(np.int32)
        select = None
        if len(active) != len(self.prompts):
            select = torch.as_tensor(active, dtype=torch.long, device=device)
        return StepRows(DECODE, self.requests[active], position, fed[active].astype(np.int32), select)
