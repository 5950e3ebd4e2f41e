"""fused_moe at one token in ONE kernel: the SwiGLU programs and the down programs of fused_moe.py's two
decode kernels share a launch, and a down program waits in-kernel for the SwiGLU outputs instead of for a
kernel boundary.

Why (batch-1 decode, docs/design.md "What a kernel costs under replay"): fused_moe.py's pair costs about
19 us a layer at the 35B shape for 56.6 MB of expert bytes (13.4 us at copy bandwidth); each kernel pays
its ramp (launch, first DRAM latency) and its tail. Here the down programs find their routing and issue
their weight loads while the SwiGLU programs are still running, and only their activation loads (9 KB
from L2) wait.

Programs and their order. Grid (N1 + N2,): N1 = (k + 1) * cdiv(max(I, Is), BI) SwiGLU programs (pairs
fastest, the shared expert as pair k), then N2 = cdiv(H, BH) down programs. A down program spins until
all N1 SwiGLU programs have published; that is safe only if every SwiGLU program has started by then,
so a program's role is its *ticket*, taken with an atomic increment as it starts, not its program id: any
program holding a down ticket started after all N1 SwiGLU tickets were handed to running programs, whatever
order the hardware dispatches blocks in.

sync [4] int32 (the caller's; zero on entry, and every launch leaves it zero):
  sync[0] tickets taken, sync[1] SwiGLU programs published, sync[2] down programs done.
A SwiGLU program stores its act rows, passes a block barrier (every thread's stores are then ordered
before the next step) and adds 1 to sync[1] with release semantics; a down program polls sync[1] with
volatile loads until it reads N1, then reads it once more with an acquire atomic, and loads act bypassing
L1 (.cg: L1 is not coherent across SMs). The down program that finishes last (sync[2] reaches N2: every
ticket was taken, every program is past its wait) zeroes sync.

Numerics are fused_moe.py's: the SwiGLU rows by its `_swiglu_rows`, the routing by its `_route_nth` /
`_route_row`, the down rows with the same roundings; the down products are summed over the whole I in one
reduction (fused_moe.py's down kernel sums BI-wide chunks first), so the output equals the two-kernel
one within fp32 summation order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRETED, launch, next_pow2, rnd, to_dt
from .fused_moe import _route_nth, _route_row, _swiglu_rows


LINE = 32          # int32s per 128-byte line: every counter and flag of sync on its own line (its own L2 slice)
FLAGS = 16         # ready flags the down programs poll, program r the flag r % FLAGS


def sync_len(top_k: int) -> int:
    """int32s of sync one launch uses: the SwiGLU programs' count, FLAGS ready flags."""
    return LINE * (1 + FLAGS)


