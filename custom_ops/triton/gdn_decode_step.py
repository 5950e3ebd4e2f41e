"""Triton lowering of gdn_decode_step: ONE kernel per call (contract: custom_ops/gdn_decode_step.py).

Grid (B, HV, cdiv(V, BV)); program (b, h, vt) owns value head h's columns vt*BV.. of the state:
  conv window (conv_state[slots[b]] ‖ qkv[b]) · conv_weight + SiLU for its q, k (K channels of key
  head h // (HV/HK)) and v (BV channels), rounded to qkv.dtype as the reference does;
  q, k L2-normed (eps 1e-6), q scaled by K^-0.5; beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias);
  S [K, BV] fp32 (K whole, in registers) = rec_state[slots[b], h, :, tile] * exp(g);
  S += k (beta (v - S^T k))^T;  out = S^T q.
New conv rows: every program writes its v channels; the q/k channels of key head hk are written
once, by the program (b, hk*REP, 0). The q/k conv is recomputed by the REP*cdiv(V, BV) programs
that need it (2*K*W loads, ~4 KB from L2) instead of a second launch.
Numerics: fp32 throughout; the reference's roundings to the model dtype (conv products, their sum
and SiLU in the weight dtype, the cast to qkv.dtype, sigmoid(b)) are reproduced with `rnd`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..gdn_decode_step import _validate
from ._common import launch, next_pow2, rnd, to_dt


@triton.jit
def _conv_silu(x_row, sx_c, cs_row, scs_c, scs_w, w_ptr, sw_c, sw_w, ncs_row, sncs_c, sncs_w,
               ch, ch_mask, store_mask, W: tl.constexpr, WP: tl.constexpr, XDT: tl.constexpr):
    """Depthwise causal conv + SiLU of channels `ch` [N] -> fp32 [N] (rounded through XDT);
    stores the shifted window (new conv-state row) where store_mask."""
    t = tl.arange(0, WP)                                                   # taps, [WP]
    st = tl.load(cs_row + ch[:, None] * scs_c + t[None, :] * scs_w,
                 mask=ch_mask[:, None] & (t[None, :] < W - 1), other=0.0)  # [N, WP] state dtype
    x = tl.load(x_row + ch * sx_c, mask=ch_mask, other=0.0)               # [N]
    win = tl.where(t[None, :] == W - 1, to_dt(x, st.dtype)[:, None], st)      # state ‖ x
    w = tl.load(w_ptr + ch[:, None] * sw_c + t[None, :] * sw_w,
                mask=ch_mask[:, None] & (t[None, :] < W), other=0.0)
    tl.store(ncs_row + ch[:, None] * sncs_c + (t[None, :] - 1) * sncs_w, win,
             mask=store_mask & ch_mask[:, None] & (t[None, :] >= 1) & (t[None, :] < W))
    # the reference multiplies and sums in the weight dtype, then SiLU, then casts to qkv.dtype
    WDT: tl.constexpr = w_ptr.dtype.element_ty
    prod = rnd(rnd(win.to(tl.float32), WDT) * w.to(tl.float32), WDT)
    acc = rnd(tl.sum(prod, axis=1), WDT)                                     # [N]
    return rnd(rnd(acc * tl.sigmoid(acc), WDT), XDT)


@triton.jit
def _gates(av, A_log_h, b_h):
    """(g, beta), fp32: g = -exp(A_log) * softplus(a + dt_bias) (av = a + dt_bias, fp32), beta = sigmoid(b) rounded
    like b.sigmoid() in b's dtype."""
    sp = tl.where(av > 20.0, av, tl.log(1.0 + tl.exp(tl.minimum(av, 20.0))))   # F.softplus, threshold 20
    return -tl.exp(A_log_h.to(tl.float32)) * sp, rnd(tl.sigmoid(b_h.to(tl.float32)), b_h.dtype)


