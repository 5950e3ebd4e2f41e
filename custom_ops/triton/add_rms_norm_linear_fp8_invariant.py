"""Batch-invariant lowering of add_rms_norm_linear_fp8 (contract: custom_ops/add_rms_norm_linear_fp8.py; export
--batch-invariant). The default makes the normed row in the GEMV's registers at one row and runs the norm kernel
first above: here the add_rms_norm kernel (one row per program, its tile from K only), then
linear_fp8_invariant.py's projection (every row by its fixed 16-row dot tile), at every batch.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from .. import _registry
from ..add_rms_norm_linear_fp8 import _validate
from .linear_fp8_invariant import matmul_rows
from .norms import add_rms_norm_triton


@triton_op("onegraph::add_rms_norm_linear_fp8_invariant_triton", mutates_args=())
def add_rms_norm_linear_fp8_invariant_triton(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor,
                                             eps: float, w: torch.Tensor, scale: torch.Tensor,
                                             tail: Optional[torch.Tensor] = None
                                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _validate(x, residual, norm_w, eps, w, scale, tail)
    normed, h = add_rms_norm_triton(x, residual, norm_w, eps)
    return matmul_rows(normed, w, scale, tail), normed, h


_registry.register_lowering("add_rms_norm_linear_fp8", _registry.INVARIANT,
                            torch.ops.onegraph.add_rms_norm_linear_fp8_invariant_triton.default)
