"""Triton lowering of add_rms_norm_linear (contract: custom_ops/add_rms_norm_linear.py).

Up to GEMV_MAX_M rows: one launch of the projection GEMV (custom_ops/triton/linear.py) whose prologue
makes the normed rows from x and residual (their statistics in a first pass over K, each K tile again as
it is multiplied; both reads hit L2) and whose program 0 writes normed and h. The GEMV's tile is the plain
projection's (chosen from (M, K) only), so y's columns are the sums the unfused GEMV gives for the same
normed rows. Above GEMV_MAX_M rows (prefill chunks, large decode buckets): the add_rms_norm kernel, then
the projection (aten GEMM), two launches where a GEMM's own time dwarfs one.
"""
from __future__ import annotations

import torch
from torch.library import triton_op

from .. import _registry
from ..add_rms_norm_linear import _validate
from .linear import GEMV_MAX_M, gemv, project
from .norms import add_rms_norm_triton


@triton_op("onegraph::add_rms_norm_linear_triton", mutates_args=())
def add_rms_norm_linear_triton(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                               w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _validate(x, residual, norm_w, eps, w)
    if x.shape[0] <= GEMV_MAX_M:
        return gemv(x, w, norm=(residual, norm_w, eps))
    normed, h = add_rms_norm_triton(x, residual, norm_w, eps)
    return project(normed, w), normed, h


_registry.register_lowering("add_rms_norm_linear", "triton", torch.ops.onegraph.add_rms_norm_linear_triton.default)
