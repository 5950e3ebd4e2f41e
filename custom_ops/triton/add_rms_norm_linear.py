"""Triton lowering of add_rms_norm_linear (contract: custom_ops/add_rms_norm_linear.py).

Below SPLIT_FROM_M rows: one launch of the projection GEMV (custom_ops/triton/linear.py) whose prologue
makes the normed rows from x and residual (their statistics in a first pass over K, each K tile again as
it is multiplied; both reads hit L2) and whose program 0 writes normed and h. The GEMV's tile is the plain
projection's (chosen from (M, K) only), so y's columns are the sums the unfused GEMV gives for the same
normed rows. From SPLIT_FROM_M to SPLIT_TO_M rows (decode buckets): the add_rms_norm kernel, then the 16-row
dot tile over every row tile (linear.gemv's row tiles, the batch-invariant projection's plan): the 35B router
(257 x 2048) on the H200, µs a call at 8 / 16 / 32 / 64 rows, 7.99 / 7.75 / 7.30 / 7.39 against the fused
prologue's 9.98 / 14.66 and the norm kernel + cuBLAS's 10.76 / 10.99 (at 2 / 4 rows the fused launch wins, 5.83 /
7.44 against 7.96 / 7.98; benchmarks/h200_batch_invariant_ops.json). Above (prefill chunks): the add_rms_norm
kernel, then the projection (aten GEMM), two launches where a GEMM's own time dwarfs one.
"""
from __future__ import annotations

import torch
from torch.library import triton_op

from .. import _registry
from ..add_rms_norm_linear import _validate
from .linear import gemv, project
from .norms import add_rms_norm_triton

SPLIT_FROM_M, SPLIT_TO_M = 8, 64


@triton_op("onegraph::add_rms_norm_linear_triton", mutates_args=())
def add_rms_norm_linear_triton(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                               w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _validate(x, residual, norm_w, eps, w)
    M = x.shape[0]
    if M < SPLIT_FROM_M:
        return gemv(x, w, norm=(residual, norm_w, eps))
    normed, h = add_rms_norm_triton(x, residual, norm_w, eps)
    return (gemv(normed, w, row_tiles=True) if M <= SPLIT_TO_M else project(normed, w)), normed, h


_registry.register_lowering("add_rms_norm_linear", "triton", torch.ops.onegraph.add_rms_norm_linear_triton.default)
