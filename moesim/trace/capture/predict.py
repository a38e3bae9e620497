"""Predictor columns, computed once with the real model.

* ``pred_next_layer``: layer l+1's gate applied to layer l's gate input (the
  feature-based layer-wise prefetch the papers compare against).
* ``pred_residual``: the same after adding layer l's mean residual vector, the
  mean of (input of gate l+1 - input of gate l) over calibration tokens
  (DALI, 003_46c415738ddfa491.txt Sec. 4.2, Eq. 10-11).
* ``pred_next_token``: a predictor shaped like layer l's gate (a linear map
  hidden -> num_experts plus the gate's own selection rule) that maps this
  token's layer-l gate input to the next token's layer-l router logits,
  fitted by ridge least squares on calibration decode tokens (SMoE,
  000_dba2fecbbc66318b.txt Sec. IV-D, which trains a gate-shaped MLP on a few
  hundred decode samples; a closed-form fit keeps it deterministic).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moesim.trace.capture.tap import DECODE, LayerRouting, StepRows

#: ridge strength relative to the mean squared feature value; small, only for conditioning
RIDGE = 1e-3


def take(tensor: torch.Tensor, select: torch.Tensor | None) -> torch.Tensor:
    return tensor if select is None else tensor.index_select(0, select)


def rank_by_weight(weights: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids) with the highest weight first (DeepSeek routers return them unsorted)."""
    ordered, order = torch.sort(weights.float(), dim=-1, descending=True, stable=True)
    return ordered, indices.gather(-1, order)


@dataclass
class Predictors:
    """Calibrated predictor state: residual vectors and next-token gates (None = not calibrated)."""

    residual: torch.Tensor | None = None  # (num_layers - 1, hidden) float32
    next_token: list[Any] | None = None  # gate-shaped modules, one per MoE layer
    calibration_tokens: int = 0
    next_token_pairs: int = 0

    def next_token_weights(self) -> list[np.ndarray]:
        return [g.weight.detach().float().cpu().numpy() for g in self.next_token or []]

    def next_token_biases(self) -> list[np.ndarray | None]:
        return [None if getattr(g, "bias", None) is None else g.bias.detach().float().cpu().numpy()
                for g in self.next_token or []]


