"""linear_f32: y = x @ w.T accumulated and returned in fp32, unrounded.

x [N, K], w [M, K] (both the model dtype) -> y [N, M] fp32.
Used by the row-parallel projections of models/qwen3_5/model.py under `fp32_reduce`: their partial sums are
all-reduced in fp32 and rounded to the model dtype once, so the result does not depend on the TP degree.
Reference: upcast both operands and multiply in fp32 (a bf16 or fp16 product is exact in fp32, so this
IS the fp32 accumulation). CUDA lowering: one GEMM with an fp32 output (aten.mm.dtype, which
AOTInductor calls through its C shim) instead of an fp32 copy of the weight at every step.
"""
import torch
import torch.nn.functional as F

from ._registry import check_shape, define_op, register_lowering

SCHEMA = "(Tensor x, Tensor w) -> Tensor"


def _validate(x, w):
    check_shape(x, (None, None), "linear_f32 x")
    check_shape(w, (None, x.shape[1]), "linear_f32 w")
    if x.dtype != w.dtype:
        raise ValueError(f"linear_f32: x is {x.dtype} but w is {w.dtype}")


def reference_linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float())


def _mm_out_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:                 # aten.mm.dtype takes 16-bit operands only
        return torch.mm(x, w.t())
    return torch.mm(x, w.t(), out_dtype=torch.float32)


linear_f32 = define_op("linear_f32", version=1, schema=SCHEMA, reference=reference_linear_f32, validate=_validate,
                       fake=lambda x, w: x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32),
                       lowerings={"cpu": "decompose", "cuda": "aten", "xpu": "decompose"})
register_lowering("linear_f32", "aten", _mm_out_f32)
