"""Triton lowerings of causal_conv_update and causal_conv_prefill: the GDN depthwise causal conv + SiLU
with its per-slot state (contracts: custom_ops/causal_conv_update.py, causal_conv_prefill.py).

update, grid (B, cdiv(C, BC)): row b's window is state[slots[b]] ‖ x[b] ([BC, W] in registers);
y = silu(sum_j window_j * w_j); the new state rows are the window minus its oldest tap.
prefill, grid (cdiv(T, BT), cdiv(C, BC)): y[t, c] = silu(sum_j w[c, j] * seq[c, t + j]) over
seq = state[slot] ‖ x^T, reading seq[c, i] from the state for i < W-1 and from x[i - (W-1)] after;
the programs of the first token block also write the new state, seq[c, n_valid + j] for j < W-1
(the last W-1 valid inputs: padding rows past n_valid never enter it).

Numerics follow the references (weight dtype = model dtype on the model path): update multiplies
in the weight dtype (each product rounded to it, as the reference's elementwise product), sums in
fp32 and rounds the sum; prefill accumulates the products in fp32 and rounds once (a conv1d); both
apply SiLU as x / (1 + exp(-x)) in fp32 and round to the weight dtype, then to x.dtype. bf16
results are within 1 bf16 ulp of the reference (summation order); states are exact copies.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..causal_conv_prefill import _validate as _validate_prefill
from ..causal_conv_update import _validate as _validate_update
from ._common import launch, next_pow2, rnd, to_dt


@triton.jit
def _silu_out(acc, WDT: tl.constexpr, ODT: tl.constexpr):
    """fp32 pre-activation -> silu in the weight dtype (as F.silu on a weight-dtype tensor) -> ODT."""
    a = rnd(acc, WDT)
    return to_dt(rnd(tl.math.div_rn(a, 1.0 + tl.exp(-a)), WDT), ODT)


@triton.jit
def _conv_update_kernel(x, state, slots, w, y, new_state,
                        s_x_b, s_x_c, s_s_s, s_s_c, s_s_k, s_w_c, s_w_k, s_n_b, s_n_c, s_n_k, C,
                        W: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr, IN_PLACE: tl.constexpr):
    """IN_PLACE: new_state is the state itself and row slots[b] is overwritten (each channel is owned by one
    program; a block barrier keeps every load of the row before any store); else new_state[b]."""
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = offs_c < C
    offs_k = tl.arange(0, BW)                                   # taps: 0..W-2 state, W-1 the new x
    SDT: tl.constexpr = state.dtype.element_ty
    WDT: tl.constexpr = w.dtype.element_ty
    slot = tl.load(slots + b)                                   # int64: slot * stride stays 64-bit
    st = tl.load(state + slot * s_s_s + offs_c[:, None] * s_s_c + offs_k[None, :] * s_s_k,
                 mask=mc[:, None] & (offs_k[None, :] < W - 1), other=0.0).to(tl.float32)   # [BC, BW]
    xv = rnd(tl.load(x + b * s_x_b + offs_c * s_x_c, mask=mc, other=0.0).to(tl.float32), SDT)  # x.to(state dtype)
    win = tl.where(offs_k[None, :] == W - 1, xv[:, None], st)  # [BC, BW] window in the state dtype
    wt = tl.load(w + offs_c[:, None] * s_w_c + offs_k[None, :] * s_w_k,
                 mask=mc[:, None] & (offs_k[None, :] < W), other=0.0).to(tl.float32)
    prod = rnd(rnd(win, WDT) * wt, WDT)                         # window.to(w.dtype) * w, in w.dtype
    acc = tl.sum(tl.where(offs_k[None, :] < W, prod, 0.0), axis=1)
    tl.store(y + b * C + offs_c, _silu_out(acc, WDT, y.dtype.element_ty), mask=mc)
    # new state row = window[1:]: shift the taps left by one
    out_k = tl.arange(0, BW)
    nxt = tl.load(state + slot * s_s_s + offs_c[:, None] * s_s_c + (out_k[None, :] + 1) * s_s_k,
                  mask=mc[:, None] & (out_k[None, :] + 1 < W - 1), other=0.0)
    nxt = tl.where(out_k[None, :] == W - 2, to_dt(xv, SDT)[:, None], nxt)
    # in place: written through `state` itself (new_state, the same tensor, only lends its strides), so the
    # compiler's kernel analysis sees the state read and written through one argument and copies nothing
    if IN_PLACE:
        tl.debug_barrier()                    # the shifted store crosses threads: every load of the row first
        dst = state + slot * s_n_b
    else:
        dst = new_state + b * s_n_b
    tl.store(dst + offs_c[:, None] * s_n_c + out_k[None, :] * s_n_k, nxt, mask=mc[:, None] & (out_k[None, :] < W - 1))


@triton.jit
def _seq_at(x, state_row, i, offs_c, m, s_x_t, s_x_c, s_s_c, s_s_k, W: tl.constexpr):
    """seq[c, i] (state ‖ x^T) for seq positions i [BT] and channels offs_c [BC], in fp32, state dtype."""
    from_state = i < W - 1
    sv = tl.load(state_row + offs_c[None, :] * s_s_c + i[:, None] * s_s_k,
                 mask=m & from_state[:, None], other=0.0).to(tl.float32)
    xi = tl.where(from_state, 0, i - (W - 1))
    xv = tl.load(x + xi[:, None] * s_x_t + offs_c[None, :] * s_x_c,
                 mask=m & (i >= W - 1)[:, None], other=0.0).to(tl.float32)
    return tl.where(from_state[:, None], sv, rnd(xv, state_row.dtype.element_ty))   # x.to(state dtype)


@triton.jit
def _conv_prefill_kernel(x, state, slot, n_valid, w, y, new_state,
                         s_x_t, s_x_c, s_s_s, s_s_c, s_s_k, s_w_c, s_w_k, T, C,
                         W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr):
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mt = offs_t < T
    mc = offs_c < C
    m = mt[:, None] & mc[None, :]
    WDT: tl.constexpr = w.dtype.element_ty
    state_row = state + tl.load(slot) * s_s_s                   # int64 offset
    acc = tl.zeros([BT, BC], tl.float32)
    for j in tl.static_range(W):                                # y[t] = sum_j w[j] * seq[t + j]
        wj = tl.load(w + offs_c * s_w_c + j * s_w_k, mask=mc, other=0.0).to(tl.float32)
        sj = _seq_at(x, state_row, offs_t + j, offs_c, m, s_x_t, s_x_c, s_s_c, s_s_k, W)
        acc += rnd(sj, WDT) * wj[None, :]                       # seq.to(w.dtype); fp32 accumulation
    tl.store(y + offs_t[:, None] * C + offs_c[None, :], _silu_out(acc, WDT, y.dtype.element_ty), mask=m)
    if tl.program_id(0) == 0:
        # new state: seq[c, n_valid + k] for k < W-1, [BC, BW] (taps on the minor axis, as stored)
        offs_k = tl.arange(0, BW)
        mk = mc[:, None] & (offs_k[None, :] < W - 1)
        i = tl.load(n_valid) + offs_k                           # [BW] seq positions
        from_state = i < W - 1
        sv = tl.load(state_row + offs_c[:, None] * s_s_c + i[None, :] * s_s_k,
                     mask=mk & from_state[None, :], other=0.0)
        xi = tl.where(from_state, 0, i - (W - 1))
        xv = tl.load(x + xi[None, :] * s_x_t + offs_c[:, None] * s_x_c, mask=mk & (i >= W - 1)[None, :], other=0.0)
        SDT: tl.constexpr = state.dtype.element_ty
        nxt = tl.where(from_state[None, :], sv, to_dt(xv.to(tl.float32), SDT))
        tl.store(new_state + offs_c[:, None] * (W - 1) + offs_k[None, :], nxt, mask=mk)


@triton_op("onegraph::causal_conv_update_triton", mutates_args=())
def causal_conv_update_triton(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                              weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _validate_update(x, conv_state, slots, weight)
    slots = slots.contiguous()          # the kernel reads slots[b] at slots + b (an expanded slot has stride 0)
    B, C = x.shape
    W = weight.shape[1]
    y = torch.empty((B, C), dtype=x.dtype, device=x.device)
    new_state = torch.empty((B, C, W - 1), dtype=conv_state.dtype, device=x.device)
    run_update(x, conv_state, slots, weight, y, new_state)
    return y, new_state


# Channels per program and warps of the update (latency, not bytes: 48 KB of state a layer at B = 1). Swept on
# the H200 at C = 8192, in place, 30 layers per CUDA graph (benchmarks/h200_conv_update_sweep.json, which names
# its script): 64 x 4 warps takes 1.75 / 2.45 / 10.5 us a layer at B = 1 / 8 / 64 where 256 x 4 takes 3.55 / 3.79 /
# 15.5; outputs and state identical (one channel per lane-row).
UPDATE_BC = 64
UPDATE_WARPS = 4


def run_update(x, conv_state, slots, weight, y, new_state) -> None:
    """The update launch: y [B, C] and the new rows, into new_state [B, C, W-1], or in place into conv_state's
    rows at slots when new_state is conv_state (gdn_decode_step_norm's in-place twin)."""
    B, C = x.shape
    BC = min(UPDATE_BC, next_pow2(C))
    launch(_conv_update_kernel, (B, triton.cdiv(C, BC)), x, conv_state, slots, weight, y, new_state,
           *x.stride(), *conv_state.stride(), *weight.stride(), *new_state.stride(), C,
           W=weight.shape[1], BC=BC, BW=next_pow2(weight.shape[1]), IN_PLACE=new_state is conv_state, num_warps=UPDATE_WARPS)


def run_prefill(x, conv_state, slot, n_valid, weight, block_t: int, block_c: int):
    """The prefill launch with an explicit tiling (the op picks one; tests force small, odd tiles)."""
    T, C = x.shape
    W = weight.shape[1]
    y = torch.empty((T, C), dtype=x.dtype, device=x.device)
    new_state = torch.empty((1, C, W - 1), dtype=conv_state.dtype, device=x.device)
    launch(_conv_prefill_kernel, (triton.cdiv(T, block_t), triton.cdiv(C, block_c)), x, conv_state, slot, n_valid,
           weight, y, new_state, *x.stride(), *conv_state.stride(), *weight.stride(), T, C,
           W=W, BT=block_t, BC=block_c, BW=next_pow2(W), num_warps=4)
    return y, new_state


@triton_op("onegraph::causal_conv_prefill_triton", mutates_args=())
def causal_conv_prefill_triton(x: torch.Tensor, conv_state: torch.Tensor, slot: torch.Tensor, n_valid: torch.Tensor,
                               weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _validate_prefill(x, conv_state, slot, n_valid, weight)
    # 16 tokens x 128 channels per program: channel-contiguous rows of x, 35B (C = 8192, T = 2048):
    # 8192 programs
    return run_prefill(x, conv_state, slot, n_valid, weight, 16, min(128, next_pow2(x.shape[1])))


_registry.register_lowering("causal_conv_update", "triton", torch.ops.onegraph.causal_conv_update_triton.default)
_registry.register_lowering("causal_conv_prefill", "triton", torch.ops.onegraph.causal_conv_prefill_triton.default)
