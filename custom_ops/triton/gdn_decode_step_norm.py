"""Triton lowering of gdn_decode_step_norm (contract: custom_ops/gdn_decode_step_norm.py), and its in-place
twin that writes the new state rows straight into the state at `slots`. Two paths, by B * HK (SPLIT_BELOW = 64):
- small batches: three launches with many programs each, `_split`: causal_conv_update's kernel (grid
  (B, C / 256), each channel's row owned by one program, so it may write in place), the GDN step on its
  output (grid (B, HV, V / BV), each state element owned by one thread), the gated norm (grid (B * HV));
- otherwise ONE kernel, below:

Grid (B, HK); program (b, hk) owns key head hk and its REP = HV/HK value heads, whole:
  conv window (conv_state[slots[b]] ‖ qkv[b]) · conv_weight + SiLU of its q, k (K channels each) and its
  REP heads' v (REP*V channels), rounded as the reference rounds (see gdn_decode_step's kernel);
  q, k L2-normed (eps 1e-6), q scaled by K^-0.5; per head beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias);
  then BVC value columns at a time (block_vc): S [REP, K, BVC] fp32 (in registers) = rec_state[slots[b], heads,
  :, cols] * exp(g); S += k (beta (v - S^T k))^T; out = S^T q rounded to qkv.dtype, parked in y;
  finally y = w * norm(out) * silu(z) over each head's V (gated_rms_norm's roundings), out read back from y.
Why whole heads: the norm needs a head's whole V (one program, no cross-program reduction), and the
in-place twin needs every state element a program reads to be written by that program only — the q/k
conv rows of key head hk are read by all REP of its value heads, so one program owns them all.
In place, a block barrier separates the reads of each conv window (q/k, then each chunk's v) and of each state
chunk from their stores (the shifted window store crosses threads; a replicated layout could too): each program
reads its rows before it overwrites them. The columns of a chunk are independent of the others' (the sums run
over K), so the chunking changes no value: the norm's sums over V are those of the whole-head kernel. Padding rows share the
scratch slot; their programs race on its rows, which nothing reads back (any mix of finite updates).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..gdn_decode_step_norm import _validate
from ._common import launch, next_pow2, rnd, to_dt


@triton.jit
def _window(x_row, sx_c, cs_row, scs_c, scs_w, ch, ch_mask, W: tl.constexpr, WP: tl.constexpr):
    """The conv window of channels `ch` [N]: conv-state row ‖ x -> [N, WP] in the state dtype."""
    t = tl.arange(0, WP)
    st = tl.load(cs_row + ch[:, None] * scs_c + t[None, :] * scs_w,
                 mask=ch_mask[:, None] & (t[None, :] < W - 1), other=0.0)
    x = tl.load(x_row + ch * sx_c, mask=ch_mask, other=0.0)
    return tl.where(t[None, :] == W - 1, to_dt(x, st.dtype)[:, None], st)


@triton.jit
def _conv_silu(win, w_ptr, sw_c, sw_w, ch, ch_mask, W: tl.constexpr, WP: tl.constexpr, XDT: tl.constexpr):
    """Depthwise conv + SiLU of a window [N, WP] -> fp32 [N] rounded through XDT: the reference multiplies
    and sums in the weight dtype, then SiLU, then casts to qkv.dtype."""
    t = tl.arange(0, WP)
    w = tl.load(w_ptr + ch[:, None] * sw_c + t[None, :] * sw_w, mask=ch_mask[:, None] & (t[None, :] < W), other=0.0)
    WDT: tl.constexpr = w_ptr.dtype.element_ty
    prod = rnd(rnd(win.to(tl.float32), WDT) * w.to(tl.float32), WDT)
    acc = rnd(tl.sum(prod, axis=1), WDT)
    return rnd(rnd(acc * tl.sigmoid(acc), WDT), XDT)


@triton.jit
def _store_window(nc_row, snc_c, snc_w, win, ch, ch_mask, W: tl.constexpr, WP: tl.constexpr):
    """New conv-state row of channels `ch`: the window shifted by one tap (its last W-1 taps)."""
    t = tl.arange(0, WP)
    tl.store(nc_row + ch[:, None] * snc_c + (t[None, :] - 1) * snc_w, win,
             mask=ch_mask[:, None] & (t[None, :] >= 1) & (t[None, :] < W))


@triton.jit
def _gdn_decode_norm_kernel(
        qkv, a, b, z, conv_state, rec_state, slots, conv_w, A_log, dt_bias, norm_w,
        y, new_conv, new_rec,
        s_qkv_b, s_qkv_c, s_a_b, s_a_h, s_b_b, s_b_h, s_z_b, s_z_c,
        s_cs_s, s_cs_c, s_cs_w, s_rs_s, s_rs_h, s_rs_k, s_rs_v,
        s_w_c, s_w_w, s_y_b, s_y_h, s_y_v,
        s_nc_b, s_nc_c, s_nc_w, s_nr_b, s_nr_h, s_nr_k, s_nr_v,
        q_scale, eps,
        HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, REP: tl.constexpr, RP: tl.constexpr,
        W: tl.constexpr, WP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVC: tl.constexpr,
        ROUND_MID: tl.constexpr, IN_PLACE: tl.constexpr):
    i_b = tl.program_id(0)
    hk = tl.program_id(1)
    XDT: tl.constexpr = qkv.dtype.element_ty

    slot = tl.load(slots + i_b)                                            # int64: 64-bit offsets
    x_row = qkv + i_b * s_qkv_b
    cs_row = conv_state + slot * s_cs_s
    # the new conv row: the state's own row `slot` in place (new_conv / new_rec are then never touched: the
    # launcher passes the state's strides as theirs), else row b of the new rows
    nc_row = conv_state + slot * s_nc_b if IN_PLACE else new_conv + i_b * s_nc_b
    nr_row = rec_state + slot * s_nr_b if IN_PLACE else new_rec + i_b * s_nr_b

    # ---- q, k of key head hk (K channels each) and the REP heads' gates
    offs_k = tl.arange(0, BK)
    mk = offs_k < K
    offs_r = tl.arange(0, RP)
    mr = offs_r < REP
    heads = hk * REP + offs_r                                              # [RP] value heads
    ch_q = hk * K + offs_k
    ch_k = HK * K + hk * K + offs_k
    win_q = _window(x_row, s_qkv_c, cs_row, s_cs_c, s_cs_w, ch_q, mk, W, WP)
    win_k = _window(x_row, s_qkv_c, cs_row, s_cs_c, s_cs_w, ch_k, mk, W, WP)
    av = tl.load(a + i_b * s_a_b + heads * s_a_h, mask=mr, other=0.0).to(tl.float32) \
        + tl.load(dt_bias + heads, mask=mr, other=0.0).to(tl.float32)
    A = tl.load(A_log + heads, mask=mr, other=0.0).to(tl.float32)
    bv = tl.load(b + i_b * s_b_b + heads * s_b_h, mask=mr, other=0.0).to(tl.float32)

    q = _conv_silu(win_q, conv_w, s_w_c, s_w_w, ch_q, mk, W, WP, XDT)                      # [BK]
    k = _conv_silu(win_k, conv_w, s_w_c, s_w_w, ch_k, mk, W, WP, XDT)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * tl.cast(q_scale, tl.float32)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    # gates (fp32): g = -exp(A_log) * softplus(a + dt_bias); beta = sigmoid(b) rounded like b.sigmoid()
    sp = tl.where(av > 20.0, av, tl.log(1.0 + tl.exp(tl.minimum(av, 20.0))))   # F.softplus, threshold 20
    decay = tl.exp(-tl.exp(A) * sp)                                        # [RP] exp(g)
    beta = rnd(tl.sigmoid(bv), b.dtype.element_ty)
    if IN_PLACE:
        tl.debug_barrier()                   # every thread has read the q/k windows before they are shifted
    _store_window(nc_row, s_nc_c, s_nc_w, win_q, ch_q, mk, W, WP)
    _store_window(nc_row, s_nc_c, s_nc_w, win_k, ch_k, mk, W, WP)

    # ---- the REP heads' state, BVC value columns at a time: [RP, BK, BVC] fp32 of it in registers
    r3 = offs_r[:, None, None]
    k3 = offs_k[None, :, None]
    for c in range(0, BV // BVC):
        offs_v = c * BVC + tl.arange(0, BVC)
        v3 = offs_v[None, None, :]
        m3 = (r3 < REP) & (k3 < K) & (v3 < V)
        i_rv = tl.arange(0, RP * BVC)                                      # the chunk's v channels, flat
        v_of = c * BVC + i_rv % BVC
        m_rv = ((i_rv // BVC) < REP) & (v_of < V)
        ch_v = 2 * HK * K + (hk * REP + i_rv // BVC) * V + v_of
        win_v = _window(x_row, s_qkv_c, cs_row, s_cs_c, s_cs_w, ch_v, m_rv, W, WP)
        S = tl.load(rec_state + slot * s_rs_s + (hk * REP + r3) * s_rs_h + k3 * s_rs_k + v3 * s_rs_v,
                    mask=m3, other=0.0)                                    # [RP, BK, BVC] fp32
        v = tl.reshape(_conv_silu(win_v, conv_w, s_w_c, s_w_w, ch_v, m_rv, W, WP, XDT), (RP, BVC))

        S = S * decay[:, None, None]
        kv = tl.sum(S * k[None, :, None], axis=1)                          # [RP, BVC]
        delta = (v - kv) * beta[:, None]
        S = S + k[None, :, None] * delta[:, None, :]
        o = rnd(tl.sum(S * q[None, :, None], axis=1), XDT)                 # [RP, BVC]: out.to(qkv.dtype)

        if IN_PLACE:
            tl.debug_barrier()               # every thread has read this chunk's v windows before they are shifted
        _store_window(nc_row, s_nc_c, s_nc_w, win_v, ch_v, m_rv, W, WP)
        tl.store(nr_row + (hk * REP + r3) * s_nr_h + k3 * s_nr_k + v3 * s_nr_v, S, mask=m3)
        # the head's output before its norm, parked in y (exactly: o is rounded to qkv.dtype = y.dtype)
        tl.store(y + i_b * s_y_b + heads[:, None] * s_y_h + offs_v[None, :] * s_y_v, to_dt(o, y.dtype.element_ty),
                 mask=mr[:, None] & (offs_v < V)[None, :])

    # ---- gated_rms_norm of each head's V: norm(o).to(dtype), w * that in promote(w, dtype), * silu(z) fp32
    tl.debug_barrier()                       # the chunks' o, stored by other threads, read back (past L1: .cg)
    offs_v = tl.arange(0, BV)
    mv = offs_v < V
    m2 = mr[:, None] & mv[None, :]
    y_ptr = y + i_b * s_y_b + heads[:, None] * s_y_h + offs_v[None, :] * s_y_v
    o = tl.load(y_ptr, mask=m2, other=0.0, cache_modifier=".cg").to(tl.float32)          # [RP, BV]
    zf = tl.load(z + i_b * s_z_b + (heads[:, None] * V + offs_v[None, :]) * s_z_c, mask=m2,
                 other=0.0).to(tl.float32)
    wn = tl.load(norm_w + offs_v, mask=mv, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(o * o, axis=1) / V + tl.cast(eps, tl.float32))  # [RP]; AOTI passes floats as fp64
    yv = wn[None, :] * rnd(o * inv[:, None], XDT)
    if ROUND_MID:
        yv = rnd(yv, XDT)
    yv = yv * (zf * tl.sigmoid(zf))
    tl.debug_barrier()                       # every thread has read o back before y is overwritten
    tl.store(y_ptr, to_dt(yv, y.dtype.element_ty), mask=m2)


# Below this many (row, key head) programs the (B, HK) grid leaves most of the GPU idle. Measured at the 35B
# shape, in place, each call on its own inputs in one CUDA graph (H200, benchmarks/h200_decode_parts.json):
# B = 1 (16 programs) 11.97 us per layer for the one kernel vs 8.59 for the split path (conv 32 programs,
# step B * HV * V / 16 = 256, norm 32); B = 8 (128 programs) 19.25 vs 21.29, the one kernel ahead.
SPLIT_BELOW = 64
# The fused kernel walks each head's V columns BVC at a time. Whole heads (BVC = V) hold [REP, K, V] fp32 of state
# in registers: 128 KB at the 35B shape, 16 warps, one program per SM, its loads, math and stores one after the
# other. At bs64 that kernel read and wrote the ~8 GB of state at ~56 % of copy bandwidth (3.36 ms of the
# 21.25 ms step, benchmarks/h200_35b_batches.json). 32-column chunks (32 KB, 8 warps) let several programs share
# an SM, one's loads in flight while another computes. Chunked from CHUNK_FROM programs on: a choice not yet
# timed on the GPU (`python -m onegraph.tools.sweep_gdn_decode` times every block and the split path per batch).
CHUNK_V, CHUNK_FROM = 32, 256


def block_vc(B: int, HK: int, BV: int) -> int:
    """The fused kernel's V columns per loop step at B rows of HK key heads (BV: V padded to a power of 2)."""
    return min(CHUNK_V, BV) if B * HK >= CHUNK_FROM else BV


