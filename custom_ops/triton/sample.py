"""Triton lowering of sample: greedy / temperature / top-k / top-p with the counter-based Gumbel RNG
(contract and reference: custom_ops/sample.py). No sort of the vocabulary.

The reference ranks the scaled logits s = logits / T (descending), keeps the ranks r with
r < top_k and (mass ranked above r) < top_p (rank 0 always), and returns the kept token with the
largest s + gumbel(u(seed, position, token)). That is the same as: the Gumbel-max winner over
tokens whose rank is below K' (the kept prefix), so:

Kernel 1, grid (B, NSPLIT) (NSPLIT from V alone, `plan`), each program a contiguous chunk of the vocabulary, in one pass:
  - greedy: first index of the largest logit (NaN counts as largest, as torch.argmax);
  - only if T > 0: the chunk's Gumbel-max winner over all tokens, ordered by (s + g desc, s desc,
    id asc) -- the reference's argmax over ranked tokens breaks ties by rank;
  - only if the row filters (0 < top_k < V or top_p < 1): the softmax partials (max, sum of exp)
    and the chunk's top R tokens by (s desc, id asc), packed in a uint64 (order-preserving bits of
    s above, ~id below) and kept with `tl.topk`.
Kernel 2, grid (B,): merges the chunks. Greedy rows and rows without filtering are done (the
winner over all tokens). Filtering rows rank the global top R exactly, take the reference's
probabilities / exclusive cumsum / keep rule on them, and if the kept prefix ends inside the top R,
pick the Gumbel-max among it. Only when all R are kept (a wide top-p on a flat distribution) does
the kept set reach deeper: then the all-token winner is the answer if its rank is below K' (one
counting pass over the row), and otherwise K' is found by bisection on the value threshold
(~30 counting passes, one program: slow, and rare: the winner must fall outside the kept mass).

Exactness: s is a correctly rounded division (div_rn, as torch), the noise is the reference's
32-bit hash and its fp64 -log(-log(u)) rounded to fp32, so the sampled ids are the reference's.
Two documented differences, both at rounding level: (1) probabilities are exp(s - max) / sum with a
different summation order, so a token whose mass-above sits within ~1e-6 of top_p may be kept on one
side and not the other; (2) tokens with equal s are ranked by token id (what a stable sort gives:
CUDA's radix sort is stable; the reference's CPU sort is not, so its order among ties varies).
top_p >= 1 with top_k <= 0 keeps every token, as the contract says (the reference's fp32 cumsum can
drop a tail whose mass-above rounds to 1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..sample import _validate
from ._common import launch, next_pow2

R = 64                 # exact top-R candidates per row (a kept set of up to R tokens needs no extra pass)
BV = 1024              # vocabulary tile of kernel 1
# Chunks per row: as many as fill the GPU at one row (~256 kernel-1 programs, 2 waves on a 132-SM H200, up to
# MAX_SPLITS), the same at every batch: the chunks' softmax sums merge in one order whatever the batch, so a row's
# top-p edge does not move with its neighbours (docs/design.md, "Batch invariance"). A plan chosen from B (fewer,
# longer chunks for more rows) was no faster: 35B vocabulary, top-p 0.9 on flat logits, H200, B = 16 / 32 / 64:
# 376 / 3,253 / 4,047 us against 353 / 3,151 / 3,795 with the one-row plan, equal at B = 1..8
# (benchmarks/h200_batch_invariant_ops.json).
MAX_SPLITS = 64        # kernel 2 ranks MAX_SPLITS * R candidates with one bitonic top-k
TARGET_PROGRAMS = 256


# ---------------------------------------------------------------- shared device helpers

@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (products wrap mod 2^32, as the reference's masked int64 products)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _row_hash(seed, position):
    """(seed, position) int64 scalars -> the row's uint32 key (reference `uniform`, first two lines)."""
    su = seed.to(tl.uint64, bitcast=True)
    s = _mix32((su & 0xFFFFFFFF).to(tl.uint32)) ^ _mix32((su >> 32).to(tl.uint32) ^ tl.full([], 0x9E3779B9, tl.uint32))
    return _mix32(s ^ _mix32((position.to(tl.uint64, bitcast=True) & 0xFFFFFFFF).to(tl.uint32)))


