"""linear_w8a8_fp8: FP8 projection with per-channel weight scales and dynamic per-token FP8 activations
(compressed-tensors' "FP8 dynamic" scheme, as vLLM runs it with torch._scaled_mm).

x [M, K] bf16/fp16/fp32, w [N, K] float8_e4m3fn, scale [N, 1] fp32 (w[n, k] = fp32(q[n, k]) * scale[n]: the
`weight_scale` of a channel-strategy float weight) -> y [M, N] x.dtype.
  s_x[m] = amax_k |x[m, k]| / 448          (fp32; 1 for an all-zero row)
  xq[m, k] = e4m3(clamp(fp32(x[m, k]) / s_x[m], -448, 448))   rounded to nearest even
  y[m, n] = x.dtype((fp32 sum_k fp32(xq[m, k]) * fp32(q[n, k]) * s_x[m]) * scale[n])
Every product of two e4m3 values is exact in fp32; the sum is fp32 (its order is the implementation's:
the reference's BLAS and the Triton kernel agree to fp32 rounding, not bit for bit).
Quantizing the activations (not weight-only) is what the checkpoint's `input_activations` asks for and what
vLLM computes, so a compressed-tensors FP8 checkpoint gives here what it gives there; on the H200 it lets the
prefill tiles run fp8 x fp8 tensor-core dots.
Reference: the above in plain torch (the CPU lowering traced to aten). CUDA lowering:
custom_ops/triton/linear_w8a8.py (row quantization kernel; GEMV for M <= 16, tl.dot e4m3 tiles above).
"""
import torch

from ._registry import define_op
from .linear_w8a8_int8 import LOWERINGS, SCHEMA, row_scale, validate_w8a8

FP8 = torch.float8_e4m3fn
QMAX = 448.0


def _validate(x, w, scale):
    validate_w8a8("linear_w8a8_fp8", x, w, scale, FP8)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] e4m3, s_x [M, 1] fp32): dynamic per-token e4m3."""
    s = row_scale(x, QMAX)
    return (x.float() / s).clamp(-QMAX, QMAX).to(FP8), s


def reference_linear_w8a8_fp8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    xq, s = quantize_rows(x)
    return (((xq.float() @ w.float().T) * s) * scale.view(1, -1)).to(x.dtype)


linear_w8a8_fp8 = define_op("linear_w8a8_fp8", version=1, schema=SCHEMA, reference=reference_linear_w8a8_fp8,
                            validate=_validate, fake=lambda x, w, scale: x.new_empty((x.shape[0], w.shape[0])),
                             lowerings=LOWERINGS)
