"""Triton lowering of qk_norm_rope: the q and k heads' RMSNorm + partial rotary embedding in one
launch (contract: custom_ops/qk_norm_rope.py).

Grid (N, Hq + KVH): program (n, h) takes one head row [D] of token n, a q head for h < Hq, else
k head h - Hq, read in place through its strides (the fused projection's output is not copied).
It normalises the row as `_rms_norm_kernel` (norms.py) does, with the same [BD] tile and warp
count so the fp32 sum of squares reduces in the same order, then rotates as `_rope_kernel`
(rope.py) does: column i < rot pairs with i + rot/2 (first half) or i - rot/2 (second half), whose
normalised value is recomputed from the partner's input (same row statistic, same arithmetic: the
value the norm op would have stored there).

Numerics: the reference's roundings to the model dtype are reproduced: the normalised row, cos/sin,
x * cos, rotated * sin and their sum. So the output equals today's two kernels in sequence bit for
bit (same reduction order, same elementwise arithmetic), and the references up to where torch's and
Triton's fp32 cos/sin differ by an ulp (then 1 ulp of the model dtype, as rope.py says).

In-place twin (`qk_norm_rope_kv_inplace_triton`, put in the graph by export/inplace_kv.py, never
called by the model): the same kernel also writes this step's k and v rows into the KV cache,
k_cache[w_slots[n], h, w_pos[n]] = k'[n, h] and v_cache[...] = v[n, h] (the k-head program copies its
v head too), replacing the model's two index_put writes and the Inductor kernel that did them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from .._registry import check_shape
from ..qk_norm_rope import _validate
from ._common import launch, next_pow2, rnd, to_dt
from .norms import _warps


@triton.jit
def _qk_norm_rope_kernel(q, k, v, wq, wk, positions, inv_freq, q_out, k_dst, v_dst, w_slots, w_pos,
                         s_q_n, s_q_h, s_q_d, s_k_n, s_k_h, s_k_d, s_v_n, s_v_h, s_v_d,
                         s_kd_s, s_kd_h, s_kd_t, s_kd_d, s_vd_s, s_vd_h, s_vd_t, s_vd_d, n_d, eps, t_max,
                         HQ: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                         BD: tl.constexpr, WRITE_KV: tl.constexpr, CLAMP: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    DT: tl.constexpr = q.dtype.element_ty
    offs = tl.arange(0, BD)
    m = offs < D
    rot = offs < 2 * HALF
    first = offs < HALF
    partner = tl.where(first, offs + HALF, offs - HALF)
    # k' lands at k_dst[slot, head, t]: the KV cache row (slot, pos) of this token, or (WRITE_KV off)
    # the contiguous output, addressed as a cache with slot = n, t = 0
    if WRITE_KV:
        slot = tl.load(w_slots + n)
        t = tl.load(w_pos + n)
        if CLAMP:                                   # w_pos and positions raw: clamped into the cache here
            t = tl.minimum(tl.maximum(t, 0), t_max - 1)
    else:
        slot = n
        t = 0
    # a q head (h < HQ) or k head h - HQ: both addresses computed, one selected (branch-free, so the
    # strides' run-time specialisations never have to agree between two branches)
    is_q = h < HQ
    hq = tl.minimum(h, HQ - 1)
    hk = tl.maximum(h - HQ, 0)
    q_row = q + n * s_q_n + hq * s_q_h
    k_row = k + n * s_k_n + hk * s_k_h
    x_at = tl.where(is_q, q_row + offs * s_q_d, k_row + offs * s_k_d)                 # [BD] pointers
    xp_at = tl.where(is_q, q_row + partner * s_q_d, k_row + partner * s_k_d)
    w_at = tl.where(is_q, wq + offs, wk + offs)
    wp_at = tl.where(is_q, wq + partner, wk + partner)
    y_at = tl.where(is_q, q_out + (n * HQ + hq) * D + offs,
                    k_dst + slot * s_kd_s + hk * s_kd_h + t * s_kd_t + offs * s_kd_d)
    if WRITE_KV:                                    # the k-head program also copies its v head
        mv = m & (h >= HQ)
        vv = tl.load(v + n * s_v_n + hk * s_v_h + offs * s_v_d, mask=mv, other=0.0)
        tl.store(v_dst + slot * s_vd_s + hk * s_vd_h + t * s_vd_t + offs * s_vd_d, vv, mask=mv)
    # RMSNorm, as _rms_norm_kernel: fp32 statistic over the row, (x * inv) * (1 + w) rounded to DT
    xf = tl.load(x_at, mask=m, other=0.0).to(tl.float32)
    # n_d == D, a run-time int as in _rms_norm_kernel: a constexpr divisor may compile to other arithmetic
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_d + tl.cast(eps, tl.float32))   # AOTI passes floats as fp64
    wf = tl.load(w_at, mask=m, other=0.0).to(tl.float32)
    yv = rnd(xf * inv * (1.0 + wf), DT)
    # rotate_half partner: -y[i + HALF] for the first half, y[i - HALF] for the second
    mp = m & rot
    xp = tl.load(xp_at, mask=mp, other=0.0).to(tl.float32)
    wp = tl.load(wp_at, mask=mp, other=0.0).to(tl.float32)
    yp = rnd(xp * inv * (1.0 + wp), DT)
    yp = tl.where(first, -yp, yp)
    # cos/sin of position * inv_freq[i mod HALF] in fp32, rounded to DT (as rope.py)
    fi = tl.where(first, offs, offs - HALF)
    freq = tl.load(inv_freq + fi, mask=rot, other=0.0).to(tl.float32)
    pos = tl.load(positions + n)
    if CLAMP:
        pos = tl.minimum(tl.maximum(pos, 0), t_max - 1)
    ang = pos.to(tl.float32) * freq
    cos = rnd(tl.cos(ang), DT)
    sin = rnd(tl.sin(ang), DT)
    out = rnd(rnd(yv * cos, DT) + rnd(yp * sin, DT), DT)
    out = tl.where(rot, out, yv)                    # dims rot..D pass through (normalised only)
    tl.store(y_at, to_dt(out, DT), mask=m)


def run(q, k, q_weight, k_weight, positions, inv_freq, eps: float, kv=None, clamp: bool = False):
    """-> (q' [N, HQ, D], k' [N, KVH, D]); kv = (v, w_slots, w_pos, k_cache, v_cache): k' and v are
    written into the caches at (w_slots[n], :, w_pos[n]) instead, and k' is not returned (None).
    clamp (with kv): positions and w_pos clamped to [0, cache length) in the kernel."""
    N, HQ, D = q.shape
    KVH = k.shape[1]
    q_out = torch.empty((N, HQ, D), dtype=q.dtype, device=q.device)
    if kv is None:
        k_out = torch.empty((N, KVH, D), dtype=q.dtype, device=q.device)
        v, w_slots, w_pos, k_dst, v_dst = q, positions, positions, k_out, q_out    # v, w_*, v_dst unused
        kd_strides = (KVH * D, D, 0, 1)                                          # [N, KVH, D] as slot = n, t = 0
        vd_strides = (0, 0, 0, 0)
        v_strides = (0, 0, 0)
    else:
        v, w_slots, w_pos, k_dst, v_dst = kv
        k_out = None
        kd_strides, vd_strides, v_strides = k_dst.stride(), v_dst.stride(), v.stride()
    BD = next_pow2(D)
    launch(_qk_norm_rope_kernel, (N, HQ + KVH), q, k, v, q_weight, k_weight, positions, inv_freq, q_out, k_dst, v_dst,
           w_slots, w_pos, *q.stride(), *k.stride(), *v_strides, *kd_strides, *vd_strides, D, eps,
           k_dst.shape[2] if kv is not None else 1,
           HQ=HQ, KVH=KVH, D=D, HALF=inv_freq.shape[0], BD=BD, WRITE_KV=kv is not None, CLAMP=clamp,
           num_warps=_warps(BD))            # the warp count of _rms_norm_kernel: same reduction order
    return q_out, k_out


@triton_op("onegraph::qk_norm_rope_triton", mutates_args=())
def qk_norm_rope_triton(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                        positions: torch.Tensor, inv_freq: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _validate(q, k, q_weight, k_weight, positions, inv_freq, eps)
    # read with unit stride (an expanded position tensor is made dense)
    return run(q, k, q_weight, k_weight, positions.contiguous(), inv_freq.contiguous(), eps)


def _validate_kv(q, k, v, w_slots, w_pos, k_cache, v_cache):
    N, _, D = q.shape
    KVH = k.shape[1]
    check_shape(v, (N, KVH, D), "qk_norm_rope_kv_inplace v", q.dtype)
    check_shape(k_cache, (None, KVH, None, D), "qk_norm_rope_kv_inplace k_cache", q.dtype)
    check_shape(v_cache, tuple(k_cache.shape), "qk_norm_rope_kv_inplace v_cache", q.dtype)
    check_shape(w_slots, (N,), "qk_norm_rope_kv_inplace w_slots", torch.int64)
    check_shape(w_pos, (N,), "qk_norm_rope_kv_inplace w_pos", torch.int64)


@triton_op("onegraph::qk_norm_rope_kv_inplace_triton", mutates_args={"k_cache", "v_cache"})
def qk_norm_rope_kv_inplace_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                                   k_weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float,
                                   w_slots: torch.Tensor, w_pos: torch.Tensor, k_cache: torch.Tensor,
                                   v_cache: torch.Tensor, clamp: bool = False) -> torch.Tensor:
    """qk_norm_rope_triton(q, k, ...) -> (q', k') followed by k_cache[w_slots, :, w_pos] = k' and
    v_cache[w_slots, :, w_pos] = v, in one kernel; returns q'. Export puts it in place of that pattern
    (export/inplace_kv.py); never called by the model. (w_slots, w_pos) pairs must be distinct, as for
    the index_put it replaces, or the rows written there are unspecified. clamp: positions and w_pos are
    used as positions.clamp(0, Tmax - 1) and w_pos.clamp(0, Tmax - 1) (Tmax = k_cache.shape[2]), so the
    graph hands the kernel its raw positions input rather than a clamp AOTInductor would recompute into a
    buffer of its own for each kernel."""
    _validate(q, k, q_weight, k_weight, positions, inv_freq, eps)
    _validate_kv(q, k, v, w_slots, w_pos, k_cache, v_cache)
    kv = (v, w_slots.contiguous(), w_pos.contiguous(), k_cache, v_cache)
    return run(q, k, q_weight, k_weight, positions.contiguous(), inv_freq.contiguous(), eps, kv, clamp)[0]


_registry.register_lowering("qk_norm_rope", "triton", torch.ops.onegraph.qk_norm_rope_triton.default)
