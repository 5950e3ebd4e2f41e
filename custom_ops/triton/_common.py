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


# Programmatic dependent launch (PDL, Hopper and later; docs/design.md). A kernel that declares a constexpr
# `PDL` is launched with PDL = PDL_MODE on such a device: it loads what no kernel of a step writes (its
# weights) first, then runs pdl_wait() (griddepcontrol.wait: returns once the predecessor grid has completed
# and its writes are visible) and adds the wait's zero to every other pointer, so none of those accesses can
# precede it; at PDL == 2 it first runs pdl_trigger() (griddepcontrol.launch_dependents), which lets its
# successor be launched once every block of this one has started. Launched plainly, both instructions return at
# once, so the compiled kernel is the same; a captured decode graph turns the edges into these kernels into
# programmatic ones (runtime/pdl.py), so each is launched, and streams its weights, while its predecessor drains.
# PDL_MODE 0 compiles them without; benchmarks set it to compare. PDL_KERNELS: the names launched with it.
PDL_MODE = 0
PDL_KERNELS: set[str] = set()


@triton.jit
def pdl_wait():
    """griddepcontrol.wait, -> an int32 zero (times 16, so pointers keep their 16-element alignment).
    Pure, and a data dependency of every address after it, rather than Triton's side-effecting gdc_wait: torch's
    mutation analysis of a wrapped kernel cannot analyze a side-effecting inline asm (it then treats every
    argument as mutated: wrong AOTInductor outputs). The zero is %nctaid.z - 1 (every grid here is at most 2-D,
    launch() checks), which neither LLVM nor ptxas can fold, so no access that adds it is scheduled above it."""
    z = tl.inline_asm_elementwise("griddepcontrol.wait;\n\tmov.u32 $0, %nctaid.z;\n\tsub.u32 $0, $0, 1;",
                                  "=r", [], dtype=tl.int32, is_pure=True, pack=1)
    return z * 16


@triton.jit
def pdl_trigger():
    """griddepcontrol.launch_dependents, -> an int32 zero (times 16) the caller adds to its weight pointers (a
    pure asm whose result is unused would be removed)."""
    z = tl.inline_asm_elementwise("griddepcontrol.launch_dependents;\n\tmov.u32 $0, %nctaid.z;\n\tsub.u32 $0, $0, 1;",
                                  "=r", [], dtype=tl.int32, is_pure=True, pack=1)
    return z * 16


def pdl_device(dev: torch.device) -> bool:
    """Compiled (not interpreted) kernels on a CUDA device of compute capability >= 9: griddepcontrol exists."""
    return (not INTERPRETED and dev.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(dev)[0] >= 9)


def pdl_kernel_names() -> list[str]:
    """The kernels of this package that declare PDL: those a graph lowered here with PDL_MODE on may hold, each
    waiting for its predecessor (the manifest records them; runtime/pdl.py rewrites the edges into them)."""
    import importlib
    import pkgutil
    pkg = importlib.import_module(__package__)
    names = set()
    for m in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{__package__}.{m.name}")
        names.update(v.fn.__name__ for v in vars(mod).values()
                     if isinstance(v, triton.runtime.jit.JITFunction) and "PDL" in v.arg_names)
    return sorted(names)


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
    if "PDL" in kernel.arg_names and "PDL" not in meta and PDL_MODE:
        dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if dev is not None and pdl_device(dev):
            if len(grid) > 2:
                raise ValueError(f"{kernel.fn.__name__}: a PDL kernel's grid is at most 2-D (pdl_wait's zero)")
            meta["PDL"] = PDL_MODE
            PDL_KERNELS.add(kernel.fn.__name__)
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
