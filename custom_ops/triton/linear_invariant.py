"""Batch-invariant lowering of linear (contract: custom_ops/linear.py; export --batch-invariant).

linear.py sums a row with fp32 FMA into a [BN, BK] accumulator at M = 1, with tl.dot (tensor cores) at
1 < M <= GEMV_MAX_M, its tile chosen from M, and with cuBLAS above: a row's bits depend on how many rows share
the launch (the padding rows of a decode bucket included). Here every row is summed as linear.py sums one row:
fp32 FMA of w [BN, BK] (linear.tile(1, K), from K only) and the row's [BK] into a [BN, BK] accumulator, one
reduction over BK at the end, rounded once to x.dtype. At M > 1 a program takes R rows (rows_per_program) and
one output tile, loading each weight tile once for its R rows: each row's [BN, BK] slice of the [R, BN, BK]
accumulator takes the same FMAs in the same order and the same reduction over BK as the one-row loop, so a
row's bits depend neither on M nor on R, nor on the row's place in its group (tests/test_batch_invariant.py
checks that compiled on the GPU, where the reduction trees are real). The row groups run fastest in the grid
(p = n-tile * cdiv(M, R) + group), so the groups that read one weight tile run together: the tile comes from
DRAM once, from L2 for the other groups. The tile depends on K only, so a column's sum does not depend on N
either (the concatenated projections, models/qwen3_5/fuse.py, stay exact). No cuBLAS: above GEMV_MAX_M rows too.
Cost against linear.py at M > 1: R FMAs per weight element loaded and cdiv(M, R) passes over each weight tile
(benchmarks/*batch_invariant_ops.json; docs/design.md, "Batch invariance").
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
def _gemv_rows_kernel(x, w, y, N, s_x_m, s_w_n, s_y_m, M: tl.constexpr, K: tl.constexpr, R: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr):
    """y[m-group, n-tile] = x[m-group] @ w[n-tile].T for program p = n-tile * cdiv(M, R) + m-group; x and w
    contiguous along K. R == 1: the one-row loop as linear.py runs it; R > 1: R rows share each weight tile
    load, each row's [BN, BK] slice of the [R, BN, BK] accumulator taking the same FMAs and the same reduction."""
    pid = tl.program_id(0)
    G: tl.constexpr = (M + R - 1) // R
    DT: tl.constexpr = y.dtype.element_ty
    rn = (pid // G) * BN + tl.arange(0, BN)
    mn = rn < N
    rn64 = rn.to(tl.int64)                           # w offsets pass 2**31 for the large projections
    if R == 1:
        m = pid % G
        x_row = x + m.to(tl.int64) * s_x_m
        acc = tl.zeros([BN, BK], tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < K
            xt = tl.load(x_row + rk, mask=mk, other=0.0)                                      # [BK]
            wt = tl.load(w + rn64[:, None] * s_w_n + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            acc += wt.to(tl.float32) * xt.to(tl.float32)[None, :]                             # [BN, BK]
        tl.store(y + m.to(tl.int64) * s_y_m + rn, to_dt(tl.sum(acc, axis=1), DT), mask=mn)
    else:
        rm = (pid % G) * R + tl.arange(0, R)
        mm = rm < M
        rm64 = rm.to(tl.int64)
        acc = tl.zeros([R, BN, BK], tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < K
            xt = tl.load(x + rm64[:, None] * s_x_m + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
            wt = tl.load(w + rn64[:, None] * s_w_n + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            acc += wt.to(tl.float32)[None, :, :] * xt.to(tl.float32)[:, None, :]            # [R, BN, BK]
        tl.store(y + rm64[:, None] * s_y_m + rn[None, :], to_dt(tl.sum(acc, axis=2), DT),
                 mask=mm[:, None] & mn[None, :])


# rows a program takes at M > 1: as many as keep its [R, BN, BK] fp32 accumulator within ACC_ELEMENTS (35B:
# 16 at K = 2048, tile 4 x 128; 4 at K = 4096, tile 1 x 4096), at most MAX_ROWS
ACC_ELEMENTS, MAX_ROWS = 16384, 16


def rows_per_program(M: int, K: int) -> int:
    bn, bk, _, _ = tile(1, K)
    return 1 if M == 1 else min(MAX_ROWS, triton.next_power_of_2(M), max(1, ACC_ELEMENTS // (bn * bk)))


def gemv_rows(x: torch.Tensor, w: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T, each row by the one-row plan (module docstring) -> [M, N] in x.dtype; rows
    overrides the rows per program (benchmarks and tests only: a row's bits do not depend on it)."""
    M, K = x.shape
    N = w.shape[0]
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = tile(1, K)
    r = rows or rows_per_program(M, K)
    launch(_gemv_rows_kernel, (triton.cdiv(M, r) * triton.cdiv(N, bn),), x, w, y, N, x.stride(0), w.stride(0),
           y.stride(0), M=M, K=K, R=r, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    return y


@triton_op("onegraph::linear_invariant_triton", mutates_args=())
def linear_invariant_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    _validate(x, w)
    return gemv_rows(x, w)


_registry.register_lowering("linear", _registry.INVARIANT, torch.ops.onegraph.linear_invariant_triton.default)
