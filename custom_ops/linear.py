"""linear: y = x @ w.T in x.dtype (a projection without bias; the caller adds a bias).

x [M, K], w [N, K] (same dtype) -> y [M, N].
Reference: F.linear, so a CPU artifact (decomposed to aten) and the eager model compute exactly what
they did before this op existed. CUDA lowering (custom_ops/triton/linear.py): at decode sizes
(M <= GEMV_MAX_M) a Triton GEMV whose tile depends on (M, K) only, never on N, so a weight
concatenated along N (models/qwen3_5/fuse.py) gives each output column the very sum the separate weight gave;
above that, the aten GEMM (cuBLAS), which is at bandwidth or compute bound there.
"""
import torch
import torch.nn.functional as F

from ._registry import check_shape, define_op

SCHEMA = "(Tensor x, Tensor w) -> Tensor"


def _validate(x, w):
    check_shape(x, (None, None), "linear x")
    check_shape(w, (None, x.shape[1]), "linear w")
    if x.dtype != w.dtype:
        raise ValueError(f"linear: x is {x.dtype} but w is {w.dtype}")


def reference_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


linear = define_op("linear", version=1, schema=SCHEMA, reference=reference_linear, validate=_validate,
                   fake=lambda x, w: x.new_empty((x.shape[0], w.shape[0])))
