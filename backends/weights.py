"""Expert weights of a real run: every routed expert in host memory, GPU cache slots, staging buffers, routing.

Routed experts live in (pinned, for CUDA) host memory in the model's shape
and dtype, filled with random values once per shape and reused by the next
run of the same shape; GPU cache slots are one preallocated pool with a
free list per layer, plus staging buffers for experts streamed through
without caching (000 Alg. 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backends.devices import Work
from backends.kernels import expert_params, random_fill, torch_dtype
from moesim.errors import ConfigError
from moesim.util import host_bytes_available

GIB = 2**30


def check_host_memory(model, expert_dtype: str, pinned: bool = False) -> None:
    """Refuse a real run whose routed experts cannot fit in host memory, before anything is measured
    (``moesim validate`` measures a profile first, which takes minutes); ``pinned``: as a CUDA run takes it."""
    itemsize = torch_dtype(expert_dtype).itemsize
    _check_fits(model.num_layers, model.num_experts * expert_params(model, model.moe_intermediate_size) * itemsize,
                pinned)


def pinned_bytes(nbytes: int) -> int:
    """Host memory a pinned allocation of ``nbytes`` takes: torch's pinned (caching host) allocator rounds every
    allocation up to a power of two (54 GiB of Qwen3-30B-A3B experts pin 64 GiB)."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


