"""Triton lowering of gdn_decode_step_norm (contract: custom_ops/gdn_decode_step_norm.py), and its in-place
twin that writes the new state rows straight into the state at `slots`: three launches, each with many
programs, `_launch`:
- causal_conv_update's kernel (grid (B, C / 64), each channel's row owned by one program, so it may write in
  place) -> xc [B, C], the conv + SiLU;
- the GDN step on xc (grid (B, HV, V / BV), each state element owned by one thread) -> out [B, HV, V];
- the gated norm (grid (B * HV)) -> y [B, HV, V].

Why not one kernel: a (B, HK) grid whose programs each own a key head's REP value heads whole (the norm
needs a head's whole V; the in-place write needs each state element owned by the program that reads it) was
slower than these three launches at every batch on the H200 at the 35B shape, in place, 30 layers in one
CUDA graph (benchmarks/h200_gdn_decode_sweep.json): 13.1 vs 8.1 us a layer at B = 1, 19.3 vs 17.6 at 8,
117.0 vs 94.9 at 64, 219.8 vs 186.4 at 128, whether it held a head's [2, 128, 128] fp32 state at once or
walked V 16 to 64 columns at a time. The (B, HV, V / BV) grid keeps every SM busy; the whole-head program
was one 16-warp program per SM, its loads, math and stores one after the other.
"""
from __future__ import annotations

import torch
from torch.library import triton_op

from .. import _registry
from ..gdn_decode_step_norm import _validate
from . import causal_conv, gdn_decode_step, norms


def _launch(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads,
            eps, y, new_conv, new_rec, plan_rows: int | None = None) -> None:
    """The three launches into y [B, HV, V] and the new rows: into new_conv [B, C, W-1] / new_rec [B, HV, K, V],
    or in place into the state rows at slots when they are conv_state / rec_state. Same values as the
    reference composition (up to the fp32 summation order of the step). plan_rows: gdn_decode_step.run's (the
    conv and norm launches are per row already)."""
    xc = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)          # [B, C] conv + SiLU
    causal_conv.run_update(qkv, conv_state, slots, conv_weight, xc, new_conv)
    out = torch.empty(y.shape, dtype=qkv.dtype, device=qkv.device)           # [B, HV, V] before the norm
    gdn_decode_step.run(xc, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads, out,
                        new_conv, new_rec, conv_in=True, plan_rows=plan_rows)
    norms.gated_rms_norm_heads(out, z, norm_weight, eps, y)


@triton_op("onegraph::gdn_decode_step_norm_triton", mutates_args=())
def gdn_decode_step_norm_triton(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor,
                                conv_state: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor,
                                conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                                norm_weight: torch.Tensor, num_k_heads: int,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _validate(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads, eps)
    B, C = qkv.shape
    _, HV, K, V = rec_state.shape
    y = qkv.new_empty((B, HV, V))
    new_conv = conv_state.new_empty((B, C, conv_weight.shape[1] - 1))
    new_rec = rec_state.new_empty((B, HV, K, V))
    _launch(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads, eps,
            y, new_conv, new_rec)
    return y, new_conv, new_rec


@triton_op("onegraph::gdn_decode_step_norm_inplace_triton", mutates_args={"conv_state", "rec_state"})
def gdn_decode_step_norm_inplace_triton(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor,
                                        conv_state: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor,
                                        conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                                        norm_weight: torch.Tensor, num_k_heads: int, eps: float) -> torch.Tensor:
    """gdn_decode_step_norm_triton followed by conv_state[slots] = new_conv_rows, rec_state[slots] =
    new_rec_rows, its kernels writing the rows in place; returns y. Export puts it in place of that
    pattern (export/inplace.py); never called by the model."""
    _validate(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads, eps)
    B = qkv.shape[0]
    _, HV, _, V = rec_state.shape
    y = qkv.new_empty((B, HV, V))
    # in place the kernels read and write the state through conv_state / rec_state themselves, so Inductor's
    # analysis sees each state tensor read and written through one argument
    _launch(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads, eps,
            y, conv_state, rec_state)
    return y


_registry.register_lowering("gdn_decode_step_norm", "triton", torch.ops.onegraph.gdn_decode_step_norm_triton.default)
