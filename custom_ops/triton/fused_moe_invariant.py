"""Batch-invariant lowering of fused_moe (contract: custom_ops/fused_moe.py; export --batch-invariant).

fused_moe.py picks its plan from the token count T: at T = 1 one-load tiles and routing inside the SwiGLU
kernel, above it looped tiles and routing first, and for T * k > E the grouped GEMM of the reference's prefill
branch (pairs sorted by expert, per-expert roundings): a token's bits depend on how many tokens share the call.
Here every T takes the T = 1 tiles (fused_moe.decode_tiles(1)) in the two decode kernels, routed as the default
routes (fused_moe.route_first: in the SwiGLU kernel at T = 1, by _route_kernel, one program per token, above):
a routed pair (t, j) is computed in its own SwiGLU programs from token t's row and its expert, and token t's down +
combine in its own programs, so a token's output is the one it gets alone whatever the other tokens and their
experts are. Where the routing runs does not change its bits (fused_moe.py), only which tiles sum the products.

Numerics: the reference's decode branch (T * k <= E) for every T, so above E / k tokens this differs from the
reference's prefill branch by that branch's roundings (the per-expert sum is rounded per expert there).
Cost against fused_moe.py at T > 1: the T = 1 tiles; at T * k > E every pair reads its expert's rows (experts
shared by several tokens are read once from DRAM, then from L2) where the default's grouped GEMM reads each once
for all its rows (docs/design.md, "Batch invariance").
"""
from __future__ import annotations

import torch
from torch.library import triton_op

from .. import _registry
from ..fused_moe import _validate
from .fused_moe import decode, decode_tiles, route_first


@triton_op("onegraph::fused_moe_invariant_triton", mutates_args=())
def fused_moe_invariant_triton(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                               shared_gate: torch.Tensor, shared_up: torch.Tensor, shared_down: torch.Tensor,
                               top_k: int, fp32_out: bool = False) -> torch.Tensor:
    _validate(x, logits, gate_up, down, shared_gate, shared_up, shared_down, top_k)
    out_dtype = torch.float32 if fp32_out else x.dtype
    return decode(x, logits, gate_up, down, shared_gate, shared_up, shared_down, top_k, out_dtype, decode_tiles(1),
                  route_first(x.shape[0]))


_registry.register_lowering("fused_moe", _registry.INVARIANT, torch.ops.onegraph.fused_moe_invariant_triton.default)
