"""Triton lowering of fused_moe_fp8 (contract: custom_ops/fused_moe_fp8.py): fused_moe's two decode kernels
(custom_ops/triton/fused_moe.py, whose routing helpers they call) reading block-FP8 expert weights as bytes.

Same grids, routing and roundings as the bf16 kernels; only the weight loads differ. A weight tile is loaded
as e4m3 (half the bytes of bf16: decode reads each selected expert once, so the bytes are the time) and
upcast to fp32 in registers (exact); the 128x128 block scale is never applied per weight: a program's weight
rows all lie in one 128-row block (its row tile divides 128), so for every column h the scale s[row block,
h // 128] is one value. Kernel 1 sums each 128-column block's products and multiplies that sum by its scale
(one multiply per block and row); kernel 2 folds the scale into the activation it multiplies, x[h] * s, once
per column tile ([k, BI] multiplies). The per-weight work stays the bf16 kernel's: one convert, one FMA (fp32
accumulation). s * (x . q) over a block, (x * s) . q and x . (q * s) differ only by fp32 rounding, far below
the x.dtype roundings the reference makes after each projection.
Kernel 1 (SwiGLU), grid (T*k + T, cdiv(max(I, Is), BI)): pair p = (t, j) routes itself (`_route_nth`; from
T = fused_moe.ROUTE_FIRST_FROM on, `_route_kernel` has routed first and the pair loads its expert),
reads its expert's gate and up rows [BI, BH] per step with the scales of their block rows (gate block rows
first in gate_up_scale, then up's); programs p >= T*k do token p - T*k's shared expert and write the
token's routing for kernel 2 (unless routed first). Kernel 2 (down + combine), grid (T, cdiv(H, BH)): the k experts' [k, BH, BI]
down tiles side by side, each expert's scales gathered per column ([k, BI] from a table of a few KiB, L1/L2
resident) and folded into its activations.
T*k > E (prefill, and decode batches past E / k) goes to fused_moe_fp8_prefill.py's grouped GEMMs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..fused_moe_fp8 import _validate
from ..linear_fp8 import BLOCK
from . import fused_moe_fp8_prefill
from ._common import launch, next_pow2, rnd, to_dt
from .fused_moe import _route_nth, _route_row, route_buffers, route_triton


@triton.jit
def _swiglu_rows_fp8(x_row, sx_h, wg, sg_r, sg_h, wu, su_r, su_h, sc_g, sc_u, rows, mrow, H: tl.constexpr,
                     DT: tl.constexpr, BI: tl.constexpr, BH: tl.constexpr, SB: tl.constexpr):
    """silu(x . wg[rows]) * (x . wu[rows]) -> [BI] fp32, rounded where the reference rounds; wg / wu e4m3,
    sc_g / sc_u the scale-table rows of the block row holding `rows` (fp32, contiguous along H blocks).
    A step's [BI, BH] weight tile is taken as [BI, BH / SB, SB]: each 128-column block's products with x are summed
    first and that block's sum multiplied by its one scale, so the scales cost a multiply per block, not per column
    (benchmarks/h200_moe_fp8_bs1_sweep.json; BH a multiple of SB)."""
    NB: tl.constexpr = BH // SB
    b = tl.arange(0, NB)
    c = tl.arange(0, SB)
    acc_g = tl.zeros([BI], tl.float32)
    acc_u = tl.zeros([BI], tl.float32)
    for h0 in range(0, H, BH):
        offs_h = h0 + b[:, None] * SB + c[None, :]                           # [NB, SB]
        mh = offs_h < H
        xv = tl.load(x_row + offs_h * sx_h, mask=mh, other=0.0).to(tl.float32)
        mb = h0 + b * SB < H
        s_g = tl.load(sc_g + h0 // SB + b, mask=mb, other=0.0)               # [NB]: s[block row, column block]
        s_u = tl.load(sc_u + h0 // SB + b, mask=mb, other=0.0)
        m3 = mrow[:, None, None] & mh[None, :, :]
        gw = tl.load(wg + rows[:, None, None] * sg_r + offs_h[None, :, :] * sg_h, mask=m3, other=0.0)
        uw = tl.load(wu + rows[:, None, None] * su_r + offs_h[None, :, :] * su_h, mask=m3, other=0.0)
        acc_g += tl.sum(tl.sum(gw.to(tl.float32) * xv[None, :, :], axis=2) * s_g[None, :], axis=1)
        acc_u += tl.sum(tl.sum(uw.to(tl.float32) * xv[None, :, :], axis=2) * s_u[None, :], axis=1)
    g = rnd(acc_g, DT)
    u = rnd(acc_u, DT)
    return rnd(rnd(g * tl.sigmoid(g), DT) * u, DT)


@triton.jit
def _moe_fp8_swiglu_kernel(x, logits, gate_up, gu_s, sh_gate, sg_s, sh_up, su_s, act, act_sh, route_w, route_i,
                           s_x_t, s_x_h, s_l_t, s_gu_e, s_gu_r, s_gu_h, s_gus_e, s_gus_r, s_sg_r, s_sg_h, s_sgs_r,
                           s_su_r, s_su_h, s_sus_r,
                           P, H: tl.constexpr, I: tl.constexpr, Is: tl.constexpr, E: tl.constexpr, BE: tl.constexpr,
                           TOPK: tl.constexpr, BKK: tl.constexpr, BI: tl.constexpr, BH: tl.constexpr,
                           SB: tl.constexpr, ROUTED_IN: tl.constexpr):
    """ROUTED_IN: route_i / route_w hold the routing already (fused_moe.route_first)."""
    pid = tl.program_id(0)
    it = tl.program_id(1)
    DT: tl.constexpr = x.dtype.element_ty
    rows = it * BI + tl.arange(0, BI)
    rb = (it * BI) // SB                          # the tile's block row (BI divides SB)
    if pid < P:                                   # routed pair p = t*k + j
        t = pid // TOPK
        if ROUTED_IN:
            e = tl.load(route_i + pid)
        else:
            e = _route_nth(logits, t, s_l_t, pid - t * TOPK, E, BE, TOPK)  # each program routes its pair itself
        mrow = rows < I
        w_e = gate_up + e * s_gu_e
        s_e = gu_s + e * s_gus_e
        NBI: tl.constexpr = (I + SB - 1) // SB    # the up rows' block rows follow the gate rows'
        a = _swiglu_rows_fp8(x + t * s_x_t, s_x_h, w_e, s_gu_r, s_gu_h, w_e + I * s_gu_r, s_gu_r, s_gu_h,
                             s_e + rb * s_gus_r, s_e + (NBI + rb) * s_gus_r, rows, mrow, H, DT, BI, BH, SB)
        tl.store(act + pid * I + rows, to_dt(a, DT), mask=mrow)
    else:                                         # shared expert of token t
        t = pid - P
        mrow = rows < Is
        a = _swiglu_rows_fp8(x + t * s_x_t, s_x_h, sh_gate, s_sg_r, s_sg_h, sh_up, s_su_r, s_su_h,
                             sg_s + rb * s_sgs_r, su_s + rb * s_sus_r, rows, mrow, H, DT, BI, BH, SB)
        tl.store(act_sh + t * Is + rows, to_dt(a, DT), mask=mrow)
        if it == 0 and not ROUTED_IN:
            # the token's routing for the down kernel, after this program's own loads (as fused_moe's)
            top_w, top_i = _route_row(logits, t, s_l_t, E, BE, TOPK, BKK)
            ks = tl.arange(0, BKK)
            tl.store(route_w + t * TOPK + ks, top_w, mask=ks < TOPK)
            tl.store(route_i + t * TOPK + ks, top_i, mask=ks < TOPK)


@triton.jit
def _moe_fp8_down_kernel(logits, down, d_s, sh_down, sd_s, act, act_sh, route_w, route_i, y,
                         s_l_t, s_d_e, s_d_h, s_d_i, s_ds_e, s_ds_h, s_sd_h, s_sd_i, s_sds_h, s_y_t, s_y_h,
                         H: tl.constexpr, I: tl.constexpr, Is: tl.constexpr, E: tl.constexpr, BE: tl.constexpr,
                         TOPK: tl.constexpr, BKK: tl.constexpr, BH: tl.constexpr, BI: tl.constexpr,
                         SB: tl.constexpr):
    t = tl.program_id(0)
    ih = tl.program_id(1)
    DT: tl.constexpr = logits.dtype.element_ty      # x.dtype
    RT: tl.constexpr = y.dtype.element_ty           # where the down products round: x.dtype, or fp32 (fp32_out)
    rows = ih * BH + tl.arange(0, BH)
    mrow = rows < H
    rb = (ih * BH) // SB                            # the tile's block row of down / shared_down (BH divides SB)

    # the shared expert first: its loads do not wait for the routing's
    acc = tl.zeros([BH, BI], tl.float32)
    for i0 in range(0, Is, BI):
        offs_i = i0 + tl.arange(0, BI)
        mi = offs_i < Is
        av = tl.load(act_sh + t * Is + offs_i, mask=mi, other=0.0).to(tl.float32)
        av = av * tl.load(sd_s + rb * s_sds_h + offs_i // SB, mask=mi, other=0.0)
        dw = tl.load(sh_down + rows[:, None] * s_sd_h + offs_i[None, :] * s_sd_i,
                     mask=mrow[:, None] & mi[None, :], other=0.0)
        acc += dw.to(tl.float32) * av[None, :]
    shared = rnd(tl.sum(acc, axis=1), RT)

    ks = tl.arange(0, BKK)
    mk = ks < TOPK
    top_w = tl.load(route_w + t * TOPK + ks, mask=mk, other=0.0)       # [BKK] fp32: kernel 1's routing
    top_i = tl.load(route_i + t * TOPK + ks, mask=mk, other=0)          # [BKK] int64 (lanes >= k: 0)
    wt = rnd(top_w, DT)                              # the reference's weights are cast to x.dtype
    s_rows = d_s + top_i[:, None] * s_ds_e + rb * s_ds_h                # [BKK, 1] each expert's scale row
    acc = tl.zeros([BKK, BH, BI], tl.float32)
    for i0 in range(0, I, BI):
        offs_i = i0 + tl.arange(0, BI)
        mi = offs_i < I
        m2 = mk[:, None] & mi[None, :]
        av = tl.load(act + (t * TOPK + ks)[:, None] * I + offs_i[None, :], mask=m2, other=0.0).to(tl.float32)
        av = av * tl.load(s_rows + (offs_i // SB)[None, :], mask=m2, other=0.0)            # [BKK, BI]
        dw = tl.load(down + top_i[:, None, None] * s_d_e + rows[None, :, None] * s_d_h + offs_i[None, None, :] * s_d_i,
                     mask=mk[:, None, None] & mrow[None, :, None] & mi[None, None, :], other=0.0)
        acc += dw.to(tl.float32) * av[:, None, :]
    contrib = rnd(rnd(tl.sum(acc, axis=2), RT) * wt[:, None], RT)              # (y * w) in RT, [BKK, BH]
    routed = rnd(tl.sum(contrib, axis=0), RT)                                  # as fused_moe's down kernel

    gate = rnd(tl.sigmoid(tl.load(logits + t * s_l_t + E).to(tl.float32)), DT)     # sigmoid(shared gate logit)
    res = routed + rnd(gate * shared, RT)
    tl.store(y + t * s_y_t + rows * s_y_h, to_dt(res, RT), mask=mrow)



# Tiles ((BI1, BH1, warps) of kernel 1, (BH2, BI2, warps) of kernel 2), the same at every decode T (as
# fused_moe.decode_tiles): kernel 1 reads [BI1, BH1] e4m3 tiles of gate and up per step, kernel 2 [k, BH2, BI2]
# tiles of down. BI1 and BH2 (weight rows per program) must divide 128 (one block row per program), BH1 be a
# multiple of it. H200, one token, each call on its own weights, 12 calls per replayed CUDA graph, routing
# precomputed (a sweep of candidate kernels, benchmarks/h200_moe_fp8_bs1_sweep.json; `python -m
# onegraph.scripts.bench_moe_fp8 --batches 1 --copies 12` times this op's tiles): kernel 1 with the per-block sums
# 7.73 us at (2, 2048, 2) against 9.28 for the best tile of the per-column scale form; kernel 2 6.77 at (4, 512, 4)
# against 6.86 at (2, 512, 4). A minimal kernel reading the same bytes with no scales and no roundings took
# 7.20 / 5.57 (the same sweep).
ONE = ((2, 2048, 2), (4, 512, 4))


def tiles() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    return ONE


def _launch_decode(x, logits, gate_up, gate_up_scale, down, down_scale, shared_gate, shared_gate_scale,
                   shared_up, shared_up_scale, shared_down, shared_down_scale, top_k, out_dtype):
    """The two decode kernels over T tokens, with tiles() (benchmarks set ONE to time others)."""
    T, H = x.shape
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    Is = shared_gate.shape[0]
    (bi1, bh1, w1), (bh2, bi2, w2) = tiles()
    if BLOCK % bi1 or BLOCK % bh2 or bh1 % BLOCK:
        raise ValueError(f"fused_moe_fp8: weight-row tiles must divide {BLOCK} and the SwiGLU column tile be a multiple "
                         f"of it, got {bi1}, {bh2} and {bh1}")
    # the scale tables are read as contiguous rows of block columns (a few KiB; contiguous already when loaded)
    gus, ds, sgs, sus, sds = (s.contiguous() for s in (gate_up_scale, down_scale, shared_gate_scale,
                                                       shared_up_scale, shared_down_scale))
    P = T * top_k
    act = torch.empty((P, I), dtype=x.dtype, device=x.device)
    act_sh = torch.empty((T, Is), dtype=x.dtype, device=x.device)
    route_w, route_i, routed = route_buffers(logits, T, E, top_k)              # kernel 1 -> kernel 2
    y = torch.empty((T, H), dtype=out_dtype, device=x.device)
    BI = min(bi1, next_pow2(max(I, Is)))
    BH = min(bh1, max(BLOCK, next_pow2(H)))       # whole 128-column blocks (masked past H)
    route = dict(E=E, BE=next_pow2(E), TOPK=top_k, BKK=next_pow2(top_k), SB=BLOCK)
    launch(_moe_fp8_swiglu_kernel, (P + T, triton.cdiv(max(I, Is), BI)),
           x, logits, gate_up, gus, shared_gate, sgs, shared_up, sus, act, act_sh, route_w, route_i,
           *x.stride(), logits.stride(0), *gate_up.stride(), *gus.stride()[:2], *shared_gate.stride(), sgs.stride(0),
           *shared_up.stride(), sus.stride(0),
           P, H=H, I=I, Is=Is, BI=BI, BH=BH, ROUTED_IN=routed, num_warps=w1, **route)
    BHo = min(bh2, next_pow2(H))
    BIo = min(bi2, next_pow2(max(I, Is)))
    launch(_moe_fp8_down_kernel, (T, triton.cdiv(H, BHo)),
           logits, down, ds, shared_down, sds, act, act_sh, route_w, route_i, y,
           logits.stride(0), *down.stride(), *ds.stride()[:2], *shared_down.stride(), sds.stride(0), *y.stride(),
           H=H, I=I, Is=Is, BH=BHo, BI=BIo, num_warps=w2, **route)
    return y


@triton_op("onegraph::fused_moe_fp8_triton", mutates_args=())
def fused_moe_fp8_triton(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                         down: torch.Tensor, down_scale: torch.Tensor, shared_gate: torch.Tensor,
                         shared_gate_scale: torch.Tensor, shared_up: torch.Tensor, shared_up_scale: torch.Tensor,
                         shared_down: torch.Tensor, shared_down_scale: torch.Tensor, top_k: int,
                         fp32_out: bool = False) -> torch.Tensor:
    args = (x, logits, gate_up, gate_up_scale, down, down_scale, shared_gate, shared_gate_scale, shared_up,
            shared_up_scale, shared_down, shared_down_scale, top_k)
    _validate(*args)
    out_dtype = torch.float32 if fp32_out else x.dtype
    E = gate_up.shape[0]
    if x.shape[0] * top_k > E:    # static at trace time: the reference's per-expert branch, as grouped GEMMs
        w, idx = route_triton(logits[:, :E], top_k)                          # [T, k] x.dtype, int64
        return fused_moe_fp8_prefill.fused_moe_fp8_prefill(x, w, idx, *args[2:12], logits, out_dtype)
    return _launch_decode(*args, out_dtype)


_registry.register_lowering("fused_moe_fp8", "triton", torch.ops.onegraph.fused_moe_fp8_triton.default)
