"""Triton lowering of add_rms_norm_linear_fp8 (contract: custom_ops/add_rms_norm_linear_fp8.py).

One row: one launch of linear_fp8's kernel in its REGS form (custom_ops/triton/linear_fp8.py): every program
makes the normed row in registers and multiplies it with its e4m3 rows (or, past the FP8 programs, the float
tail's rows); program 0 writes normed and h.
More rows: the add_rms_norm kernel, then linear_fp8's kernel, two launches (export/fold_norm.py only puts
this op in one-row graphs; the op itself takes any M).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from .. import _registry
from ..add_rms_norm_linear_fp8 import _validate
from . import linear_fp8
from .norms import add_rms_norm_triton


@triton_op("onegraph::add_rms_norm_linear_fp8_triton", mutates_args=())
def add_rms_norm_linear_fp8_triton(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                                   w: torch.Tensor, scale: torch.Tensor, tail: Optional[torch.Tensor] = None
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _validate(x, residual, norm_w, eps, w, scale, tail)
    if x.shape[0] == 1:
        return linear_fp8.matmul(x, w, scale, norm=(residual, norm_w, eps), tail=tail)
    normed, h = add_rms_norm_triton(x, residual, norm_w, eps)
    return linear_fp8.matmul(normed, w, scale, tail=tail), normed, h


_registry.register_lowering("add_rms_norm_linear_fp8", "triton",
                            torch.ops.onegraph.add_rms_norm_linear_fp8_triton.default)
