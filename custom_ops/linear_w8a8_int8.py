"""linear_w8a8_int8: W8A8 INT8 projection, y = x @ w.T with int8 weights and int8 activations quantized here.

x [M, K] bf16/fp16/fp32, w [N, K] int8 (per-output-channel symmetric), scale [N, 1] fp32 (w[n, k] =
q[n, k] * scale[n], compressed-tensors' `weight_scale` of a channel-strategy int8 weight) -> y [M, N] x.dtype.
Activations are quantized inside the op, dynamically per row (token), symmetric, as vLLM's W8A8 INT8:
  s_x[m] = amax_k |x[m, k]| / 127          (fp32; 1 for an all-zero row, so xq = 0 there)
  xq[m, k] = clamp(round_half_even(fp32(x[m, k]) / s_x[m]), -127, 127)          int8
  acc[m, n] = sum_k xq[m, k] * q[n, k]     exact integer: |acc| <= K * 127 * 128 < 2**31 for K < 132,000
  y[m, n] = x.dtype((fp32(acc[m, n]) * s_x[m]) * scale[n])                      (this order, fp32)
Each row depends on itself only, so a batch gives every row what it gives alone.
Reference (the truth, and the CPU lowering traced to aten): the integer sum computed in fp32 over K-chunks of
CHUNK = 1024 (|chunk sum| <= 1024 * 127 * 128 = 16,646,144 < 2**24, so every partial sum of integers is exact
in fp32 in any order), the chunks' exact sums added in int32; so it equals the int32 sum bit for bit, runs
on fp32 BLAS (CPU and, under kernels=reference, CUDA: aten has no int8 GEMM for every shape there).
CUDA lowering (custom_ops/triton/linear_w8a8.py): a row-quantization kernel, then a GEMV (M <= 16: int32
multiply-adds) or a tl.dot int8 x int8 -> int32 tile above (IMMA); both integer-exact, so the kernel output
equals the reference bit for bit.
"""
import torch
import torch.nn.functional as F

from ._registry import check_shape, define_op

SCHEMA = "(Tensor x, Tensor w, Tensor scale) -> Tensor"
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
QMAX = 127.0
CHUNK = 1024
# hand-written Triton on CUDA/XPU (custom_ops/triton/linear_w8a8.py), the reference decomposed on CPU
LOWERINGS = {"cpu": "decompose", "cuda": "triton", "xpu": "triton"}


def validate_w8a8(op: str, x, w, scale, w_dtype) -> None:
    check_shape(x, (None, None), f"{op} x", X_DTYPES)
    check_shape(w, (None, x.shape[1]), f"{op} w", w_dtype)
    check_shape(scale, (w.shape[0], 1), f"{op} scale (one per output channel of w)", torch.float32)


def _validate(x, w, scale):
    validate_w8a8("linear_w8a8_int8", x, w, scale, torch.int8)


def row_scale(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """x [M, K] -> s_x [M, 1] fp32 = amax |x[m]| / qmax (1 where a row is all zero)."""
    amax = x.float().abs().amax(dim=1, keepdim=True)
    # divided by a tensor, not the Python number: CUDA's aten multiplies by the reciprocal of a scalar divisor
    # (1 ulp off IEEE division for some amax), the Triton kernel divides (div_rn) as the CPU does
    return torch.where(amax > 0, amax / torch.full_like(amax, qmax), torch.ones_like(amax))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] int8, s_x [M, 1] fp32): dynamic per-token symmetric int8."""
    s = row_scale(x, QMAX)
    return (x.float() / s).round().clamp(-QMAX, QMAX).to(torch.int8), s


def int_dot(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """xq [M, K] int8 @ wq [N, K].T int8 -> [M, N] int32, exactly (module docstring: fp32 chunks of 1024)."""
    M, K = xq.shape
    N = wq.shape[0]
    c = -(-K // CHUNK)
    pad = c * CHUNK - K
    xs = F.pad(xq.float(), (0, pad)).view(M, c, CHUNK).transpose(0, 1)               # [c, M, CHUNK]
    ws = F.pad(wq.float(), (0, pad)).view(N, c, CHUNK).permute(1, 2, 0)              # [c, CHUNK, N]
    return torch.bmm(xs, ws).to(torch.int32).sum(0, dtype=torch.int32)               # [M, N]


def reference_linear_w8a8_int8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    xq, s = quantize_rows(x)
    return ((int_dot(xq, w).float() * s) * scale.view(1, -1)).to(x.dtype)


linear_w8a8_int8 = define_op("linear_w8a8_int8", version=1, schema=SCHEMA, reference=reference_linear_w8a8_int8,
                             validate=_validate, fake=lambda x, w, scale: x.new_empty((x.shape[0], w.shape[0])),
                             lowerings=LOWERINGS)
