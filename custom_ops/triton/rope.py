"""Triton lowering of rope: partial rotary embedding, rotate-half form (contract: custom_ops/rope.py).

One elementwise kernel, grid (N, cdiv(H, BH)): a program rotates BH heads of one token, the whole
head ([BH, BD] tile, BD = next_pow2(D)). Column i < rot pairs with i + rot/2 (first half) or
i - rot/2 (second half), read as a second, shifted load of the same tile; columns >= rot are copied.
cos/sin of position * inv_freq[i mod rot/2] are computed once per token in fp32 and rounded to
x.dtype, as the reference does.

Numerics follow the reference: x * cos and rotated * sin are each rounded to x.dtype before the
sum (rounded again), so bf16 outputs are bit-exact unless cos/sin land on a different side of a bf16
rounding boundary (torch's and Triton's fp32 cos/sin differ by an ulp or so): then 1 bf16 ulp.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .. import _registry
from ..rope import _validate
from ._common import launch, next_pow2, rnd, to_dt


@triton.jit
def _rope_kernel(x, positions, inv_freq, y, s_x_n, s_x_h, s_x_d, s_y_n, s_y_h, H,
                 D: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    n = tl.program_id(0)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    mh = offs_h < H
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    DT: tl.constexpr = x.dtype.element_ty
    rot = offs_d < 2 * HALF                                      # rotated columns
    first = offs_d < HALF
    # angle of column i: position * inv_freq[i mod HALF] (fp32 product, as positions.float() * inv_freq)
    fi = tl.where(first, offs_d, offs_d - HALF)
    freq = tl.load(inv_freq + fi, mask=rot, other=0.0).to(tl.float32)
    ang = tl.load(positions + n).to(tl.float32) * freq            # [BD]
    cos = rnd(tl.cos(ang), DT)
    sin = rnd(tl.sin(ang), DT)
    row = x + n * s_x_n + offs_h[:, None] * s_x_h
    m2 = mh[:, None] & md[None, :]
    xv = tl.load(row + offs_d[None, :] * s_x_d, mask=m2, other=0.0).to(tl.float32)      # [BH, BD]
    # rotate_half: -x[i + HALF] for the first half, x[i - HALF] for the second
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    xp = tl.load(row + partner[None, :] * s_x_d, mask=m2 & rot[None, :], other=0.0).to(tl.float32)
    xp = tl.where(first[None, :], -xp, xp)
    out = rnd(rnd(xv * cos[None, :], DT) + rnd(xp * sin[None, :], DT), DT)
    out = tl.where(rot[None, :], out, xv)                         # dims rot..D pass through
    tl.store(y + n * s_y_n + offs_h[:, None] * s_y_h + offs_d[None, :], to_dt(out, DT), mask=m2)


@triton_op("onegraph::rope_triton", mutates_args=())
def rope_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    _validate(x, positions, inv_freq)
    positions, inv_freq = positions.contiguous(), inv_freq.contiguous()   # read with unit stride
    N, H, D = x.shape
    y = torch.empty((N, H, D), dtype=x.dtype, device=x.device)
    BD = next_pow2(D)
    BH = min(next_pow2(H), max(1, 4096 // BD))                   # <= 4096 elements per program
    launch(_rope_kernel, (N, triton.cdiv(H, BH)), x, positions, inv_freq, y, *x.stride(), y.stride(0), y.stride(1),
           H, D=D, HALF=inv_freq.shape[0], BH=BH, BD=BD, num_warps=4)
    return y


_registry.register_lowering("rope", "triton", torch.ops.onegraph.rope_triton.default)
