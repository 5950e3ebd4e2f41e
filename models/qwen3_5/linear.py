"""The projection every Qwen3.5 layer uses, by weight dtype: bf16/fp16/fp32 through onegraph::linear, block-FP8
and W8A8 through their ops. Below model.py and fuse.py, which both build it."""
from __future__ import annotations

import torch
from torch import nn

from onegraph import custom_ops  # noqa: F401  (registers torch.ops.onegraph)

ops = torch.ops.onegraph


class Linear(nn.Linear):
    """A projection through onegraph::linear (a GEMV at decode sizes on CUDA). x [N, in] -> [N, out].
    FP8 (checkpoint/quant.py make_fp8): weight [out, in] float8_e4m3fn and weight_scale_inv
    [ceil(out/128), ceil(in/128)] fp32, through onegraph::linear_fp8 (weight-only: x stays as it is).
    W8A8 (checkpoint/quant.py make_w8a8): weight [out, in] int8 or float8_e4m3fn and weight_scale [out, 1] fp32,
    through onegraph::linear_w8a8_int8 / linear_w8a8_fp8 (x quantized per row inside the op)."""

    def forward(self, x):
        if self.weight.dtype in (torch.float8_e4m3fn, torch.int8):
            # RowLinear's fp32_out: an fp32 x makes the op return its fp32 accumulation unrounded
            x = x.float() if getattr(self, "fp32_out", False) else x
            if self.weight.dtype == torch.int8:
                y = ops.linear_w8a8_int8(x, self.weight, self.weight_scale)
            elif hasattr(self, "weight_scale"):
                y = ops.linear_w8a8_fp8(x, self.weight, self.weight_scale)
            else:
                y = ops.linear_fp8(x, self.weight, self.weight_scale_inv)
        else:
            y = ops.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


