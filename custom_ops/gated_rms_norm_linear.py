"""gated_rms_norm_linear: the GDN layer's output norm (gated_rms_norm over each value head) and the projection
that reads it (out_proj) in one op — the norm folded into the projection that consumes it.

x [M, HV*V] (the GDN step's output, heads flattened), z [M, HV*V] (the gate; may be a strided column view of
the fused in_proj output), norm_w [V] (plain w, not 1 + w), eps, w [N, HV*V] (w.dtype == x.dtype)
-> y [M, N] = linear(gated_rms_norm(x.reshape(-1, V), z.reshape(-1, V), norm_w, eps).reshape(M, -1), w).
Why one op: at batch 1 the norm is a kernel of its own for 16 KB (35B: 30 a step); the CUDA lowering
(custom_ops/triton/gated_rms_norm_linear.py) makes the normed row in the GEMV's prologue instead. Put in the
graph by an export fold at batch 1 (export/fold_norm.py), never by the model.
Reference: the two ops' references composed, so CPU and eager compute what the unfused pair computes.
"""
import torch

from ._registry import check_shape, define_op
from .gated_rms_norm import reference_gated_rms_norm
from .linear import reference_linear

SCHEMA = "(Tensor x, Tensor z, Tensor norm_w, float eps, Tensor w) -> Tensor"


def _validate(x, z, norm_w, eps, w):
    check_shape(x, (None, None), "gated_rms_norm_linear x")
    check_shape(z, tuple(x.shape), "gated_rms_norm_linear z")
    check_shape(norm_w, (None,), "gated_rms_norm_linear norm_w")
    V = norm_w.shape[0]
    if V == 0 or x.shape[1] % V:
        raise ValueError(f"gated_rms_norm_linear: x's {x.shape[1]} columns are not whole heads of norm_w's {V}")
    check_shape(w, (None, x.shape[1]), "gated_rms_norm_linear w", x.dtype)


def reference_gated_rms_norm_linear(x, z, norm_w, eps, w):
    V = norm_w.shape[0]
    y = reference_gated_rms_norm(x.reshape(-1, V), z.reshape(-1, V), norm_w, eps)
    return reference_linear(y.reshape(x.shape), w)


gated_rms_norm_linear = define_op("gated_rms_norm_linear", version=1, schema=SCHEMA,
                                  reference=reference_gated_rms_norm_linear, validate=_validate,
                                  fake=lambda x, z, norm_w, eps, w: x.new_empty((x.shape[0], w.shape[0])))