def _check_fits(layers: int, layer_bytes: int, pinned: bool = False) -> None:
    """``layers`` MoE layers of ``layer_bytes`` routed expert weights each fit in host memory (``pinned``: as the
    pinned allocator takes them), or the error says how many layers do."""
    total, available = layers * layer_bytes, host_bytes_available()
    taken = pinned_bytes(total) if pinned else total
    if available is None or taken <= 0.9 * available:
        return
    room = pinned_bytes(int(0.9 * available) + 1) // 2 if pinned else 0.9 * available  # a power of two, if pinned
    fits = int(room // layer_bytes) if layer_bytes else layers
    fix = (f"run the first {fits} MoE layers or fewer: moesim validate --layers {fits}" if fits
           else f"fewer MoE layers (moesim validate --layers N) cannot help: one layer's experts need "
           f"{layer_bytes / GIB:.1f} GiB; free host memory or use a larger machine")
    need = (f"{taken / GIB:.1f} GiB of pinned host memory ({total / GIB:.1f} GiB rounded up to a power of two by "
            "torch's pinned allocator)" if pinned and taken != total else f"{total / GIB:.1f} GiB of host memory")
    raise ConfigError(f"routed experts need {need}, {available / GIB:.1f} GiB is available", field="--layers",
                      fix=fix)


def _check_stand_in_slots(slots: int, staging: int, slot_bytes: int) -> None:
    """The CPU stand-in's "GPU" slots are host memory too, taken beside the routed experts already there: a
    plan sized by the profile's GPU memory (the host's, as measured) would be killed for memory instead."""
    total, available = (slots + staging) * slot_bytes, host_bytes_available()
    if available is not None and total > 0.9 * available:
        fits = max(int(0.8 * available // slot_bytes) - staging, 0)  # headroom: available memory moves
        raise ConfigError(f"the CPU stand-in's {slots} expert slots and {staging} staging buffers need "
                          f"{total / GIB:.1f} GiB of host memory beside the routed experts, {available / GIB:.1f} GiB "
                          "is available", field="cache.slots",
                          fix=f"--set cache.slots={fits} or fewer, or fewer layers (moesim validate --layers N)")


# ----------------------------------------------------------------------------- weights and buffers
#: the routed experts of the last run, kept for the next run of the same shape: filling tens of GiB of
#: pinned host memory takes longer than many a run (validate runs several systems on one trace)
_HOST_EXPERTS: dict[tuple, torch.Tensor] = {}


def host_experts(model, params: int, dtype: torch.dtype, pin: bool, generator: torch.Generator) -> torch.Tensor:
    """(layers, experts, params) random expert weights in host memory, reused while the shape and seed stay."""
    key = (model.num_layers, model.num_experts, params, dtype, pin, generator.initial_seed())
    if key not in _HOST_EXPERTS:
        _HOST_EXPERTS.clear()  # free the previous shape's weights before taking memory for these
        _check_fits(model.num_layers, model.num_experts * params * dtype.itemsize, pin)
        host = torch.empty(model.num_layers, model.num_experts, params, dtype=dtype, pin_memory=pin)
        _HOST_EXPERTS[key] = random_fill(host, generator)
    return _HOST_EXPERTS[key]


class ExpertWeights:
    """Every routed expert in host memory (pinned for CUDA), GPU slots per layer and staging buffers.

    With per-layer quotas alone (``shared`` None) layer ``l`` owns rows ``[first[l], first[l] + capacity[l])``
    of one preallocated slot tensor. With a model-wide pool (``shared``: its slots, the memory plan's ``pool``)
    the quotas only bound what one layer may hold (the cache state enforces both) and may add up to far more
    than the pool, up to every expert of the model: the tensor then has the pool's slots, one free list that
    every layer takes from.
    """

    def __init__(self, model, dtype: torch.dtype, device: torch.device, capacity: list[int], staging: int,
                 generator: torch.Generator, shared: int | None = None) -> None:
        self.params = expert_params(model, model.moe_intermediate_size)
        self.host = host_experts(model, self.params, dtype, device.type == "cuda", generator)
        self.first = np.concatenate([[0], np.cumsum(capacity)]).astype(int).tolist()
        self.shared = None if shared is None else min(shared, self.first[-1])
        slots = self.first[-1] if self.shared is None else self.shared
        if device.type == "cpu":
            _check_stand_in_slots(max(slots, 1), staging, self.params * dtype.itemsize)
        self.pool = torch.empty(max(slots, 1), self.params, dtype=dtype, device=device)
        self.staging = torch.empty(staging, self.params, dtype=dtype, device=device)
        self.capacity = capacity
        self._writeback: torch.Tensor | None = None
        self.reset()

    def writeback_buffer(self) -> torch.Tensor:
        """Host memory (pinned for CUDA) of one expert that write-backs copy into, allocated at the first."""
        if self._writeback is None:
            self._writeback = torch.empty(self.params, dtype=self.pool.dtype,
                                          pin_memory=self.pool.device.type == "cuda")
        return self._writeback

    def reset(self) -> None:
        if self.shared is not None:
            common = list(range(self.shared))[::-1]
            self.free = [common] * len(self.capacity)  # one list: a slot a layer frees, any layer may take
        else:
            self.free = [list(range(self.first[l], self.first[l] + c))[::-1] for l, c in enumerate(self.capacity)]
        self.slot: dict[tuple[int, int], int] = {}
        #: last work that read a slot / staging buffer: a copy into it waits for that
        self.last_use: dict[int, Work] = {}
        self.staging_use: dict[int, Work] = {}

    def take(self, layer: int, expert: int) -> tuple[torch.Tensor, Work | None]:
        slot = self.free[layer].pop()
        self.slot[(layer, expert)] = slot
        return self.pool[slot], self.last_use.get(slot)

    def drop(self, layer: int, expert: int) -> None:
        self.free[layer].append(self.slot.pop((layer, expert)))

    def on_gpu(self, layer: int, expert: int) -> torch.Tensor:
        return self.pool[self.slot[(layer, expert)]]


@dataclass
class LayerRouting:
    """Token rows of each active expert (grouped), their gate weights, on host and device."""

    rows: np.ndarray
    weights: np.ndarray
    spans: dict[int, tuple[int, int]]
    rows_t: torch.Tensor | None = None
    weights_t: torch.Tensor | None = None

    @classmethod
    def of(cls, experts: np.ndarray, weights: np.ndarray | None) -> "LayerRouting":
        tokens, top_k = experts.shape
        flat = experts.ravel().astype(np.int64)
        gate = (weights.ravel() if weights is not None else np.full(flat.size, 1.0 / top_k)).astype(np.float32)
        order = np.argsort(flat, kind="stable")
        ids, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
        rows = np.repeat(np.arange(tokens), top_k)[order]
        return cls(rows, gate[order], {int(e): (int(s), int(n)) for e, s, n in zip(ids, starts, counts)})