@triton.jit
def _gumbel(h, idx):
    """Token ids -> fp32 Gumbel noise: u = (hash + 0.5) / 2^32, -log(-log(u)) in fp64, rounded to fp32
    (the reference's double arithmetic; fp64 log on CUDA is libdevice's, as torch's)."""
    r = _mix32(h ^ _mix32(idx.to(tl.uint32) + tl.full([], 0x632BE5AB, tl.uint32)))
    u = (r.to(tl.float64) + 0.5) / 4294967296.0
    return (-tl.log(-tl.log(u))).to(tl.float32)


@triton.jit
def _not32(x):
    """~x on uint32 (the interpreter cannot build the all-ones constant of `~` for unsigned types)."""
    return x ^ tl.full([], 0xFFFFFFFF, tl.uint32)


@triton.jit
def _ord(s):
    """fp32 -> uint32 whose unsigned order is the float order (non-NaN)."""
    b = s.to(tl.uint32, bitcast=True)
    return tl.where((b >> 31) != 0, _not32(b), b | tl.full([], 0x80000000, tl.uint32))


@triton.jit
def _unord(o):
    b = tl.where((o >> 31) != 0, o & tl.full([], 0x7FFFFFFF, tl.uint32), _not32(o))
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _best(key, s, idx, valid):
    """Block winner by (key desc, s desc, idx asc) among `valid` lanes -> (key, s, idx) scalars."""
    key = tl.where(valid, key, float("-inf"))
    k_max = tl.max(key, axis=0)
    on = valid & (key == k_max)
    s_max = tl.max(tl.where(on, s, float("-inf")), axis=0)
    i_min = tl.min(tl.where(on & (s == s_max), idx, 2147483647), axis=0)
    return k_max, s_max, i_min


@triton.jit
def _better(k1, s1, i1, k0, s0, i0):
    """Is (k1, s1, i1) ranked before (k0, s0, i0)?"""
    return (k1 > k0) | ((k1 == k0) & ((s1 > s0) | ((s1 == s0) & (i1 < i0))))


@triton.jit
def _scaled(logits_row, offs, m, t):
    """s = logits / T, correctly rounded as torch's division; masked lanes -inf."""
    x = tl.load(logits_row + offs, mask=m, other=float("-inf")).to(tl.float32)
    return tl.where(m, tl.math.div_rn(x, tl.zeros_like(x) + t), float("-inf"))


# ---------------------------------------------------------------- kernel 1: one pass per chunk

