"""Triton lowering of gdn_prefill: the chunked gated delta rule in three kernels (contract:
custom_ops/gdn_prefill.py).

Value head h reads key head h // (HV/HK). Tokens go in chunks of BT = 64; rows t >= T load as zeros
with g = beta = 0, which changes nothing (the reference pads the same way). NT = cdiv(T, BT) chunks;
the fp32 workspaces hold Tp = NT * BT rows per value head.
  1. _wy_kernel, grid (NT, HV), every chunk in parallel:
     G = in-chunk cumsum of g -> G [HV, Tp];
     Att = causal(q k^T exp(G_i - G_j)) [HV, Tp, BT], the intra-chunk attention (once per head, not
       per V tile);
     A = strictly lower beta_i (k_i . k_j) exp(G_i - G_j); (I + A)^-1 by forward substitution inside
       the four 16x16 diagonal blocks, then block substitution below them (the exact inverse, as the
       reference's recursive blocks), through the chunk's [BT, BT] scratch Ai;
     w = (I + A)^-1 (beta exp(G) k) [HV, Tp, K], u = (I + A)^-1 (beta v) [HV, Tp, V].
  2. _state_kernel, grid (HV, V/16), the only sequential part: S [K, 16] fp32 starts at
     rec_state[slot]; per chunk c: h[c] = S (the state entering the chunk, [NT, HV, K, V]);
     v_new = u - w S (written over u); S = exp(G_last) S + (exp(G_last - G) k)^T v_new.
     Writes the final S. K <= 128 (S is held as two 64-row halves).
  3. _out_kernel, grid (NT, HV, V/64), parallel: out = (exp(G) q) h[c] + Att v_new.
q, k are L2-normed (x * rsqrt(sum x^2 + 1e-6), as the reference) and q scaled by K^-0.5 as row
scales applied to the products of the raw rows (a row sum over K, no normalised copy in memory).

chunk_size: the kernels always use 64-token chunks. The result is the recurrence's (see the contract)
whatever the chunk length, so every chunk_size the op accepts gives the same numbers up to fp32 rounding.
Numerics: fp32 throughout, as the reference; dots in "tf32x3" (three tf32 tensor-core products,
about fp32 accuracy); the output is rounded once to x.dtype (nearest-even), where the reference rounds.
Launch configurations: no register spills on sm_90 at the 35B-A3B shapes (tests check it); timing
on the H200 is not tuned yet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..gdn_prefill import _validate
from ._common import launch, next_pow2, to_dt

BT = 64          # chunk length; the WY kernel's 4x4 blocks of BC = 16 rows are written for it
BC = 16


@triton.jit
def _dot(a, b):
    """fp32 x fp32 -> fp32 at about fp32 accuracy (the operands are computed fp32 values, not
    model-dtype ones, so plain tf32 would lose 13 bits)."""
    return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _rows(ptr, s_t, s_c, r0, T, c0, ncols, R: tl.constexpr, BN: tl.constexpr):
    """ptr[r0 : r0+R, c0 : c0+BN] as fp32 [R, BN]; rows >= T and columns >= c0 + ncols read as 0."""
    r = (r0 + tl.arange(0, R)).to(tl.int64)                                   # T * C may pass 2^31
    c = tl.arange(0, BN)
    m = (r < T)[:, None] & (c < ncols)[None, :]
    return tl.load(ptr + r[:, None] * s_t + (c0 + c)[None, :] * s_c, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _vec(ptr, s_t, r0, T, R: tl.constexpr):
    """ptr[r0 : r0+R] as fp32 [R]; rows >= T read as 0 (padding: g = beta = 0)."""
    r = r0 + tl.arange(0, R)
    return tl.load(ptr + r * s_t, mask=r < T, other=0.0).to(tl.float32)


@triton.jit
def _store_rows(ptr, s_t, r0, val, ncols, R: tl.constexpr, BN: tl.constexpr):
    """ptr[(r0 + i) * s_t + j] = val[i, j] for j < ncols."""
    r = r0 + tl.arange(0, R)
    c = tl.arange(0, BN)
    tl.store(ptr + r[:, None] * s_t + c[None, :], val, mask=(c < ncols)[None, :])


@triton.jit
def _blk(ptr, i: tl.constexpr, j: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Block (i, j) [BC, BC] of a row-major [BT, BT] matrix."""
    r = i * BC + tl.arange(0, BC)
    c = j * BC + tl.arange(0, BC)
    return tl.load(ptr + r[:, None] * BT + c[None, :])


