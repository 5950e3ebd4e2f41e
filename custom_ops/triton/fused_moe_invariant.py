"""Batch-invariant lowering of fused_moe (contract: custom_ops/fused_moe.py; export --batch-invariant).

fused_moe.py takes the grouped GEMM of the reference's prefill branch for T * k > E (pairs sorted by expert,
per-expert roundings): there a token's bits depend on the other tokens in the call. Its decode kernels take one plan at every T (fused_moe.decode_tiles; where the routing runs changes
no bit), so up to E / k tokens a token's output is the one it gets alone. Here they run at every T, the grouped
GEMM never: a routed pair (t, j) is computed in its own SwiGLU programs from token t's row and its expert, and
token t's down + combine in its own programs, whatever the other tokens and their experts are.

Numerics: the reference's decode branch (T * k <= E) for every T, so above E / k tokens this differs from the
reference's prefill branch by that branch's roundings (the per-expert sum is rounded per expert there).
Cost against fused_moe.py at T * k > E: every pair reads its expert's rows (experts shared by several tokens are
read once from DRAM, then from L2) where the default's grouped GEMM reads each once for all its rows
(docs/design.md, "Batch invariance").
"""
from __future__ import annotations

import torch
from torch.library import triton_op

from .. import _registry
from ..fused_moe import _validate
from .fused_moe import decode


@triton_op("onegraph::fused_moe_invariant_triton", mutates_args=())
def fused_moe_invariant_triton(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                               shared_gate: torch.Tensor, shared_up: torch.Tensor, shared_down: torch.Tensor,
                               top_k: int, fp32_out: bool = False) -> torch.Tensor:
    _validate(x, logits, gate_up, down, shared_gate, shared_up, shared_down, top_k)
    out_dtype = torch.float32 if fp32_out else x.dtype
    return decode(x, logits, gate_up, down, shared_gate, shared_up, shared_down, top_k, out_dtype)


_registry.register_lowering("fused_moe", _registry.INVARIANT, torch.ops.onegraph.fused_moe_invariant_triton.default)