@triton.jit
def _scan_kernel(logits, temperature, top_k, top_p, seed, position,
                 g_val, g_idx, w_key, w_s, w_idx, p_max, p_sum, cand, s_l_b, V,
                 NSPLIT: tl.constexpr, NB: tl.constexpr, BV: tl.constexpr, R: tl.constexpr):
    b = tl.program_id(0)
    sp = tl.program_id(1)
    row = logits + b.to(tl.int64) * s_l_b
    lo = sp * NB * BV                                        # chunk [lo, lo + NB*BV) of the vocabulary
    t_in = tl.load(temperature + b)
    k = tl.load(top_k + b)
    filt = ((k > 0) & (k < V)) | (tl.load(top_p + b) < 1.0)
    t = tl.where(t_in > 0, t_in, 1.0)
    out = b * NSPLIT + sp

    # greedy: first largest logit; NaN is largest (torch.argmax), found as the first NaN
    gv = float("-inf")
    gi = 2147483647
    gnan = 2147483647
    for i in range(NB):
        offs = lo + i * BV + tl.arange(0, BV)
        m = offs < V
        x = tl.load(row + offs, mask=m, other=float("-inf")).to(tl.float32)
        gnan = tl.minimum(gnan, tl.min(tl.where(m & (x != x), offs, 2147483647), axis=0))
        bm = tl.max(tl.where(x != x, float("-inf"), x), axis=0)
        bi = tl.min(tl.where(m & (x == bm), offs, 2147483647), axis=0)
        take = bm > gv
        gi = tl.where(take, bi, gi)
        gv = tl.where(take, bm, gv)
    gi = tl.where(gi == 2147483647, lo, gi)                   # all -inf: the first index (or an empty chunk)
    tl.store(g_val + out, tl.where(gnan < 2147483647, float("nan"), gv))
    tl.store(g_idx + out, tl.where(gnan < 2147483647, gnan, gi))

    if t_in > 0:
        h = _row_hash(tl.load(seed + b), tl.load(position + b))
        wk = float("-inf")
        ws = float("-inf")
        wi = 2147483647
        mx = float("-inf")
        sm = 0.0
        top = tl.zeros([R], tl.uint64)                        # packed (s, ~id); 0 = empty
        for i in range(NB):
            offs = lo + i * BV + tl.arange(0, BV)
            m = offs < V
            s = _scaled(row, offs, m, t)                      # [BV]
            key = s + _gumbel(h, offs)
            bk, bs, bi = _best(key, s, offs, m)
            take = _better(bk, bs, bi, wk, ws, wi)
            wk = tl.where(take, bk, wk)
            ws = tl.where(take, bs, ws)
            wi = tl.where(take, bi, wi)
            if filt:
                bmax = tl.max(s, axis=0)
                mx_new = tl.maximum(mx, bmax)
                safe = tl.where(mx_new == float("-inf"), 0.0, mx_new)   # an all-masked tile adds 0
                sm = sm * tl.exp(mx - safe) + tl.sum(tl.exp(s - safe), axis=0)
                mx = mx_new
                packed = (_ord(s).to(tl.uint64) << 32) | _not32(offs.to(tl.uint32)).to(tl.uint64)
                packed = tl.where(m, packed, 0)
                both = tl.reshape(tl.join(top, tl.topk(packed, R)), [2 * R])
                top = tl.topk(both, R)
        tl.store(w_key + out, wk)
        tl.store(w_s + out, ws)
        tl.store(w_idx + out, wi)
        tl.store(p_max + out, mx)
        tl.store(p_sum + out, sm)
        tl.store(cand + out * R + tl.arange(0, R), top.to(tl.int64, bitcast=True))


# ---------------------------------------------------------------- kernel 2: merge and pick

@triton.jit
def _count_above(row, V, t, x, x_id, m_row, BVF: tl.constexpr):
    """Tokens ranked above (s = x, id = x_id), i.e. s > x, or s == x and a smaller id -> (how many,
    sum of exp(s - m_row) over them): one pass over the row."""
    c = 0
    mass = 0.0
    start = 0
    while start < V:
        offs = start + tl.arange(0, BVF)
        m = offs < V
        s = _scaled(row, offs, m, t)
        above = m & ((s > x) | ((s == x) & (offs < x_id)))
        c += tl.sum(above.to(tl.int32), axis=0)
        mass += tl.sum(tl.where(above, tl.exp(s - m_row), 0.0), axis=0)
        start += BVF
    return c, mass


