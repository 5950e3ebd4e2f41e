"""Batch-invariant lowering of gdn_decode_step_norm and its in-place twin (contract:
custom_ops/gdn_decode_step_norm.py; export --batch-invariant).

gdn_decode_step_norm.py's step kernel tiles a value head's state [K, V] into [K, BV] tiles with BV chosen from
B * HV (gdn_decode_step.block_v: 16 below 256 programs' worth, else 32; 35B shape: 16 at B = 1, 32 from B = 8).
BV sets the tile's layout, hence the order of the reductions over K (S^T k, S^T q). Here every B takes B = 1's
BV. The conv update and the gated norm are one row per program with fixed tiles already. Cost at B * HV >= 256:
twice the step's programs at half the columns each; to be measured on the H200 (docs/design.md, "Batch
invariance"). The twin is what export/inplace.py folds the functional op and its write-backs into, as for
gdn_decode_step_norm_triton.
"""
from __future__ import annotations

import torch
from torch.library import triton_op

from .. import _registry
from ..gdn_decode_step_norm import _validate
from .gdn_decode_step_norm import _launch


@triton_op("onegraph::gdn_decode_step_norm_invariant_triton", mutates_args=())
def gdn_decode_step_norm_invariant_triton(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor,
                                          conv_state: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor,
                                          conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                                          norm_weight: torch.Tensor, num_k_heads: int,
                                          eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _validate(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads, eps)
    B, C = qkv.shape
    _, HV, K, V = rec_state.shape
    y = qkv.new_empty((B, HV, V))
    new_conv = conv_state.new_empty((B, C, conv_weight.shape[1] - 1))
    new_rec = rec_state.new_empty((B, HV, K, V))
    _launch(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads, eps,
            y, new_conv, new_rec, plan_rows=1)
    return y, new_conv, new_rec


@triton_op("onegraph::gdn_decode_step_norm_invariant_inplace_triton", mutates_args={"conv_state", "rec_state"})
def gdn_decode_step_norm_invariant_inplace_triton(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                                                  z: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor,
                                                  slots: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                                                  dt_bias: torch.Tensor, norm_weight: torch.Tensor, num_k_heads: int,
                                                  eps: float) -> torch.Tensor:
    """gdn_decode_step_norm_invariant_triton with the new rows written in place (export/inplace.py); returns y."""
    _validate(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads, eps)
    B = qkv.shape[0]
    _, HV, _, V = rec_state.shape
    y = qkv.new_empty((B, HV, V))
    _launch(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads, eps,
            y, conv_state, rec_state, plan_rows=1)
    return y


_registry.register_lowering("gdn_decode_step_norm", _registry.INVARIANT,
                            torch.ops.onegraph.gdn_decode_step_norm_invariant_triton.default)
