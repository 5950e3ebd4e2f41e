"""add_rms_norm: residual add fused with the zero-centred RMSNorm.

x [..., N], residual [..., N], weight [N] -> (rms_norm(x + residual), x + residual), both in
x.dtype. The sum is taken in the model dtype first, exactly as the decoder layer adds its residual.
"""
import torch

from ._registry import check_shape, define_op
from .rms_norm import reference_rms_norm

SCHEMA = "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)"


def _validate(x, residual, weight, eps):
    check_shape(residual, tuple(x.shape), "add_rms_norm residual")
    check_shape(weight, (x.shape[-1],), "add_rms_norm weight")


def reference_add_rms_norm(x, residual, weight, eps):
    s = residual + x
    return reference_rms_norm(s, weight, eps), s


add_rms_norm = define_op("add_rms_norm", version=1, schema=SCHEMA, reference=reference_add_rms_norm,
                         validate=_validate,
                         fake=lambda x, r, w, eps: (torch.empty_like(x), torch.empty_like(x)))
