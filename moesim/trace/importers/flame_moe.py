"""``flame-moe``: FLAME-MoE-290M teacher-forced routing (DynaNDE-Simulator sample, npz extract).

``flame-moe-290m_layers2-9_2048tok_top6.npz`` holds ``layers`` [8] (transformer
layers 2..9, the model's MoE layers, mapped here to MoE layers 0..7),
``token_ids`` [2048], ``indices`` [8, 2048, 6] and ``scores`` [8, 2048, 6]: the
selected experts' softmax probabilities over all 64 experts, not renormalized.
The 2048 tokens are consecutive pretraining-stream tokens run in one training
forward, so they become one prefill step of one request, positions 0..2047. The
two shared experts are always on and not logged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moesim.errors import TraceFormatError
from moesim.trace.importers._common import (PREFILL, ImportReport, RoutingRows, check_experts, check_ids,
                                            check_weights, new_report, order_by_weight, report_read, write_import)
from moesim.util import listed

FORMAT = "flame-moe"
MODEL = "flame-moe-290m"
FIRST_MOE_LAYER = 2
SOURCE = {
    "repository": "https://github.com/Akash-N-Pai/DynaNDE-Simulator",
    "commit": "f274466b9095e0b417f701a3ef3a14a6639b6aed",
    "upstream_path": "Sample routing traces/Encoder_Batch_0-32/Layer_{2..9}/*.pt",
    "upstream_origin": "HF dataset CMU-FLAME/FLAME-MoE-Traces, run flame-moe-290m/31066, iter 5473, shard 0-0",
    "license": "dataset card: Apache-2.0; the GitHub repository has no LICENSE file",
    "upstream_model": "FLAME-MoE-290M (arXiv 2505.20225), teacher-forced training forward",
}


def _load(path: Path) -> dict[str, np.ndarray]:
    names = ("layers", "token_ids", "indices", "scores")
    try:
        data = np.load(path)
        if not hasattr(data, "files"):  # a lone .npy array
            raise ValueError(path)
        missing = [key for key in names if key not in data.files]
        if missing:
            raise TraceFormatError(f"the npz has no array '{missing[0]}' (it has: {listed(data.files)})",
                                   source=str(path), field=missing[0],
                                   fix="use flame-moe-290m_layers2-9_2048tok_top6.npz (layers, token_ids, indices, "
                                       "scores)")
        arrays = {key: data[key] for key in names}
        report_read(path.stat().st_size, path)
    except (OSError, ValueError):
        raise TraceFormatError("not a readable npz file", source=str(path), fix="give the .npz extract") from None
    layers, indices = arrays["layers"], arrays["indices"]
    tokens = len(arrays["token_ids"])
    if indices.ndim == 3 and arrays["scores"].shape == indices.shape and indices.shape[1] != tokens:
        # the routing arrays agree with each other: the token ids are the odd one out
        raise TraceFormatError(f"{tokens} token ids for the {indices.shape[1]} tokens of 'indices' and 'scores'",
                               source=str(path), field="token_ids", fix="one token id per routed token")
    expected = (len(layers), tokens, indices.shape[-1] if indices.ndim == 3 else 0)
    for name in ("indices", "scores"):
        if arrays[name].shape != expected or expected[2] != 6:
            raise TraceFormatError(f"shape {arrays[name].shape}, expected [{len(layers)}, {tokens}, 6]",
                                   source=str(path), field=name, fix="one top-6 row per layer and token")
    return arrays


def import_files(sources: list[Path], out: Path) -> ImportReport:
    report, model = new_report(FORMAT, out, MODEL)
    rows = RoutingRows(top_k=model.top_k, with_weights=True, with_token_id=True)
    for request, path in enumerate(sources):
        arrays = _load(path)
        moe_layers = arrays["layers"].astype(int) - FIRST_MOE_LAYER
        bad = (moe_layers < 0) | (moe_layers >= model.num_layers)
        if bad.any():
            raise TraceFormatError(f"transformer layer {arrays['layers'][bad][0]} is not one of FLAME-MoE-290M's "
                                   "MoE layers 2..9", source=str(path), field="layers",
                                   fix="keep layers 2-9 only (10-26 upstream are copies)")
        values, counts = np.unique(arrays["layers"], return_counts=True)
        if (counts > 1).any():
            raise TraceFormatError(f"transformer layer {values[counts > 1][0]} is listed {counts.max()} times in "
                                   f"'layers' ({arrays['layers'].tolist()})", source=str(path), field="layers",
                                   fix="each MoE layer's routing appears once (the extract lists layers 2..9)")
        tokens = len(arrays["token_ids"])
        for i, layer in enumerate(moe_layers):
            experts, weights, changed = order_by_weight(check_ids(arrays["indices"][i], path, "indices"),
                                                        check_weights(arrays["scores"][i], path, "scores")
                                                        .astype(np.float32))
            check_experts(experts, model, Path(f"{path} layer {arrays['layers'][i]}"), np.arange(tokens), "indices",
                          unit="token")
            report.repaired["rows_reordered_by_weight"] += changed
            rows.add(request=request, step=request, phase=PREFILL, position=np.arange(tokens), layer=int(layer),
                     experts=experts, weights=weights, token_id=arrays["token_ids"])
    report.notes.append("teacher-forced training forward: one prefill step, no decode; weights are top-6 "
                        "probabilities (not renormalized)")
    source = {**SOURCE, "files": [p.name for p in sources],
              "layer_mapping": "transformer layers 2..9 -> MoE layers 0..7"}
    return write_import(out, rows, model, report, source, weights_renormalized=False)
