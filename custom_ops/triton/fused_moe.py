"""Triton lowering of fused_moe (contract: custom_ops/fused_moe.py), built for decode (T = 1..64).

Input logits [T, E + 1] (x.dtype): the router logits and the shared expert's gate logit, projected by the
caller (at decode the GEMV that also applies the post-attention norm, custom_ops/triton/linear.py).
At T = 1 routing needs no launch of its own (3.6 us per layer at the 35B bs1 step on the H200, where aten's
topk alone had taken 0.39 of a 4.26 ms step): every routed program of kernel 1 finds its own expert from the
E logits (`_route_nth`: a 512-byte L2 read and j + 1 max-scans for rank j), and the token's shared-expert
program (which needs no routing to start) writes the whole routing (`_route_row`: fp32 softmax, top-k,
renormalise) after its own work, for kernel 2 to load. From T = ROUTE_FIRST_FROM on, that repeated prefix
costs more than a launch, and `_route_kernel` routes every token first (route_first below). The prefill
path always routes with `_route_kernel`.
Ties matter: the 35B random router's 8th and 9th bf16 logits are equal in 8 % of layer-tokens (H200,
8 bs8 eager steps). CUDA torch.topk keeps the lowest indices among values equal to the k-th (H200:
2000 of 2000 tied rows), and so does `_route_row` (it takes the largest logit, lowest index first, k
times); softmax is monotone, so selecting on logits is selecting on probabilities. Only the order of
equal values within the k can differ from torch's (its bitonic sort is not stable); kernel 2 sums the
k bf16 products in fp32, which is exact, and in any order, unless their exponents span over 16 bits.
Kernel 1 (SwiGLU), grid (T*k + T, cdiv(max(I, Is), BI)): program p < T*k takes pair p = (t, j) and
computes act[p, tile] = silu(x[t] . gate_up[idx, tile]) * (x[t] . gate_up[idx, I + tile]) reading
only that expert's rows; programs p >= T*k do the shared expert of token p - T*k.
Kernel 2 (down + combine), grid (T, cdiv(H, BH)): y[t, tile] = sum_j w[t,j] down[idx[t,j], tile] . act
+ sigmoid(logits[t, E]) shared_down[tile] . act_shared; the k experts' tiles are loaded side by side
([k, BH, BI]) so a program keeps k loads in flight instead of walking the experts one by one.
Programs are launched pairs-fastest (kernel 1) and tokens-fastest (kernel 2), so the programs that
read one expert's tile run together and share it through L2: DRAM traffic ~ distinct experts.
Numerics: fp32 accumulation; the reference's roundings to x.dtype (gate_up product, silu, act,
down product, its scaling by w, the routed sum, the shared gate and product) are reproduced. With
fp32_out, y is fp32 and the roundings after the down products are to fp32 (none), as the reference's.
Prefill (T*k > E, the reference's per-expert loop branch) dispatches to fused_moe_prefill.py: a
grouped GEMM (tensor cores) over the pairs sorted by expert, with that branch's roundings.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..fused_moe import _validate
from . import fused_moe_prefill
from ._common import launch, next_pow2, rnd, to_dt


@triton.jit
def _route_keys(logits, t, s_l_t, E: tl.constexpr, BE: tl.constexpr):
    """Token t's logits [E] (x.dtype) -> keys [BE] whose order is (logit, then the lower index): the logit's bits
    made order-preserving as a signed integer (negative floats have their magnitude bits flipped; a NaN sorts above
    +inf, so it is picked and stays in bounds while its weights carry the NaN), shifted over 16 index bits holding
    BE - 1 - e. One max over keys is one top-1 step: a single block reduction where comparing values and then
    looking for the lowest index among the largest took two.
    16-bit logits (bf16, fp16: the model's) make int32 keys from their own 16 bits; others int64 keys from the
    fp32 bits. int32 keys halve the reductions' shuffles and compare in one instruction (a SwiGLU program's
    routing prefix is j + 1 such reductions before its weight loads can issue).
    Lanes >= E get the smallest key."""
    offs = tl.arange(0, BE)
    m = offs < E
    if logits.dtype.element_ty.primitive_bitwidth == 16:
        b16 = tl.load(logits + t * s_l_t + offs, mask=m, other=0.0).to(tl.int16, bitcast=True)
        ordered = tl.where(b16 < 0, b16 ^ 0x7FFF, b16).to(tl.int32)
        keys = (ordered << 16) | (BE - 1 - offs)
    else:
        b = tl.load(logits + t * s_l_t + offs, mask=m, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
        ordered = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
        keys = (ordered.to(tl.int64) << 16) | (BE - 1 - offs).to(tl.int64)
    return tl.where(m, keys, _key_min(keys))


@triton.jit
def _key_min(keys):
    """The smallest key of keys' type: below every real key (masked lanes, maxima already taken)."""
    if keys.dtype == tl.int32:
        return -2147483647 - 1
    else:
        return -9223372036854775807 - 1


