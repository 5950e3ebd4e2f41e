"""Prefill path of the Triton fused_moe_fp8 lowering (contract: custom_ops/fused_moe_fp8.py): T*top_k > E.
fused_moe_prefill.py's algorithm (block table of expert-sorted pairs, grouped SwiGLU GEMM, grouped down GEMM,
the shared expert as one group, the combine kernel: the last three and the combine reused from there) with
e4m3 weight tiles.

Per K step a [BK, BN] e4m3 weight tile is upcast to x.dtype (exact: every e4m3 value is a bf16, fp16 and fp32
value) and multiplied on the tensor cores into a fresh fp32 partial, which is scaled by the tile's one block
scale and added to the accumulator: BN and BK are powers of two <= 128 (TILES), so a tile lies in one 128x128 block.
That is the reference's fp32 weight values fp32(q) * s up to fp32 summation order (linear_fp8's prefill rule),
without writing a dequantized copy of the experts; the roundings to x.dtype are fused_moe_prefill's.
Swap form (SWAP in TILES, fused_moe_prefill's docstring): the upcast [BN, BK] tile times x[rows]^T [BK, BM] into
an [BN, BM] partial, scaled the same way, transposed once after the K loop. Why here above all: with BM = 16 the
plain form is an mma.sync GEMM whose upcast B tile goes to shared memory and back; swapped, the weight rows are
wgmma's M (64 a warpgroup) and the upcast tile its operand A, which wgmma may take from registers.
Scale tables: gate_up_scale [E, 2*ceil(I/128), ceil(H/128)] (up rows' block rows start at ceil(I/128));
down_scale [E, ceil(H/128), ceil(I/128)]; the shared expert's 2-D tables are one group (expert stride 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..linear_fp8 import BLOCK
from ._common import INTERPRETED, launch, mma, next_pow2, rnd, to_dt
from .fused_moe_prefill import (BH_COMBINE, BK_MAX, BM_MAX, BN_MAX, _combine_kernel, _strides3, _tile, dense_table,
                                plan, routed_table)


@triton.jit
def _grouped_swiglu_fp8_kernel(x, src, blk_e, blk_row, blk_end, wg, wu, sg, su, act,
                               s_x_t, s_x_h, s_g_e, s_g_n, s_g_h, s_u_e, s_u_n, s_u_h,
                               s_sg_e, s_sg_n, s_su_e, s_su_n, u0, ub0,
                               H: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, SB: tl.constexpr,
                               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr,
                               DOT_F32: tl.constexpr):
    """act[r, n-tile] for the sorted rows r of block b; gate rows n of wg[e] (scale block row n // 128 of
    sg[e]), up rows u0 + n of wu[e] (scale block row ub0 + n // 128 of su[e]); scale tables contiguous in H.
    SWAP: the transposed product (module docstring)."""
    b = tl.program_id(0)
    nb = tl.program_id(1)
    DT: tl.constexpr = x.dtype.element_ty
    r0 = tl.load(blk_row + b)
    r1 = tl.load(blk_end + b)
    if r0 < r1:                                       # blocks past the last tile have no rows
        e = tl.load(blk_e + b)                        # int64: 64-bit weight offsets
        rows = r0 + tl.arange(0, BM)
        mr = rows < r1
        tok = tl.load(src + rows, mask=mr, other=0) // TOPK              # [BM] pair -> token
        cols = nb * BN + tl.arange(0, BN)             # [BN] intermediate channels, one 128-row block
        mc = cols < N
        x_rows = x + tok * s_x_t                                         # [BM]
        g_rows = wg + e * s_g_e + cols * s_g_n                           # [BN]
        u_rows = wu + e * s_u_e + (u0 + cols) * s_u_n
        cb = (nb * BN) // SB
        sg_row = sg + e * s_sg_e + cb * s_sg_n
        su_row = su + e * s_su_e + (ub0 + cb) * s_su_n
        if SWAP:   # acc^T [BN, BM] += (W tile [BN, BK] @ x^T [BK, BM]) * s: the upcast tile is the MMA's A
            acc_g = tl.zeros([BN, BM], tl.float32)
            acc_u = tl.zeros([BN, BM], tl.float32)
            for h0 in range(0, H, BK):
                kk = h0 + tl.arange(0, BK)
                mk = kk < H
                m_xt = mk[:, None] & mr[None, :]
                xt = tl.load(x_rows[None, :] + kk[:, None] * s_x_h, mask=m_xt, other=0.0)           # [BK, BM]
                mw = mc[:, None] & mk[None, :]
                g = tl.load(g_rows[:, None] + kk[None, :] * s_g_h, mask=mw, other=0.0).to(DT)       # [BN, BK]
                u = tl.load(u_rows[:, None] + kk[None, :] * s_u_h, mask=mw, other=0.0).to(DT)
                acc_g += mma(g, xt, tl.zeros([BN, BM], tl.float32), DOT_F32) * tl.load(sg_row + h0 // SB)
                acc_u += mma(u, xt, tl.zeros([BN, BM], tl.float32), DOT_F32) * tl.load(su_row + h0 // SB)
            acc_g = tl.trans(acc_g)                   # [BM, BN]: the epilogue below is the plain form's
            acc_u = tl.trans(acc_u)
        else:      # acc [BM, BN] += (x [BM, BK] @ W tile^T [BK, BN]) * s
            acc_g = tl.zeros([BM, BN], tl.float32)
            acc_u = tl.zeros([BM, BN], tl.float32)
            for h0 in range(0, H, BK):
                kk = h0 + tl.arange(0, BK)
                mk = kk < H
                m_xa = mr[:, None] & mk[None, :]
                xa = tl.load(x_rows[:, None] + kk[None, :] * s_x_h, mask=m_xa, other=0.0)           # [BM, BK]
                mw = mk[:, None] & mc[None, :]
                g = tl.load(g_rows[None, :] + kk[:, None] * s_g_h, mask=mw, other=0.0).to(DT)       # [BK, BN]
                u = tl.load(u_rows[None, :] + kk[:, None] * s_u_h, mask=mw, other=0.0).to(DT)
                acc_g += mma(xa, g, tl.zeros([BM, BN], tl.float32), DOT_F32) * tl.load(sg_row + h0 // SB)
                acc_u += mma(xa, u, tl.zeros([BM, BN], tl.float32), DOT_F32) * tl.load(su_row + h0 // SB)
        g = rnd(acc_g, DT)                            # F.linear output in x.dtype
        u = rnd(acc_u, DT)
        a = rnd(rnd(g * tl.sigmoid(g), DT) * u, DT)   # silu in x.dtype, then the product
        tl.store(act + rows[:, None] * N + cols[None, :], to_dt(a, DT), mask=mr[:, None] & mc[None, :])


@triton.jit
def _grouped_down_fp8_kernel(act, src, wts, blk_e, blk_row, blk_end, wd, sd, out,
                             s_d_e, s_d_n, s_d_k, s_sd_e, s_sd_n,
                             K: tl.constexpr, H: tl.constexpr, HAS_W: tl.constexpr, SB: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr,
                             DOT_F32: tl.constexpr):
    """out[src[r], n-tile] = rnd(act[r] . wd[e, n-tile]) (* wts[src[r]], rounded), wd e4m3 with the scales of
    sd[e]'s block row n // 128 (contiguous in K blocks). SWAP: the transposed product."""
    b = tl.program_id(0)
    nb = tl.program_id(1)
    DT: tl.constexpr = out.dtype.element_ty          # the rounding dtype: x.dtype, or fp32 (fp32_out)
    AT: tl.constexpr = act.dtype.element_ty
    r0 = tl.load(blk_row + b)
    r1 = tl.load(blk_end + b)
    if r0 < r1:
        e = tl.load(blk_e + b)
        rows = r0 + tl.arange(0, BM)
        mr = rows < r1
        cols = nb * BN + tl.arange(0, BN)             # [BN] output channels (H), one 128-row block
        mc = cols < H
        d_rows = wd + e * s_d_e + cols * s_d_n                           # [BN]
        s_row = sd + e * s_sd_e + ((nb * BN) // SB) * s_sd_n
        if SWAP:   # acc^T [BN, BM] += (down tile [BN, BK] @ act^T [BK, BM]) * s
            acc = tl.zeros([BN, BM], tl.float32)
            for k0 in range(0, K, BK):
                kk = k0 + tl.arange(0, BK)
                mk = kk < K
                m_at = mk[:, None] & mr[None, :]
                at = tl.load(act + rows[None, :] * K + kk[:, None], mask=m_at, other=0.0)           # [BK, BM]
                m_d = mc[:, None] & mk[None, :]
                d = tl.load(d_rows[:, None] + kk[None, :] * s_d_k, mask=m_d, other=0.0).to(AT)      # [BN, BK]
                acc += mma(d, at, tl.zeros([BN, BM], tl.float32), DOT_F32) * tl.load(s_row + k0 // SB)
            acc = tl.trans(acc)                       # [BM, BN]
        else:
            acc = tl.zeros([BM, BN], tl.float32)
            for k0 in range(0, K, BK):
                kk = k0 + tl.arange(0, BK)
                mk = kk < K
                m_a = mr[:, None] & mk[None, :]
                a = tl.load(act + rows[:, None] * K + kk[None, :], mask=m_a, other=0.0)             # [BM, BK]
                m_d = mk[:, None] & mc[None, :]
                d = tl.load(d_rows[None, :] + kk[:, None] * s_d_k, mask=m_d, other=0.0).to(AT)      # [BK, BN]
                acc += mma(a, d, tl.zeros([BM, BN], tl.float32), DOT_F32) * tl.load(s_row + k0 // SB)
        y = rnd(acc, DT)                              # F.linear(act, down[e]) in x.dtype
        dst = tl.load(src + rows, mask=mr, other=0)
        if HAS_W:
            y = rnd(y * tl.load(wts + dst, mask=mr, other=0.0).to(tl.float32)[:, None], DT)      # y_e * w_e
        tl.store(out + dst[:, None] * H + cols[None, :], to_dt(y, DT), mask=mr[:, None] & mc[None, :])


def _strides2(t: torch.Tensor):
    """(expert, block row) strides of a scale table; 2-D (shared expert): expert stride 0."""
    return t.stride()[:2] if t.dim() == 3 else (0, t.stride(0))


# (BN cap, BK cap, warps, stages, SWAP) of the grouped SwiGLU and down kernels, by kernel and optionally by (kernel,
# rows class), and BM_MIN by rows class: fused_moe_prefill's TILES / BM_MIN rules (its `plan`), for these kernels.
# The caps divide 128, so a weight tile lies in one 128x128 block (one scale). At the 35B shape, 64 tokens (222
# distinct experts), one call per weight copy in a replayed CUDA graph (`python -m onegraph.scripts.bench_moe_fp8
# --batches 64 --copies 6`, benchmarks/h200_moe_fp8_b64.json): SwiGLU (32, 128) 291 us a call against 347 at
# fused_moe_prefill's (64, 64); no plain down tile of 20 beat (64, 64) by more than 2 %. At decode batches ("few": up
# to 4 rows an expert) the down kernel runs swapped, the weight rows wgmma's M: 312.5 us a call against 336.1 on an
# H100 (`python -m onegraph.scripts.bench_moe_fp8 --batches 64 --copies 6 --grouped swap`,
# benchmarks/h100_moe_fp8_b64_swap.json; the SwiGLU swapped too, 317.1).
TILES = {"swiglu": (32, 128, 4, 3, False), "down": (BN_MAX, BK_MAX, 4, 3, False),
         ("down", "few"): (32, 128, 2, 3, True)}
BM_MIN: dict[str, int] = {}


def _grouped_swiglu(x, table, wg, wu, sg, su, u0, ub0, N, topk, tile):
    src, blk_e, blk_row, blk_end, BM = table
    R, H = src.shape[0], x.shape[1]
    act = torch.empty((R, N), dtype=x.dtype, device=x.device)
    bn, bk, warps, stages, swap = tile
    BN, BK = _tile(N, bn), _tile(H, bk)
    launch(_grouped_swiglu_fp8_kernel, (blk_e.shape[0], triton.cdiv(N, BN)),
           x, src, blk_e, blk_row, blk_end, wg, wu, sg, su, act,
           *x.stride(), *_strides3(wg), *_strides3(wu), *_strides2(sg), *_strides2(su), u0, ub0,
           H=H, N=N, TOPK=topk, SB=BLOCK, BM=BM, BN=BN, BK=BK, SWAP=swap, DOT_F32=INTERPRETED, num_warps=warps,
           num_stages=stages)
    return act


def _grouped_down(act, table, wd, sd, wts, out, tile):
    src, *blocks, BM = table
    K, H = act.shape[1], out.shape[1]
    bn, bk, warps, stages, swap = tile
    BN, BK = _tile(H, bn), _tile(K, bk)
    launch(_grouped_down_fp8_kernel, (blocks[0].shape[0], triton.cdiv(H, BN)),
           act, src, wts if wts is not None else act, *blocks, wd, sd, out, *_strides3(wd), *_strides2(sd),
           K=K, H=H, HAS_W=wts is not None, SB=BLOCK, BM=BM, BN=BN, BK=BK, SWAP=swap, DOT_F32=INTERPRETED,
           num_warps=warps, num_stages=stages)


def fused_moe_fp8_prefill(x, w, idx, gate_up, gate_up_scale, down, down_scale, shared_gate, shared_gate_scale,
                          shared_up, shared_up_scale, shared_down, shared_down_scale, logits, out_dtype=None):
    """x [T, H], w [T, k] x.dtype, idx [T, k] int64 (the routing), the op's FP8 weights and scales, logits
    [T, E + 1] -> y [T, H] in out_dtype (None: x.dtype)."""
    if any(not isinstance(c, int) or c <= 0 or BLOCK % c for t in TILES.values() for c in t[:2]):
        raise ValueError(f"fused_moe_fp8 prefill: tiles must divide {BLOCK}, got {TILES}")
    out_dtype = out_dtype or x.dtype
    T, H = x.shape
    k = idx.shape[1]
    E, I2, _ = gate_up.shape
    I, Is = I2 // 2, shared_gate.shape[0]
    P = T * k
    gus, ds, sgs, sus, sds = (s.contiguous() for s in (gate_up_scale, down_scale, shared_gate_scale,
                                                       shared_up_scale, shared_down_scale))
    bm_min, sw, dn = plan(TILES, BM_MIN, P, E)                       # static: from (P, E)
    w_pair, table = routed_table(idx, w, E, bm_min)                  # fused_moe_prefill's pair table

    act = _grouped_swiglu(x, table, gate_up, gate_up, gus, gus, u0=I, ub0=triton.cdiv(I, BLOCK), N=I, topk=k,
                          tile=sw)
    y_pair = torch.empty((P, H), dtype=out_dtype, device=x.device)
    _grouped_down(act, table, down, ds, w_pair, y_pair, dn)

    _, sw, dn = plan(TILES, BM_MIN, T, 1)                            # the shared expert: T rows of one expert
    shared = dense_table(T, BM_MAX, x.device)
    act_sh = _grouped_swiglu(x, shared, shared_gate, shared_up, sgs, sus, u0=0, ub0=0, N=Is, topk=1, tile=sw)
    y_sh = torch.empty((T, H), dtype=out_dtype, device=x.device)
    _grouped_down(act_sh, shared, shared_down, sds, None, y_sh, dn)

    y = torch.empty((T, H), dtype=out_dtype, device=x.device)
    BH = min(BH_COMBINE, next_pow2(H))
    launch(_combine_kernel, (T, triton.cdiv(H, BH)),
           logits, y_pair, y_sh, y, logits.stride(0), *y.stride(), H=H, E=E, TOPK=k, BH=BH, num_warps=4)
    return y
