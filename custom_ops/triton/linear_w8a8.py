"""Triton lowerings of linear_w8a8_int8 and linear_w8a8_fp8 (contracts: custom_ops/linear_w8a8_{int8,fp8}.py).

Two kernels per call, shared by both ops (INT selects int8 / e4m3); at M == 1 one (the GEMV quantizes its row,
below):
1. _quant_rows, grid (M,): one program per row of x [M, K]: amax over K, s_x = amax / QMAX (IEEE division,
   tl.math.div_rn, as torch), then xq = x / s_x rounded to the 8-bit type into a [M, K] buffer (2 x K bytes
   per row: negligible next to the weight). Rounding is done by hand in fp32 so the compiled kernel and
   Triton's CPU interpreter agree with torch: int8 by the 1.5 * 2**23 round-half-even trick (|v| <= 127),
   e4m3 by integer arithmetic on the fp32 bits (the interpreter's own fp32 -> e4m3 cast drops the carry
   into the exponent: 124.6 became 64); the final cast is then exact.
2. _w8a8_kernel, grid (cdiv(N, BN), cdiv(M, BM)): program (n, m) reads rows [n*BN, (n+1)*BN) of w once:
   - M == 1 (GEMV): products into a [BN, BK] accumulator (int32 for int8: exact; fp32 for e4m3: each product
     of two e4m3 values is exact), one reduction at the end;
   - M > 1: tl.dot of xq [BM, BK] and the w tile, int8 x int8 -> int32 (IMMA) or e4m3 x e4m3 -> fp32
     (sm89+ tensor cores); BM = 16 up to GEMV_MAX_M rows, 64 above (prefill). e4m3 promotes each wgmma's
     partial into the fp32 accumulator (max_num_imprecise_acc = 32): Hopper's FP8 MMA accumulates in reduced
     precision and Triton's sm_90 default never promotes. A 17-row fp32 call on the H200 is 1.1e-4 from the
     float64 reference (relative to its largest output) promoted, 4.4e-4 not: the MMA's own alignment of
     products within one instruction is the rest, so e4m3 dot results are held to 2**-11, not fp32's 1e-5.
   Epilogue: y = (fp32(acc) * s_x[m]) * scale[n], rounded to x.dtype once (the reference's order).
For int8 every step is exact or the reference's own fp32 operation, so the output equals the reference bit
for bit; for e4m3 it differs by fp32 summation order only.
The tile depends on (M class, K) only, never on N, so a weight concatenated along N (models/qwen3_5/fuse.py) gives
bit-identical columns to the separate weights. Tiles are not tuned on a GPU yet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..linear_w8a8_fp8 import _validate as _validate_fp8
from ..linear_w8a8_int8 import _validate as _validate_int8
from ._common import launch, to_dt
from .linear import GEMV_MAX_M      # the GEMV / dot split: one rule for the projection kernels


@triton.jit
def _rne_e4m3(v):
    """fp32 v with |v| <= 448 -> fp32 holding the nearest e4m3 value (ties to even): 3 mantissa bits kept
    for normal values (|v| >= 2**-6), multiples of 2**-9 below (subnormals, by the 1.5 * 2**23 trick)."""
    b = v.to(tl.uint32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) << 20
    sub = (v + 24576.0) - 24576.0                    # 24576 = 1.5 * 2**14: rounds to multiples of 2**-9
    return tl.where(tl.abs(v) < 0.015625, sub, normal.to(tl.float32, bitcast=True))


@triton.jit
def _row_scale(x_row, K: tl.constexpr, BK: tl.constexpr, QMAX: tl.constexpr):
    """s_x of one row of x [K]: amax / QMAX (IEEE division, as torch), 1 for a zero row."""
    amax = tl.zeros([BK], tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        v = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    a = tl.max(amax, axis=0)
    return tl.where(a > 0, tl.math.div_rn(a, QMAX), 1.0)


@triton.jit
def _quantize(v, s, QMAX: tl.constexpr, INT: tl.constexpr):
    """fp32 v / s rounded to the 8-bit type (int8 | e4m3), clamped to +-QMAX."""
    v = tl.minimum(tl.maximum(tl.math.div_rn(v, s), -QMAX), QMAX)
    if INT:
        return ((v + 12582912.0) - 12582912.0).to(tl.int8)       # 12582912 = 1.5 * 2**23: round half to even
    else:
        return _rne_e4m3(v).to(tl.float8e4nv)


@triton.jit
def _quant_rows(x, xq, sx, s_x_m, s_q_m, K: tl.constexpr, BK: tl.constexpr, QMAX: tl.constexpr,
                INT: tl.constexpr):
    m = tl.program_id(0)
    s = _row_scale(x + m * s_x_m, K, BK, QMAX)
    tl.store(sx + m, s)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        v = tl.load(x + m * s_x_m + rk, mask=mk, other=0.0).to(tl.float32)
        tl.store(xq + m * s_q_m + rk, _quantize(v, s, QMAX, INT), mask=mk)


@triton.jit
def _w8a8_kernel(xq, w, sx, sw, y, M, N, s_x_m, s_w_n, s_y_m, K: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, INT: tl.constexpr,
                 QIN: tl.constexpr, QBK: tl.constexpr, QMAX: tl.constexpr):
    """y[m-tile, n-tile] = (xq[m-tile] @ w[n-tile].T) * sx[m] * sw[n]; xq, w contiguous along K.
    QIN (M == 1): xq is the float row itself; the program finds its scale (_row_scale, QBK-wide passes) and
    quantizes each K tile as it loads it (_quantize), the values _quant_rows would have written (sx unused)."""
    pid_n = tl.program_id(0)
    DT: tl.constexpr = y.dtype.element_ty
    ACC: tl.constexpr = tl.int32 if INT else tl.float32
    rn = pid_n * BN + tl.arange(0, BN)
    mn = rn < N
    rn64 = rn.to(tl.int64)                           # w offsets pass 2**31 for the vocab-sized projections
    swv = tl.load(sw + rn, mask=mn, other=0.0)       # [BN]
    if DOT:
        rm = tl.program_id(1) * BM + tl.arange(0, BM)
        mm = rm < M
        acc = tl.zeros([BM, BN], ACC)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < K
            xt = tl.load(xq + rm[:, None] * s_x_m + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
            wt = tl.load(w + rn64[:, None] * s_w_n + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            # e4m3: Hopper's FP8 MMA accumulates in reduced precision and Triton's sm_90 default never
            # promotes; 32 (one wgmma's K) adds each MMA's partial into the fp32 acc. int8: exact, unused.
            acc = tl.dot(xt, tl.trans(wt), acc, out_dtype=ACC, max_num_imprecise_acc=None if INT else 32)
        sxv = tl.load(sx + rm, mask=mm, other=0.0)
        out = (acc.to(tl.float32) * sxv[:, None]) * swv[None, :]
        tl.store(y + rm[:, None] * s_y_m + rn[None, :], to_dt(out, DT), mask=mm[:, None] & mn[None, :])
    else:
        if QIN:
            s_row = _row_scale(xq, K, QBK, QMAX)
        else:
            s_row = tl.load(sx)
        acc = tl.zeros([BN, BK], ACC)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < K
            if QIN:
                xv = _quantize(tl.load(xq + rk, mask=mk, other=0.0).to(tl.float32), s_row, QMAX, INT).to(ACC)
            else:
                xv = tl.load(xq + rk, mask=mk, other=0.0).to(ACC)
            wt = tl.load(w + rn64[:, None] * s_w_n + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            acc += wt.to(ACC) * xv[None, :]
        out = (tl.sum(acc, axis=1).to(tl.float32) * s_row) * swv
        tl.store(y + rn, to_dt(out, DT), mask=mn)


# (BM, BN, BK, num_warps, num_stages) by M class: 1 (GEMV), 2..GEMV_MAX_M, above (prefill). Starting points
# from custom_ops/triton/linear.py's H200-tuned bf16 GEMV (8-bit weights: twice the K per byte); not tuned.
TILES = {"one": (1, 8, 256, 4, 3), "few": (16, 32, 128, 4, 4), "many": (64, 64, 128, 4, 3)}


def tile(M: int, K: int) -> tuple[int, int, int, int, int]:
    cls = "one" if M == 1 else "few" if M <= GEMV_MAX_M else "many"
    bm, bn, bk, warps, stages = TILES[cls]
    floor = 1 if cls == "one" else 32                # 8-bit tl.dot needs K-tiles of 32 at least
    return bm, bn, max(floor, min(bk, triton.next_power_of_2(K))), warps, stages


def quantize_rows(x: torch.Tensor, integer: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] int8 | e4m3, s_x [M] fp32) by _quant_rows (the ops' quantize_rows)."""
    M, K = x.shape
    x = x.contiguous()
    xq = torch.empty((M, K), dtype=torch.int8 if integer else torch.float8_e4m3fn, device=x.device)
    sx = torch.empty((M,), dtype=torch.float32, device=x.device)
    launch(_quant_rows, (M,), x, xq, sx, x.stride(0), xq.stride(0), K=K, BK=quant_bk(K),
           QMAX=qmax(integer), INT=integer, num_warps=4)
    return xq, sx


