"""Helpers shared by the Triton lowerings (imported only when triton is installed)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _is_traced(t) -> bool:
    return isinstance(t, torch.Tensor) and torch._subclasses.fake_tensor.is_fake(t)


def launch(kernel, grid, *args, **meta) -> None:
    """kernel[grid](*args, **meta) through `wrap_triton`, so tracing (export fake mode, AOTInductor)
    records the kernel instead of running it.

    wrap_triton hands back the raw kernel when it is an interpreted function (TRITON_INTERPRET=1, the
    CPU test mode): such a kernel cannot run on fake tensors, and while tracing under fake tensors
    there is nothing to compute, so the launch is skipped there. Real (compiled) kernels never take
    that branch: wrap_triton returns a traceable wrapper for them.
    """
    if any(g == 0 for g in grid):
        return
    k = wrap_triton(kernel)
    if k is kernel and any(_is_traced(a) for a in args):
        return
    k[grid](*args, **meta)


@triton.jit
def _rne_bf16(x):
    """fp32 -> fp32 holding the nearest bf16 (ties to even), by integer arithmetic on the bits."""
    b = x.to(tl.uint32, bitcast=True)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.to(tl.float32, bitcast=True)


@triton.jit
def to_dt(x, DT: tl.constexpr):
    """Cast fp32 `x` to DT rounding to nearest-even, as torch does. bf16 is rounded by hand (then the
    cast is exact) because the Triton interpreter's fp32 -> bf16 cast truncates; on the GPU both agree."""
    if DT == x.dtype:
        return x
    elif DT == tl.bfloat16:
        return _rne_bf16(x.to(tl.float32)).to(tl.bfloat16)
    else:
        return x.to(DT)


@triton.jit
def rnd(x, DT: tl.constexpr):
    """Round fp32 `x` through dtype DT and back: reproduces where the reference rounds to the model
    dtype (a bf16 matmul output, a bf16 sigmoid, ...), so bf16 results track it closely."""
    if DT == tl.bfloat16:
        return _rne_bf16(x)
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def mma(a, b, acc, DOT_F32: tl.constexpr):
    """acc + a @ b in fp32. fp32 operands use IEEE fp32 (tf32 would miss the fp32 tolerance).
    DOT_F32 (True only for interpreted kernels): Triton's CPU interpreter multiplies bf16 tl.dot operands
    as their raw uint16 bits (triton 3.6 interpreter create_dot), so there they are upcast first (exact;
    same products, fp32 accumulation). Compiled kernels keep bf16 operands (tensor cores)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    elif DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


# Interpreted kernels (TRITON_INTERPRET=1 in the CPU tests) need the bf16 dot workaround in `mma`.
INTERPRETED = not isinstance(mma, triton.runtime.jit.JITFunction)