@triton.jit
def _poll(p, ACQUIRE: tl.constexpr, INTERP: tl.constexpr):
    """*p at GPU scope, relaxed after a short sleep (many programs poll), or with acquire semantics (once, after
    the poll saw the flag: an acquire load also invalidates the SM's L1). The interpreter runs programs one
    after another, so there a plain load sees the final value."""
    if INTERP:
        return tl.load(p)
    elif ACQUIRE:
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [p],
                                         dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise("nanosleep.u32 64; ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l", [p],
                                         dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _moe_one_kernel(x, logits, gate_up, sh_gate, sh_up, down, sh_down, act, act_sh, y, sync,
                    s_x_h, s_gu_e, s_gu_r, s_gu_h, s_sg_r, s_sg_h, s_su_r, s_su_h, s_d_e, s_d_h, s_d_i,
                    s_sd_h, s_sd_i, s_y_h,
                    H: tl.constexpr, I: tl.constexpr, Is: tl.constexpr, E: tl.constexpr, BE: tl.constexpr,
                    TOPK: tl.constexpr, BKK: tl.constexpr, BI: tl.constexpr, N_IT: tl.constexpr,
                    BH: tl.constexpr, BIA: tl.constexpr, LINE: tl.constexpr, FLAGS: tl.constexpr,
                    INTERP: tl.constexpr, PREFETCH: tl.constexpr):
    DT: tl.constexpr = x.dtype.element_ty
    RT: tl.constexpr = y.dtype.element_ty           # where the down products round: x.dtype, or fp32 (fp32_out)
    NP: tl.constexpr = TOPK + 1                     # pairs: the k routed experts, then the shared one
    N1: tl.constexpr = NP * N_IT
    role = tl.program_id(0)
    if role < N1:
        pair = role % NP
        rows = (role // NP) * BI + tl.arange(0, BI)
        if pair < TOPK:
            e = _route_nth(logits, 0, 0, pair, E, BE, TOPK)
            mrow = rows < I
            w_e = gate_up + e * s_gu_e
            a = _swiglu_rows(x, s_x_h, w_e, s_gu_r, s_gu_h, w_e + I * s_gu_r, s_gu_r, s_gu_h, rows, mrow, H, DT, BI, H)
            tl.store(act + pair * I + rows, to_dt(a, DT), mask=mrow)
        else:
            mrow = rows < Is
            a = _swiglu_rows(x, s_x_h, sh_gate, s_sg_r, s_sg_h, sh_up, s_su_r, s_su_h, rows, mrow, H, DT, BI, H)
            tl.store(act_sh + rows, to_dt(a, DT), mask=mrow)
        tl.debug_barrier()                          # every thread's act stores before the release below
        if tl.atomic_add(sync, 1, sem="acq_rel") == N1 - 1:        # the last SwiGLU program: raise every flag at once
            fl = tl.arange(0, FLAGS)
            tl.atomic_xchg(sync + (1 + fl) * LINE, tl.full([FLAGS], 1, tl.int32), sem="release")
    else:
        flag0 = sync + LINE
        hrows = (role - N1) * BH + tl.arange(0, BH)
        mhrow = hrows < H
        top_w, top_i = _route_row(logits, 0, 0, E, BE, TOPK, BKK)
        ks = tl.arange(0, BKK)
        mk = ks < TOPK
        offs_i = tl.arange(0, BIA)
        # the weights first: they do not depend on the SwiGLU programs, so their latency passes while those run
        late = 0
        if not PREFETCH:
            f = _poll(flag0 + (role - N1) % FLAGS * LINE, False, INTERP)
            while f == 0:
                f = _poll(flag0 + (role - N1) % FLAGS * LINE, False, INTERP)
            late = f - 1
        dw = tl.load(down + late + top_i[:, None, None] * s_d_e + hrows[None, :, None] * s_d_h + offs_i[None, None, :] * s_d_i,
                     mask=mk[:, None, None] & mhrow[None, :, None] & (offs_i < I)[None, None, :], other=0.0)
        sdw = tl.load(sh_down + hrows[:, None] * s_sd_h + offs_i[None, :] * s_sd_i,
                      mask=mhrow[:, None] & (offs_i < Is)[None, :], other=0.0)
        glogit = tl.load(logits + E).to(tl.float32)
        flag = sync + (1 + (role - N1) % FLAGS) * LINE
        f = _poll(flag, False, INTERP)
        while f == 0:
            f = _poll(flag, False, INTERP)
        zero = tl.multiple_of(_poll(flag + f - 1, True, INTERP) - 1, 16)            # the act addresses carry the flag's value: loaded after it
        av = tl.load(act + zero + ks[:, None] * I + offs_i[None, :], mask=mk[:, None] & (offs_i < I)[None, :],
                     other=0.0, cache_modifier=".cg").to(tl.float32)                         # [BKK, BIA]
        ash = tl.load(act_sh + zero + offs_i, mask=offs_i < Is, other=0.0, cache_modifier=".cg").to(tl.float32)
        shared = rnd(tl.sum(sdw.to(tl.float32) * ash[None, :], axis=1), RT)                  # [BH]
        wt = rnd(top_w, DT)                          # the reference's weights are cast to x.dtype
        yk = rnd(tl.sum(dw.to(tl.float32) * av[:, None, :], axis=2), RT)                     # [BKK, BH]
        routed = rnd(tl.sum(rnd(yk * wt[:, None], RT), axis=0), RT)
        gate = rnd(tl.sigmoid(glogit), DT)
        tl.store(y + hrows * s_y_h, to_dt(routed + rnd(gate * shared, RT), RT), mask=mhrow)


# (BI, BH, warps): BI SwiGLU rows of gate and of up per program (whole rows of H), BH down rows per program
# (whole rows of I, the k experts and the shared one side by side); one warp count serves both roles.
ONE_TILES = (2, 1, 2)


def fused_moe_one(x, logits, gate_up, down, shared_gate, shared_up, shared_down, top_k: int, sync: torch.Tensor,
                  fp32_out: bool = False, tiles=None, prefetch: bool = True) -> torch.Tensor:
    """fused_moe's decode at T = 1 in one launch; sync: int32 [sync_len(top_k)], zero (the launch leaves it
    non-zero: each launch needs a zeroed one)."""
    T, H = x.shape
    assert T == 1, "fused_moe_one: one token"
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    Is = shared_gate.shape[0]
    BI, BH, W = tiles or ONE_TILES
    BI = min(BI, next_pow2(max(I, Is)))
    BH = min(BH, next_pow2(H))
    n_it = triton.cdiv(max(I, Is), BI)
    n2 = triton.cdiv(H, BH)
    act = torch.empty((top_k, I), dtype=x.dtype, device=x.device)
    act_sh = torch.empty((Is,), dtype=x.dtype, device=x.device)
    y = torch.empty((1, H), dtype=torch.float32 if fp32_out else x.dtype, device=x.device)
    assert next_pow2(H) == H, "whole rows of H per SwiGLU program"
    launch(_moe_one_kernel, ((top_k + 1) * n_it + n2,),
           x, logits, gate_up, shared_gate, shared_up, down, shared_down, act, act_sh, y, sync,
           x.stride(1), *gate_up.stride(), *shared_gate.stride(), *shared_up.stride(), *down.stride(),
           *shared_down.stride(), y.stride(1),
           H=H, I=I, Is=Is, E=E, BE=next_pow2(E), TOPK=top_k, BKK=next_pow2(top_k), BI=BI, N_IT=n_it,
           BH=BH, BIA=next_pow2(max(I, Is)), LINE=LINE, FLAGS=FLAGS, INTERP=INTERPRETED, PREFETCH=prefetch, num_warps=W)
    return y
