"""Triton lowering of attention_prefill: causal GQA flash attention of a chunk of T tokens of one slot
over its KV cache (contract: custom_ops/attention_prefill.py).

One kernel, grid (cdiv(T*G, BM), KVH): the T*G query rows of kv head kh (G = H/KVH heads per kv
head) are flattened token-major, row r = token * G + g, and cut into blocks of BM rows, so the G
heads that share a kv head share every K/V tile (one load feeds G * BM/G query rows), for any G.
A program walks keys 0 .. min(start_pos + last token of its block + 1, Tmax) in tiles of BN with an
online softmax; the causal mask (key j <= start_pos + token) is applied per row on every tile (a
where on [BM, BN]: cheap next to the two [BM, D] x [D, BN] dots). Heavy blocks (late tokens, more
keys) get the lowest program ids, so they start first.

Dot operands are fp32 (see attention_decode._dot: tf32 is exact on bf16/fp16 values and accumulates
in fp32; fp32 models get "ieee"): the Triton interpreter cannot run bf16 dots. q k^T is summed over D
in chunks of DC = 64 so that no fp32 [BM, D] operand has to live in registers (D = 256).
Numerics follow `masked_attention`: q k^T rounded to q.dtype, times scale in q.dtype; softmax in
fp32; probabilities enter the value product in q.dtype, unnormalised (the reference rounds the
normalised ones). That is a different draw of the same bf16 rounding noise, so bf16 outputs differ
from the reference by up to 2 ulps (tests: |err| <= 1e-2 + 1e-2 |ref|); fp32 by <= 5e-5.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..attention_prefill import _validate
from ._common import launch, next_pow2, rnd, to_dt
from .attention_decode import _dot


@triton.jit
def _prefill_kernel(q, k_cache, v_cache, slot, start_pos, out,
                    s_q_t, s_q_h, s_q_d, s_k_s, s_k_h, s_k_t, s_k_d, s_v_s, s_v_h, s_v_t, s_v_d,
                    s_o_t, s_o_h, s_o_d, scale, T, Tmax,
                    G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                    DC: tl.constexpr, IEEE: tl.constexpr):
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)        # heaviest row block first
    i_kh = tl.program_id(1)
    DT: tl.constexpr = q.dtype.element_ty
    p0 = tl.load(start_pos)                                  # int64: position of token 0
    base_slot = tl.load(slot)                                # int64: slot * stride stays 64-bit

    rows = i_m * BM + tl.arange(0, BM)                       # [BM] flattened (token, head in group)
    mr = rows < T * G
    tok = rows // G
    heads = i_kh * G + rows % G
    qpos = p0 + tok                                          # [BM] each row attends keys j <= qpos
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    q_rows = q + tok[:, None] * s_q_t + heads[:, None] * s_q_h             # [BM, 1] row pointers
    k_base = k_cache + base_slot * s_k_s + i_kh * s_k_h
    v_base = v_cache + base_slot * s_v_s + i_kh * s_v_h
    last_tok = tl.minimum((i_m * BM + BM - 1) // G, T - 1)
    hi = tl.minimum(p0 + last_tok + 1, Tmax)                # keys this block needs: 0 .. hi-1
    sc = tl.cast(scale, tl.float32)                          # AOTI passes floats as fp64

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)                     # unnormalised output rows
    # A `while`, not `for start in range(0, hi, BN)`: the compiler would pipeline a `for` (as in
    # attention_decode), but at this tile its stages take 256 KB of shared memory, over sm_90's 227 KB
    # (tools/compile_check.py). Key 0 is allowed for every row (also
    # the padding rows past T*G, whose qpos >= 0), so no row's running max stays -inf: no NaN.
    start = 0
    while start < hi:
        offs_n = start + tl.arange(0, BN)                    # [BN]
        mn = offs_n < hi
        # q k^T over D in chunks of DC: a loop-invariant fp32 q [BM, D] would be hoisted into
        # registers as the dot's left operand (D = 256: 128 per thread, next to the accumulator's
        # 64); q chunks are re-read each tile instead (L1 hits) and live only for their dot.
        s = tl.zeros([BM, BN], tl.float32)
        for c in tl.static_range(0, BD, DC):
            offs_c = c + tl.arange(0, DC)
            mc = offs_c < D
            qc = tl.load(q_rows + offs_c[None, :] * s_q_d, mask=mr[:, None] & mc[None, :], other=0.0)
            kc = tl.load(k_base + offs_n[:, None] * s_k_t + offs_c[None, :] * s_k_d,
                         mask=mn[:, None] & mc[None, :], other=0.0)
            s += _dot(qc.to(tl.float32), tl.trans(kc.to(tl.float32)), IEEE)   # [BM, BN] fp32
        s = rnd(rnd(s, DT) * sc, DT)                         # (q k^T) * scale in q.dtype
        s = tl.where(mn[None, :] & (offs_n[None, :] <= qpos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_base + offs_n[:, None] * s_v_t + offs_d[None, :] * s_v_d,
                     mask=mn[:, None] & md[None, :], other=0.0)                     # [BN, BD]
        acc = acc * alpha[:, None] + _dot(rnd(p, DT), vt.to(tl.float32), IEEE)
        m_i = m_new
        start += BN

    res = acc / l_i[:, None]
    tl.store(out + tok[:, None] * s_o_t + heads[:, None] * s_o_h + offs_d[None, :] * s_o_d,
             to_dt(res, out.dtype.element_ty), mask=mr[:, None] & md[None, :])


def plan(T: int, G: int, D: int, ieee: bool) -> tuple[int, int, int]:
    """-> (BM query rows, BN keys per tile, num_warps), fixed per graph shape."""
    BD = max(16, next_pow2(D))
    # D = 256 (35B): 64 rows (8 tokens x 8 heads) x 64 keys, 8 warps: the fp32 accumulator
    # [64, 256] is 64 registers per thread; compiles for sm_90 without spills (compile_check).
    # fp32 models (tests) take "ieee" dots, which run on CUDA cores from registers: smaller tiles.
    bm = 32 if ieee else 64
    BM = min(bm, max(16, next_pow2(T * G)))                 # a 1-token chunk needs only G rows
    return BM, 32 if ieee else 64, 8 if BD >= 256 else 4


def run(q, k_cache, v_cache, slot, start_pos, scale: float, block_m: int, block_n: int,
        num_warps: int = 4) -> torch.Tensor:
    """The launch with an explicit tiling (the op uses `plan`; tests force small, odd tilings)."""
    T, H, D = q.shape
    KVH, Tmax = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    if H % KVH:
        raise ValueError(f"attention_prefill: {H} query heads not a multiple of {KVH} kv heads")
    BD = max(16, next_pow2(D))
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    launch(_prefill_kernel, (triton.cdiv(T * G, block_m), KVH), q, k_cache, v_cache, slot, start_pos, out,
           *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), float(scale), T, Tmax,
           G=G, D=D, BM=block_m, BD=BD, BN=block_n, DC=min(64, BD), IEEE=q.dtype == torch.float32,
           num_warps=num_warps)
    return out


@triton_op("onegraph::attention_prefill_triton", mutates_args=())
def attention_prefill_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor,
                             start_pos: torch.Tensor, scale: float) -> torch.Tensor:
    _validate(q, k_cache, v_cache, slot, start_pos, scale)
    T, H, D = q.shape
    # tiling fixed at trace time from the static shapes
    block_m, block_n, warps = plan(T, H // k_cache.shape[1], D, q.dtype == torch.float32)
    return run(q, k_cache, v_cache, slot, start_pos, scale, block_m, block_n, warps)


_registry.register_lowering("attention_prefill", "triton", torch.ops.onegraph.attention_prefill_triton.default)