@triton.jit
def _qk_norm(q, k, q_scale):
    """q, k [BK] fp32 L2-normed (eps 1e-6), q scaled by q_scale (K^-0.5)."""
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * tl.cast(q_scale, tl.float32)
    return q, k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)


@triton.jit
def _delta_rule(S, q, k, v, g, beta):
    """One token of the gated delta rule on the state tile S [BK, BV] fp32 -> (new S, out [BV] = S^T q)."""
    S = S * tl.exp(g)
    kv = tl.sum(S * k[:, None], axis=0)                                      # [BV]
    delta = (v - kv) * beta
    S = S + k[:, None] * delta[None, :]
    return S, tl.sum(S * q[:, None], axis=0)


@triton.jit
def _gdn_decode_kernel(
        qkv, a, b, conv_state, rec_state, slots, conv_w, A_log, dt_bias,
        out, new_conv, new_rec,
        s_qkv_b, s_qkv_c, s_a_b, s_a_h, s_b_b, s_b_h,
        s_cs_s, s_cs_c, s_cs_w, s_rs_s, s_rs_h, s_rs_k, s_rs_v,
        s_w_c, s_w_w, s_o_b, s_o_h, s_o_v,
        s_nc_b, s_nc_c, s_nc_w, s_nr_b, s_nr_h, s_nr_k, s_nr_v,
        q_scale,
        HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, REP: tl.constexpr,
        W: tl.constexpr, WP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        CONV_IN: tl.constexpr, REC_IN_PLACE: tl.constexpr):
    """CONV_IN: qkv already holds conv + SiLU's output (causal_conv_update's y) and the conv state is not
    touched; REC_IN_PLACE: new_rec is rec_state and row slots[b] is written (each state element is read and
    written by the one thread that holds it)."""
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    hk = i_h // REP
    XDT: tl.constexpr = qkv.dtype.element_ty

    slot = tl.load(slots + i_b)                                            # int64: 64-bit offsets
    x_row = qkv + i_b * s_qkv_b
    cs_row = conv_state + slot * s_cs_s
    nc_row = new_conv + i_b * s_nc_b

    offs_k = tl.arange(0, BK)
    mk = offs_k < K
    offs_v = i_v * BV + tl.arange(0, BV)
    mv = offs_v < V
    m2 = mk[:, None] & mv[None, :]
    s_at = rec_state + slot * s_rs_s + i_h * s_rs_h + offs_k[:, None] * s_rs_k + offs_v[None, :] * s_rs_v
    if CONV_IN:
        # the state tile [BK, BV] fp32 first: it needs only the slot, so its DRAM latency overlaps the q/k/v
        # loads and their norms below (the compiler does not move a load across those reductions' barriers).
        # Not with the conv inside (spec verify): held across the conv it took 112 registers, not 72, at B = 64
        S = tl.load(s_at, mask=m2, other=0.0)
        q = tl.load(x_row + (hk * K + offs_k) * s_qkv_c, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(x_row + (HK * K + hk * K + offs_k) * s_qkv_c, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(x_row + (2 * HK * K + i_h * V + offs_v) * s_qkv_c, mask=mv, other=0.0).to(tl.float32)
    else:
        write_qk = (i_h % REP == 0) & (i_v == 0)
        q = _conv_silu(x_row, s_qkv_c, cs_row, s_cs_c, s_cs_w, conv_w, s_w_c, s_w_w, nc_row, s_nc_c, s_nc_w,
                       hk * K + offs_k, mk, write_qk, W, WP, XDT)
        k = _conv_silu(x_row, s_qkv_c, cs_row, s_cs_c, s_cs_w, conv_w, s_w_c, s_w_w, nc_row, s_nc_c, s_nc_w,
                       HK * K + hk * K + offs_k, mk, write_qk, W, WP, XDT)
        v = _conv_silu(x_row, s_qkv_c, cs_row, s_cs_c, s_cs_w, conv_w, s_w_c, s_w_w, nc_row, s_nc_c, s_nc_w,
                       2 * HK * K + i_h * V + offs_v, mv, i_v >= 0, W, WP, XDT)   # every program stores its v
    # gates (fp32): g = -exp(A_log) * softplus(a + dt_bias); beta = sigmoid(b) rounded like b.sigmoid(); before
    # the norms' reductions, so that their loads are in flight with the others
    av = tl.load(a + i_b * s_a_b + i_h * s_a_h).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32)
    g, beta = _gates(av, tl.load(A_log + i_h), tl.load(b + i_b * s_b_b + i_h * s_b_h))
    q, k = _qk_norm(q, k, q_scale)
    if not CONV_IN:
        S = tl.load(s_at, mask=m2, other=0.0)
    S, o = _delta_rule(S, q, k, v, g, beta)
    tl.store(out + i_b * s_o_b + i_h * s_o_h + offs_v * s_o_v, to_dt(o, XDT), mask=mv)
    # in place: through rec_state itself (new_rec, the same tensor, only lends its strides): the compiler's
    # kernel analysis then sees the state read and written through one argument and copies nothing
    if REC_IN_PLACE:
        dst = rec_state + slot * s_nr_b
    else:
        dst = new_rec + i_b * s_nr_b
    tl.store(dst + i_h * s_nr_h + offs_k[:, None] * s_nr_k + offs_v[None, :] * s_nr_v, S, mask=m2)


def block_v(B: int, HV: int, V: int) -> int:
    """V-tile width: narrow tiles while B*HV alone cannot fill the GPU (decode at small batch)."""
    bv = 16 if B * HV < 256 else 32
    return min(bv, next_pow2(V))


@triton_op("onegraph::gdn_decode_step_triton", mutates_args=())
def gdn_decode_step_triton(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_state: torch.Tensor,
                           rec_state: torch.Tensor, slots: torch.Tensor, conv_weight: torch.Tensor,
                           A_log: torch.Tensor, dt_bias: torch.Tensor,
                           num_k_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _validate(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads)
    B, C = qkv.shape
    _, HV, K, V = rec_state.shape
    W = conv_weight.shape[1]
    out = qkv.new_empty((B, HV, V))
    new_conv = conv_state.new_empty((B, C, W - 1))
    new_rec = rec_state.new_empty((B, HV, K, V))
    run(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads, out, new_conv, new_rec)
    return out, new_conv, new_rec


def run(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads, out, new_conv, new_rec,
        conv_in: bool = False, plan_rows: int | None = None) -> None:
    """The step's launch into out [B, HV, V] and the new rows. conv_in: qkv is causal_conv_update's output
    (the conv state untouched; new_conv unused). new_rec is rec_state: the rows at slots in place.
    plan_rows: the batch the V tile is chosen for (default B; 1 in the batch-invariant lowering: the V tile sets
    the layout of the [K, BV] state tile, hence the order of the sums over K)."""
    B = qkv.shape[0]
    _, HV, K, V = rec_state.shape
    W = conv_weight.shape[1]
    BK, BV = next_pow2(K), block_v(B if plan_rows is None else plan_rows, HV, V)
    launch(_gdn_decode_kernel, (B, HV, triton.cdiv(V, BV)),
           qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, out, new_conv, new_rec,
           *qkv.stride(), *a.stride(), *b.stride(), *conv_state.stride(), *rec_state.stride(),
           *conv_weight.stride(), *out.stride(), *new_conv.stride(), *new_rec.stride(),
           float(K) ** -0.5,
           HK=num_k_heads, K=K, V=V, REP=HV // num_k_heads, W=W, WP=next_pow2(W), BK=BK, BV=BV,
           CONV_IN=conv_in, REC_IN_PLACE=new_rec is rec_state, num_warps=4 if BK * BV <= 4096 else 8)


_registry.register_lowering("gdn_decode_step", "triton", torch.ops.onegraph.gdn_decode_step_triton.default)
