"""Prefill path of the Triton fused_moe lowering (contract: custom_ops/fused_moe.py): T*top_k > E, where
the reference loops over all E experts. Called by custom_ops/triton/fused_moe.py after the router.

Shapes: x [T, H]; w, idx [T, k] (router output); gate_up [E, 2I, H]; down [E, H, I]; shared_gate,
shared_up [Is, H]; shared_down [H, Is]; logits [T, E + 1] (its last column the shared expert's gate
logit). P = T*k (token, expert) pairs.

Algorithm (grouped GEMM over expert-sorted pairs; every shape static, so export/AOTInductor trace it):
 0-1. `_pair_table_kernel` (routed_table), grid (E,): pair p = t*k + j is token t's j-th smallest expert
    id (the order in which the reference adds the experts up), w_pair [P] its weight; src [P] (sorted row
    -> pair, by expert then token) and for each of NB = cdiv(P, BM) + min(E, P) blocks (a static upper
    bound on sum_e cdiv(count_e, BM)) its expert and row range [row, end) in the sorted order. Blocks past
    the last tile get end = 0 and exit at once.
 2. `_grouped_swiglu_kernel`, grid (NB, cdiv(I, BN)): act[r] = silu(x[tok] . gate_e) * (x[tok] . up_e)
    for the BM sorted rows r of one expert: tl.dot tiles [BM, BK] x [BK, BN] (tensor cores).
 3. `_grouped_down_kernel`, grid (NB, cdiv(H, BN)): y[pair] = rnd(rnd(act[r] . down_e) * w[pair]),
    written back in pair order [P, H].
 4. The shared expert runs through the same two kernels as ONE group of T rows (ids all 0, no weight),
    -> y_sh [T, H], on the tiles of its own rows class (plan(T, 1)). Why not aten mm: Inductor would fuse
    silu(g) * u without the bf16 roundings the eager reference makes between them; the kernels reproduce
    them, on the same tensor cores.
 5. `_combine_kernel`, grid (T, cdiv(H, BH)): routed = y[t*k] + y[t*k+1] + ... rounded to x.dtype
    after each add (ascending expert id, as the reference's per-expert loop does; the reference's
    exact-zero terms for unselected experts change nothing), then
    out = rnd(routed + rnd(rnd(sigmoid(logits[t, E])) * y_sh[t])).
Swap form (a tile option of kernels 2-3, SWAP in TILES): the kernels compute the transposed product
W tile [BN, BK] @ x[rows]^T [BK, BM] -> acc^T [BN, BM] and transpose it before the epilogue. Why: with few rows
per expert (decode batches: ~2 at 64 tokens of top-8 over 256 experts) the token rows are the MMA's M, and
Hopper's wgmma needs M = 64 per warpgroup (with BM = 16 Triton falls back to mma.sync m16n8k16); swapped, the
weight rows (64 / 128) are M, the few tokens N, and the weight tile is operand A, which wgmma may read from
registers. Compiled for sm_90 (Triton 3.6) at BM = 16 the swapped kernels are wgmma m64n16k16, the FP8 kernels'
upcast tile a register operand (the bf16 tile stays in shared memory, where its load put it). The same products
in fp32 accumulation: results equal the plain form's up to fp32 summation order.
Numerics: fp32 accumulation (fp32 operands in IEEE fp32, not tf32); every rounding of the reference's
prefill branch to x.dtype is reproduced (`rnd`), so bf16 tracks eager to a rare 1-ulp flip.
Weight offsets: expert ids are int64 (e * stride exceeds 2^31 elements on large models).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRETED, launch, mma, next_pow2, rnd, to_dt


@triton.jit
def _grouped_swiglu_kernel(x, src, blk_e, blk_row, blk_end, wg, wu, act,
                           s_x_t, s_x_h, s_g_e, s_g_n, s_g_h, s_u_e, s_u_n, s_u_h, u0,
                           H: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr,
                           DOT_F32: tl.constexpr):
    """act[r, n-tile] for the sorted rows r of block b; gate rows n of wg[e], up rows u0 + n of wu[e].
    SWAP: the transposed product (module docstring), same products and fp32 accumulation."""
    b = tl.program_id(0)
    nb = tl.program_id(1)
    DT: tl.constexpr = x.dtype.element_ty
    r0 = tl.load(blk_row + b)
    r1 = tl.load(blk_end + b)
    if r0 < r1:                                       # blocks past the last tile have no rows
        e = tl.load(blk_e + b)                        # int64: 64-bit weight offsets
        rows = r0 + tl.arange(0, BM)                  # [BM] sorted rows of expert e
        mr = rows < r1
        tok = tl.load(src + rows, mask=mr, other=0) // TOPK              # [BM] pair -> token
        cols = nb * BN + tl.arange(0, BN)             # [BN] intermediate channels
        mc = cols < N
        x_rows = x + tok * s_x_t                                         # [BM]
        g_rows = wg + e * s_g_e + cols * s_g_n                           # [BN]
        u_rows = wu + e * s_u_e + (u0 + cols) * s_u_n
        if SWAP:   # acc^T [BN, BM] = W tile [BN, BK] @ x^T [BK, BM]: weight rows on the MMA's M
            acc_g = tl.zeros([BN, BM], tl.float32)
            acc_u = tl.zeros([BN, BM], tl.float32)
            for h0 in range(0, H, BK):
                kk = h0 + tl.arange(0, BK)
                mk = kk < H
                m_xt = mk[:, None] & mr[None, :]
                xt = tl.load(x_rows[None, :] + kk[:, None] * s_x_h, mask=m_xt, other=0.0)           # [BK, BM]
                mw = mc[:, None] & mk[None, :]
                g = tl.load(g_rows[:, None] + kk[None, :] * s_g_h, mask=mw, other=0.0)              # [BN, BK]
                u = tl.load(u_rows[:, None] + kk[None, :] * s_u_h, mask=mw, other=0.0)
                acc_g = mma(g, xt, acc_g, DOT_F32)
                acc_u = mma(u, xt, acc_u, DOT_F32)
            acc_g = tl.trans(acc_g)                   # [BM, BN]: the epilogue below is the plain form's
            acc_u = tl.trans(acc_u)
        else:      # acc [BM, BN] = x [BM, BK] @ W tile^T [BK, BN]
            acc_g = tl.zeros([BM, BN], tl.float32)
            acc_u = tl.zeros([BM, BN], tl.float32)
            for h0 in range(0, H, BK):
                kk = h0 + tl.arange(0, BK)
                mk = kk < H
                m_xa = mr[:, None] & mk[None, :]
                xa = tl.load(x_rows[:, None] + kk[None, :] * s_x_h, mask=m_xa, other=0.0)           # [BM, BK]
                mw = mk[:, None] & mc[None, :]
                g = tl.load(g_rows[None, :] + kk[:, None] * s_g_h, mask=mw, other=0.0)              # [BK, BN]
                u = tl.load(u_rows[None, :] + kk[:, None] * s_u_h, mask=mw, other=0.0)
                acc_g = mma(xa, g, acc_g, DOT_F32)
                acc_u = mma(xa, u, acc_u, DOT_F32)
        g = rnd(acc_g, DT)                            # F.linear output in x.dtype
        u = rnd(acc_u, DT)
        a = rnd(rnd(g * tl.sigmoid(g), DT) * u, DT)   # silu in x.dtype, then the product
        tl.store(act + rows[:, None] * N + cols[None, :], to_dt(a, DT), mask=mr[:, None] & mc[None, :])


@triton.jit
def _grouped_down_kernel(act, src, wts, blk_e, blk_row, blk_end, wd, out,
                         s_d_e, s_d_n, s_d_k,
                         K: tl.constexpr, H: tl.constexpr, HAS_W: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr,
                         DOT_F32: tl.constexpr):
    """out[src[r], n-tile] = rnd(act[r] . wd[e, n-tile]) (* wts[src[r]], rounded) for block b's rows,
    rounded to out's dtype (x.dtype, or fp32 for fp32_out). SWAP: the transposed product."""
    b = tl.program_id(0)
    nb = tl.program_id(1)
    DT: tl.constexpr = out.dtype.element_ty          # the rounding dtype: x.dtype, or fp32 (fp32_out)
    r0 = tl.load(blk_row + b)
    r1 = tl.load(blk_end + b)
    if r0 < r1:
        e = tl.load(blk_e + b)                        # int64
        rows = r0 + tl.arange(0, BM)
        mr = rows < r1
        cols = nb * BN + tl.arange(0, BN)             # [BN] output channels (H)
        mc = cols < H
        d_rows = wd + e * s_d_e + cols * s_d_n                           # [BN]
        if SWAP:   # acc^T [BN, BM] = down tile [BN, BK] @ act^T [BK, BM]
            acc = tl.zeros([BN, BM], tl.float32)
            for k0 in range(0, K, BK):
                kk = k0 + tl.arange(0, BK)
                mk = kk < K
                m_at = mk[:, None] & mr[None, :]
                at = tl.load(act + rows[None, :] * K + kk[:, None], mask=m_at, other=0.0)           # [BK, BM]
                m_d = mc[:, None] & mk[None, :]
                d = tl.load(d_rows[:, None] + kk[None, :] * s_d_k, mask=m_d, other=0.0)             # [BN, BK]
                acc = mma(d, at, acc, DOT_F32)
            acc = tl.trans(acc)                       # [BM, BN]
        else:
            acc = tl.zeros([BM, BN], tl.float32)
            for k0 in range(0, K, BK):
                kk = k0 + tl.arange(0, BK)
                mk = kk < K
                m_a = mr[:, None] & mk[None, :]
                a = tl.load(act + rows[:, None] * K + kk[None, :], mask=m_a, other=0.0)             # [BM, BK]
                m_d = mk[:, None] & mc[None, :]
                d = tl.load(d_rows[None, :] + kk[:, None] * s_d_k, mask=m_d, other=0.0)             # [BK, BN]
                acc = mma(a, d, acc, DOT_F32)
        y = rnd(acc, DT)                              # F.linear(act, down[e]) in x.dtype
        dst = tl.load(src + rows, mask=mr, other=0)  # [BM] pair (routed) or token (shared)
        if HAS_W:
            y = rnd(y * tl.load(wts + dst, mask=mr, other=0.0).to(tl.float32)[:, None], DT)      # y_e * w_e
        tl.store(out + dst[:, None] * H + cols[None, :], to_dt(y, DT), mask=mr[:, None] & mc[None, :])


