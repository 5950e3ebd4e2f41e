"""linear_fp8: y = x @ dequant(w, scale).T in x.dtype, with block-quantized FP8 weights (weight-only), and
optionally a float tail of rows of the same input in the same launch.

x [M, K] bf16/fp16/fp32, w [N, K] float8_e4m3fn, scale [ceil(N/128), ceil(K/128)] fp32 (one multiplier
per 128x128 block of w: the `weight_scale_inv` of the official -FP8 checkpoints, checkpoint/quant.py),
tail [Nt, K] x.dtype or None -> y [M, N + Nt] x.dtype = [x @ dequant(w, scale).T | x @ tail.T].
Why the tail: an FP8 checkpoint keeps some projections of a layer's input float (the GDN in_proj_b / in_proj_a,
64 x 2048 at 35B), which cannot join the e4m3 weight (models/qwen3_5/fuse.py); as a projection of its own it is a
second launch per layer for a few KB (~2 us fixed cost at batch 1, 30 a 35B step). With the tail its rows are
extra programs of the FP8 kernel. An optional argument of this op rather than a second op: `Tensor? tail=None`
passes torch.export and AOTInductor (a traced call without it records no argument, as before), and
add_rms_norm_linear_fp8 and export/fold_norm.py carry it through unchanged. The tail columns are
F.linear(x.float(), tail.float()) rounded to x.dtype once (an fp32 x: unrounded).
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

SCHEMA = "(Tensor x, Tensor w, Tensor scale, Tensor? tail=None) -> Tensor"
BLOCK = 128
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _validate(x, w, scale, tail=None):
    check_shape(x, (None, None), "linear_fp8 x", X_DTYPES)
    check_shape(w, (None, x.shape[1]), "linear_fp8 w", torch.float8_e4m3fn)
    nb, kb = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
    check_shape(scale, (nb, kb), "linear_fp8 scale (one per 128x128 block of w)", torch.float32)
    if tail is not None:
        check_shape(tail, (None, x.shape[1]), "linear_fp8 tail (float rows after w's, x's dtype)", x.dtype)


def out_features(w: torch.Tensor, tail: torch.Tensor | None) -> int:
    """N + Nt: the columns of y."""
    return w.shape[0] + (0 if tail is None else tail.shape[0])


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


def reference_linear_fp8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                         tail: torch.Tensor | None = None) -> torch.Tensor:
    wf = dequantize_blocks(w, scale)                                         # [N, K] fp32
    if tail is not None:                     # one fp32 GEMM over [N + Nt, K] (one CPU kernel, as a fused projection)
        wf = torch.cat([wf, tail.float()])
    return F.linear(x.float(), wf).to(x.dtype)


linear_fp8 = define_op("linear_fp8", version=2, schema=SCHEMA, reference=reference_linear_fp8, validate=_validate,
                       fake=lambda x, w, scale, tail=None: x.new_empty((x.shape[0], out_features(w, tail))))