def ridge_fit(x: torch.Tensor, y: torch.Tensor, intercept: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W (out, in) and optional bias minimising |x W^T + b - y|^2 + lam |W|^2, in float64.

    The dual form is used when there are fewer samples than features.
    """
    x, y = x.double(), y.double()
    x_mean = x.mean(0) if intercept else None
    y_mean = y.mean(0) if intercept else None
    if intercept:
        x, y = x - x_mean, y - y_mean
    samples, features = x.shape
    lam = RIDGE * float((x * x).sum()) / max(samples * features, 1) * max(samples, 1) + 1e-12
    if samples >= features:
        coef = torch.linalg.solve(x.T @ x + lam * torch.eye(features, dtype=x.dtype, device=x.device), x.T @ y)
    else:
        coef = x.T @ torch.linalg.solve(x @ x.T + lam * torch.eye(samples, dtype=x.dtype, device=x.device), y)
    bias = (y_mean - x_mean @ coef) if intercept else None
    return coef.T.contiguous(), bias


def fit_next_token_gate(gate: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    """A copy of ``gate`` whose linear map is fitted to predict next-token logits ``y`` from ``x``."""
    has_bias = isinstance(getattr(gate, "bias", None), torch.Tensor)
    weight, bias = ridge_fit(x, y, intercept=has_bias)
    clone = copy.deepcopy(gate)
    with torch.no_grad():
        clone.weight.copy_(weight.to(clone.weight.dtype))
        if has_bias and bias is not None:
            clone.bias.copy_(bias.to(clone.bias.dtype))
    return clone


@dataclass
class CalibrationCollector:
    """Statistics of the calibration run: residual sums and (this token, next token) pairs per layer."""

    num_layers: int
    hidden_size: int
    residual_sum: torch.Tensor | None = None
    tokens: int = 0
    #: per request: each layer's gate input of its latest token, (layers, hidden)
    last_hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    pair_inputs: list[torch.Tensor] = field(default_factory=list)  # (n, layers, hidden) each
    pair_targets: list[torch.Tensor] = field(default_factory=list)  # (n, layers, experts) each

    def consume(self, rows: StepRows, layers: list[LayerRouting]) -> None:
        hidden = torch.stack([take(layer.hidden, rows.select) for layer in layers])  # (L, n, H)
        diffs = (hidden[1:].double() - hidden[:-1].double()).sum(1)
        self.residual_sum = diffs if self.residual_sum is None else self.residual_sum + diffs
        self.tokens += rows.tokens
        per_token = hidden.transpose(0, 1).detach().cpu()  # (n, L, H)
        if rows.phase == DECODE:
            logits = torch.stack([take(layer.logits, rows.select) for layer in layers]).transpose(0, 1).cpu()
            have = [j for j, r in enumerate(rows.request) if int(r) in self.last_hidden]
            if have:
                self.pair_inputs.append(torch.stack([self.last_hidden[int(rows.request[j])] for j in have]))
                self.pair_targets.append(logits[have].float())
        # the latest token of each request is the source of its next pair
        last_of = {int(r): j for j, r in enumerate(rows.request)}
        for request, j in last_of.items():
            self.last_hidden[request] = per_token[j].clone()

    def end_batch(self) -> None:
        self.last_hidden.clear()

    def fit(self, routers: list[Any]) -> Predictors:
        residual = None
        if self.residual_sum is not None and self.tokens:
            residual = (self.residual_sum / self.tokens).float()
        gates = None
        pairs = sum(len(x) for x in self.pair_inputs)
        if pairs:
            inputs = torch.cat(self.pair_inputs)
            targets = torch.cat(self.pair_targets)
            device = routers[0].weight.device
            gates = [fit_next_token_gate(router, inputs[:, l].to(device), targets[:, l].to(device))
                     for l, router in enumerate(routers)]
        return Predictors(residual=residual, next_token=gates, calibration_tokens=self.tokens,
                          next_token_pairs=pairs)


class TraceRows:
    """Turns one forward pass's routing into trace columns (numpy), predictors included."""

    def __init__(self, routers: list[Any], scores_function: str, predictors: Predictors | None) -> None:
        self.routers = routers
        self.scores_function = scores_function
        self.predictors = predictors or Predictors()

    @property
    def columns(self) -> list[str]:
        cols = ["weights", "scores", "token_id", "pred_next_layer"]
        if self.predictors.residual is not None:
            cols.append("pred_residual")
        if self.predictors.next_token is not None:
            cols.append("pred_next_token")
        return cols

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        return torch.sigmoid(logits) if self.scores_function == "sigmoid" else torch.softmax(logits, dim=-1)

    def build(self, step: int, rows: StepRows, layers: list[LayerRouting]) -> dict[str, Any]:
        # Tensors of all layers are concatenated before sorting and scoring: one op per step, not per layer.
        num_layers, select = len(layers), rows.select
        weights, experts = rank_by_weight(torch.cat([take(layer.weights, select) for layer in layers]),
                                          torch.cat([take(layer.indices, select) for layer in layers]))
        scores = self._scores(torch.cat([take(layer.logits, select) for layer in layers]))
        hidden = [take(layer.hidden, select) for layer in layers]
        n = rows.tokens
        data: dict[str, Any] = {
            "request": np.tile(rows.request, num_layers),
            "step": np.full(n * num_layers, step, dtype=np.int32),
            "phase": np.full(n * num_layers, rows.phase, dtype=np.int8),
            "position": np.tile(rows.position, num_layers),
            "layer": np.repeat(np.arange(num_layers, dtype=np.int16), n),
            "experts": experts.cpu().numpy(),
            "weights": weights.cpu().numpy(),
            "scores": scores.cpu().numpy(),
            "token_id": np.tile(rows.token_id, num_layers),
        }
        data.update(self._next_layer_columns(hidden, n))
        if self.predictors.next_token is not None:
            outs = [gate.forward(x) for gate, x in zip(self.predictors.next_token, hidden)]
            ids = rank_by_weight(torch.cat([o[1] for o in outs]), torch.cat([o[2] for o in outs]))[1]
            data["pred_next_token"] = list_column(ids, n, num_layers, num_layers)
        return data

    def _next_layer_columns(self, hidden: list[torch.Tensor], n: int) -> dict[str, Any]:
        """pred_next_layer (and pred_residual): gate l+1 on layer l's input (plus the residual vector)."""
        residual, num_layers = self.predictors.residual, len(hidden)
        weights, indices = [], []
        for l in range(num_layers - 1):
            x = hidden[l]
            if residual is not None:  # one gate call on [x; x + res_vec] rows
                x = torch.cat([x, (x.float() + residual[l].to(x.device)).to(x.dtype)])
            _, w, i = self.routers[l + 1].forward(x)
            weights.append(w)
            indices.append(i)
        if not weights:  # a single MoE layer: nothing follows it
            empty = list_column(torch.zeros((0, 0), dtype=torch.long), n, num_layers, 0)
            return {"pred_next_layer": empty, **({"pred_residual": empty} if residual is not None else {})}
        ids = rank_by_weight(torch.cat(weights), torch.cat(indices))[1]
        if residual is None:
            return {"pred_next_layer": list_column(ids, n, num_layers, num_layers - 1)}
        ids = ids.reshape(num_layers - 1, 2, n, -1)
        return {"pred_next_layer": list_column(ids[:, 0].reshape(-1, ids.shape[-1]), n, num_layers, num_layers - 1),
                "pred_residual": list_column(ids[:, 1].reshape(-1, ids.shape[-1]), n, num_layers, num_layers - 1)}


def list_column(ids: torch.Tensor, rows_per_layer: int, num_layers: int,
                layers_with_ids: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a predictor column from the first ``layers_with_ids`` layers' (rows, k) ids;
    the remaining layers (the last, for next-layer predictors) get empty lists."""
    width = ids.shape[-1] if ids.numel() else 0
    lengths = np.zeros(rows_per_layer * num_layers, dtype=np.int32)
    lengths[:rows_per_layer * layers_with_ids] = width
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return offsets, ids.reshape(-1).cpu().numpy().astype(np.int16)