@triton.jit
def _put(ptr, i: tl.constexpr, j: tl.constexpr, val, BT: tl.constexpr, BC: tl.constexpr):
    r = i * BC + tl.arange(0, BC)
    c = j * BC + tl.arange(0, BC)
    tl.store(ptr + r[:, None] * BT + c[None, :], val)


@triton.jit
def _diag_inv(A, BC: tl.constexpr):
    """(I + A)^-1 [BC, BC] for A strictly lower, by forward substitution: row i of N = (I + A)^-1 - I
    is -A_i + sum_{j<i} (-A_ij) N_j (rows 0 and 1 are -A_i already)."""
    o = tl.arange(0, BC)
    N = -A
    for i in tl.static_range(2, BC):
        a = tl.sum(tl.where((o == i)[:, None], -A, 0.0), axis=0)              # -A_i, [BC]
        a = a + tl.sum(a[:, None] * N, axis=0)
        N = tl.where((o == i)[:, None], a[None, :], N)
    return N + tl.where(o[:, None] == o[None, :], 1.0, 0.0)


@triton.jit
def _wy_kernel(x, g, beta, G, Att, Ai, w, u, s_x_t, s_x_c, s_g_t, s_g_h, s_b_t, s_b_h, q_scale, T,
               HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, REP: tl.constexpr, BK: tl.constexpr,
               BKT: tl.constexpr, BVF: tl.constexpr, BVT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    Tp = tl.num_programs(0) * BT
    t0 = i_t * BT
    o_t = tl.arange(0, BT)
    qcol = (i_h // REP) * K
    kcol = HK * K + qcol
    vcol = 2 * HK * K + i_h * V
    b = _vec(beta + i_h * s_b_h, s_b_t, t0, T, BT)                           # [BT]
    Gc = tl.cumsum(_vec(g + i_h * s_g_h, s_g_t, t0, T, BT), axis=0)           # log decay since chunk start
    tl.store(G + i_h * Tp + t0 + o_t, Gc)
    # over column tiles of the raw q, k: the key Gram matrix k k^T, q k^T [BT, BT] and squared norms;
    # the l2norm is a row/column scale, applied after the products
    P = tl.zeros([BT, BT], tl.float32)
    QK = tl.zeros([BT, BT], tl.float32)
    nk = tl.zeros([BT], tl.float32)
    nq = tl.zeros([BT], tl.float32)
    for c0 in tl.static_range(0, BK, BKT):
        kt = _rows(x, s_x_t, s_x_c, t0, T, kcol + c0, K - c0, BT, BKT)       # [BT, BKT]
        qt = _rows(x, s_x_t, s_x_c, t0, T, qcol + c0, K - c0, BT, BKT)
        nk += tl.sum(kt * kt, axis=1)
        nq += tl.sum(qt * qt, axis=1)
        P += _dot(kt, tl.trans(kt))
        QK += _dot(qt, tl.trans(kt))
    r = tl.rsqrt(nk + 1e-6)                                                   # k = raw k * r
    D = Gc[:, None] - Gc[None, :]
    causal = o_t[:, None] >= o_t[None, :]
    # the intra-chunk attention causal(q k^T exp(G_i - G_j)) [BT, BT] for the output kernel
    att = QK * (tl.rsqrt(nq + 1e-6) * tl.cast(q_scale, tl.float32))[:, None] * r[None, :]
    att = tl.where(causal, att * tl.exp(tl.where(causal, D, 0.0)), 0.0)
    tl.store(Att + (i_h * Tp + t0 + o_t)[:, None] * BT + o_t[None, :], att)
    low = o_t[:, None] > o_t[None, :]
    A = tl.where(low, P * (r * b)[:, None] * r[None, :] * tl.exp(tl.where(low, D, 0.0)), 0.0)

    # (I + A)^-1 by 16x16 blocks. Register tensors cannot be sliced, so A goes through this chunk's
    # [BT, BT] scratch (L2-resident); a CTA barrier makes a thread's global stores visible to the others.
    Ai_c = Ai + (i_h * Tp + t0) * BT
    tl.store(Ai_c + o_t[:, None] * BT + o_t[None, :], A)
    tl.debug_barrier()
    # M_ii by forward substitution, then for i > j: M_ij = -M_ii sum_{j <= l < i} A_il M_lj
    M00, M11 = _diag_inv(_blk(Ai_c, 0, 0, BT, BC), BC), _diag_inv(_blk(Ai_c, 1, 1, BT, BC), BC)
    M22, M33 = _diag_inv(_blk(Ai_c, 2, 2, BT, BC), BC), _diag_inv(_blk(Ai_c, 3, 3, BT, BC), BC)
    A10, A21, A32 = _blk(Ai_c, 1, 0, BT, BC), _blk(Ai_c, 2, 1, BT, BC), _blk(Ai_c, 3, 2, BT, BC)
    A20, A31, A30 = _blk(Ai_c, 2, 0, BT, BC), _blk(Ai_c, 3, 1, BT, BC), _blk(Ai_c, 3, 0, BT, BC)
    M10 = -_dot(M11, _dot(A10, M00))
    M21 = -_dot(M22, _dot(A21, M11))
    M32 = -_dot(M33, _dot(A32, M22))
    M20 = -_dot(M22, _dot(A20, M00) + _dot(A21, M10))
    M31 = -_dot(M33, _dot(A31, M11) + _dot(A32, M21))
    M30 = -_dot(M33, _dot(A30, M00) + _dot(A31, M10) + _dot(A32, M20))
    tl.debug_barrier()                                                        # all of A read before M overwrites it
    _put(Ai_c, 0, 0, M00, BT, BC)
    _put(Ai_c, 1, 1, M11, BT, BC)
    _put(Ai_c, 2, 2, M22, BT, BC)
    _put(Ai_c, 3, 3, M33, BT, BC)
    _put(Ai_c, 1, 0, M10, BT, BC)
    _put(Ai_c, 2, 1, M21, BT, BC)
    _put(Ai_c, 3, 2, M32, BT, BC)
    _put(Ai_c, 2, 0, M20, BT, BC)
    _put(Ai_c, 3, 1, M31, BT, BC)
    _put(Ai_c, 3, 0, M30, BT, BC)
    tl.debug_barrier()
    # M [BT, BT] lower triangular (the blocks above the diagonal were never written: masked to 0)
    M = tl.load(Ai_c + o_t[:, None] * BT + o_t[None, :], mask=o_t[None, :] <= o_t[:, None], other=0.0)

    # w = M (beta exp(G) l2norm(k)) [BT, K]: the decayed keys that read the state entering the chunk
    e = r * b * tl.exp(Gc)
    w_h = w + (i_h * Tp) * K
    for c0 in tl.static_range(0, BK, BKT):
        kt = _rows(x, s_x_t, s_x_c, t0, T, kcol + c0, K - c0, BT, BKT) * e[:, None]
        _store_rows(w_h + c0, K, t0, _dot(M, kt), K - c0, BT, BKT)
    # u = M (beta v) [BT, V]: the pseudo-values
    u_h = u + (i_h * Tp) * V
    for c0 in tl.static_range(0, BVF, BVT):
        vt = _rows(x, s_x_t, s_x_c, t0, T, vcol + c0, V - c0, BT, BVT) * b[:, None]
        _store_rows(u_h + c0, V, t0, _dot(M, vt), V - c0, BT, BVT)


@triton.jit
def _state_kernel(x, G, w, u, h, rec_state, slot, new_rec, s_x_t, s_x_c,
                  s_rs_s, s_rs_h, s_rs_k, s_rs_v, s_nr_h, s_nr_k, s_nr_v, T,
                  NT: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, REP: tl.constexpr,
                  HV: tl.constexpr, BKH: tl.constexpr, TWO: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr):
    """S [K, BV] is held as two row halves S0, S1 [BKH, BV] (S1 only when TWO, i.e. K > 64): the
    fp32 products then take [BT, 64] operands, which fit the registers without spilling."""
    i_h = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    Tp = NT * BT
    kcol = HK * K + (i_h // REP) * K
    o_k = tl.arange(0, BKH)
    offs_v = i_v * BV + tl.arange(0, BV)
    mv = offs_v < V
    o_t = tl.arange(0, BT)
    s_row = tl.load(slot)                                                     # int64: 64-bit offsets
    rs = rec_state + s_row * s_rs_s + i_h * s_rs_h + offs_v[None, :] * s_rs_v
    S0 = tl.load(rs + o_k[:, None] * s_rs_k, mask=(o_k < K)[:, None] & mv[None, :], other=0.0)      # [BKH, BV]
    if TWO:
        S1 = tl.load(rs + (BKH + o_k)[:, None] * s_rs_k, mask=(BKH + o_k < K)[:, None] & mv[None, :], other=0.0)
    hv = (o_k[:, None] * V + offs_v[None, :]).to(tl.int64)                    # offsets in one h[c, head]
    w_h, G_h = w + (i_h * Tp) * K, G + i_h * Tp
    # NT is a constexpr (T is static per graph): a compile-time trip count, a pipelined `for`
    for c in range(NT):
        t0 = c * BT
        h_c = h + (c * HV + i_h) * K * V                                      # state entering chunk c
        tl.store(h_c + hv, S0, mask=(o_k < K)[:, None] & mv[None, :])
        # v_new = u - w S  [BT, BV], written over u
        u_ptr = u + (i_h * Tp + t0 + o_t)[:, None] * V + offs_v[None, :]
        vn = tl.load(u_ptr, mask=mv[None, :], other=0.0) - _dot(_rows(w_h, K, 1, t0, Tp, 0, K, BT, BKH), S0)
        ka = _rows(x, s_x_t, s_x_c, t0, T, kcol, K, BT, BKH)                  # raw keys, 0 past T
        nk = tl.sum(ka * ka, axis=1)
        if TWO:
            tl.store(h_c + BKH * V + hv, S1, mask=(BKH + o_k < K)[:, None] & mv[None, :])
            vn -= _dot(_rows(w_h, K, 1, t0, Tp, BKH, K - BKH, BT, BKH), S1)
            kb = _rows(x, s_x_t, s_x_c, t0, T, kcol + BKH, K - BKH, BT, BKH)
            nk += tl.sum(kb * kb, axis=1)
        tl.store(u_ptr, vn, mask=mv[None, :])
        # S = exp(G_last) S + (l2norm(k) exp(G_last - G))^T v_new
        Gl = tl.load(G_h + t0 + BT - 1)
        sc = tl.rsqrt(nk + 1e-6) * tl.exp(Gl - tl.load(G_h + t0 + o_t))        # [BT]
        S0 = S0 * tl.exp(Gl) + _dot(tl.trans(ka * sc[:, None]), vn)
        if TWO:
            S1 = S1 * tl.exp(Gl) + _dot(tl.trans(kb * sc[:, None]), vn)
    nr = new_rec + i_h * s_nr_h + offs_v[None, :] * s_nr_v
    tl.store(nr + o_k[:, None] * s_nr_k, S0, mask=(o_k < K)[:, None] & mv[None, :])
    if TWO:
        tl.store(nr + (BKH + o_k)[:, None] * s_nr_k, S1, mask=(BKH + o_k < K)[:, None] & mv[None, :])


@triton.jit
def _out_kernel(x, G, Att, vn, h, out, s_x_t, s_x_c, s_o_t, s_o_h, s_o_v, q_scale, T,
                HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, REP: tl.constexpr, HV: tl.constexpr,
                BK: tl.constexpr, BKT: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_v = tl.program_id(2)
    Tp = tl.num_programs(0) * BT
    t0 = i_t * BT
    XDT: tl.constexpr = x.dtype.element_ty
    qcol = (i_h // REP) * K
    o_t = tl.arange(0, BT)
    offs_v = i_v * BV + tl.arange(0, BV)
    mv = offs_v < V
    h_c = h + (i_t * HV + i_h) * K * V
    # raw q S [BT, BV] over column tiles; l2norm(q) K^-0.5 exp(G) is a row scale applied after
    qS = tl.zeros([BT, BV], tl.float32)
    nq = tl.zeros([BT], tl.float32)
    for c0 in tl.static_range(0, BK, BKT):
        q = _rows(x, s_x_t, s_x_c, t0, T, qcol + c0, K - c0, BT, BKT)         # [BT, BKT]
        offs_k = c0 + tl.arange(0, BKT)
        S = tl.load(h_c + offs_k[:, None] * V + offs_v[None, :], mask=(offs_k < K)[:, None] & mv[None, :],
                    other=0.0)                                                # [BKT, BV]
        nq += tl.sum(q * q, 1)
        qS += _dot(q, S)
    rq = tl.rsqrt(nq + 1e-6) * tl.cast(q_scale, tl.float32)
    Gc = tl.load(G + i_h * Tp + t0 + o_t)                                     # [BT]
    rows_p = i_h * Tp + t0 + o_t                                              # rows of the [HV, Tp, *] workspaces
    att = tl.load(Att + rows_p[:, None] * BT + o_t[None, :])                  # [BT, BT]
    vnew = tl.load(vn + rows_p[:, None] * V + offs_v[None, :], mask=mv[None, :], other=0.0)
    o = qS * (rq * tl.exp(Gc))[:, None] + _dot(att, vnew)                     # [BT, BV]
    rows = t0 + o_t
    tl.store(out + rows[:, None] * s_o_t + i_h * s_o_h + offs_v[None, :] * s_o_v, to_dt(o, XDT),
             mask=(rows < T)[:, None] & mv[None, :])


@triton_op("onegraph::gdn_prefill_triton", mutates_args=())
def gdn_prefill_triton(x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, rec_state: torch.Tensor,
                       slot: torch.Tensor, num_k_heads: int, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    _validate(x, g, beta, rec_state, slot, num_k_heads, chunk_size)
    T = x.shape[0]
    _, HV, K, V = rec_state.shape
    if K > 128:
        raise ValueError(f"gdn_prefill_triton: key head dim {K} > 128 (the state kernel holds two 64-row halves)")
    NT = triton.cdiv(T, BT)
    Tp = NT * BT
    # fp32 workspaces, every element written before it is read
    G = g.new_empty((HV, Tp))                                                 # in-chunk cumsum of g
    Att = g.new_empty((HV, Tp, BT))                                           # per chunk: causal q k^T decay
    Ai = g.new_empty((HV, Tp, BT))                                            # per chunk: A, then (I + A)^-1
    w = g.new_empty((HV, Tp, K))
    u = g.new_empty((HV, Tp, V))                                              # u, then v_new in place
    h = g.new_empty((NT, HV, K, V))                                           # state entering each chunk
    out = x.new_empty((T, HV, V))
    new_rec = rec_state.new_empty((1, HV, K, V))
    BK, BVF = max(16, next_pow2(K)), max(16, next_pow2(V))
    common = dict(HK=num_k_heads, K=K, V=V, REP=HV // num_k_heads, BT=BT)
    launch(_wy_kernel, (NT, HV), x, g, beta, G, Att, Ai, w, u, *x.stride(), *g.stride(), *beta.stride(),
           float(K) ** -0.5, T,
           BK=BK, BKT=min(64, BK), BVF=BVF, BVT=min(64, BVF), BC=BC, **common, num_warps=4)
    # the sequential kernel: narrow V tiles for more programs (35B: 32 heads x 8 = 256, two per SM at
    # ~250 registers and, with 2 stages, ~94 KB of shared memory each: one wave on an H200)
    BV = min(16, BVF)
    launch(_state_kernel, (HV, triton.cdiv(V, BV)), x, G, w, u, h, rec_state, slot, new_rec, *x.stride(),
           *rec_state.stride(), *new_rec.stride()[1:], T, NT=NT, HV=HV, BKH=min(64, BK), TWO=BK > 64, BV=BV,
           **common, num_warps=4, num_stages=2)
    BV = min(64, BVF)
    launch(_out_kernel, (NT, HV, triton.cdiv(V, BV)), x, G, Att, u, h, out, *x.stride(), *out.stride(),
           float(K) ** -0.5, T, HV=HV, BK=BK, BKT=min(64, BK), BV=BV, **common, num_warps=4)
    return out, new_rec


_registry.register_lowering("gdn_prefill", "triton", torch.ops.onegraph.gdn_prefill_triton.default)
