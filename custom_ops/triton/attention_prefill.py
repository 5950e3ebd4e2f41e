"""Triton lowering of attention_prefill: causal GQA flash attention of a chunk of T tokens of one slot
over its KV cache (contract: custom_ops/attention_prefill.py).

One kernel, grid (cdiv(T*G, BM), KVH): the T*G query rows of kv head kh (G = H/KVH heads per kv
head) are flattened token-major, row r = token * G + g, and cut into blocks of BM rows, so the G
heads that share a kv head share every K/V tile (one load feeds G * BM/G query rows), for any G.
A program walks keys 0 .. min(start_pos + last token of its block + 1, Tmax) in tiles of BN with an
online softmax; the causal mask (key j <= start_pos + token) is applied per row on every tile (a
where on [BM, BN]: cheap next to the two [BM, D] x [D, BN] dots). Heavy blocks (late tokens, more
keys) get the lowest program ids, so they start first.

A 16-bit model's dots take their operands in the model dtype (tensor cores, fp32 accumulation; `mma`:
interpreted kernels upcast them first, exact), an fp32 model's run "ieee". q is loaded once per program
([BM, D]: 32 registers a thread in bf16 at BM = 64, D = 256, 8 warps) and the key loop is a run-time `for`,
which the compiler pipelines (K and V tiles of the next keys load while this tile's dots run).
Numerics follow `masked_attention`: q k^T rounded to q.dtype, times scale in q.dtype; softmax in
fp32; probabilities enter the value product in q.dtype, unnormalised (the reference rounds the
normalised ones). That is a different draw of the same bf16 rounding noise, so bf16 outputs differ
from the reference by up to 2 ulps (tests: |err| <= 1e-2 + 1e-2 |ref|); fp32 by <= 5e-5.
Measured on the H200 at the 35B shape: the kernel before, with fp32 (tf32) operands, q k^T in D chunks and
an unpipelined `while`, took 152 ms of a 360 ms TTFT(8192) (benchmarks/h200_35b_prefill.json); one layer's
call at T = 8192: 15.6 ms then, 1.78 ms now (benchmarks/h200_attention_prefill.json).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..attention_prefill import _validate
from ._common import INTERPRETED, launch, mma, next_pow2, rnd, to_dt


@triton.jit
def _prefill_kernel(q, k_cache, v_cache, slot, start_pos, out,
                    s_q_t, s_q_h, s_q_d, s_k_s, s_k_h, s_k_t, s_k_d, s_v_s, s_v_h, s_v_t, s_v_d,
                    s_o_t, s_o_h, s_o_d, scale, T, Tmax,
                    G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                    DOT_F32: tl.constexpr):
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
    qb = tl.load(q + tok[:, None] * s_q_t + heads[:, None] * s_q_h + offs_d[None, :] * s_q_d,
                 mask=mr[:, None] & md[None, :], other=0.0)                          # [BM, BD] q.dtype
    k_base = k_cache + base_slot * s_k_s + i_kh * s_k_h
    v_base = v_cache + base_slot * s_v_s + i_kh * s_v_h
    last_tok = tl.minimum((i_m * BM + BM - 1) // G, T - 1)
    hi = tl.minimum(p0 + last_tok + 1, Tmax)                # keys this block needs: 0 .. hi-1
    sc = tl.cast(scale, tl.float32)                          # AOTI passes floats as fp64

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)                     # unnormalised output rows
    # Key 0 is allowed for every row (also the padding rows past T*G, whose qpos >= 0), so no row's
    # running max stays -inf: no NaN.
    for start in range(0, hi, BN):
        offs_n = start + tl.arange(0, BN)                    # [BN]
        mn = offs_n < hi
        kt = tl.load(k_base + offs_n[None, :] * s_k_t + offs_d[:, None] * s_k_d,
                     mask=md[:, None] & mn[None, :], other=0.0)                     # [BD, BN]
        s = mma(qb, kt, tl.zeros([BM, BN], tl.float32), DOT_F32)                    # [BM, BN] fp32
        s = rnd(rnd(s, DT) * sc, DT)                         # (q k^T) * scale in q.dtype
        s = tl.where(mn[None, :] & (offs_n[None, :] <= qpos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_base + offs_n[:, None] * s_v_t + offs_d[None, :] * s_v_d,
                     mask=mn[:, None] & md[None, :], other=0.0)                     # [BN, BD]
        acc = mma(to_dt(p, DT), vt, acc * alpha[:, None], DOT_F32)
        m_i = m_new

    res = acc / l_i[:, None]
    tl.store(out + tok[:, None] * s_o_t + heads[:, None] * s_o_h + offs_d[None, :] * s_o_d,
             to_dt(res, out.dtype.element_ty), mask=mr[:, None] & md[None, :])


def plan(T: int, G: int, KVH: int, D: int, ieee: bool) -> tuple[int, int, int, int]:
    """-> (BM query rows, BN keys per tile, num_warps, num_stages), fixed per graph shape."""
    BD = max(16, next_pow2(D))
    if ieee:       # fp32 models (tests): "ieee" dots run on CUDA cores from registers: small tiles
        return min(32, max(16, next_pow2(T * G))), 32, 8 if BD >= 256 else 4, 2
    # 16-bit, swept on the H200 at the 35B shape (16 heads, 2 KV heads, D = 256; benchmarks/h200_attention_prefill.json):
    # 128 rows (16 tokens x 8 heads) x 64 keys, 8 warps, 2 stages (160 KB of shared memory) where that still
    # makes >= 256 programs: T = 8192 1.78 ms, 2048 tokens at position 30720 3.60 ms; a shorter chunk keeps more
    # programs with 64 rows x 32 keys, 4 warps, 3 stages: T = 512 27 us (128 rows: 36 us).
    if triton.cdiv(T * G, 128) * KVH >= 256:
        return 128, 64, 8, 2
    return min(64, max(16, next_pow2(T * G))), 32, 4, 3       # a 1-token chunk needs only G rows


def run(q, k_cache, v_cache, slot, start_pos, scale: float, block_m: int, block_n: int,
        num_warps: int = 4, stages: int = 2) -> torch.Tensor:
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
           G=G, D=D, BM=block_m, BD=BD, BN=block_n, DOT_F32=INTERPRETED, num_warps=num_warps, num_stages=stages)
    return out


@triton_op("onegraph::attention_prefill_triton", mutates_args=())
def attention_prefill_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor,
                             start_pos: torch.Tensor, scale: float) -> torch.Tensor:
    _validate(q, k_cache, v_cache, slot, start_pos, scale)
    T, H, D = q.shape
    # tiling fixed at trace time from the static shapes
    block_m, block_n, warps, stages = plan(T, H // k_cache.shape[1], k_cache.shape[1], D, q.dtype == torch.float32)
    return run(q, k_cache, v_cache, slot, start_pos, scale, block_m, block_n, warps, stages)


_registry.register_lowering("attention_prefill", "triton", torch.ops.onegraph.attention_prefill_triton.default)
