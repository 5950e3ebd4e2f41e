"""Triton lowerings of rms_norm, add_rms_norm and gated_rms_norm: one program per row, the whole
row (N <= a few thousand) in registers (contracts: custom_ops/{rms_norm,add_rms_norm,gated_rms_norm}.py).

Rows are x.reshape(-1, N) with their real row stride, so a strided view (the q half of q_proj's
query ‖ gate output) is read in place, not copied. Outputs are new contiguous tensors.
Numerics follow the references: statistics in fp32; add_rms_norm rounds the sum to the model dtype
before normalising; gated_rms_norm rounds norm(x) to x.dtype and w * that to promote(w, x) before
the fp32 SiLU gate.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..add_rms_norm import _validate as _validate_add
from ..gated_rms_norm import _validate as _validate_gated
from ..rms_norm import _validate as _validate_rms
from ._common import launch, next_pow2, rnd, to_dt


@triton.jit
def _rms_norm_kernel(x, res, w, y, s_out, sx_r, sx_n, sr_r, sr_n, sy_r, N, eps,
                     HAS_RES: tl.constexpr, BN: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.arange(0, BN)
    m = offs < N
    v = tl.load(x + r * sx_r + offs * sx_n, mask=m, other=0.0)
    if HAS_RES:  # s = residual + x in the model dtype, returned as the new residual stream
        rv = tl.load(res + r * sr_r + offs * sr_n, mask=m, other=0.0)
        v = to_dt(rv.to(tl.float32) + v.to(tl.float32), x.dtype.element_ty)
        tl.store(s_out + r * sy_r + offs, v, mask=m)
    xf = v.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + tl.cast(eps, tl.float32))   # AOTI passes floats as fp64
    wf = tl.load(w + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y + r * sy_r + offs, to_dt(xf * inv * (1.0 + wf), y.dtype.element_ty), mask=m)


@triton.jit
def _gated_rms_norm_kernel(x, z, w, y, sx_r, sx_n, sz_r, sz_n, sy_r, N, eps,
                           ROUND_MID: tl.constexpr, BN: tl.constexpr, ZH: tl.constexpr):
    """Row r of x, y; z's row r is row r // ZH of z at column offset (r % ZH) * N (ZH > 1: z [B, ZH * N]
    holds ZH heads per row, a strided view of a fused projection output that cannot be reshaped in place)."""
    r = tl.program_id(0)
    offs = tl.arange(0, BN)
    m = offs < N
    xf = tl.load(x + r * sx_r + offs * sx_n, mask=m, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + tl.cast(eps, tl.float32))   # AOTI passes floats as fp64
    yv = rnd(xf * inv, x.dtype.element_ty)                                  # norm(x).to(dtype)
    yv = tl.load(w + offs, mask=m, other=0.0).to(tl.float32) * yv          # weight * that, in
    if ROUND_MID:                                                           # promote(w, x) = x.dtype
        yv = rnd(yv, x.dtype.element_ty)
    zf = tl.load(z + (r // ZH) * sz_r + ((r % ZH) * N + offs) * sz_n, mask=m, other=0.0).to(tl.float32)
    tl.store(y + r * sy_r + offs, to_dt(yv * zf * tl.sigmoid(zf), y.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _warps(bn: int) -> int:
    return 1 if bn <= 256 else 4 if bn <= 2048 else 8


@triton_op("onegraph::rms_norm_triton", mutates_args=())
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _validate_rms(x, weight, eps)
    N = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    BN = next_pow2(N)
    launch(_rms_norm_kernel, (x2.shape[0],), x2, x2, weight, y, y, *x2.stride(), *x2.stride(), N, N, eps,
           HAS_RES=False, BN=BN, num_warps=_warps(BN))
    return y


@triton_op("onegraph::add_rms_norm_triton", mutates_args=())
def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _validate_add(x, residual, weight, eps)
    N = x.shape[-1]
    x2, r2 = _rows(x), _rows(residual)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    BN = next_pow2(N)
    launch(_rms_norm_kernel, (x2.shape[0],), x2, r2, weight, y, s, *x2.stride(), *r2.stride(), N, N, eps,
           HAS_RES=True, BN=BN, num_warps=_warps(BN))
    return y, s


@triton_op("onegraph::gated_rms_norm_triton", mutates_args=())
def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _validate_gated(x, z, weight, eps)
    N = x.shape[-1]
    x2, z2 = _rows(x), _rows(z)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    BN = next_pow2(N)
    launch(_gated_rms_norm_kernel, (x2.shape[0],), x2, z2, weight, y, *x2.stride(), *z2.stride(), N, N, eps,
           ROUND_MID=torch.promote_types(weight.dtype, x.dtype) == x.dtype, BN=BN, ZH=1, num_warps=_warps(BN))
    return y


def gated_rms_norm_heads(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, y: torch.Tensor) -> None:
    """y [B, HV, V] (contiguous) = gated_rms_norm of o [B, HV, V] (contiguous) with the gate z [B, HV*V] (a
    strided column view is read in place): gdn_decode_step_norm's output norm as its own launch."""
    B, HV, V = o.shape
    BN = next_pow2(V)
    launch(_gated_rms_norm_kernel, (B * HV,), o, z, weight, y, V, 1, *z.stride(), V, V, eps,
           ROUND_MID=torch.promote_types(weight.dtype, o.dtype) == o.dtype, BN=BN, ZH=HV, num_warps=_warps(BN))


_registry.register_lowering("rms_norm", "triton", torch.ops.onegraph.rms_norm_triton.default)
_registry.register_lowering("add_rms_norm", "triton", torch.ops.onegraph.add_rms_norm_triton.default)
_registry.register_lowering("gated_rms_norm", "triton", torch.ops.onegraph.gated_rms_norm_triton.default)
