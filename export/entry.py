"""The traced entry points: wrapper modules around a model family's decode / prefill (models/__init__.py;
in a speculative artifact, graphs/spec_graphs.py's prefill and spec round), and the example inputs (names,
shapes, dtypes) that trace each graph's signature (graphs/signature.py: state last, the slot dimension S dynamic).
"""
from __future__ import annotations

import torch
from torch.export import Dim

from onegraph.graphs.signature import GraphSpec, graph_spec, state_inputs  # noqa: F401  (the signatures: graphs/)

EXPORT_SLOTS = 2          # slots in the example state (S = 3 with scratch); S is dynamic anyway


class DecodeEntry(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return self.model.decode(*args)


class PrefillEntry(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return self.model.prefill(*args)


class SpecPrefillEntry(torch.nn.Module):
    """A speculative artifact's prefill: the plain prefill's outputs + the MTP head's catch-up."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        from onegraph.graphs import spec_graphs
        return spec_graphs.prefill(self.model, *args)


class SpecEntry(torch.nn.Module):
    """One speculative round of k drafts (graphs/spec_graphs.py step)."""

    def __init__(self, model: torch.nn.Module, k: int):
        super().__init__()
        self.model, self.k = model, k

    def forward(self, *args):
        from onegraph.graphs import spec_graphs
        return spec_graphs.step(self.model, self.k, *args)


def example_inputs(spec: GraphSpec, device) -> tuple:
    """Zero-filled example inputs (S = EXPORT_SLOTS + 1); n_valid = T so prefill traces the full chunk."""
    out = []
    for name, shape, dtype in spec.inputs:
        shape = tuple(EXPORT_SLOTS + 1 if s == "S" else s for s in shape)
        t = torch.zeros(shape, dtype=dtype, device=device)
        if name == "n_valid":
            t.fill_(spec.bucket)
        out.append(t)
    return tuple(out)


def dynamic_shapes(spec: GraphSpec, batch: Dim | None = None):
    """The slot dim S of the state is dynamic. batch (a decode graph only; scripts/bench_symbolic_batch.py):
    the head inputs' batch dim B too, one graph for every B in the Dim's range instead of one per bucket."""
    S = Dim("S", min=2, max=1 << 16)
    if batch is not None and spec.kind != "decode":
        raise ValueError(f"a symbolic batch is for decode graphs, not {spec.kind}")
    return (tuple({0: S} if s and s[0] == "S" else {0: batch} if batch is not None else None
                  for _, s, _ in spec.inputs),)


def entry_module(model: torch.nn.Module, kind: str, k: int = 0) -> torch.nn.Module:
    if kind == "spec":
        return SpecEntry(model, k)
    if kind == "prefill":
        return SpecPrefillEntry(model) if k else PrefillEntry(model)
    return DecodeEntry(model)
