"""linear_fp8: y = x @ dequant(w, scale).T in x.dtype, with block-quantized FP8 weights (weight-only).

x [M, K] bf16/fp16/fp32, w [N, K] float8_e4m3fn, scale [ceil(N/128), ceil(K/128)] fp32 (one multiplier
per 128x128 block of w: the `weight_scale_inv` of the official -FP8 checkpoints, checkpoint/quant.py)
-> y [M, N] x.dtype.
Reference: dequantize w to fp32 (fp32(q) * scale, exact: an e4m3 value times an fp32 scale is one fp32
rounding), F.linear in fp32 with x upcast (exact), rounded to x.dtype once. In an fp32 model that is what
transformers' dequantized model computes (Fp8Dequantize to fp32, then nn.Linear) up to summation order.
In a bf16 model transformers rounds the dequantized weight to bf16 first (relative 2**-9 per weight) and
multiplies in bf16; this op keeps the fp32 weight, as the Triton kernel does.
An fp32 x gives the fp32 accumulation unrounded: the row-parallel projections under `fp32_reduce` call
it with x.float() (models/qwen3_5/model.py).
CPU lowering: the reference traced to aten (AOTInductor fuses the dequantization into the GEMM's input).
CUDA lowering (custom_ops/triton/linear_fp8.py): one Triton kernel that reads the e4m3 bytes and scales in
registers — a GEMV tiled by (M, K) only at decode sizes, tl.dot tiles above.
"""
import torch
import torch.nn.functional as F

from ._registry import check_shape, define_op

SCHEMA = "(Tensor x, Tensor w, Tensor scale) -> Tensor"
BLOCK = 128
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _validate(x, w, scale):
    check_shape(x, (None, None), "linear_fp8 x", X_DTYPES)
    check_shape(w, (None, x.shape[1]), "linear_fp8 w", torch.float8_e4m3fn)
    nb, kb = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
    check_shape(scale, (nb, kb), "linear_fp8 scale (one per 128x128 block of w)", torch.float32)


def expand_scale(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[..., ceil(n/128), ceil(k/128)] -> [..., n, k]: each block's scale over its elements (expand +
    reshape + slice: no copy until the multiply, which Inductor fuses)."""
    *lead, nb, kb = scale.shape
    full = scale[..., :, None, :, None].expand(*lead, nb, BLOCK, kb, BLOCK).reshape(*lead, nb * BLOCK, kb * BLOCK)
    return full[..., :n, :k]


def dequantize_blocks(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [..., N, K] e4m3, scale [..., ceil(N/128), ceil(K/128)] fp32 -> dtype(fp32(w) * scale)."""
    n, k = w.shape[-2:]
    return (w.float() * expand_scale(scale, n, k)).to(dtype)


def reference_linear_fp8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), dequantize_blocks(w, scale)).to(x.dtype)


linear_fp8 = define_op("linear_fp8", version=1, schema=SCHEMA, reference=reference_linear_fp8, validate=_validate,
                       fake=lambda x, w, scale: x.new_empty((x.shape[0], w.shape[0])))
