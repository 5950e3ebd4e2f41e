"""Triton lowering of linear_fp8 (contract: custom_ops/linear_fp8.py): block-FP8 weights read as bytes.

Weight-only FP8: x stays in the model dtype, w [N, K] is read as e4m3 (half the bytes of bf16: decode is
bandwidth bound) and each value is upcast and scaled in registers, never written back dequantized.
One kernel, grid (cdiv(N, BN) + cdiv(Nt, BN), cdiv(M, BM)); program (n, m) reads rows [n*BN, (n+1)*BN) of w once
for BM rows of x (the programs past cdiv(N, BN) read the float tail's rows, below):
- M == 1 (GEMV): fp32 FMA of fp32(q) with x's tile times its block scales, x[k] * s[k // 128], into a
  [BN, BK] accumulator, one reduction at the end. BN divides 128, so a program's rows lie in one block row
  and a K tile needs one scale per 128 columns (BK may span blocks), applied to the [BK] x tile once rather
  than to each of the [BN, BK] weights: x . (q * s) and (x * s) . q differ only by fp32 rounding.
- 1 < M <= BM < 16 (tile(): M = 2..4 where measured faster): the GEMV's arithmetic over BM rows at once, the
  weight tile upcast once for all of them into a [BM, BN, BK] accumulator; a row's sum does not depend on the
  rows beside it.
- BM >= 16: tl.dot of x [BM, BK] with the raw e4m3 tile upcast to x.dtype — exact: every e4m3 value is a bf16
  (and an fp16) value — accumulated in fp32 per BK-tile, then scaled by that tile's block scale
  (BK divides 128, so one scale per row of the tile) and added: the reference up to fp32 summation and
  rounding order. The same kernel covers prefill (M > GEMV_MAX_M, BM = 64): dequantizing first would
  either round the weight to bf16 (not the reference: transformers' bf16 path, 2**-9 per weight) or need
  an fp32 GEMM (no tensor cores, ~15x slower on the H100), and would write and re-read the weight.
The tile (BM, BN, BK, warps, stages) depends on (M class, K) only, never on N, so a weight concatenated
along N (models/qwen3_5/fuse.py) gives bit-identical columns to the separate weights, as custom_ops/triton/linear.py.
The float tail (linear_fp8's `tail`, an FP8 model's GDN [b; a] rows): cdiv(Nt, BN) more programs of the same launch
take its rows at the same tile, without the scales (the dot path accumulates them in one fp32 accumulator instead of
per block; the K-looped REGS form at half the K tile, so its bf16 tile needs no more registers than the e4m3 one),
and write columns N.. of y. So the FP8 columns are the tail-free launch's bits
and the tail costs no launch of its own (~2 us each at batch 1: 30 a 35B decode step); the tail columns depend on
(M class, K) only too, not on N or Nt. In the REGS form the tail programs multiply the same normed row.
The Triton 3.6 interpreter (CPU tests) loads float8_e4m3fn pointers and converts every finite e4m3 value
exactly (all 254 checked; it reads the two NaN encodings as +-480, which no checkpoint holds), so the
weight is passed as float8_e4m3fn on both paths.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..linear_fp8 import BLOCK, _validate
from ._common import INTERPRETED, launch, mma, to_dt
from .linear import GEMV_MAX_M, _h_tile, _normed_row


@triton.jit
def _fp8_kernel(x, w, s, t, y, M, N, NT, s_x_m, s_w_n, s_s_n, s_t_n, s_y_m, res, nw, normed, hout, eps,
                K: tl.constexpr, SB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                DOT: tl.constexpr, DOT_F32: tl.constexpr, REGS: tl.constexpr, TAIL: tl.constexpr, GM: tl.constexpr,
                SWAP: tl.constexpr):
    """y[m-tile, n-tile] = x[m-tile] @ (fp32(w) * s)[n-tile].T; x, w, t contiguous along K; SB = 128.
    TAIL (a float tail t [NT, K]): the programs after the cdiv(N, BN) FP8 ones take t's rows BN at a time, at the
    same tile (_rows), unscaled, and write columns N.. of y (row stride N + NT). Without it the launch is the
    FP8 rows' alone (the branch is compiled out).
    REGS (add_rms_norm_linear_fp8 at M == 1, BK = next_pow2(K)): the rows multiplied are add_rms_norm's normed
    row, made in registers as custom_ops/triton/linear.py's REGS path makes it (program 0 writes normed and h)."""
    q = tl.program_id(0)
    if BM > 1:
        # a 1-D grid of (N tiles + tail tiles) x M tiles; pid its weight (N) tile, pm its M tile. Launch order: GM
        # M tiles of one weight tile side by side, then the next weight tile (GM = 1: an M tile's every weight tile,
        # then the next M tile). With GM >= the M tiles, the programs sharing a weight tile run together and the
        # weight comes from DRAM once; a group of GM M tiles bounds the x rows that must stay in L2 meanwhile.
        nm = tl.cdiv(M, BM)
        per = GM * (tl.num_programs(0) // nm)
        first = (q // per) * GM
        gm = tl.minimum(nm - first, GM)              # the last group may hold fewer M tiles
        pm = first + (q % per) % gm
        pid = (q % per) // gm
    else:
        pm = 0
        pid = q
    if TAIL:
        nf = (N + BN - 1) // BN
        if pid >= nf:
            _rows(x, t, s, y + N, (pid - nf) * BN, NT, pid, pm, M, s_x_m, s_t_n, s_s_n, s_y_m, res, nw, normed,
                  hout, eps, K, SB, BM, BN, BK, DOT, DOT_F32, REGS, False, SWAP)
        else:
            _rows(x, w, s, y, pid * BN, N, pid, pm, M, s_x_m, s_w_n, s_s_n, s_y_m, res, nw, normed, hout,
                  eps, K, SB, BM, BN, BK, DOT, DOT_F32, REGS, True, SWAP)
    else:
        _rows(x, w, s, y, pid * BN, N, pid, pm, M, s_x_m, s_w_n, s_s_n, s_y_m, res, nw, normed, hout,
              eps, K, SB, BM, BN, BK, DOT, DOT_F32, REGS, True, SWAP)


@triton.jit
def _rows(x, w, s, y, r0, N, pid, pm, M, s_x_m, s_w_n, s_s_n, s_y_m, res, nw, normed, hout, eps, K: tl.constexpr,
          SB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
          DOT_F32: tl.constexpr, REGS: tl.constexpr, SCALED: tl.constexpr, SWAP: tl.constexpr):
    """Rows [r0, r0 + BN) of w [N, K] (columns of y, whose first column y points at) for the program of weight
    tile `pid` and (DOT) M tile `pm`.
    SCALED: w is e4m3 with block scales s; else a float weight (the tail) multiplied as it is, the same loop."""
    DT: tl.constexpr = y.dtype.element_ty
    rn = r0 + tl.arange(0, BN)
    mn = rn < N
    rn64 = rn.to(tl.int64)                           # w offsets pass 2**31 for the vocab-sized projections
    srow0 = (r0 // SB) * s_s_n                       # BN divides SB: the rows' one row of the scale table (GEMV)
    if REGS and BK < K:
        # the normed row made per K tile: a pass for the sum of squares of h = x + res (L2 reads), then the
        # GEMV loop rounds each tile of the normed row as add_rms_norm does and folds the block scale into it
        ss = tl.zeros([BK], tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            hv = _h_tile(x, res, rk, rk < K, DT)
            ss += hv * hv
        inv = tl.rsqrt(tl.sum(ss, axis=0) / K + tl.cast(eps, tl.float32))
        # the tail's bf16 tile holds twice the e4m3 tile's bytes: at half its width the tail branch needs no more
        # registers than the FP8 one (sm_90, 35B in_proj: 72 a thread, 92 at the full width), and so the launch's
        # occupancy stays the tail-free one's; the row's elements are the same values at any tile
        TK: tl.constexpr = BK if SCALED else BK // 2
        acc = tl.zeros([BN, TK], tl.float32)
        for k0 in range(0, K, TK):
            rk = k0 + tl.arange(0, TK)
            mk = rk < K
            wt = tl.load(w + rn64[:, None] * s_w_n + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            hv = _h_tile(x, res, rk, mk, DT)
            row = to_dt(hv * inv * (1.0 + tl.load(nw + rk, mask=mk, other=0.0).to(tl.float32)), DT)
            if pid == 0:
                tl.store(normed + rk, row, mask=mk)
                tl.store(hout + rk, to_dt(hv, DT), mask=mk)
            acc += wt.to(tl.float32) * _scaled(row.to(tl.float32), s, srow0, rk, mk, SB, SCALED)[None, :]
        tl.store(y + rn, to_dt(tl.sum(acc, axis=1), DT), mask=mn)
    elif REGS:
        row = _normed_row(x, res, nw, normed, hout, eps, pid, K, BK, DT)                        # [BK]
        pk = tl.arange(0, BK)
        mk = pk < K
        wt = tl.load(w + rn64[:, None] * s_w_n + pk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        acc = wt.to(tl.float32) * _scaled(row.to(tl.float32), s, srow0, pk, mk, SB, SCALED)[None, :]
        tl.store(y + rn, to_dt(tl.sum(acc, axis=1), DT), mask=mn)
    elif not DOT and BM > 1:
        # FMA over BM rows of x (M <= BM at decode: a verify's K + 1 rows, the small buckets): the weight tile is
        # loaded and upcast once for all of them; per row the M == 1 arithmetic (x's tile times its block scales,
        # fp32 products into a [BN, BK] accumulator, one reduction at the end), as a [BM, BN, BK] accumulator
        rm = pm * BM + tl.arange(0, BM)
        mm = rm < M
        acc = tl.zeros([BM, BN, BK], tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < K
            xt = tl.load(x + rm[:, None] * s_x_m + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
            wt = tl.load(w + rn64[:, None] * s_w_n + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            xs = _scaled(xt.to(tl.float32), s, srow0, rk[None, :], mk[None, :], SB, SCALED)             # [BM, BK]
            acc += wt.to(tl.float32)[None, :, :] * xs[:, None, :]
        tl.store(y + rm[:, None] * s_y_m + rn[None, :], to_dt(tl.sum(acc, axis=2), DT), mask=mm[:, None] & mn[None, :])
    elif DOT:
        rm = pm * BM + tl.arange(0, BM)
        mm = rm < M
        srow = (rn // SB) * s_s_n                    # [BN] each row's block row in the scale table
        # SWAP: the transposed product acc^T [BN, BM] = w tile [BN, BK] @ x^T [BK, BM]; the upcast weight is the
        # MMA's A operand, which sm_90's wgmma takes from registers (the plain form writes the upcast tile to shared
        # memory first, as B), and x's rows sit on the MMA's N, which may be 16 where M must be 64. Same products,
        # same fp32 accumulation per tile
        acc = tl.zeros([BN, BM] if SWAP else [BM, BN], tl.float32)
        for k0 in range(0, K, BK):                   # BK divides SB: one block column per tile
            rk = k0 + tl.arange(0, BK)
            mk = rk < K
            xt = tl.load(x + rm[:, None] * s_x_m + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
            wt = tl.load(w + rn64[:, None] * s_w_n + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            wt = wt.to(xt.dtype)
            if SCALED:                               # each tile's product times its block scale, one per row
                st = tl.load(s + srow + k0 // SB, mask=mn, other=0.0)                              # [BN]
                if SWAP:
                    acc += mma(wt, tl.trans(xt), tl.zeros([BN, BM], tl.float32), DOT_F32) * st[:, None]
                else:
                    acc += mma(xt, tl.trans(wt), tl.zeros([BM, BN], tl.float32), DOT_F32) * st[None, :]
            elif SWAP:                               # the float tail: one fp32 accumulation over K
                acc = mma(wt, tl.trans(xt), acc, DOT_F32)
            else:
                acc = mma(xt, tl.trans(wt), acc, DOT_F32)
        if SWAP:
            tl.store(y + rm[None, :] * s_y_m + rn[:, None], to_dt(acc, DT), mask=mm[None, :] & mn[:, None])
        else:
            tl.store(y + rm[:, None] * s_y_m + rn[None, :], to_dt(acc, DT), mask=mm[:, None] & mn[None, :])
    else:
        # BN divides SB (tile()): the program's rows share one row of the scale table, so the K tile's scales
        # are one [BK] vector (a 1-2 element L1 line), folded into x's tile: one convert and one FMA per weight
        acc = tl.zeros([BN, BK], tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < K
            xv = tl.load(x + rk, mask=mk, other=0.0).to(tl.float32)
            wt = tl.load(w + rn64[:, None] * s_w_n + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            acc += wt.to(tl.float32) * _scaled(xv, s, srow0, rk, mk, SB, SCALED)[None, :]
        tl.store(y + rn, to_dt(tl.sum(acc, axis=1), DT), mask=mn)


@triton.jit
def _scaled(xv, s, srow0, rk, mk, SB: tl.constexpr, SCALED: tl.constexpr):
    """x's fp32 tile [BK] times its columns' block scales (row srow0 of the table): x . (q * s) as (x * s) . q.
    Unscaled for the float tail."""
    if SCALED:
        return xv * tl.load(s + srow0 + rk // SB, mask=mk, other=0.0)
    else:
        return xv


# (BM, BN, BK, num_warps, num_stages[, SWAP]) by M class: 1 (GEMV), 2..GEMV_MAX_M (dot, 16 rows), above (prefill),
# and K for the GEMV. GEMV tiles: the least time per 35B decode step over the FP8 projections of that K,
# `python -m onegraph.scripts.bench_linear --fp8 --rows 1,4,16` on the H200 (benchmarks/h200_linear_fp8.json, one CUDA
# graph over distinct weight copies): the GDN [qkv; z] (25.2 MB) in 8.98 us (67 % of copy bandwidth), attention
# [q; k; v] (18.9 MB) 8.14. Rows per program matter most: 4-8 rows (the earlier tile set) read the GDN run in
# 10.0 us at best; scaling each weight instead of x's tile, 11.15. out/o_proj (8.4 MB, K = 4096): two rows a program
# whole in one load (every byte of the program in flight behind one latency), 4.71 us against 5.20 at (4 rows, K tile
# 1024) (`bench_linear --fp8 --rows 1 --shapes out_or_o_proj,gdn_in_proj_qkvz`, benchmarks/h200_linear_fp8_whole_row.json).
# "batch" (decode buckets above GEMV_MAX_M rows, up to BATCH_MAX_M), `bench_linear --fp8 --rows 64`
# (benchmarks/h200_linear_fp8_m64.json): [qkv; z] 21.8 us against 24.5 at the prefill tile, out/o_proj 17.3 against
# 35.4 (the prefill tile's 64-row programs leave out_proj's 2048 rows 32 programs). Still below cuBLAS on the bf16
# weights (15.5 / 10.1 us): the e4m3 tiles are upcast for bf16 tensor cores.
# "rows2" / "rows4" (M = 2, 3..4, where TILES holds a tile for K; else "few"): the FMA path over all M rows of one
# program, `bench_linear --fp8 --rows 2,4,8` on the H100 (benchmarks/h100_linear_fp8_rows.json): out/o_proj (K = 4096)
# 8.46 us at 2 rows and 11.55 at 4 against 14.55 / 14.42 for the best 16-row dot tile (whose 64 programs of 32 rows
# loop over K one tile after another). At K = 2048 and at 8 rows every FMA tile lost to the dot tile (2 rows: 18.6
# against 13.6 for [qkv; z]).
# "many" (prefill rows): the transposed product (SWAP), 128 rows of x a program against 64 weight rows, `bench_linear
# --fp8 --rows 512,2048` on the H100 (benchmarks/h100_linear_fp8_prefill_swap.json): at 512 rows [qkv; z] 73.2 us
# (352 TFLOP/s) against 137.1 at the plain (64, 64, 128) tile and 91.5 at the best plain one, out/o_proj 37.7 against
# 45.3; at 2048 rows 308 / 211 / 89 against 529 / 394 / 170. cuBLAS on the bf16 weights: 37.1 / 30.4 / 17.2 at 512
# rows, so the upcast FP8 tile still runs at about half of bf16's tensor-core rate. At 4-16 rows the swapped tiles
# (64 weight rows a program) lost to the 16-row dot tile (16.5 against 13.7 for [qkv; z]).
TILES = {("one", 2048): (1, 32, 256, 8, 2), ("one", 4096): (1, 2, 4096, 4, 1),
         "one": (1, 32, 256, 8, 2), ("rows2", 4096): (2, 8, 1024, 8, 1), ("rows4", 4096): (4, 8, 512, 8, 1),
         "few": (16, 32, 128, 4, 4),
         ("batch", 2048): (64, 32, 64, 4, 4), ("batch", 4096): (16, 32, 128, 4, 4),
         "batch": (64, 32, 64, 4, 4), "many": (128, 64, 128, 4, 3, True)}
BATCH_MAX_M = 128
ROWS_MAX_M = 4         # "rows2" / "rows4" (M = 2 / 3..4): an FMA tile over all M rows where TILES holds one for K
DOT_MIN_BM = 16        # a tile of BM >= 16 rows runs tl.dot; fewer (1 included) the FMA path


# The launch order's group of M tiles per class (_fp8_kernel GM): 1 is an M tile's every weight tile, then the
# next M tile's, so above one M tile each program re-reads its weight tile, from DRAM unless L2 still holds it.
# `bench_linear --fp8 --rows 512,2048` (H100) swept GM in {1, 8} with the prefill tiles: within 1-7 %, 1 mostly ahead.
GROUP_M = {"one": 1, "few": 1, "batch": 1, "many": 1}


def _cls(M: int) -> str:
    return "one" if bool(M == 1) else "few" if M <= GEMV_MAX_M else "batch" if M <= BATCH_MAX_M else "many"


def tile(M: int, K: int) -> tuple[int, int, int, int, int, bool]:
    """(BM, BN, BK, warps, stages, SWAP) for M rows of K columns."""
    cls = _cls(M)
    rows = (f"rows{triton.next_power_of_2(M)}", K) if 1 < M <= ROWS_MAX_M else None    # an FMA tile where measured
    bm, bn, bk, warps, stages, *swap = TILES.get(rows) or TILES.get((cls, K), TILES[cls])
    floor = 16 if bm >= DOT_MIN_BM else 1            # tl.dot needs K-tiles of 16 at least
    return bm, bn, max(floor, min(bk, triton.next_power_of_2(K))), warps, stages, bool(swap and swap[0])


# add_rms_norm_linear_fp8 at M = 1 (REGS): (BN, BK, warps, stages), BN dividing 128. BK < K: the K-looped form
# (a sum-of-squares pass over x + res, then the GEMV loop making each tile of the normed row). The least time per
# 35B step over the GDN [qkv; z] (x30) and attention [q; k; v] (x10) folds, `python -m onegraph.scripts.bench_linear
# --fp8 --norm --rows 1` on the H200 (benchmarks/h200_linear_fp8_norm.json): 10.96 / 10.6 us against 11.19 / 10.58
# for the norm kernel + the GEMV, and 16.5 / 13.1 for the whole row in registers at 4 rows a program.
NORM_ROW_TILE = (16, 256, 4, 2)


def norm_tile(K: int) -> tuple[int, int, int, int, int]:
    bn, bk, warps, stages = NORM_ROW_TILE
    return 1, bn, min(bk, triton.next_power_of_2(K)), warps, stages


def matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, cfg: tuple | None = None,
           norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, tail: torch.Tensor | None = None,
           group_m: int | None = None):
    """x [M, K] @ dequant(w [N, K], scale).T -> [M, N] x.dtype; cfg ((BM, BN, BK, warps, stages[, SWAP]), as tile())
    and group_m (the launch order's group of M tiles, _fp8_kernel) override the tile's (benchmarks only).
    tail [Nt, K] (x.dtype): its rows x @ tail.T as columns N.. of y [M, N + Nt], by cdiv(Nt, BN) more programs of
    the same launch at the same tile (the FP8 columns are the tail-free launch's bits).
    norm = (residual [1, K], norm weight [K], eps), M == 1 only: add_rms_norm_linear_fp8's normed row instead
    of x (REGS), returning (y, normed, x + residual)."""
    M, K = x.shape
    N = w.shape[0]
    NT = 0 if tail is None else tail.shape[0]
    x, w, scale = x.contiguous(), w.contiguous(), scale.contiguous()
    t = w if tail is None else tail.contiguous()     # without a tail the kernel never reads t (TAIL=False)
    y = torch.empty((M, N + NT), dtype=x.dtype, device=x.device)
    if norm is not None:
        if M != 1:
            raise ValueError(f"linear_fp8: the norm-row form takes one row, got {M}")
        res, nw, eps = norm[0].contiguous(), norm[1], norm[2]
        normed, h = torch.empty_like(x), torch.empty_like(x)
        _, bn, bk, warps, stages = (cfg or norm_tile(K))[:5]
        launch(_fp8_kernel, (triton.cdiv(N, bn) + triton.cdiv(NT, bn),), x, w, scale, t, y, M, N, NT, x.stride(0),
               w.stride(0), scale.stride(0), t.stride(0), y.stride(0), res, nw, normed, h, eps, K=K, SB=BLOCK, BM=1,
               BN=bn, BK=min(bk, triton.next_power_of_2(K)), DOT=False, DOT_F32=INTERPRETED, REGS=True, TAIL=NT > 0,
               GM=1, SWAP=False, num_warps=warps, num_stages=stages)
        return y, normed, h
    bm, bn, bk, warps, stages, *swap = cfg or tile(M, K)
    dot = bm >= DOT_MIN_BM                           # benchmarks may run any tile at any M
    if dot and BLOCK % bk:
        raise ValueError(f"linear_fp8: the dot path needs a K tile dividing {BLOCK}, got {bk}")
    if not dot and BLOCK % bn:
        raise ValueError(f"linear_fp8: the FMA path needs a row tile dividing {BLOCK}, got {bn}")
    launch(_fp8_kernel, ((triton.cdiv(N, bn) + triton.cdiv(NT, bn)) * (triton.cdiv(M, bm) if bm > 1 else 1),),
           x, w, scale, t, y, M, N, NT, x.stride(0), w.stride(0), scale.stride(0), t.stride(0), y.stride(0),
           x, x, y, y, 0.0, K=K, SB=BLOCK, BM=bm, BN=bn, BK=bk, DOT=dot, DOT_F32=INTERPRETED, REGS=False, TAIL=NT > 0,
           GM=group_m or GROUP_M[_cls(M)], SWAP=dot and bool(swap and swap[0]), num_warps=warps, num_stages=stages)
    return y


@triton_op("onegraph::linear_fp8_triton", mutates_args=())
def linear_fp8_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                      tail: Optional[torch.Tensor] = None) -> torch.Tensor:
    _validate(x, w, scale, tail)
    return matmul(x, w, scale, tail=tail)


_registry.register_lowering("linear_fp8", "triton", torch.ops.onegraph.linear_fp8_triton.default)
