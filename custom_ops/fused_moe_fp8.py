"""fused_moe_fp8: fused_moe (custom_ops/fused_moe.py: router logits -> top-k, SwiGLU experts, weighted combine,
gated shared expert) with block-FP8 expert weights, routed and shared, read as e4m3 bytes (weight-only).

x [T, H]; logits [T, E + 1] in x.dtype (the router logits, then the shared expert's gate logit: the routing
gates stay float, as the official -FP8 checkpoints keep `mlp.gate` / `shared_expert_gate`);
gate_up [E, 2I, H] e4m3 with gate_up_scale [E, 2*ceil(I/128), ceil(H/128)] fp32: the gate rows' block scales,
  then the up rows' (each [ceil(I/128), ceil(H/128)]: a checkpoint's per-expert gate_proj and up_proj
  `weight_scale_inv` concatenated, so I need not be a multiple of 128; when it is, this is the 128x128 block
  grid of gate_up itself);
down [E, H, I] e4m3 with down_scale [E, ceil(H/128), ceil(I/128)];
shared_gate, shared_up [Is, H] e4m3 with scales [ceil(Is/128), ceil(H/128)]; shared_down [H, Is] with
  [ceil(H/128), ceil(Is/128)]; top_k; fp32_out (as fused_moe's).
-> y [T, H] in x.dtype (fp32 when fp32_out).
Weight values: fp32(q) * scale of the 128x128 block, one fp32 rounding (the checkpoint's values; the rule of
linear_fp8 and transformers' Fp8Dequantize before its cast). Reference: those fp32 weights with every
rounding of fused_moe's reference — each projection computed in fp32 (bf16 x upcast, exact) and rounded to
x.dtype where fused_moe's bf16 matmul rounds its output, silu and the products in x.dtype, the routing
and the combine as there. With scales that make every weight exactly a bf16 value (powers of two), this is
fused_moe's reference on the dequantized weights up to summation order. Why fp32 weights and not the
weights rounded to x.dtype: the Triton kernels fold the block scale into the activations it multiplies (once
per column of a weight tile, for all the tile's rows), so a weight costs one e4m3 convert and one FMA, as a
bf16 weight does;
rounding each dequantized weight to bf16 first would add conversions per weight on a bandwidth-bound path,
and move the values away from the checkpoint's.
CPU lowering: this reference traced to aten (CI covers the path). CUDA lowering: custom_ops/triton/
fused_moe_fp8.py (decode: routing + SwiGLU kernel, down + combine kernel; T*k > E: grouped GEMMs).
"""
import math

import torch
import torch.nn.functional as F

from ._registry import check_shape, define_op
from .fused_moe import route
from .linear_fp8 import BLOCK, dequantize_blocks

SCHEMA = ("(Tensor x, Tensor logits, Tensor gate_up, Tensor gate_up_scale, Tensor down, Tensor down_scale, "
          "Tensor shared_gate, Tensor shared_gate_scale, Tensor shared_up, Tensor shared_up_scale, "
          "Tensor shared_down, Tensor shared_down_scale, int top_k, bool fp32_out=False) -> Tensor")
FP8 = torch.float8_e4m3fn
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _nb(n: int) -> int:
    return math.ceil(n / BLOCK)


def _validate(x, logits, gate_up, gate_up_scale, down, down_scale, shared_gate, shared_gate_scale, shared_up,
              shared_up_scale, shared_down, shared_down_scale, top_k, fp32_out=False):
    if x.dim() != 2 or gate_up.dim() != 3:
        raise ValueError(f"fused_moe_fp8: expected x [T, H] and gate_up [E, 2I, H], got {list(x.shape)} "
                         f"and {list(gate_up.shape)}")
    T, H = x.shape
    E, I2, _ = gate_up.shape
    if I2 % 2:
        raise ValueError(f"fused_moe_fp8 gate_up: expected [E, 2I, H] (gate rows then up rows), "
                         f"got {list(gate_up.shape)}")
    I, Is = I2 // 2, shared_gate.shape[0]
    check_shape(x, (T, H), "fused_moe_fp8 x", X_DTYPES)
    check_shape(logits, (T, E + 1), "fused_moe_fp8 logits (router logits + the shared expert's gate logit)", x.dtype)
    f32 = torch.float32
    for t, shape, what in ((gate_up, (E, I2, H), "gate_up"), (down, (E, H, I), "down"),
                           (shared_gate, (Is, H), "shared_gate"), (shared_up, (Is, H), "shared_up"),
                           (shared_down, (H, Is), "shared_down")):
        check_shape(t, shape, f"fused_moe_fp8 {what}", FP8)
    check_shape(gate_up_scale, (E, 2 * _nb(I), _nb(H)),
                "fused_moe_fp8 gate_up_scale (the gate rows' 128x128 block scales, then the up rows')", f32)
    check_shape(down_scale, (E, _nb(H), _nb(I)), "fused_moe_fp8 down_scale (one per 128x128 block)", f32)
    check_shape(shared_gate_scale, (_nb(Is), _nb(H)), "fused_moe_fp8 shared_gate_scale", f32)
    check_shape(shared_up_scale, (_nb(Is), _nb(H)), "fused_moe_fp8 shared_up_scale", f32)
    check_shape(shared_down_scale, (_nb(H), _nb(Is)), "fused_moe_fp8 shared_down_scale", f32)
    if not 0 < top_k <= E:
        raise ValueError(f"fused_moe_fp8 top_k: expected 1..{E}, got {top_k}")


