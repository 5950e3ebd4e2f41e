"""Triton lowering of linear (contract: custom_ops/linear.py): a GEMV for decode sizes.

At decode (M = 1..GEMV_MAX_M rows) a projection reads its whole weight for a handful of rows: it is
bound by memory bandwidth, and cuBLAS at M = 1 reached only 50-80 % of it on the H200 for the
K = 4096 and the concatenated projections, and paid a 3-5 us floor per small matrix.
Grid: cdiv(N, BN) programs; program n reads rows [n*BN, (n+1)*BN) of w [N, K] once, in [BN, BK] tiles,
for all M rows of x:
- M == 1: fp32 FMA into a [BN, BK] accumulator, one reduction over BK at the end;
- 1 < M <= GEMV_MAX_M: tl.dot of x [BM = 16, BK] (rows >= M masked to 0) with the tile transposed,
  fp32 accumulation (tensor cores; the padding rows cost compute, which is free here).
The tile (BN, BK, warps, stages) is chosen from (M, K) only — never from N — so every output column is
the same sum in the same order whatever N is: a weight concatenated along N (models/qwen3_5/fuse.py) gives
bit-identical columns to the separate weights. Above GEMV_MAX_M rows the aten GEMM (cuBLAS) runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..linear import _validate
from ._common import INTERPRETED, launch, mma, rnd, to_dt

GEMV_MAX_M = 16
PROLOGUE_ELEMS = 4096  # add_rms_norm_linear's prologue tile above one row: PM x KP elements (32 fp32 a thread, 4 warps)
PAD_MIN_M = 256        # project(): the GEMM of unaligned rows pays its weight padding from this many rows


@triton.jit
def _offsets(rm, mm, rk, mk, s_x_m, ROWS: tl.constexpr):
    """Offsets and mask of x's tile at columns rk: [BM, BK] (ROWS) or row 0's [BK] (M == 1: kept 1-D so it
    broadcasts over the weight tile without a layout conversion)."""
    if ROWS:
        return rm[:, None] * s_x_m + rk[None, :], mm[:, None] & mk[None, :]
    else:
        return rk, mk


@triton.jit
def _h_tile(x, res, off, m2, DT: tl.constexpr):
    """add_rms_norm's residual sum x + res, rounded to the model dtype DT (fp32 holding DT values)."""
    return rnd(tl.load(res + off, mask=m2, other=0.0).to(tl.float32)
               + tl.load(x + off, mask=m2, other=0.0).to(tl.float32), DT)


@triton.jit
def _normed_row(x, res, nw, normed, hout, eps, pid, K: tl.constexpr, KP: tl.constexpr, DT: tl.constexpr):
    """add_rms_norm's normed row of x + res [K] as a [KP] tensor in registers, rounded to DT where add_rms_norm
    rounds it; program `pid` 0 also writes it to `normed` and x + res to `hout` (the REGS forms)."""
    pk = tl.arange(0, KP)
    mk = pk < K
    p_h = _h_tile(x, res, pk, mk, DT)
    inv = tl.rsqrt(tl.sum(p_h * p_h, axis=0) / K + tl.cast(eps, tl.float32))   # AOTI passes floats as fp64
    wn = 1.0 + tl.load(nw + pk, mask=mk, other=0.0).to(tl.float32)
    row = to_dt(p_h * inv * wn, DT)
    if pid == 0:
        tl.store(normed + pk, row, mask=mk)
        tl.store(hout + pk, to_dt(p_h, DT), mask=mk)
    return row


