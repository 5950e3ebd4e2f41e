"""Batch-invariant lowering of linear (contract: custom_ops/linear.py; export --batch-invariant).

linear.py sums a row with fp32 FMA into a [BN, BK] accumulator at M = 1, with tl.dot (tensor cores) at
1 < M <= GEMV_MAX_M, its tile chosen from M, and with cuBLAS above: a row's bits depend on how many rows share
the launch (the padding rows of a decode bucket included). Here every row is summed as linear.py sums one row:
grid (M * cdiv(N, BN),); program p takes row p % M and output tile p // M (rows fastest, so the M programs that
read one weight tile run together: the tile comes from DRAM once, from L2 for the other rows), and runs the
M = 1 loop with linear.tile(1, K): fp32 FMA of w [BN, BK] and the row's [BK] into [BN, BK], one reduction over
BK at the end, rounded once to x.dtype. A row's arithmetic is the same code, tile and warps at every M, so its
bits do not depend on M; the tile depends on K only, so a column's sum does not depend on N either (the
concatenated projections, models/qwen3_5/fuse.py, stay exact). No cuBLAS: above GEMV_MAX_M rows too.
Cost against linear.py at M > 1: M passes over each weight tile (one from DRAM) and M times the programs; to be
measured on the H200 (docs/design.md, "Batch invariance").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..linear import _validate
from ._common import launch, to_dt
from .linear import tile


@triton.jit
def _gemv_row_kernel(x, w, y, N, s_x_m, s_w_n, s_y_m, M: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr):
    """y[m, n-tile] = x[m] @ w[n-tile].T for program p = n-tile * M + m; x and w contiguous along K."""
    pid = tl.program_id(0)
    m = pid % M
    DT: tl.constexpr = y.dtype.element_ty
    rn = (pid // M) * BN + tl.arange(0, BN)
    mn = rn < N
    rn64 = rn.to(tl.int64)                           # w offsets pass 2**31 for the large projections
    x_row = x + m.to(tl.int64) * s_x_m
    acc = tl.zeros([BN, BK], tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        xt = tl.load(x_row + rk, mask=mk, other=0.0)                                          # [BK]
        wt = tl.load(w + rn64[:, None] * s_w_n + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        acc += wt.to(tl.float32) * xt.to(tl.float32)[None, :]                                 # [BN, BK]
    tl.store(y + m.to(tl.int64) * s_y_m + rn, to_dt(tl.sum(acc, axis=1), DT), mask=mn)


def gemv_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T, each row by the one-row plan (module docstring) -> [M, N] in x.dtype."""
    M, K = x.shape
    N = w.shape[0]
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = tile(1, K)
    launch(_gemv_row_kernel, (M * triton.cdiv(N, bn),), x, w, y, N, x.stride(0), w.stride(0), y.stride(0),
           M=M, K=K, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    return y


@triton_op("onegraph::linear_invariant_triton", mutates_args=())
def linear_invariant_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    _validate(x, w)
    return gemv_rows(x, w)


_registry.register_lowering("linear", _registry.INVARIANT, torch.ops.onegraph.linear_invariant_triton.default)
