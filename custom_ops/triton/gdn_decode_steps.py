"""Triton lowering of gdn_decode_steps: ONE kernel for T positions (contract: custom_ops/gdn_decode_steps.py).

Grid (B, HV, cdiv(V, BV)) as gdn_decode_step's kernel (custom_ops/triton/gdn_decode_step.py), whose per-position
arithmetic this is; program (b, h, vt) loads its [K, BV] fp32 state tile once, then for j = 0..T-1 makes
position j's conv window, gates and norms, updates the tile in registers and writes out[b, j] and the snapshot
rec_after[j, b]. Where T gdn_decode_step launches read and wrote the whole state T times (the 35B shape: 2 MiB a
slot a layer, each way), this reads it once and writes the T snapshots.
Position j's conv window is read from the inputs, never from another program's output: its taps are the inputs
at positions j-W+1..j, those before 0 from the slot's conv state, the rest from qkv[b]; so nothing in the launch
waits on another program. Every value is the one the T-launch chain computes (the same roundings, the state kept
in fp32 between positions as the chain stores and reloads it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..gdn_decode_steps import _validate
from ._common import launch, next_pow2, rnd, to_dt
from .gdn_decode_step import _delta_rule, _gates, _qk_norm, block_v


@triton.jit
def _conv_silu_at(x_b, sx_t, sx_c, cs_row, scs_c, scs_w, w_ptr, sw_c, sw_w, nc_row, sncs_c, sncs_w,
                  j, ch, ch_mask, store_mask, W: tl.constexpr, WP: tl.constexpr, XDT: tl.constexpr):
    """Position j's depthwise causal conv + SiLU of channels `ch` [N] -> fp32 [N] (rounded through XDT), as
    gdn_decode_step's _conv_silu with the window's taps at input positions j-W+1..j: the conv state's columns
    for those before 0, else qkv's rows; stores the shifted window (position j's conv rows) where store_mask."""
    t = tl.arange(0, WP)                                                   # taps, [WP]
    src = j - (W - 1) + t                                                  # each tap's input position
    live = t < W
    st = tl.load(cs_row + ch[:, None] * scs_c + (W - 1 + src)[None, :] * scs_w,
                 mask=ch_mask[:, None] & (live & (src < 0))[None, :], other=0.0)   # [N, WP] state dtype
    xv = tl.load(x_b + src[None, :] * sx_t + ch[:, None] * sx_c,
                 mask=ch_mask[:, None] & (live & (src >= 0))[None, :], other=0.0)
    win = tl.where((src >= 0)[None, :], to_dt(xv, st.dtype), st)                   # state ‖ inputs
    w = tl.load(w_ptr + ch[:, None] * sw_c + t[None, :] * sw_w, mask=ch_mask[:, None] & live[None, :], other=0.0)
    tl.store(nc_row + ch[:, None] * sncs_c + (t[None, :] - 1) * sncs_w, win,
             mask=store_mask & ch_mask[:, None] & (t[None, :] >= 1) & live[None, :])
    WDT: tl.constexpr = w_ptr.dtype.element_ty
    prod = rnd(rnd(win.to(tl.float32), WDT) * w.to(tl.float32), WDT)
    acc = rnd(tl.sum(prod, axis=1), WDT)                                     # [N]
    return rnd(rnd(acc * tl.sigmoid(acc), WDT), XDT)


@triton.jit
def _gdn_steps_kernel(
        qkv, a, b, conv_state, rec_state, slots, conv_w, A_log, dt_bias,
        out, conv_after, rec_after,
        s_qkv_b, s_qkv_t, s_qkv_c, s_a_b, s_a_t, s_a_h, s_b_b, s_b_t, s_b_h,
        s_cs_s, s_cs_c, s_cs_w, s_rs_s, s_rs_h, s_rs_k, s_rs_v,
        s_w_c, s_w_w, s_o_b, s_o_t, s_o_h, s_o_v,
        s_nc_t, s_nc_b, s_nc_c, s_nc_w, s_nr_t, s_nr_b, s_nr_h, s_nr_k, s_nr_v,
        q_scale,
        T: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, REP: tl.constexpr,
        W: tl.constexpr, WP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    hk = i_h // REP
    XDT: tl.constexpr = qkv.dtype.element_ty

    slot = tl.load(slots + i_b)                                            # int64: 64-bit offsets
    x_b = qkv + i_b * s_qkv_b
    cs_row = conv_state + slot * s_cs_s
    offs_k = tl.arange(0, BK)
    mk = offs_k < K
    offs_v = i_v * BV + tl.arange(0, BV)
    mv = offs_v < V
    m2 = mk[:, None] & mv[None, :]
    S = tl.load(rec_state + slot * s_rs_s + i_h * s_rs_h + offs_k[:, None] * s_rs_k + offs_v[None, :] * s_rs_v,
                mask=m2, other=0.0)                                        # [BK, BV] fp32, read once
    A_log_h = tl.load(A_log + i_h)
    dt = tl.load(dt_bias + i_h).to(tl.float32)
    write_qk = (i_h % REP == 0) & (i_v == 0)      # key head hk's q/k conv rows: written by one program
    for j in range(T):
        nc_row = conv_after + j * s_nc_t + i_b * s_nc_b
        q = _conv_silu_at(x_b, s_qkv_t, s_qkv_c, cs_row, s_cs_c, s_cs_w, conv_w, s_w_c, s_w_w, nc_row, s_nc_c,
                          s_nc_w, j, hk * K + offs_k, mk, write_qk, W, WP, XDT)
        k = _conv_silu_at(x_b, s_qkv_t, s_qkv_c, cs_row, s_cs_c, s_cs_w, conv_w, s_w_c, s_w_w, nc_row, s_nc_c,
                          s_nc_w, j, HK * K + hk * K + offs_k, mk, write_qk, W, WP, XDT)
        v = _conv_silu_at(x_b, s_qkv_t, s_qkv_c, cs_row, s_cs_c, s_cs_w, conv_w, s_w_c, s_w_w, nc_row, s_nc_c,
                          s_nc_w, j, 2 * HK * K + i_h * V + offs_v, mv, i_v >= 0, W, WP, XDT)
        # gdn_decode_step's kernel's arithmetic, from the state this loop carries
        av = tl.load(a + i_b * s_a_b + j * s_a_t + i_h * s_a_h).to(tl.float32) + dt
        g, beta = _gates(av, A_log_h, tl.load(b + i_b * s_b_b + j * s_b_t + i_h * s_b_h))
        q, k = _qk_norm(q, k, q_scale)
        S, o = _delta_rule(S, q, k, v, g, beta)
        tl.store(out + i_b * s_o_b + j * s_o_t + i_h * s_o_h + offs_v * s_o_v, to_dt(o, XDT), mask=mv)
        tl.store(rec_after + j * s_nr_t + i_b * s_nr_b + i_h * s_nr_h + offs_k[:, None] * s_nr_k
                 + offs_v[None, :] * s_nr_v, S, mask=m2)


def run(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads: int,
        plan_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launch; plan_rows: the batch the V tile is chosen for (default B; 1 in the batch-invariant lowering,
    gdn_decode_steps_invariant.py: the V tile sets the order of the sums over K)."""
    B, T, C = qkv.shape
    _, HV, K, V = rec_state.shape
    W = conv_weight.shape[1]
    out = qkv.new_empty((B, T, HV, V))
    conv_after = conv_state.new_empty((T, B, C, W - 1))
    rec_after = rec_state.new_empty((T, B, HV, K, V))
    # the V tile of gdn_decode_step at the same rows: each position's sums over K in the chain's order
    BK, BV = next_pow2(K), block_v(B if plan_rows is None else plan_rows, HV, V)
    launch(_gdn_steps_kernel, (B, HV, triton.cdiv(V, BV)),
           qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, out, conv_after, rec_after,
           *qkv.stride(), *a.stride(), *b.stride(), *conv_state.stride(), *rec_state.stride(),
           *conv_weight.stride(), *out.stride(), *conv_after.stride(), *rec_after.stride(),
           float(K) ** -0.5,
           T=T, HK=num_k_heads, K=K, V=V, REP=HV // num_k_heads, W=W, WP=next_pow2(W), BK=BK, BV=BV,
           num_warps=4 if BK * BV <= 4096 else 8)
    return out, conv_after, rec_after


@triton_op("onegraph::gdn_decode_steps_triton", mutates_args=())
def gdn_decode_steps_triton(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_state: torch.Tensor,
                            rec_state: torch.Tensor, slots: torch.Tensor, conv_weight: torch.Tensor,
                            A_log: torch.Tensor, dt_bias: torch.Tensor,
                            num_k_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _validate(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads)
    return run(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads)


_registry.register_lowering("gdn_decode_steps", "triton", torch.ops.onegraph.gdn_decode_steps_triton.default)
