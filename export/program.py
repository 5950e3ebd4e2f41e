"""A traced program without its weights: what crosses the process boundary to a lowering worker, and
what the compiled-graph cache key hashes.

torch.export.save writes the graph, signature, example inputs and constants; the parameters and
buffers (ep.state_dict) are written as meta tensors, so the file holds no weight bytes (a 35B model's
70 GB would otherwise be written once per graph). The worker binds the real tensors back by name.
Measured on `tiny` (CPU): a program saved this way, loaded and re-bound, lowers to the same kernel
and wrapper sources and the same .so as the program in memory.
"""
from __future__ import annotations

from pathlib import Path

import torch


def weights_of(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """The program's parameters and buffers by state_dict name (no copies)."""
    return {k: v.detach() for k, v in ep.state_dict.items()}


def save_without_weights(ep: torch.export.ExportedProgram, path: Path) -> None:
    real = dict(ep.state_dict)
    try:
        for k, v in real.items():
            stub = torch.empty_like(v, device="meta")          # same shape, dtype and strides
            ep.state_dict[k] = torch.nn.Parameter(stub, requires_grad=False) if isinstance(v, torch.nn.Parameter) \
                else stub
        torch.export.save(ep, str(path))
    finally:
        ep.state_dict.update(real)


def load_with_weights(path: Path, weights: dict[str, torch.Tensor]) -> torch.export.ExportedProgram:
    ep = torch.export.load(str(path))
    for k, stub in list(ep.state_dict.items()):
        t = weights.get(k)
        if t is None:
            raise KeyError(f"the program needs weight {k}, which was not shared with this worker")
        if t.shape != stub.shape or t.dtype != stub.dtype or t.stride() != stub.stride():
            raise ValueError(f"weight {k}: shared {tuple(t.shape)} {t.dtype} stride {t.stride()}, the program "
                             f"was traced with {tuple(stub.shape)} {stub.dtype} stride {stub.stride()}")
        ep.state_dict[k] = torch.nn.Parameter(t, requires_grad=False) if isinstance(stub, torch.nn.Parameter) else t
    return ep
