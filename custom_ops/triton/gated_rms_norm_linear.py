"""Triton lowering of gated_rms_norm_linear (contract: custom_ops/gated_rms_norm_linear.py).

One row (decode at batch 1): one launch of a GEMV whose prologue makes the gated-norm row in registers, so
the GDN layer's output norm needs no kernel of its own. Grid cdiv(N, BN); a program loads its [BN, HV, V]
weight rows first (they do not depend on the row, so their DRAM latency overlaps the prologue), then the
row's x and z [HV, V] (16 KB at 35B, from L2), normalises each head as gated_rms_norm's kernel does
(custom_ops/triton/norms.py: statistics in fp32, norm(x) rounded to the model dtype, w * that rounded to
promote(w, x), the fp32 SiLU gate, the output rounded to the model dtype) and multiplies it with its rows.
The sum runs in the [BN, HV, V] tile's order, another fp32 order than the plain GEMV's (as any tile change).
More rows (prefill chunks, larger decode buckets): the gated norm kernel, then the projection (two launches).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..gated_rms_norm_linear import _validate
from ._common import launch, next_pow2, rnd, to_dt
from .linear import project
from .norms import gated_rms_norm_heads

# (BN, warps) at one row: out_proj's plain GEMV tile at K = 4096 is one row per program, 8 warps (linear.py)
TILE = (1, 8)


@triton.jit   # named for tools/bench_common.py REGIONS: a projection ("gemv"), not a norm kernel
def _gemv_gated_prologue_kernel(x, z, nw, w, y, N, s_z_k, s_w_n, eps, HV: tl.constexpr, V: tl.constexpr,
                            HP: tl.constexpr, VP: tl.constexpr, BN: tl.constexpr, ROUND_MID: tl.constexpr):
    """y[0, n-tile] = gated_norm(x[0], z[0]) @ w[n-tile].T; x [1, HV*V] contiguous, z's row strided by s_z_k."""
    pid = tl.program_id(0)
    DT: tl.constexpr = y.dtype.element_ty
    XDT: tl.constexpr = x.dtype.element_ty
    rn = pid * BN + tl.arange(0, BN)
    mn = rn < N
    rh = tl.arange(0, HP)
    rv = tl.arange(0, VP)
    mhv = (rh < HV)[:, None] & (rv < V)[None, :]
    off = rh[:, None] * V + rv[None, :]                                                  # [HP, VP]
    # the weight load first: the row's L2 loads and per-head reductions then overlap its DRAM latency
    wt = tl.load(w + rn.to(tl.int64)[:, None, None] * s_w_n + off[None, :, :],
                 mask=mn[:, None, None] & mhv[None, :, :], other=0.0)                    # [BN, HP, VP]
    # the row's loads all before its reductions: one L2 latency, not one per operand
    xf = tl.load(x + off, mask=mhv, other=0.0).to(tl.float32)
    zf = tl.load(z + off * s_z_k, mask=mhv, other=0.0).to(tl.float32)
    wn = tl.load(nw + rv, mask=rv < V, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / V + tl.cast(eps, tl.float32))               # [HP]; AOTI passes fp64
    g = rnd(xf * inv[:, None], XDT)                                                      # norm(x).to(dtype)
    g = wn[None, :] * g                                                                  # weight * that, in
    if ROUND_MID:                                                                        # promote(w, x) = x.dtype
        g = rnd(g, XDT)
    row = rnd(g * zf * tl.sigmoid(zf), XDT)                                              # the norm's output
    acc = tl.sum(tl.sum(wt.to(tl.float32) * row[None, :, :], axis=2), axis=1)            # [BN]
    tl.store(y + rn, to_dt(acc, DT), mask=mn)


def gated_norm_gemv(x: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor,
                    cfg: tuple[int, int] | None = None) -> torch.Tensor:
    """The one-row form: x [1, HV*V], z [1, HV*V] (any column stride), w [N, HV*V] -> y [1, N]; cfg = (BN, warps)
    overrides the tile (benchmarks only)."""
    V = norm_w.shape[0]
    HV = x.shape[1] // V
    x, w = x.contiguous(), w.contiguous()
    N = w.shape[0]
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    bn, warps = cfg or TILE
    launch(_gemv_gated_prologue_kernel, (triton.cdiv(N, bn),), x, z, norm_w, w, y, N, z.stride(1), w.stride(0), eps,
           HV=HV, V=V, HP=next_pow2(HV), VP=next_pow2(V), BN=bn,
           ROUND_MID=torch.promote_types(norm_w.dtype, x.dtype) == x.dtype, num_warps=warps)
    return y


@triton_op("onegraph::gated_rms_norm_linear_triton", mutates_args=())
def gated_rms_norm_linear_triton(x: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, eps: float,
                                 w: torch.Tensor) -> torch.Tensor:
    _validate(x, z, norm_w, eps, w)
    M, V = x.shape[0], norm_w.shape[0]
    if M == 1:
        return gated_norm_gemv(x, z, norm_w, eps, w)
    normed = torch.empty((M, x.shape[1] // V, V), dtype=x.dtype, device=x.device)
    gated_rms_norm_heads(x.contiguous().view(normed.shape), z, norm_w, eps, normed)
    return project(normed.view(M, -1), w)


_registry.register_lowering("gated_rms_norm_linear", "triton",
                            torch.ops.onegraph.gated_rms_norm_linear_triton.default)
