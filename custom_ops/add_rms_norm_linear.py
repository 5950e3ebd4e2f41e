"""add_rms_norm_linear: the residual add and zero-centred RMSNorm of add_rms_norm, then a projection of
the normed rows — the norm folded into the projection that consumes it.

x [M, K], residual [M, K], norm_w [K], eps, w [N, K] (w.dtype == x.dtype)
-> (y [M, N] = normed @ w.T, normed [M, K], h [M, K] = x + residual), all in x.dtype;
(normed, h) are exactly add_rms_norm(x, residual, norm_w, eps) and y is linear(normed, w).
Why one op: at decode a standalone norm kernel reads a few KB and costs a launch (about 2.5 us each on
the H200, 80 per 35B step); the CUDA lowering (custom_ops/triton/add_rms_norm_linear.py) makes the normed
rows in the GEMV's prologue instead. The MoE block uses it for its router projection (the router logits
and the shared expert's gate logit), whose normed rows the experts then read.
Reference: the two ops' references composed, so CPU artifacts and eager compute what they did before.
"""
import torch

from ._registry import check_shape, define_op
from .add_rms_norm import reference_add_rms_norm
from .linear import reference_linear

SCHEMA = "(Tensor x, Tensor residual, Tensor norm_w, float eps, Tensor w) -> (Tensor, Tensor, Tensor)"


def _validate(x, residual, norm_w, eps, w):
    check_shape(x, (None, None), "add_rms_norm_linear x")
    check_shape(residual, tuple(x.shape), "add_rms_norm_linear residual", x.dtype)
    check_shape(norm_w, (x.shape[1],), "add_rms_norm_linear norm_w")
    check_shape(w, (None, x.shape[1]), "add_rms_norm_linear w", x.dtype)


def reference_add_rms_norm_linear(x, residual, norm_w, eps, w):
    normed, h = reference_add_rms_norm(x, residual, norm_w, eps)
    return reference_linear(normed, w), normed, h


def _fake(x, residual, norm_w, eps, w):
    return x.new_empty((x.shape[0], w.shape[0])), torch.empty_like(x), torch.empty_like(x)


add_rms_norm_linear = define_op("add_rms_norm_linear", version=1, schema=SCHEMA,
                                reference=reference_add_rms_norm_linear, validate=_validate, fake=_fake)