@triton.jit
def _pick_kernel(logits, temperature, top_k, top_p, seed, position,
                 g_val, g_idx, w_key, w_s, w_idx, p_max, p_sum, cand, out, s_l_b, V,
                 NSPLIT: tl.constexpr, R: tl.constexpr, BVF: tl.constexpr):
    b = tl.program_id(0)
    offs_s = tl.arange(0, NSPLIT)
    base = b * NSPLIT + offs_s                                # [NSPLIT] this row's partials

    # greedy: chunks are in vocabulary order, so the first best chunk has the first best index
    gv = tl.load(g_val + base)
    gi = tl.load(g_idx + base)
    gnan = gv != gv
    any_nan = tl.max(gnan.to(tl.int32), axis=0) > 0
    gmax = tl.max(tl.where(gnan, float("-inf"), gv), axis=0)
    greedy = tl.where(any_nan, tl.min(tl.where(gnan, gi, 2147483647), axis=0),
                      tl.min(tl.where(gv == gmax, gi, 2147483647), axis=0))

    t_in = tl.load(temperature + b)
    result = greedy.to(tl.int64)
    if t_in > 0:
        k = tl.load(top_k + b)
        p = tl.load(top_p + b)
        k_eff = tl.where((k > 0) & (k < V), k, V)
        wk, ws, wi = _best(tl.load(w_key + base), tl.load(w_s + base), tl.load(w_idx + base), offs_s < NSPLIT)
        result = wi.to(tl.int64)                              # winner over all tokens
        if (k_eff < V) | (p < 1.0):
            row = logits + b.to(tl.int64) * s_l_b
            t = tl.where(t_in > 0, t_in, 1.0)
            pm = tl.load(p_max + base)
            m_row = tl.max(pm, axis=0)
            z = tl.sum(tl.where(pm == float("-inf"), 0.0, tl.load(p_sum + base) * tl.exp(pm - m_row)), axis=0)
            # the global top R, ranked by (s desc, id asc)
            allc = tl.load(cand + b * NSPLIT * R + tl.arange(0, NSPLIT * R)).to(tl.uint64, bitcast=True)
            top = tl.topk(allc, R)                            # [R] uint64, descending
            valid = top != 0
            s_r = _unord((top >> 32).to(tl.uint32))
            id_r = _not32((top & 0xFFFFFFFF).to(tl.uint32)).to(tl.int32)
            rank = tl.arange(0, R)
            prob = tl.where(valid, tl.exp(s_r - m_row) / z, 0.0)
            before = tl.cumsum(prob, axis=0) - prob           # mass ranked above, as the reference
            keep = valid & (((rank < k_eff) & (before < p)) | (rank == 0))
            h = _row_hash(tl.load(seed + b), tl.load(position + b))
            key = tl.where(keep, s_r + _gumbel(h, tl.where(valid, id_r, 0)), float("-inf"))
            result = tl.max(tl.where(rank == tl.argmax(key, axis=0, tie_break_left=True), id_r, 0), axis=0).to(tl.int64)
            n_kept = tl.sum(keep.to(tl.int32), axis=0)
            w_in_top = tl.max((valid & (id_r == wi)).to(tl.int32), axis=0) > 0
            if (n_kept == R) & (k_eff > R):
                # The kept prefix may reach past the top R. A winner inside the top R is kept.
                result = wi.to(tl.int64)
                if w_in_top == 0:
                    c_w, m_w = _count_above(row, V, t, ws, wi, m_row, BVF)   # the winner's rank, mass above
                    if (c_w >= k_eff) | (m_w >= p * z):    # not kept: the kept set's own winner
                        result = _deep_pick(row, V, t, h, m_row, z, k_eff, p, ws, s_r, BVF, R)
    tl.store(out + b, result)


@triton.jit
def _deep_pick(row, V, t, h, m_row, z, k_eff, p, s_w, s_r, BVF: tl.constexpr, R: tl.constexpr):
    """Kept set deeper than the top R and the all-token winner outside it: bisect the value threshold
    tau = s of the last kept rank over order-preserving uint32 keys, then Gumbel-max over the kept."""
    # P(x) = "the first token of value x is kept" = c(x) < k_eff and mass(x) < p * z, true at the
    # R-th candidate (all R kept), false just below s_w (the winner is not kept); monotone in x.
    hi = _ord(tl.min(s_r, axis=0)).to(tl.int64)
    lo = _ord(s_w).to(tl.int64) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        x = _unord(mid.to(tl.uint32))
        c, mass = _count_above(row, V, t, x, 0, m_row, BVF)
        ok = (c < k_eff) & (mass < p * z)
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid)
    tau = _unord(hi.to(tl.uint32))                            # a data value: P flips only at data values
    c0, m0 = _count_above(row, V, t, tau, 0, m_row, BVF)
    # ties at tau are ranked by id: the j-th is kept while c0 + j < k_eff and m0 + j * e_tau < p * z
    n_p = tl.math.ceil(tl.minimum((p * z - m0) / tl.exp(tau - m_row), 2147483647.0)).to(tl.int64)
    n_ties = tl.maximum(tl.minimum(k_eff - c0, n_p), 1)
    wk = float("-inf")
    ws = float("-inf")
    wi = 2147483647
    seen = 0
    start = 0
    while start < V:
        offs = start + tl.arange(0, BVF)
        m = offs < V
        s = _scaled(row, offs, m, t)
        tie = m & (s == tau)
        tie_rank = seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        kept = m & ((s > tau) | (tie & (tie_rank < n_ties)))
        bk, bs, bi = _best(s + _gumbel(h, offs), s, offs, kept)
        take = _better(bk, bs, bi, wk, ws, wi)
        wk = tl.where(take, bk, wk)
        ws = tl.where(take, bs, ws)
        wi = tl.where(take, bi, wi)
        seen += tl.sum(tie.to(tl.int32), axis=0)
        start += BVF
    return wi.to(tl.int64)