def quant_bk(K: int) -> int:
    return min(1024, triton.next_power_of_2(K))


def qmax(integer: bool) -> float:
    return 127.0 if integer else 448.0


def matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
           cfg: tuple[int, int, int, int, int] | None = None, fuse_quant: bool = True) -> torch.Tensor:
    """x [M, K] float, w [N, K] int8 | e4m3, scale [N, 1] fp32 -> [M, N] x.dtype (cfg: benchmarks only).
    M == 1: one launch, the GEMV quantizing the row itself (QIN); fuse_quant=False (tests, benchmarks) runs
    _quant_rows first as M > 1 does. At batch 1 that kernel was 80 of a 35B INT8 step's launches, 0.18 of
    3.28 ms on the H200 (benchmarks/h200_35b_int8_bs1.json); every GEMV program re-reading the row (4-8 KB,
    from L1 / L2) for its scale is the price."""
    M, K = x.shape
    N = w.shape[0]
    integer = w.dtype == torch.int8
    dot = M > 1
    qin = fuse_quant and not dot
    if qin:
        xq, sx = x.contiguous(), scale                  # sx: unused by the kernel (QIN finds the row's scale)
    else:
        xq, sx = quantize_rows(x, integer)
    w, scale = w.contiguous(), scale.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = cfg or tile(M, K)
    launch(_w8a8_kernel, (triton.cdiv(N, bn), triton.cdiv(M, bm) if dot else 1), xq, w, sx, scale, y, M, N,
           xq.stride(0), w.stride(0), y.stride(0), K=K, BM=bm, BN=bn, BK=bk, DOT=dot, INT=integer,
           QIN=qin, QBK=quant_bk(K), QMAX=qmax(integer), num_warps=warps, num_stages=stages)
    return y


@triton_op("onegraph::linear_w8a8_int8_triton", mutates_args=())
def linear_w8a8_int8_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _validate_int8(x, w, scale)
    return matmul(x, w, scale)


@triton_op("onegraph::linear_w8a8_fp8_triton", mutates_args=())
def linear_w8a8_fp8_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _validate_fp8(x, w, scale)
    return matmul(x, w, scale)


_registry.register_lowering("linear_w8a8_int8", "triton", torch.ops.onegraph.linear_w8a8_int8_triton.default)
_registry.register_lowering("linear_w8a8_fp8", "triton", torch.ops.onegraph.linear_w8a8_fp8_triton.default)
