"""Batch-invariant lowering of sample (contract: custom_ops/sample.py; export --batch-invariant).

sample.py scans each row's vocabulary in NSPLIT chunks, NSPLIT chosen from B (about 256 programs; 35B vocabulary:
64 chunks at B = 1, 32 at 8, 4 at 64), and merges the chunks' softmax partials: the sum of exp that top-p's
probabilities divide by is summed in an order that depends on B, so a token at the edge of the nucleus may be
kept at one batch and dropped at another. Here every B takes B = 1's plan, sample.plan(1, V): each row's chunks
and merge are the ones it gets alone (a row's programs read only its logits and sampling inputs). Cost at B > 1:
B times the B = 1 plan's programs; to be measured on the H200 (docs/design.md, "Batch invariance").
"""
from __future__ import annotations

import torch
from torch.library import triton_op

from .. import _registry
from ..sample import _validate
from .sample import plan, run


@triton_op("onegraph::sample_invariant_triton", mutates_args=())
def sample_invariant_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    _validate(logits, temperature, top_k, top_p, seed, position)
    nsplit, nb = plan(1, logits.shape[1])                    # the one-row plan for every batch
    if logits.stride(1) != 1:            # the kernels index rows with unit stride (a copy, static)
        logits = logits.contiguous()
    # per-row inputs are read at ptr + b: an expanded (stride-0) tensor must become a real one
    rows = [t.contiguous() for t in (temperature, top_k, top_p, seed, position)]
    return run(logits, *rows, nsplit, nb)


_registry.register_lowering("sample", _registry.INVARIANT, torch.ops.onegraph.sample_invariant_triton.default)
