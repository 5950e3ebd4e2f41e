"""Where the Triton kernel tests run, shared by every tests/test_triton_*.py (import it before any
onegraph.custom_ops.triton module):
- no CUDA device: in Triton's CPU interpreter — TRITON_INTERPRET=1 is set for THIS test process before the
  kernels are defined (triton.jit reads it then, and again lazily at the first launch, so it stays set);
- a CUDA device: compiled, plus the `cuda`-marked tests at Qwen3.5-35B-A3B shapes.
Without triton installed the kernel tests are skipped (`needs_triton`); fail-closed tests still run.
"""
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:                                   # no triton: the kernel tests skip
        _interp = None
    if _interp is not None and hasattr(_interp, "_patch_lang_tensor"):
        _patch = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            """Triton 3.6's interpreter makes a loaded scalar a Python int with int(array of shape (1,)),
            which NumPy >= 2.4 refuses: a kernel's `for i in range(lo, hi, step)` over run-time bounds (the
            form the compiler pipelines) would not run here. Same value, through .item()."""
            _patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))

        _interp._patch_lang_tensor = _patch_lang_tensor
    if _interp is not None and hasattr(_interp, "GridExecutor") and hasattr(_interp, "InterpretedFunction"):
        import inspect

        import triton.language as _tl

        _active: list[frozenset] = []       # the language modules patched by each running kernel launch
        _langs_of: dict = {}

        def _langs(fn) -> frozenset:
            if fn not in _langs_of:
                _langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                          if inspect.ismodule(v) and v in (_tl, _tl.core))
            return _langs_of[fn]

        _grid_call, _device_call = _interp.GridExecutor.__call__, _interp.InterpretedFunction.__call__

        def _grid_call_tracked(self, *args, **kwargs):
            _active.append(_langs(self.fn))
            try:
                return _grid_call(self, *args, **kwargs)
            finally:
                _active.pop()

        def _device_call_in_kernel(self, *args, **kwargs):
            """A @triton.jit helper called from a running kernel: Triton 3.6 re-patches the whole language
            (inspect.getmembers over triton.language, per call, per program) although the launch already
            patched the same modules: a quarter of a whole-model interpreter test's time. Skipped when the
            helper sees no language module the launch has not patched; the call itself is Triton's."""
            if not (_active and _langs(self.fn) <= _active[-1]):
                return _device_call(self, *args, **kwargs)
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise _interp.InterpreterError(repr(e)) from e

        _interp.GridExecutor.__call__ = _grid_call_tracked
        _interp.InterpretedFunction.__call__ = _device_call_in_kernel
from onegraph.custom_ops import triton as kernels  # noqa: E402

HAVE_TRITON = kernels.AVAILABLE
# kernels defined before this module set TRITON_INTERPRET (another import order) cannot run without a GPU
INTERPRETED = HAVE_TRITON and type(kernels.norms._rms_norm_kernel).__name__ == "InterpretedFunction"
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason=f"triton not installed ({kernels.IMPORT_ERROR})")
if HAVE_TRITON and not CUDA and not INTERPRETED:
    needs_triton = pytest.mark.skip(reason="kernels were defined without TRITON_INTERPRET and there is no GPU")
cuda_only = [pytest.mark.cuda, pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="needs a CUDA device and triton")]


# The head of a subprocess script (run without TRITON_INTERPRET) that asks Inductor's TTIR analysis which
# arguments a kernel writes, compiling for sm_90 without a GPU: defines `writes(kernel, kwargs) -> [names]`.
TTIR_WRITES = """
import torch, triton
from triton.backends.compiler import GPUTarget
from torch._higher_order_ops import triton_kernel_wrap as tkw

class _Sm90:                 # the analysis asks the active driver for a target; without a GPU there is none
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

if not torch.cuda.is_available():
    triton.runtime.driver.set_active(_Sm90())
if hasattr(tkw, "identify_accessed_tensors"):            # torch >= 2.12
    writes = lambda kernel, kw: [d.name for d in tkw.identify_accessed_tensors(kernel, kw, {}).read_writes.writes]
else:                                                     # torch 2.11 (the H200 image)
    writes = lambda kernel, kw: tkw.identify_mutated_tensors(kernel, kw, {})
"""