@triton.jit
def _key_expert(key, BE: tl.constexpr):
    return (BE - 1 - (key & 0xFFFF)).to(tl.int64)


@triton.jit
def _key_logit(key, LDT: tl.constexpr):
    """The fp32 value of the logit (of dtype LDT) a key was made from (exactly)."""
    if key.dtype == tl.int32:
        hi = key >> 16
        return tl.where(hi < 0, hi ^ 0x7FFF, hi).to(tl.int16).to(LDT, bitcast=True).to(tl.float32)
    else:
        hi = (key >> 16).to(tl.int32)
        return tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi).to(tl.float32, bitcast=True)


@triton.jit
def _route_row(logits, t, s_l_t, E: tl.constexpr, BE: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Token t's logits [E] (x.dtype) -> (w [BK] fp32: the top-K softmax probabilities / their sum,
    idx [BK] int64: their experts, by logit descending, lowest index first among equal logits; lanes
    >= K are 0). K + 1 block reductions: K maxima over the keys and the softmax's sum (its max is the
    first maximum's logit)."""
    keys = _route_keys(logits, t, s_l_t, E, BE)
    offs = tl.arange(0, BE)
    lg = tl.load(logits + t * s_l_t + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    ks = tl.arange(0, BK)
    top_l = tl.zeros([BK], tl.float32)
    top_i = tl.zeros([BK], tl.int64)
    for j in tl.static_range(K):
        best = tl.max(keys, axis=0)
        top_l = tl.where(ks == j, _key_logit(best, logits.dtype.element_ty), top_l)
        top_i = tl.where(ks == j, _key_expert(best, BE), top_i)
        keys = tl.where(keys == best, _key_min(keys), keys)                       # keys are distinct
    mx = tl.max(tl.where(ks == 0, top_l, float("-inf")), axis=0)                # the largest logit
    denom = tl.sum(tl.where(offs < E, tl.exp(lg - mx), 0.0), axis=0)            # the reference's fp32 softmax
    top_p = tl.where(ks < K, tl.exp(top_l - mx) / denom, 0.0)
    return top_p / tl.sum(top_p, axis=0), top_i


@triton.jit
def _route_nth(logits, t, s_l_t, j, E: tl.constexpr, BE: tl.constexpr, K: tl.constexpr):
    """The expert (int64) of token t's j-th largest logit (_route_row's idx[j], j < K): j + 1 block
    reductions, so the SwiGLU program of pair (t, j) waits for no more routing than its own expert needs."""
    keys = _route_keys(logits, t, s_l_t, E, BE)
    best = tl.max(keys, axis=0)
    for n in tl.static_range(1, K):
        if n <= j:                                   # uniform over the program: a branch, not a mask
            keys = tl.where(keys == best, _key_min(keys), keys)
            best = tl.max(keys, axis=0)
    return _key_expert(best, BE)


@triton.jit
def _route_kernel(logits, w, idx, s_l_t, E: tl.constexpr, BE: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Token t: w[t, :K] (x.dtype), idx[t, :K] = _route_row (the prefill path's routing)."""
    t = tl.program_id(0)
    top_w, top_i = _route_row(logits, t, s_l_t, E, BE, K, BK)
    ks = tl.arange(0, BK)
    mk = ks < K
    tl.store(w + t * K + ks, to_dt(top_w, w.dtype.element_ty), mask=mk)
    tl.store(idx + t * K + ks, top_i, mask=mk)


def route_triton(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's `route` of logits [T, E] (a strided view is read in place) -> (w [T, k] logits.dtype,
    idx [T, k] int64), by _route_kernel."""
    T, E = logits.shape
    w = torch.empty((T, top_k), dtype=logits.dtype, device=logits.device)
    idx = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    launch(_route_kernel, (T,), logits, w, idx, logits.stride(0), E=E, BE=next_pow2(E), K=top_k,
           BK=next_pow2(top_k), num_warps=2)
    return w, idx


@triton.jit
def _swiglu_rows(x_row, sx_h, wg, sg_r, sg_h, wu, su_r, su_h, rows, mrow, H: tl.constexpr, DT: tl.constexpr,
                 BI: tl.constexpr, BH: tl.constexpr):
    """silu(x . wg[rows]) * (x . wu[rows]) -> [BI] fp32, rounded where the bf16 reference rounds."""
    acc_g = tl.zeros([BI, BH], tl.float32)
    acc_u = tl.zeros([BI, BH], tl.float32)
    for h0 in range(0, H, BH):
        offs_h = h0 + tl.arange(0, BH)
        mh = offs_h < H
        xv = tl.load(x_row + offs_h * sx_h, mask=mh, other=0.0).to(tl.float32)
        m2 = mrow[:, None] & mh[None, :]
        gw = tl.load(wg + rows[:, None] * sg_r + offs_h[None, :] * sg_h, mask=m2, other=0.0)
        uw = tl.load(wu + rows[:, None] * su_r + offs_h[None, :] * su_h, mask=m2, other=0.0)
        acc_g += gw.to(tl.float32) * xv[None, :]
        acc_u += uw.to(tl.float32) * xv[None, :]
    g = rnd(tl.sum(acc_g, axis=1), DT)
    u = rnd(tl.sum(acc_u, axis=1), DT)
    return rnd(rnd(g * tl.sigmoid(g), DT) * u, DT)


@triton.jit
def _moe_swiglu_kernel(x, logits, gate_up, sh_gate, sh_up, act, act_sh, route_w, route_i,
                       s_x_t, s_x_h, s_l_t, s_gu_e, s_gu_r, s_gu_h, s_sg_r, s_sg_h, s_su_r, s_su_h,
                       P, H: tl.constexpr, I: tl.constexpr, Is: tl.constexpr, E: tl.constexpr, BE: tl.constexpr,
                       TOPK: tl.constexpr, BKK: tl.constexpr, BI: tl.constexpr, BH: tl.constexpr,
                       ROUTED_IN: tl.constexpr):
    """ROUTED_IN (route_first below): route_i / route_w hold the routing already, so a routed program loads its
    expert instead of finding it and the shared programs do not write it."""
    pid = tl.program_id(0)
    it = tl.program_id(1)
    DT: tl.constexpr = x.dtype.element_ty
    rows = it * BI + tl.arange(0, BI)
    if pid < P:                                   # routed pair p = t*k + j
        t = pid // TOPK
        if ROUTED_IN:
            e = tl.load(route_i + pid)
        else:
            e = _route_nth(logits, t, s_l_t, pid - t * TOPK, E, BE, TOPK)  # each program routes its pair itself
        mrow = rows < I
        w_e = gate_up + e * s_gu_e
        a = _swiglu_rows(x + t * s_x_t, s_x_h, w_e, s_gu_r, s_gu_h, w_e + I * s_gu_r, s_gu_r, s_gu_h,
                         rows, mrow, H, DT, BI, BH)
        tl.store(act + pid * I + rows, to_dt(a, DT), mask=mrow)
    else:                                         # shared expert of token t
        t = pid - P
        mrow = rows < Is
        a = _swiglu_rows(x + t * s_x_t, s_x_h, sh_gate, s_sg_r, s_sg_h, sh_up, s_su_r, s_su_h,
                         rows, mrow, H, DT, BI, BH)
        tl.store(act_sh + t * Is + rows, to_dt(a, DT), mask=mrow)
        if it == 0 and not ROUTED_IN:
            # the token's routing for the down kernel, made after this program's own loads: the shared-expert
            # programs need no routing and start first, so this costs no routed program any latency
            top_w, top_i = _route_row(logits, t, s_l_t, E, BE, TOPK, BKK)
            ks = tl.arange(0, BKK)
            tl.store(route_w + t * TOPK + ks, top_w, mask=ks < TOPK)
            tl.store(route_i + t * TOPK + ks, top_i, mask=ks < TOPK)


@triton.jit
def _moe_down_kernel(logits, down, sh_down, act, act_sh, route_w, route_i, y,
                     s_l_t, s_d_e, s_d_h, s_d_i, s_sd_h, s_sd_i, s_y_t, s_y_h,
                     H: tl.constexpr, I: tl.constexpr, Is: tl.constexpr, E: tl.constexpr, BE: tl.constexpr,
                     TOPK: tl.constexpr, BKK: tl.constexpr, BH: tl.constexpr, BI: tl.constexpr):
    t = tl.program_id(0)
    ih = tl.program_id(1)
    DT: tl.constexpr = logits.dtype.element_ty      # x.dtype
    RT: tl.constexpr = y.dtype.element_ty           # where the down products round: x.dtype, or fp32 (fp32_out)
    rows = ih * BH + tl.arange(0, BH)
    mrow = rows < H

    # the shared expert first: its loads do not wait for the routing's
    acc = tl.zeros([BH, BI], tl.float32)
    for i0 in range(0, Is, BI):
        offs_i = i0 + tl.arange(0, BI)
        mi = offs_i < Is
        av = tl.load(act_sh + t * Is + offs_i, mask=mi, other=0.0).to(tl.float32)
        dw = tl.load(sh_down + rows[:, None] * s_sd_h + offs_i[None, :] * s_sd_i,
                     mask=mrow[:, None] & mi[None, :], other=0.0)
        acc += dw.to(tl.float32) * av[None, :]
    shared = rnd(tl.sum(acc, axis=1), RT)

    # the k experts side by side: one [BKK, BH, BI] tile of down per step keeps k times the bytes in flight
    ks = tl.arange(0, BKK)
    mk = ks < TOPK
    top_w = tl.load(route_w + t * TOPK + ks, mask=mk, other=0.0)       # [BKK] fp32: kernel 1's routing
    top_i = tl.load(route_i + t * TOPK + ks, mask=mk, other=0)          # [BKK] int64 (lanes >= k: 0)
    wt = rnd(top_w, DT)                              # the reference's weights are cast to x.dtype
    acc = tl.zeros([BKK, BH, BI], tl.float32)
    for i0 in range(0, I, BI):
        offs_i = i0 + tl.arange(0, BI)
        mi = offs_i < I
        av = tl.load(act + (t * TOPK + ks)[:, None] * I + offs_i[None, :], mask=mk[:, None] & mi[None, :],
                     other=0.0).to(tl.float32)                                           # [BKK, BI]
        dw = tl.load(down + top_i[:, None, None] * s_d_e + rows[None, :, None] * s_d_h + offs_i[None, None, :] * s_d_i,
                     mask=mk[:, None, None] & mrow[None, :, None] & mi[None, None, :], other=0.0)
        acc += dw.to(tl.float32) * av[:, None, :]
    contrib = rnd(rnd(tl.sum(acc, axis=2), RT) * wt[:, None], RT)              # (y * w) in RT, [BKK, BH]
    # .sum(1) in RT: k values already rounded to RT, added in fp32 (exact for bf16 unless their
    # exponents span more than 16 bits, so the order, a tree here, does not matter)
    routed = rnd(tl.sum(contrib, axis=0), RT)

    gate = rnd(tl.sigmoid(tl.load(logits + t * s_l_t + E).to(tl.float32)), DT)     # sigmoid(shared gate logit)
    res = routed + rnd(gate * shared, RT)
    tl.store(y + t * s_y_t + rows * s_y_h, to_dt(res, RT), mask=mrow)


# Tiles ((BI, BH, warps) of kernel 1, (BH, BI, warps) of kernel 2), the same at every decode T: every program
# loads its rows in as few tiles as fit its registers, so all of a program's bytes are in flight at once behind one
# latency (a [BI, BH] loop waits one DRAM latency per step: these loads do not feed a tl.dot, and the compiler does
# not pipeline them). H200, each call on its own weights and router logits, 12 calls per replayed CUDA graph
# (benchmarks/h200_moe_bs1_tiles.json): SwiGLU (2, 2048, 2) 12.4 us where (4, 256, 4) took 15.5 (37.7 MB: 71 % of
# copy bandwidth against 57 %; the in-kernel routing is off its critical path: routed in, the same tile takes 11.7);
# down (1, 256, 4) 7.4 us against 8.3 (18.9 MB). Above one token they beat the looped (4, 256, 4) / (4, 128, 4)
# tiles the decode buckets had (H200, the whole op, 2 weight copies alternated, routed first, `python -m
# onegraph.scripts.bench_batch_invariant`, benchmarks/h200_batch_invariant_ops.json): T = 2 / 4 / 8 / 16 / 32
# 33.2 / 55.2 / 94.7 / 165.4 / 301.6 us against 40.5 / 64.4 / 105.4 / 183.9 / 327.3. One plan at every T also makes a
# token's bits the same in every decode bucket up to E / k tokens (docs/design.md, "Batch invariance").
SWIGLU_ONE = (2, 2048, 2)
DOWN_ONE = (1, 256, 4)
# Who finds a pair's expert. In-kernel, each of the SwiGLU kernel's cdiv(I, BI) programs of a routed pair repeats
# its pair's j + 1 max-reductions over the E router keys before its first weight load, so that prefix grows with
# the batch; routing first is one _route_kernel program per token (one more launch) and the SwiGLU programs load
# their expert's index. H200, one 35B layer, each call on its own weights (`python -m onegraph.scripts.tune_moe
# --routing-prefix`, benchmarks/h200_moe_routing_prefix.json): the whole op at B = 1 23.5 us in-kernel vs 25.7
# routed first (fp32 logits through an extra conversion then), at B = 8 122.8 vs 107.1 us.
ROUTE_FIRST_FROM = 2
# Benchmarks only (scripts/tune_moe.py, like the tiles above): True / False forces either way. Never set in a model.
PREROUTED: bool | None = None


def decode_tiles() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """((BI, BH, warps) of the SwiGLU kernel, (BH, BI, warps) of the down kernel) for a decode call, whatever
    its token count (the tiles' comment)."""
    return SWIGLU_ONE, DOWN_ONE


def route_first(T: int) -> bool:
    """Does a decode call over T tokens route in _route_kernel before the SwiGLU kernel (static at trace time)?"""
    return T >= ROUTE_FIRST_FROM if PREROUTED is None else PREROUTED


def route_buffers(logits: torch.Tensor, T: int, E: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The decode kernels' routing, kernel 1 -> kernel 2: (w [T, k] fp32, idx [T, k] int64, filled). Routed
    first (route_first(T)), _route_kernel fills them now from logits[:, :E] read in place; otherwise they are
    empty and the SwiGLU kernel's shared-expert programs write them."""
    w = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    idx = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    first = route_first(T)
    if first:
        launch(_route_kernel, (T,), logits, w, idx, logits.stride(0), E=E, BE=next_pow2(E), K=top_k,
               BK=next_pow2(top_k), num_warps=2)
    return w, idx, first


@triton_op("onegraph::fused_moe_triton", mutates_args=())
def fused_moe_triton(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                     shared_gate: torch.Tensor, shared_up: torch.Tensor, shared_down: torch.Tensor,
                     top_k: int, fp32_out: bool = False) -> torch.Tensor:
    _validate(x, logits, gate_up, down, shared_gate, shared_up, shared_down, top_k)
    out_dtype = torch.float32 if fp32_out else x.dtype
    T, E = x.shape[0], gate_up.shape[0]
    if T * top_k > E:     # static at trace time: the reference's prefill branch, as a grouped GEMM
        w, idx = route_triton(logits[:, :E], top_k)                          # [T, k] x.dtype, int64
        return fused_moe_prefill.fused_moe_prefill(x, w, idx, gate_up, down, shared_gate, shared_up,
                                                   shared_down, logits, out_dtype)
    return decode(x, logits, gate_up, down, shared_gate, shared_up, shared_down, top_k, out_dtype)


def decode(x, logits, gate_up, down, shared_gate, shared_up, shared_down, top_k: int,
           out_dtype: torch.dtype) -> torch.Tensor:
    """The two decode kernels (module docstring) over T = x.shape[0] tokens, with decode_tiles() and routed as
    route_first(T) says. A pair's SwiGLU program and a token's down program compute from that pair's / token's
    inputs only, and the tiles do not depend on T, so a token's output does not depend on the others in the
    launch (fused_moe_invariant.py runs these kernels at every T)."""
    T, H = x.shape
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    Is = shared_gate.shape[0]
    P = T * top_k
    act = torch.empty((P, I), dtype=x.dtype, device=x.device)
    act_sh = torch.empty((T, Is), dtype=x.dtype, device=x.device)
    route_w, route_i, routed = route_buffers(logits, T, E, top_k)
    y = torch.empty((T, H), dtype=out_dtype, device=x.device)
    (bi1, bh1, w1), (bh2, bi2, w2) = decode_tiles()
    BI = min(bi1, next_pow2(max(I, Is)))
    BH = min(bh1, next_pow2(H))
    route = dict(E=E, BE=next_pow2(E), TOPK=top_k, BKK=next_pow2(top_k))
    launch(_moe_swiglu_kernel, (P + T, triton.cdiv(max(I, Is), BI)),
           x, logits, gate_up, shared_gate, shared_up, act, act_sh, route_w, route_i,
           *x.stride(), logits.stride(0), *gate_up.stride(), *shared_gate.stride(), *shared_up.stride(),
           P, H=H, I=I, Is=Is, BI=BI, BH=BH, ROUTED_IN=routed, num_warps=w1, **route)
    BHo = min(bh2, next_pow2(H))
    BIo = min(bi2, next_pow2(max(I, Is)))
    launch(_moe_down_kernel, (T, triton.cdiv(H, BHo)),
           logits, down, shared_down, act, act_sh, route_w, route_i, y,
           logits.stride(0), *down.stride(), *shared_down.stride(), *y.stride(),
           H=H, I=I, Is=Is, BH=BHo, BI=BIo, num_warps=w2, **route)
    return y


_registry.register_lowering("fused_moe", "triton", torch.ops.onegraph.fused_moe_triton.default)
