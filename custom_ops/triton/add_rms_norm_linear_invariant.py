"""Batch-invariant lowering of add_rms_norm_linear (contract: custom_ops/add_rms_norm_linear.py; export
--batch-invariant): the MoE block's post-attention add + RMSNorm and router projection, in every decode graph.

add_rms_norm_linear.py makes the normed rows in the GEMV's prologue (in registers at one row, through memory at
2..16 rows, each form with its own reduction tree) and hands larger batches to the norm kernel + cuBLAS: a row's
bits depend on the batch. Here: the add_rms_norm kernel (one row per program, its tile from K only), then
linear_invariant.py's GEMV (every row by its fixed 16-row tl.dot tile). Two launches at every batch, batch 1 included.
"""
from __future__ import annotations

import torch
from torch.library import triton_op

from .. import _registry
from ..add_rms_norm_linear import _validate
from .linear_invariant import gemv_rows
from .norms import add_rms_norm_triton


@triton_op("onegraph::add_rms_norm_linear_invariant_triton", mutates_args=())
def add_rms_norm_linear_invariant_triton(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                                         w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _validate(x, residual, norm_w, eps, w)
    normed, h = add_rms_norm_triton(x, residual, norm_w, eps)         # [M, K] each
    return gemv_rows(normed, w), normed, h


_registry.register_lowering("add_rms_norm_linear", _registry.INVARIANT,
                            torch.ops.onegraph.add_rms_norm_linear_invariant_triton.default)