# For subprocess scripts that compile a package: collects torch's Triton-kernel analysis log lines in
# `warnings` (a script asserts none says "assuming every input is mutated"). Needs `import logging`.
CATCH_KERNEL_WARNINGS = """
warnings = []
class Catch(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").addHandler(Catch())
"""


def compare(got, ref, atol, max_frac, what):
    """max |got - ref| <= atol and at most a fraction `max_frac` of the elements differ at all."""
    got, ref = got.float().cpu(), ref.float().cpu()
    assert got.shape == ref.shape, f"{what}: shape {list(got.shape)} != {list(ref.shape)}"
    assert torch.isfinite(got).all() and torch.isfinite(ref).all(), f"{what}: non-finite values"
    diff = (got - ref).abs()
    err, frac = diff.max().item(), (diff > 0).float().mean().item()
    assert err <= atol, f"{what}: max abs error {err:.3g} > {atol:.3g}"
    assert frac <= max_frac, f"{what}: {frac:.2%} of elements differ (allowed {max_frac:.2%})"


def same_sums(y, plain, x, w):
    """y and plain are the same GEMV of x [M, K] by w [N, K] (a float copy of the weight, scales applied) summed
    in two orders: bit for bit in the interpreter; compiled, the reduction tree of a row held in registers is
    the compiler's choice, so within fp32 summation order (K * 2**-24 of sum |x||w| per output) plus one
    rounding of the output dtype (2**-7 relative: bf16's ulp; fp32's is inside the first term)."""
    if INTERPRETED:
        assert torch.equal(y, plain), (y.float() - plain.float()).abs().max()
        return
    bound = x.shape[1] * 2.0 ** -24 * (x.float().abs() @ w.float().abs().T)
    if y.dtype != torch.float32:
        bound = bound + 2.0 ** -7 * plain.float().abs()
    diff = (y.float() - plain.float()).abs()
    assert (diff <= bound).all(), f"{(diff - bound).max().item():.3g} past the summation-order bound"


def cuda_us(fn, reps: int = 50) -> float:
    """µs per call of fn() on the GPU (CUDA events around `reps` calls after 3 warm-up calls): printed beside
    a kernel's 35B-shape check, for orientation only (the benchmarks under benchmarks/ are the measurements)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def package_copies(src: str) -> list[str]:
    """The lines of an AOTInductor package's C++ source that copy a tensor (aoti_torch_clone*, aoti_torch_copy_),
    except the wrapper's alignment guards: a graph input compiled as 16-byte aligned is cloned only if its
    pointer is not aligned at run time (`aoti_torch_clone_preserve_strides(argN_1, &argN_1_aligned)` inside an
    `if (... & (16 -1)) != 0`), which the state and the caches never are."""
    import re
    guard = re.compile(r"aoti_torch_clone_preserve_strides\((\w+), &\1_aligned\)")
    return [ln.strip() for ln in src.splitlines()
            if re.search(r"aoti_torch_clone|aoti_torch_copy_", ln) and not guard.search(ln)]


def run_package_script(path, template: str, ok_line: str) -> None:
    """Writes `template` (formatted with tests= this folder) to `path`, runs it in a fresh Python and asserts it
    exits 0 having printed `ok_line`. A subprocess because on the H200 image loading an AOTInductor package
    segfaults unless LD_PRELOAD names the system libstdc++ (docs/design.md): a SIGSEGV says so."""
    import subprocess
    import sys
    path.write_text(template.format(tests=os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=900)
    hint = "" if res.returncode != -11 else (
        "\nSIGSEGV: run with LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6) (docs/design.md)")
    assert res.returncode == 0 and ok_line in res.stdout, res.stdout[-3000:] + res.stderr[-6000:] + hint


def routed_both_ways(op, args, monkeypatch):
    """fused_moe's decode kernels run by `op` on `args` both ways, routing in-kernel and routing first
    (fused_moe.PREROUTED forced) -> (in_kernel, first). Unforced, the op takes the way fused_moe.route_first
    picks, so two bit-identical outputs are also the unforced one."""
    from onegraph.custom_ops.triton import fused_moe as mod
    outs = {}
    for first in (False, True):
        monkeypatch.setattr(mod, "PREROUTED", first)
        outs[first] = op(*args)
    monkeypatch.setattr(mod, "PREROUTED", None)
    return outs[False], outs[True]