def plan(V: int) -> tuple[int, int]:
    """-> (NSPLIT chunks per row, NB tiles per chunk) for a V-token vocabulary, at every batch."""
    tiles = triton.cdiv(V, BV)
    nsplit = min(MAX_SPLITS, TARGET_PROGRAMS, next_pow2(tiles))
    return nsplit, triton.cdiv(tiles, nsplit)


def run(logits, temperature, top_k, top_p, seed, position, nsplit: int, nb: int, bv: int = BV,
        r: int = R) -> torch.Tensor:
    """Both launches with an explicit plan (the op uses `plan`; tests force small tiles)."""
    B, V = logits.shape
    if nsplit * nb * bv < V or nsplit & (nsplit - 1) or r & (r - 1):
        raise ValueError(f"sample: {nsplit} chunks of {nb} tiles of {bv} do not cover V={V} (or not powers of 2)")
    f32 = dict(dtype=torch.float32, device=logits.device)
    i32 = dict(dtype=torch.int32, device=logits.device)
    # per (row, chunk) partials, not zero-filled (zero-filling costs 6 launches a step): a greedy row's chunks write no
    # Gumbel partials (w_*, p_*, cand), and the pick kernel reads them only for a sampled row, whose chunks
    # all write every one of them
    g_val, g_idx = torch.empty((B, nsplit), **f32), torch.empty((B, nsplit), **i32)
    w_key, w_s = torch.empty((B, nsplit), **f32), torch.empty((B, nsplit), **f32)
    w_idx = torch.empty((B, nsplit), **i32)
    p_max, p_sum = torch.empty((B, nsplit), **f32), torch.empty((B, nsplit), **f32)
    cand = torch.empty((B, nsplit, r), dtype=torch.int64, device=logits.device)   # uint64 bits
    out = torch.empty((B,), dtype=torch.int64, device=logits.device)
    args = (logits, temperature, top_k, top_p, seed, position, g_val, g_idx, w_key, w_s, w_idx, p_max, p_sum, cand)
    launch(_scan_kernel, (B, nsplit), *args, logits.stride(0), V, NSPLIT=nsplit, NB=nb, BV=bv, R=r,
           num_warps=4)
    launch(_pick_kernel, (B,), *args, out, logits.stride(0), V, NSPLIT=nsplit, R=r, BVF=4 * bv, num_warps=8)
    return out


@triton_op("onegraph::sample_triton", mutates_args=())
def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    _validate(logits, temperature, top_k, top_p, seed, position)
    nsplit, nb = plan(logits.shape[1])
    if logits.stride(1) != 1:            # the kernels index rows with unit stride (a copy, static)
        logits = logits.contiguous()
    # per-row inputs are read at ptr + b: an expanded (stride-0) tensor must become a real one
    rows = [t.contiguous() for t in (temperature, top_k, top_p, seed, position)]
    return run(logits, *rows, nsplit, nb)


_registry.register_lowering("sample", "triton", torch.ops.onegraph.sample_triton.default)
