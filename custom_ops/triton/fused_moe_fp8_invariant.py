"""Batch-invariant lowering of fused_moe_fp8 (contract: custom_ops/fused_moe_fp8.py; export --batch-invariant).

fused_moe_fp8.py runs its two decode kernels with one plan at every T (their tiles do not depend on T, the routing
runs in the SwiGLU kernel at T = 1 and in _route_kernel first above: the same bits), so up to E / k tokens a
token's output is the one it gets alone; for T * k > E it takes the grouped GEMMs, whose per-expert sums mix the
tokens' rows. Here the decode kernels run at every T: a routed pair's SwiGLU programs read its token's row and
its expert only, a token's down + combine programs its own pairs only (as fused_moe_invariant.py for bf16 experts).
Numerics: the reference's decode branch for every T (above E / k tokens the reference rounds per expert).
"""
from __future__ import annotations

import torch
from torch.library import triton_op

from .. import _registry
from ..fused_moe_fp8 import _validate
from .fused_moe_fp8 import _launch_decode


@triton_op("onegraph::fused_moe_fp8_invariant_triton", mutates_args=())
def fused_moe_fp8_invariant_triton(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor,
                                   gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                                   shared_gate: torch.Tensor, shared_gate_scale: torch.Tensor, shared_up: torch.Tensor,
                                   shared_up_scale: torch.Tensor, shared_down: torch.Tensor,
                                   shared_down_scale: torch.Tensor, top_k: int, fp32_out: bool = False) -> torch.Tensor:
    args = (x, logits, gate_up, gate_up_scale, down, down_scale, shared_gate, shared_gate_scale, shared_up,
            shared_up_scale, shared_down, shared_down_scale, top_k)
    _validate(*args)
    return _launch_decode(*args, torch.float32 if fp32_out else x.dtype)


_registry.register_lowering("fused_moe_fp8", _registry.INVARIANT,
                            torch.ops.onegraph.fused_moe_fp8_invariant_triton.default)