def dequantize_gate_up(gate_up: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I, H] e4m3, scale [..., 2*ceil(I/128), ceil(H/128)] -> [..., 2I, H] fp32 (gate rows
    with the first ceil(I/128) block rows of scale, up rows with the rest)."""
    I = gate_up.shape[-2] // 2
    nb = _nb(I)
    return torch.cat([dequantize_blocks(gate_up[..., :I, :], scale[..., :nb, :]),
                      dequantize_blocks(gate_up[..., I:, :], scale[..., nb:, :])], dim=-2)


def _mm(a: torch.Tensor, w: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """a [..., K] (x.dtype) @ w [..., N, K].T (fp32) in fp32, rounded to dt once (a bf16 matmul's rounding)."""
    return F.linear(a.float(), w).to(dt)


def _swiglu(x, gate_w, up_w, dt):
    return F.silu(_mm(x, gate_w, dt)) * _mm(x, up_w, dt)


def reference_fused_moe_fp8(x, logits, gate_up, gate_up_scale, down, down_scale, shared_gate, shared_gate_scale,
                            shared_up, shared_up_scale, shared_down, shared_down_scale, top_k, fp32_out=False):
    T = x.shape[0]
    E, I2, _ = gate_up.shape
    I = I2 // 2
    dt = x.dtype
    od = torch.float32 if fp32_out else dt                                   # the down products' dtype
    w, idx = route(logits[:, :E], top_k)
    if T * top_k <= E:              # decode: dequantize only the selected experts (fused_moe's gather branch)
        gu = torch.einsum("th,tkih->tki", x.float(), dequantize_gate_up(gate_up[idx], gate_up_scale[idx])).to(dt)
        act = F.silu(gu[..., :I]) * gu[..., I:]                               # [T, k, I] in x.dtype
        y = torch.einsum("tki,tkhi->tkh", act.float(), dequantize_blocks(down[idx], down_scale[idx])).to(od)
        routed = (y * w[..., None].to(od)).sum(1)
    else:                           # prefill: fused_moe's per-expert loop, one expert dequantized at a time
        routed = torch.zeros_like(x, dtype=od)
        for e in range(E):
            we = (w * (idx == e)).sum(-1, keepdim=True)                      # [T, 1]
            gu_w = dequantize_gate_up(gate_up[e], gate_up_scale[e])
            act = _swiglu(x, gu_w[:I], gu_w[I:], dt)
            routed = routed + _mm(act, dequantize_blocks(down[e], down_scale[e]), od) * we.to(od)
    act = _swiglu(x, dequantize_blocks(shared_gate, shared_gate_scale), dequantize_blocks(shared_up, shared_up_scale),
                  dt)
    shared = _mm(act, dequantize_blocks(shared_down, shared_down_scale), od)
    return routed + torch.sigmoid(logits[:, E:]).to(od) * shared


def _fake(x, logits, gate_up, gate_up_scale, down, down_scale, shared_gate, shared_gate_scale, shared_up,
          shared_up_scale, shared_down, shared_down_scale, top_k, fp32_out=False):
    return torch.empty_like(x, dtype=torch.float32 if fp32_out else x.dtype)


fused_moe_fp8 = define_op("fused_moe_fp8", version=1, schema=SCHEMA, reference=reference_fused_moe_fp8,
                          validate=_validate, fake=_fake)
