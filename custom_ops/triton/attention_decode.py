"""Triton lowering of attention_decode: GQA flash-decoding (contract: custom_ops/attention_decode.py).

Kernel 1, grid (B, KVH, NSPLIT): program (b, kh, sp) takes the G = H/KVH query heads of kv head kh
([BG >= 16, D] so the score and value products are tensor-core dots) against its share of keys
0..n-1 (n = min(positions[b] + 1, Tmax)): the row's length is cut into NSPLIT pieces at run time,
each a multiple of BN, so short rows still spread over all splits. It keeps an online softmax and
writes unnormalised partials (o [D] fp32, running max m, sum l) per (b, head, split).
Kernel 2, grid (B, H, D / 64): merges the splits (empty ones carry m = -inf, l = 0), normalises and applies
the output gate: out = o * sigmoid(gate), o and sigmoid(gate) each rounded to q.dtype first, as the
reference (the gate is read through its strides: the gate half of q_proj's output, not copied).
NSPLIT is fixed at trace time from B*KVH (target ~256 programs), so the graph stays static.
Dot operands are fp32 (see `_dot`): exact for bf16 values, same accumulation as a bf16 dot.
Numerics: scores are rounded to q.dtype and scaled in q.dtype as the reference's matmul does;
softmax in fp32; probabilities enter the value product in q.dtype (unnormalised, where the
reference rounds normalised ones: a difference at the model dtype's rounding level).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..attention_decode import _validate
from ._common import launch, next_pow2, rnd, to_dt


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """fp32 operands holding model-dtype values. For a 16-bit model tf32 is exact on them (10-bit
    mantissa >= bf16's 7, fp16's 10) and accumulates in fp32, as a bf16 tensor-core dot does; an
    fp32 model gets full-precision "ieee". (fp32 operands also keep the kernel runnable by the
    Triton interpreter, which cannot do bf16 arithmetic.)"""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="tf32")


@triton.jit
def _attn_split_kernel(q, k_cache, v_cache, slots, positions, o_part, m_part, l_part,
                       s_q_b, s_q_h, s_q_d, s_k_s, s_k_h, s_k_t, s_k_d, s_v_s, s_v_h, s_v_t, s_v_d,
                       scale, Tmax,
                       H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NSPLIT: tl.constexpr,
                       BG: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    i_b = tl.program_id(0)
    i_kh = tl.program_id(1)
    i_s = tl.program_id(2)
    DT: tl.constexpr = q.dtype.element_ty
    slot = tl.load(slots + i_b)                                              # int64
    n = tl.minimum(tl.load(positions + i_b) + 1, Tmax)                       # keys 0..n-1
    per = tl.cdiv(tl.cdiv(n, NSPLIT), BN) * BN
    lo = i_s * per
    hi = tl.minimum(lo + per, n)

    offs_g = tl.arange(0, BG)
    mg = offs_g < G
    heads = i_kh * G + offs_g
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    qt = tl.load(q + i_b * s_q_b + heads[:, None] * s_q_h + offs_d[None, :] * s_q_d,
                 mask=mg[:, None] & md[None, :], other=0.0).to(tl.float32)   # [BG, BD]
    k_base = k_cache + slot * s_k_s + i_kh * s_k_h
    v_base = v_cache + slot * s_v_s + i_kh * s_v_h

    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    # A `for` over a run-time range, which the compiler software-pipelines: the next tiles' K and V
    # loads are in flight while this tile's dots run (a `while` loop was not pipelined: load, then
    # math, one after the other; 59 % of copy bandwidth at 128k keys on the H200).
    for start in range(lo, hi, BN):
        offs_n = start + tl.arange(0, BN)
        mn = offs_n < hi
        m2 = mn[:, None] & md[None, :]
        kt = tl.load(k_base + offs_n[:, None] * s_k_t + offs_d[None, :] * s_k_d, mask=m2, other=0.0)
        vt = tl.load(v_base + offs_n[:, None] * s_v_t + offs_d[None, :] * s_v_d, mask=m2, other=0.0)
        s = _dot(qt, tl.trans(kt.to(tl.float32)), IEEE)                      # [BG, BN] fp32
        s = rnd(rnd(s, DT) * tl.cast(scale, tl.float32), DT)                                      # (q k^T) * scale in q.dtype
        s = tl.where(mn[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(rnd(p, DT), vt.to(tl.float32), IEEE)
        m_i = m_new

    row = (i_b * H + heads) * NSPLIT + i_s                                   # [BG]
    tl.store(o_part + row[:, None] * D + offs_d[None, :], acc, mask=mg[:, None] & md[None, :])
    tl.store(m_part + row, m_i, mask=mg)
    tl.store(l_part + row, l_i, mask=mg)


@triton.jit
def _attn_combine_kernel(o_part, m_part, l_part, gate, out, s_g_b, s_g_h, s_g_d, s_o_b, s_o_h, s_o_d,
                         H: tl.constexpr, D: tl.constexpr, NSPLIT: tl.constexpr,
                         BS: tl.constexpr, BD: tl.constexpr):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    offs_s = tl.arange(0, BS)
    ms = offs_s < NSPLIT
    offs_d = tl.program_id(2) * BD + tl.arange(0, BD)
    md = offs_d < D
    row = (i_b * H + i_h) * NSPLIT + offs_s
    m = tl.load(m_part + row, mask=ms, other=float("-inf"))
    l = tl.load(l_part + row, mask=ms, other=0.0)
    m_max = tl.max(m, axis=0)
    wgt = tl.where(ms & (m > float("-inf")), tl.exp(m - m_max), 0.0)        # empty splits weigh 0
    o = tl.load(o_part + row[:, None] * D + offs_d[None, :], mask=ms[:, None] & md[None, :], other=0.0)
    res = tl.sum(o * wgt[:, None], axis=0) / tl.sum(l * wgt, axis=0)
    DT: tl.constexpr = out.dtype.element_ty
    g = tl.load(gate + i_b * s_g_b + i_h * s_g_h + offs_d * s_g_d, mask=md, other=0.0).to(tl.float32)
    res = rnd(res, DT) * rnd(tl.sigmoid(g), DT)                             # o * sigmoid(gate) in q.dtype
    tl.store(out + i_b * s_o_b + i_h * s_o_h + offs_d * s_o_d, to_dt(res, DT), mask=md)


TARGET_PROGRAMS = 256      # ~2 waves of programs on a 132-SM H200
MAX_SPLITS = 64
COMBINE_D = 64             # head dims per combine program


def plan(B: int, KVH: int, Tmax: int, D: int) -> tuple[int, int]:
    """-> (BN keys per step, NSPLIT splits), fixed per graph shape."""
    # 64 keys of K and V per step: ~64 KB of loads in flight per SM (one 8-warp program fits per SM
    # at D = 256: ~240 registers, no spills on sm_90, see scripts/compile_check.py)
    BN = 64
    nsplit = max(1, min(TARGET_PROGRAMS // max(B * KVH, 1), MAX_SPLITS, triton.cdiv(Tmax, BN)))
    return BN, nsplit


def run(q, k_cache, v_cache, slots, positions, scale: float, gate, block_n: int, nsplit: int) -> torch.Tensor:
    """Both launches with an explicit plan (the op uses `plan`; tests force small tiles and splits)."""
    B, H, D = q.shape
    KVH = k_cache.shape[1]
    Tmax = k_cache.shape[2]
    BD = max(16, next_pow2(D))
    o_part = torch.empty((B, H, nsplit, D), dtype=torch.float32, device=q.device)
    m_part = torch.empty((B, H, nsplit), dtype=torch.float32, device=q.device)
    l_part = torch.empty((B, H, nsplit), dtype=torch.float32, device=q.device)
    out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    launch(_attn_split_kernel, (B, KVH, nsplit), q, k_cache, v_cache, slots, positions, o_part, m_part, l_part,
           *q.stride(), *k_cache.stride(), *v_cache.stride(), float(scale), Tmax,
           H=H, G=H // KVH, D=D, NSPLIT=nsplit, BG=max(16, next_pow2(H // KVH)), BD=BD, BN=block_n,
           IEEE=q.dtype == torch.float32, num_warps=4 if BD <= 128 else 8)
    # the combine's [NSPLIT, BDC] partials per program: a D chunk each, so B*H*D/BDC programs share the reads
    # (whole rows: 16 programs at batch 1, each loading 64 KB of fp32 partials). H200, 35B shape, bs1 at 1,024
    # keys, split + combine: 6.6 us where whole rows took 7.0 (benchmarks/h200_attention_combine_chunks.json)
    BDC = min(BD, COMBINE_D)
    launch(_attn_combine_kernel, (B, H, triton.cdiv(D, BDC)), o_part, m_part, l_part, gate, out, *gate.stride(),
           *out.stride(), H=H, D=D, NSPLIT=nsplit, BS=next_pow2(nsplit), BD=BDC, num_warps=4)
    return out


@triton_op("onegraph::attention_decode_triton", mutates_args=())
def attention_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                            positions: torch.Tensor, scale: float, gate: torch.Tensor) -> torch.Tensor:
    _validate(q, k_cache, v_cache, slots, positions, scale, gate)
    B, H, D = q.shape
    _, KVH, Tmax, _ = k_cache.shape
    block_n, nsplit = plan(B, KVH, Tmax, D)
    # the kernel reads row b's index at ptr + b: an expanded (stride-0) index tensor must be made dense
    return run(q, k_cache, v_cache, slots.contiguous(), positions.contiguous(), scale, gate, block_n, nsplit)


_registry.register_lowering("attention_decode", "triton", torch.ops.onegraph.attention_decode_triton.default)