@triton.jit
def _combine_kernel(logits, y_pair, y_sh, out, s_l_t, s_o_t, s_o_h,
                    H: tl.constexpr, E: tl.constexpr, TOPK: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    DT: tl.constexpr = logits.dtype.element_ty      # x.dtype
    RT: tl.constexpr = out.dtype.element_ty         # x.dtype, or fp32 (fp32_out: no rounding after the GEMMs)
    cols = hb * BH + tl.arange(0, BH)
    mc = cols < H
    # routed: the token's k pair rows, ascending expert id, rounded after each add (0 + y is exact)
    routed = tl.load(y_pair + (t * TOPK) * H + cols, mask=mc, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOPK):
        routed = rnd(routed + tl.load(y_pair + (t * TOPK + j) * H + cols, mask=mc, other=0.0).to(tl.float32), RT)
    gate = rnd(tl.sigmoid(tl.load(logits + t * s_l_t + E).to(tl.float32)), DT)    # sigmoid(shared gate logit)
    shared = tl.load(y_sh + t * H + cols, mask=mc, other=0.0).to(tl.float32)
    res = routed + rnd(gate * shared, RT)
    tl.store(out + t * s_o_t + cols * s_o_h, to_dt(res, RT), mask=mc)


# Tile caps. BM (rows per block of the pair table) adapts to the rows per expert (P / E), from the rows class's
# BM_MIN (16 unless set below) to 64; BN x BK weight tiles from TILES.
BM_MAX, BN_MAX, BK_MAX = 64, 64, 64
BH_COMBINE = 256

# Rows classes: the mean rows per expert r = cdiv(P, E), static (T, k and E are); the shared expert's r is T. At the
# 35B shape (E 256, top-8) decode batches of 64 / 128 tokens give the routed pairs r = 2 / 4 ("few"), prefill chunks
# of 512 / 2048 tokens 16 / 64; the shared expert is "many" from 33 tokens on.
ROW_CLASSES = ((4, "few"), (32, "mid"))           # r <= 4: "few"; r <= 32: "mid"; above: "many"

# Grouped-kernel tiles (BN cap, BK cap, warps, stages, SWAP) by kernel ("swiglu", "down"); a (kernel, rows class)
# entry overrides its kernel's for that class. SWAP: the transposed product (module docstring). BM_MIN: a class's
# smallest block rows, default 16; a class run swapped may take 8 (8 rows are exactly mma.sync m16n8k16's N; Triton
# 3.6 emits wgmma from N = 16). The defaults are the plain tiles these kernels had before the swap form. "mid"
# (a 512-token chunk at the 35B shape: 16 rows an expert) runs the SwiGLU swapped: 646.8 us a call against 682.7 for
# the plain tile, on an H100 (`python -m onegraph.scripts.tune_moe --grouped swap --batches 512`,
# benchmarks/h100_moe_grouped_t512.json; no swapped down tile beat the plain one there). `tune_moe --grouped` sweeps
# both forms (prefill sizes, decode batch 64), scripts/bench_moe_fp8.py the FP8 kernels' table at decode batch 64.
TILES = {"swiglu": (BN_MAX, BK_MAX, 4, 3, False), "down": (BN_MAX, BK_MAX, 4, 3, False),
         ("swiglu", "mid"): (32, 128, 2, 4, True)}
BM_MIN: dict[str, int] = {}


def _pow2(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def _tile(n: int, cap: int, floor: int = 16) -> int:
    return min(cap, max(floor, next_pow2(n)))


def row_class(P: int, E: int) -> str:
    """The rows class of P routed pairs over E experts (ROW_CLASSES)."""
    r = triton.cdiv(P, E)
    return next((name for top, name in ROW_CLASSES if r <= top), "many")


def plan(tiles: dict, bm_min: dict, P: int, E: int):
    """(BM floor of the routed table, swiglu tile, down tile) for P pairs over E experts, from a module's TILES and
    BM_MIN (this module's, or fused_moe_fp8_prefill's); a malformed entry raises ValueError."""
    cls = row_class(P, E)
    sw, dn = (tiles.get((name, cls), tiles[name]) for name in ("swiglu", "down"))
    for name, t in (("swiglu", sw), ("down", dn)):
        if not (isinstance(t, tuple) and len(t) == 5 and all(_pow2(c) and c >= 16 for c in t[:2])
                and _pow2(t[2]) and isinstance(t[3], int) and t[3] >= 1 and isinstance(t[4], bool)):
            raise ValueError(f"fused_moe prefill: the {name} tile of rows class {cls!r} must be (BN, BK, warps, "
                             f"stages, swap), BN and BK powers of two >= 16, warps a power of two; got {t!r}")
    bm = bm_min.get(cls, 16)
    if not (_pow2(bm) and 8 <= bm <= BM_MAX):      # below 8 rows no MMA shape gains (mma.sync's N is 8)
        raise ValueError(f"fused_moe prefill: BM_MIN of rows class {cls!r} must be a power of two in [8, {BM_MAX}], "
                         f"got {bm!r}")
    return bm, sw, dn


@triton.jit
def _pair_table_kernel(idx, w, w_pair, src, blk_e, blk_row, blk_end, T: tl.constexpr, NB: tl.constexpr,
                       E: tl.constexpr, BE: tl.constexpr, K: tl.constexpr, BKK: tl.constexpr, BT: tl.constexpr,
                       BM: tl.constexpr, BB: tl.constexpr):
    """Program e (of E): expert e's part of the pair table (routed_table). Each program reads all of idx
    [T, k] twice (a few KB, from L2): once for every expert's pair count (a histogram, so it knows where
    its rows and blocks start), once for its own pairs in token order."""
    e = tl.program_id(0)
    ks = tl.arange(0, BKK)
    mk = ks < K
    es = tl.arange(0, BE)
    counts = tl.zeros([BE], tl.int32)
    for t0 in range(0, T, BT):
        ts = t0 + tl.arange(0, BT)
        m2 = (ts < T)[:, None] & mk[None, :]
        ids = tl.load(idx + ts[:, None] * K + ks[None, :], mask=m2, other=0).to(tl.int32)        # [BT, BKK]
        counts += tl.histogram(tl.reshape(ids, [BT * BKK]), BE)
        counts -= tl.where(es == 0, BT * BKK - tl.sum(tl.sum(m2.to(tl.int32), axis=1), axis=0), 0)  # masked: 0s
    seg_end = tl.cumsum(counts, 0)                   # [BE] rows of experts <= e, in the sorted order
    tiles = (counts + BM - 1) // BM
    tile_end = tl.cumsum(tiles, 0)
    me = es == e
    cnt = tl.sum(tl.where(me, counts, 0), axis=0)
    row0 = tl.sum(tl.where(me, seg_end, 0), axis=0) - cnt
    ntile = tl.sum(tl.where(me, tiles, 0), axis=0)
    tile0 = tl.sum(tl.where(me, tile_end, 0), axis=0) - ntile
    # blocks [tile0, tile0 + ntile) are e's; the last expert also writes the unused ones after them (expert
    # E, no rows), with the row the aten table gave them: its own formula continued
    last = e == E - 1
    b_end = tl.where(last, NB, tile0 + ntile)
    for b0 in range(0, NB, BB):                      # every block, masked to this program's (NB is small)
        bs = b0 + tl.arange(0, BB)
        mb = (bs >= tile0) & (bs < b_end)
        used = bs < tile0 + ntile
        tl.store(blk_e + bs, tl.where(used, e, E).to(tl.int64), mask=mb)
        tl.store(blk_row + bs, (row0 + (bs - tile0) * BM).to(tl.int64), mask=mb)
        tl.store(blk_end + bs, tl.where(used, row0 + cnt, 0).to(tl.int64), mask=mb)
    # e's pairs in token order: a token picks e at most once; its pair is p = t*k + j with j the number of
    # the token's experts below e (its experts ascending)
    run = 0
    for t0 in range(0, T, BT):
        ts = t0 + tl.arange(0, BT)
        mt = ts < T
        m2 = mt[:, None] & mk[None, :]
        ids = tl.load(idx + ts[:, None] * K + ks[None, :], mask=m2, other=E)                      # [BT, BKK]
        sel = ids == e
        has = tl.sum(sel.to(tl.int32), axis=1)                                                     # [BT] 0 | 1
        j = tl.sum((ids < e).to(tl.int32), axis=1)
        wv = tl.load(w + ts[:, None] * K + ks[None, :], mask=m2, other=0.0).to(tl.float32)
        wt = tl.sum(tl.where(sel, wv, 0.0), axis=1)  # the one selected weight, exactly
        p = ts * K + j
        rank = run + tl.cumsum(has, 0) - has
        tl.store(src + row0 + rank, p.to(tl.int64), mask=has > 0)
        tl.store(w_pair + p, wt.to(w_pair.dtype.element_ty), mask=has > 0)
        run += tl.sum(has, axis=0)


# _pair_table_kernel's token tile and warps: each of its E programs scans all T * k ids twice, BT tokens a step, so
# fewer, wider steps pay. H100, µs a call at T = 512 / 2048 / 8192 (`python -m onegraph.scripts.tune_moe --pair-table
# --batches 512,2048,8192`, benchmarks/h100_pair_table.json): (64, 4) 14.4 / 52.0 / 213.1, (1024, 8) 9.1 / 24.6 / 107.2
PAIR_BT, PAIR_WARPS = 1024, 8


def routed_table(idx: torch.Tensor, w: torch.Tensor, E: int, bm_min: int = 16, bt: int | None = None,
                 warps: int | None = None):
    """The routed pairs' grouping, one launch (_pair_table_kernel, grid (E,)). idx, w [T, k] (route: a token's
    k distinct experts and their weights) -> (w_pair [P], table): pair p = t*k + j is token t's j-th smallest
    expert (the order in which the reference adds the experts up), w_pair[p] its weight; table = (src [P]:
    sorted row -> pair, by expert then token; per block b < NB = cdiv(P, BM) + min(E, P) its expert blk_e
    [NB] (E: unused), rows [blk_row, blk_end) of src (unused: end 0), BM). What an aten per-token sort, a
    stable argsort, a scatter_add, cumsums and a searchsorted made before (tests keep that as the reference):
    about 25 us a layer at T = 64 in Inductor's sort kernels. BM: the rows per expert rounded up to a power of
    two, in [bm_min, BM_MAX]."""
    T, k = idx.shape
    P = T * k
    BM = _tile(triton.cdiv(P, E), BM_MAX, bm_min)
    NB = triton.cdiv(P, BM) + min(E, P)
    idx, w = idx.contiguous(), w.contiguous()
    w_pair = torch.empty(P, dtype=w.dtype, device=w.device)
    src = torch.empty(P, dtype=torch.int64, device=w.device)
    blk_e, blk_row, blk_end = (torch.empty(NB, dtype=torch.int64, device=w.device) for _ in range(3))
    launch(_pair_table_kernel, (E,), idx, w, w_pair, src, blk_e, blk_row, blk_end, T=T, NB=NB,
           E=E, BE=next_pow2(E), K=k, BKK=next_pow2(k), BT=bt or max(16, min(PAIR_BT, next_pow2(T))), BM=BM, BB=64,
           num_warps=warps or PAIR_WARPS)
    return w_pair, (src, blk_e, blk_row, blk_end, BM)


def dense_table(T: int, BM_cap: int, device) -> tuple:
    """The shared expert's grouping: all T tokens one group, in order (the table routed_table's layout gives
    for T pairs of one expert)."""
    BM = _tile(T, BM_cap)
    nb = triton.cdiv(T, BM)
    b = torch.arange(nb + 1, dtype=torch.int64, device=device)
    return (torch.arange(T, dtype=torch.int64, device=device), (b >= nb).to(torch.int64), b * BM,
            torch.where(b < nb, T, 0), BM)


def _strides3(t: torch.Tensor):
    """(expert, row, col) strides; a 2-D (shared-expert) weight is one expert: expert stride 0."""
    return t.stride() if t.dim() == 3 else (0, *t.stride())


def _grouped_swiglu(x, table, wg, wu, u0, N, topk, tile):
    """-> act [R, N] in sorted order for the rows of `table` (routed_table's; pair p reads x[p // topk])."""
    src, blk_e, blk_row, blk_end, BM = table
    R, H = src.shape[0], x.shape[1]
    act = torch.empty((R, N), dtype=x.dtype, device=x.device)
    bn, bk, warps, stages, swap = tile
    BN, BK = _tile(N, bn), _tile(H, bk)
    launch(_grouped_swiglu_kernel, (blk_e.shape[0], triton.cdiv(N, BN)),
           x, src, blk_e, blk_row, blk_end, wg, wu, act,
           *x.stride(), *_strides3(wg), *_strides3(wu), u0,
           H=H, N=N, TOPK=topk, BM=BM, BN=BN, BK=BK, SWAP=swap, DOT_F32=INTERPRETED, num_warps=warps,
           num_stages=stages)
    return act


def _grouped_down(act, table, wd, wts, out, tile):
    src, *blocks, BM = table
    K, H = act.shape[1], out.shape[1]
    bn, bk, warps, stages, swap = tile
    BN, BK = _tile(H, bn), _tile(K, bk)
    launch(_grouped_down_kernel, (blocks[0].shape[0], triton.cdiv(H, BN)),
           act, src, wts if wts is not None else act, *blocks, wd, out, *_strides3(wd),
           K=K, H=H, HAS_W=wts is not None, BM=BM, BN=BN, BK=BK, SWAP=swap, DOT_F32=INTERPRETED,
           num_warps=warps, num_stages=stages)


def fused_moe_prefill(x, w, idx, gate_up, down, shared_gate, shared_up, shared_down, logits,
                      out_dtype=None):
    """x [T, H], w [T, k] x.dtype, idx [T, k] int64 (from `route`), logits [T, E + 1] (fused_moe's: the last
    column is the shared expert's gate logit) -> y [T, H] in out_dtype (None: x.dtype;
    fp32: fused_moe's fp32_out)."""
    out_dtype = out_dtype or x.dtype
    T, H = x.shape
    k = idx.shape[1]
    E, I2, _ = gate_up.shape
    I, Is = I2 // 2, shared_gate.shape[0]
    P = T * k
    bm_min, sw, dn = plan(TILES, BM_MIN, P, E)                       # static: from (P, E)
    w_pair, table = routed_table(idx, w, E, bm_min)                  # [P] weight of pair p = t*k + j

    # routed experts: act [P, I] (sorted rows) -> y_pair [P, H] (pair order), each rnd(rnd(y) * w)
    act = _grouped_swiglu(x, table, gate_up, gate_up, u0=I, N=I, topk=k, tile=sw)
    y_pair = torch.empty((P, H), dtype=out_dtype, device=x.device)
    _grouped_down(act, table, down, w_pair, y_pair, dn)

    # shared expert: one group holding every token -> y_sh [T, H], on the tiles of its own rows class (T rows of
    # one expert: at a 64-token decode batch "many", where the routed pairs are "few")
    _, sw, dn = plan(TILES, BM_MIN, T, 1)
    shared = dense_table(T, BM_MAX, x.device)
    act_sh = _grouped_swiglu(x, shared, shared_gate, shared_up, u0=0, N=Is, topk=1, tile=sw)
    y_sh = torch.empty((T, H), dtype=out_dtype, device=x.device)
    _grouped_down(act_sh, shared, shared_down, None, y_sh, dn)

    y = torch.empty((T, H), dtype=out_dtype, device=x.device)
    BH = min(BH_COMBINE, next_pow2(H))
    launch(_combine_kernel, (T, triton.cdiv(H, BH)),
           logits, y_pair, y_sh, y, logits.stride(0), *y.stride(), H=H, E=E, TOPK=k, BH=BH, num_warps=4)
    return y