def _split(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads,
           eps, y, new_conv, new_rec) -> None:
    """Three launches: causal_conv_update (its rows into new_conv, or in place), the step on its output
    (new_rec, or in place), the gated norm into y. Same values as the reference composition."""
    from . import causal_conv, gdn_decode_step, norms
    xc = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)          # [B, C] conv + SiLU
    causal_conv.run_update(qkv, conv_state, slots, conv_weight, xc, new_conv)
    B = qkv.shape[0]
    _, HV, _, V = rec_state.shape
    out = qkv.new_empty((B, HV, V))
    gdn_decode_step.run(xc, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads, out,
                        new_conv, new_rec, conv_in=True)
    norms.gated_rms_norm_heads(out, z, norm_weight, eps, y)


def _launch(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads,
            eps, y, new_conv, new_rec, in_place: bool, fused: bool | None = None, block_v: int | None = None):
    """fused: None picks by B * HK (SPLIT_BELOW); block_v: the fused kernel's V columns per loop step (None:
    block_vc). Tests and tools/sweep_gdn_decode.py force them."""
    B = qkv.shape[0]
    if not (B * num_k_heads >= SPLIT_BELOW if fused is None else fused):
        return _split(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight,
                      num_k_heads, eps, y, new_conv, new_rec)
    _, HV, K, V = rec_state.shape
    W = conv_weight.shape[1]
    REP = HV // num_k_heads
    RP, BK, BV = next_pow2(REP), next_pow2(K), next_pow2(V)
    BVC = block_vc(B, num_k_heads, BV) if block_v is None else min(block_v, BV)
    n = RP * BK * BVC                                 # state elements in registers (35B: 2*128*128, or 2*128*32)
    launch(_gdn_decode_norm_kernel, (B, num_k_heads),
           qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, y, new_conv, new_rec,
           *qkv.stride(), *a.stride(), *b.stride(), *z.stride(), *conv_state.stride(), *rec_state.stride(),
           *conv_weight.stride(), *y.stride(), *new_conv.stride(), *new_rec.stride(),
           float(K) ** -0.5, eps,
           HK=num_k_heads, K=K, V=V, REP=REP, RP=RP, W=W, WP=next_pow2(W), BK=BK, BV=BV, BVC=BVC,
           ROUND_MID=torch.promote_types(norm_weight.dtype, qkv.dtype) == qkv.dtype, IN_PLACE=in_place,
           num_warps=4 if n <= 4096 else 8 if n <= 16384 else 16)


