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
from onegraph.custom_ops import triton as kernels  # noqa: E402

HAVE_TRITON = kernels.AVAILABLE
# kernels defined before this module set TRITON_INTERPRET (another import order) cannot run without a GPU
INTERPRETED = HAVE_TRITON and type(kernels.norms._rms_norm_kernel).__name__ == "InterpretedFunction"
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason=f"triton not installed ({kernels.IMPORT_ERROR})")
if HAVE_TRITON and not CUDA and not INTERPRETED:
    needs_triton = pytest.mark.skip(reason="kernels were defined without TRITON_INTERPRET and there is no GPU")
cuda_only = [pytest.mark.cuda, pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="needs a CUDA device and triton")]
