"""The GDN causal conv update in the epilogue of the projection that feeds it, in place (one row).

Two in-place twins, put in the batch-1 decode graph by export/fold_conv.py, never called by the model:
  linear_conv_inplace_triton(x [1, K], w [N, K], conv_state [S, C, W-1], slots [1], conv_weight [C, W]) -> y [1, N]
  add_rms_norm_linear_conv_inplace_triton(x, residual, norm_w, eps, w, conv_state, slots, conv_weight)
      -> (y [1, N], normed [1, K], h [1, K])
are linear / add_rms_norm_linear (custom_ops/linear.py, add_rms_norm_linear.py) followed by
  y[:, :C], conv_state[slots] = causal_conv_update(y[:, :C], conv_state, slots, conv_weight)
(custom_ops/causal_conv_update.py): the first C output columns (the GDN in_proj's qkv part) replaced by their
conv + SiLU, the slot's state row shifted in place. One launch of the projection GEMV
(custom_ops/triton/linear.py, CONV): every program owns its BN output channels, hence their conv-state rows,
so the update needs no other program's result; the conv kernel's launch (30 a 35B step, ~2 us each on the
H200) is gone. The conv's arithmetic is causal_conv_update's kernel's own (the same helpers), on the value
the projection stored, so y and the state are the unfused pair's bit for bit wherever the GEMV's sums are.
"""
from __future__ import annotations

import torch
from torch.library import triton_op

from .._registry import check_shape
from ..add_rms_norm_linear import _validate as _validate_norm_linear
from ..linear import _validate as _validate_linear
from .linear import gemv


def _validate_conv(x, w, conv_state, slots, conv_weight):
    check_shape(x, (1, None), "linear_conv x (one row)")
    check_shape(conv_weight, (None, None), "linear_conv conv_weight")
    C, W = conv_weight.shape
    if C > w.shape[0]:
        raise ValueError(f"linear_conv: {C} conv channels but the projection has {w.shape[0]} outputs")
    check_shape(conv_state, (None, C, W - 1), "linear_conv conv_state")
    check_shape(slots, (1,), "linear_conv slots", torch.int64)


@triton_op("onegraph::linear_conv_inplace_triton", mutates_args={"conv_state"})
def linear_conv_inplace_triton(x: torch.Tensor, w: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                               conv_weight: torch.Tensor) -> torch.Tensor:
    _validate_linear(x, w)
    _validate_conv(x, w, conv_state, slots, conv_weight)
    return gemv(x, w, conv=(conv_state, slots.contiguous(), conv_weight))


@triton_op("onegraph::add_rms_norm_linear_conv_inplace_triton", mutates_args={"conv_state"})
def add_rms_norm_linear_conv_inplace_triton(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                                            w: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                                            conv_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _validate_norm_linear(x, residual, norm_w, eps, w)
    _validate_conv(x, w, conv_state, slots, conv_weight)
    return gemv(x, w, norm=(residual, norm_w, eps), conv=(conv_state, slots.contiguous(), conv_weight))