@triton.jit
def _gemv_kernel(x, w, y, M, N, s_x_m, s_w_n, s_y_m, res, nw, normed, hout, eps, K: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                 DOT_F32: tl.constexpr, NORM: tl.constexpr, KP: tl.constexpr, REGS: tl.constexpr,
                 PM: tl.constexpr, MT: tl.constexpr):
    """y[:M, n-tile] = x[:M] @ w[n-tile].T; x and w contiguous along K.
    MT (DOT, no NORM): row tiles of BM rows; program p takes row tile p % MT of output tile p // MT (a weight
    tile's MT programs adjacent, so it comes from DRAM once). 1 except in linear_invariant.py's plan.
    NORM (add_rms_norm_linear): the rows multiplied are normed = rms_norm(x + res) * (1 + nw) instead of x.
    Every program makes them in a prologue (x and res are 2-8 KB per row, read from L2) and writes them to
    `normed` (program 0 also x + res to `hout`); after a block barrier the plain GEMV loop reads them back
    from there. The programs write identical bytes to the same addresses, so whichever lands last, a
    program reads its own values (visible to the whole block after the barrier). Making the rows per K tile
    inside the loop instead kept its L2 loads and the program-0 stores in the loop, which then did not
    pipeline: 8.3 us for the 35B router where add_rms_norm + GEMV took 3.7 (H200).
    KP: the prologue's row tile (M == 1: the whole row, next_pow2(K)); PM (M > 1): its rows, next_pow2(M), so
    that a [PM, KP] tile of PROLOGUE_ELEMS takes as few K steps as M allows. Each step of its two passes waits on
    its L2 loads (no tl.dot: not pipelined): at 16 rows x 128 columns, the tile before, the 35B router's
    prologue took 32 of them at M = 2.
    REGS (NORM at M == 1, BK == KP: one K tile): the normed row stays in registers and is multiplied as it is,
    with one [BN, KP] weight load and no loop; only program 0 writes normed and h. No program waits on a
    barrier or reads the row back, and the writes are one row per call, not one per program: the form that
    suits the wide projections (the GDN in_proj's 3088 programs would write 12 MB of rows in the form above)."""
    pid = tl.program_id(0)
    DT: tl.constexpr = y.dtype.element_ty
    rn = (pid // MT) * BN + tl.arange(0, BN)
    mn = rn < N
    rn64 = rn.to(tl.int64)                           # w offsets pass 2**31 for the large projections
    rm = (pid % MT) * BM + tl.arange(0, BM)
    mm = rm < M
    if REGS:                                         # NORM, M == 1, the whole row one tile (docstring)
        pk = tl.arange(0, KP)
        mk = pk < K
        # the weight load first: it does not depend on the row, so its DRAM latency overlaps the prologue's L2
        # loads and reductions (whose block barriers the compiler does not move a load across)
        wt = tl.load(w + rn64[:, None] * s_w_n + pk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        row = _normed_row(x, res, nw, normed, hout, eps, pid, K, KP, DT)                        # [KP]
        tl.store(y + rn, to_dt(tl.sum(wt.to(tl.float32) * row.to(tl.float32)[None, :], axis=1), DT), mask=mn)
    else:
        if NORM:
            if DOT:                                      # [PM, KP] tiles (PROLOGUE_ELEMS), two passes
                pr = tl.arange(0, PM)
                pmr = pr < M
                ss = tl.zeros([PM, KP], tl.float32)
                for p0 in range(0, K, KP):
                    pk = p0 + tl.arange(0, KP)
                    p_off, p_m = _offsets(pr, pmr, pk, pk < K, s_x_m, True)
                    p_h = _h_tile(x, res, p_off, p_m, DT)
                    ss += p_h * p_h
                inv = tl.rsqrt(tl.sum(ss, axis=1) / K + tl.cast(eps, tl.float32))   # [PM]; AOTI passes floats as fp64
                for p0 in range(0, K, KP):
                    pk = p0 + tl.arange(0, KP)
                    p_off, p_m = _offsets(pr, pmr, pk, pk < K, s_x_m, True)
                    p_h = _h_tile(x, res, p_off, p_m, DT)
                    wn = 1.0 + tl.load(nw + pk, mask=pk < K, other=0.0).to(tl.float32)
                    tl.store(normed + p_off, to_dt(p_h * inv[:, None] * wn[None, :], DT), mask=p_m)
                    if pid == 0:
                        tl.store(hout + p_off, to_dt(p_h, DT), mask=p_m)
            else:                                        # the whole row in one load
                pk = tl.arange(0, KP)
                p_h = _h_tile(x, res, pk, pk < K, DT)
                inv = tl.rsqrt(tl.sum(p_h * p_h, axis=0) / K + tl.cast(eps, tl.float32))
                wn = 1.0 + tl.load(nw + pk, mask=pk < K, other=0.0).to(tl.float32)
                tl.store(normed + pk, to_dt(p_h * inv * wn, DT), mask=pk < K)
                if pid == 0:
                    tl.store(hout + pk, to_dt(p_h, DT), mask=pk < K)
            tl.debug_barrier()                           # this block's normed rows are written before it reads them
            src = normed
        else:
            src = x
        if DOT:
            acc = tl.zeros([BM, BN], tl.float32)
        else:
            acc = tl.zeros([BN, BK], tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < K
            off, m2 = _offsets(rm, mm, rk, mk, s_x_m, DOT)
            xt = tl.load(src + off, mask=m2, other=0.0)
            wt = tl.load(w + rn64[:, None] * s_w_n + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            if DOT:
                acc = mma(xt, tl.trans(wt), acc, DOT_F32)
            else:                                        # M == 1: fp32 FMA into [BN, BK]
                acc += wt.to(tl.float32) * xt.to(tl.float32)[None, :]
        if DOT:
            tl.store(y + rm[:, None] * s_y_m + rn[None, :], to_dt(acc, DT), mask=mm[:, None] & mn[None, :])
        else:
            tl.store(y + rn, to_dt(tl.sum(acc, axis=1), DT), mask=mn)


# (BN, BK, num_warps, num_stages) by (M == 1, K): the tile with the least time per 35B decode step over
# that class's projections (fused GDN in_proj x30, fused attention qkv x10, out/o_proj x40), measured on
# the H200 by `python -m onegraph.scripts.bench_linear` (benchmarks/h200_linear.json). At M = 1 it reads the
# fused GDN in_proj (50.6 MB) in 13.7 us (87 % of copy bandwidth; cuBLAS 15.6 us), out_proj (16.8 MB,
# K = 4096) in 6.5 us (61 %; cuBLAS 9.4 us: a fixed ~2 us of launch and ramp-up dominates at this size).
# K = 4096 at M = 1 then took one row whole per program, (1, 4096, 8, 1): 5.9 us against 6.6 for (4, 128, 8, 1)
# on the same H200 run (12 weights per graph, benchmarks/h200_moe_bs1_tiles.json): a program's 8 KB in flight
# at once where the loop waited one DRAM latency per tile (its loads feed no tl.dot and are not pipelined).
TILES = {
    (True, 2048): (4, 128, 8, 3),
    (True, 4096): (1, 4096, 8, 1),
    (False, 2048): (32, 128, 4, 4),
    (False, 4096): (16, 256, 4, 4),
}
DEFAULT_TILE = {True: (4, 128, 8, 3), False: (32, 128, 4, 4)}


# add_rms_norm_linear at M = 1 (REGS): (BN, warps) with BK the whole row, up to NORM_ROW_MAX_K columns (a
# [BN, K] weight tile in registers: 64 values a thread at (4, 2048, 4 warps)). The best of 9 (BN, warps) over a
# 35B step on the H200 (`python -m onegraph.scripts.bench_linear --norm --rows 1`, benchmarks/h200_linear_norm.json,
# second run: the weight load issued before the norm prologue): GDN in_proj 14.2 us, attention [q; k; v] 11.0
# (norm kernel + GEMV: 15.3, 12.9); the router 2.35 (its own best, (4, 8), 2.26).
NORM_ROW_TILE, NORM_ROW_MAX_K = (4, 4), 4096


def norm_row_tile(K: int) -> tuple[int, int, int, int]:
    return NORM_ROW_TILE[0], triton.next_power_of_2(K), NORM_ROW_TILE[1], 1


def tile(M: int, K: int) -> tuple[int, int, int, int]:
    # bool(): under a symbolic batch (scripts/bench_symbolic_batch.py) M == 1 is a SymBool, and using it in the
    # TILES key made the export's decomposition crash inside sympy; bool() guards M on the trace's example
    one = bool(M == 1)
    bn, bk, warps, stages = TILES.get((one, K), DEFAULT_TILE[one])
    return bn, min(bk, triton.next_power_of_2(K)), warps, stages


def gemv(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int, int, int] | None = None,
         norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, row_tiles: bool = False):
    """x [M <= GEMV_MAX_M, K] @ w [N, K].T by _gemv_kernel; cfg overrides the tile (benchmarks only).
    norm = (residual [M, K], norm weight [K], eps): add_rms_norm_linear's rows instead of x, and returns
    (y, normed, x + residual).
    row_tiles (linear_invariant.py; no norm): any M, in tiles of BM = 16 rows by the tl.dot path and the tile of
    tile(GEMV_MAX_M, K), M = 1 included: a row's products and sums are then the same whatever M is."""
    M, K = x.shape
    N = w.shape[0]
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    regs = norm is not None and M == 1 and K <= NORM_ROW_MAX_K
    bn, bk, warps, stages = cfg or (norm_row_tile(K) if regs else tile(GEMV_MAX_M if row_tiles else M, K))
    dot = row_tiles or M > 1
    mt = triton.cdiv(M, GEMV_MAX_M) if row_tiles else 1
    if norm is None:
        res, nw, normed, h, eps = x, x, y, y, 0.0
    else:
        res, nw, eps = norm[0].contiguous(), norm[1], norm[2]
        normed, h = torch.empty_like(x), torch.empty_like(x)
    PM = triton.next_power_of_2(M)
    KP = triton.next_power_of_2(K) if M == 1 else min(triton.next_power_of_2(K), max(16, PROLOGUE_ELEMS // PM))
    launch(_gemv_kernel, (mt * triton.cdiv(N, bn),), x, w, y, M, N, x.stride(0), w.stride(0), y.stride(0),
           res, nw, normed, h, eps, K=K, BM=GEMV_MAX_M if dot else 1, BN=bn, BK=bk, DOT=dot,
           DOT_F32=INTERPRETED, NORM=norm is not None, KP=KP, REGS=regs and bk == KP, PM=PM, MT=mt,
           num_warps=warps, num_stages=stages)
    return y if norm is None else (y, normed, h)


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T: the GEMV up to GEMV_MAX_M rows, the aten GEMM above (static at trace time:
    prefill chunks and large decode buckets).

    cuBLAS picks a `cutlass_75 ... align1` kernel when y's rows are not 16-byte aligned (the MoE router's N = 257:
    [E experts; shared gate]). From PAD_MIN_M rows the weight is padded with zero rows to the alignment, the
    product made with aligned rows [M, N + pad] and its first N columns copied out (contiguous, as the fake):
    H100, K = 2048, µs a call (benchmarks/h100_gemm_align.json): M = 512 20.1 -> 11.9, 2048 49.3 -> 13.6, 8192
    157.2 -> 26.8; at M = 64 the pad and the copy cost more than they save (8.8 -> 11.4), so decode buckets keep
    the plain call."""
    if x.shape[0] > GEMV_MAX_M:
        pad = -w.shape[0] % (16 // w.element_size())
        if pad and x.shape[0] >= PAD_MIN_M:
            return F.linear(x, F.pad(w, (0, 0, 0, pad)))[:, :w.shape[0]].contiguous()
        return F.linear(x, w)
    return gemv(x, w)


@triton_op("onegraph::linear_triton", mutates_args=())
def linear_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    _validate(x, w)
    return project(x, w)


_registry.register_lowering("linear", "triton", torch.ops.onegraph.linear_triton.default)
