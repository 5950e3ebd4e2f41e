"""Batch-invariant lowering of attention_decode (contract: custom_ops/attention_decode.py; export --batch-invariant).

attention_decode.py cuts each row's keys into NSPLIT pieces, NSPLIT chosen from B * KVH (about 256 programs),
and merges the pieces' partial softmaxes: the merge's order, and the pieces' own sums, depend on B (35B shape:
64 splits at B = 1, 16 at 8, 2 at 64). Here every B takes B = 1's plan, attention_decode.plan(1, ...): a row's
split and combine programs then compute the same sums whatever the batch (each program reads its own row's
query, keys and partials only). Cost at B > 1: B times the programs and partials of the B = 1 plan, where
attention_decode.py keeps about 256 programs; to be measured on the H200 (docs/design.md, "Batch invariance").
"""
from __future__ import annotations

import torch
from torch.library import triton_op

from .. import _registry
from ..attention_decode import _validate
from .attention_decode import plan, run


@triton_op("onegraph::attention_decode_invariant_triton", mutates_args=())
def attention_decode_invariant_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                      slots: torch.Tensor, positions: torch.Tensor, scale: float,
                                      gate: torch.Tensor) -> torch.Tensor:
    _validate(q, k_cache, v_cache, slots, positions, scale, gate)
    _, KVH, Tmax, D = k_cache.shape
    block_n, nsplit = plan(1, KVH, Tmax, D)                  # the one-row plan for every batch
    return run(q, k_cache, v_cache, slots.contiguous(), positions.contiguous(), scale, gate, block_n, nsplit)


_registry.register_lowering("attention_decode", _registry.INVARIANT,
                            torch.ops.onegraph.attention_decode_invariant_triton.default)