@triton_op("onegraph::gdn_decode_step_norm_triton", mutates_args=())
def gdn_decode_step_norm_triton(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor,
                                conv_state: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor,
                                conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                                norm_weight: torch.Tensor, num_k_heads: int,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _validate(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads, eps)
    B, C = qkv.shape
    _, HV, K, V = rec_state.shape
    y = qkv.new_empty((B, HV, V))
    new_conv = conv_state.new_empty((B, C, conv_weight.shape[1] - 1))
    new_rec = rec_state.new_empty((B, HV, K, V))
    _launch(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads, eps,
            y, new_conv, new_rec, in_place=False)
    return y, new_conv, new_rec


@triton_op("onegraph::gdn_decode_step_norm_inplace_triton", mutates_args={"conv_state", "rec_state"})
def gdn_decode_step_norm_inplace_triton(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor,
                                        conv_state: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor,
                                        conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                                        norm_weight: torch.Tensor, num_k_heads: int, eps: float) -> torch.Tensor:
    """gdn_decode_step_norm_triton followed by conv_state[slots] = new_conv_rows, rec_state[slots] =
    new_rec_rows, in one kernel that writes the rows in place; returns y. Export puts it in place of that
    pattern (export/inplace.py); never called by the model."""
    _validate(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads, eps)
    B = qkv.shape[0]
    _, HV, _, V = rec_state.shape
    y = qkv.new_empty((B, HV, V))
    # in place the kernel reads and writes through conv_state / rec_state and never touches new_conv / new_rec
    # (passed only for their strides), so Inductor's analysis sees each state tensor read and written through
    # one argument
    _launch(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads, eps,
            y, conv_state, rec_state, in_place=True)
    return y


_registry.register_lowering("gdn_decode_step_norm", "triton", torch.ops.onegraph.gdn_decode_step_norm_triton.default)
