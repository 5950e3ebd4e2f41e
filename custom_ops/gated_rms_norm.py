"""gated_rms_norm: the GDN output norm, y = (w * norm(x).to(dtype)) * silu(z), plain w (not 1 + w).

x [N, V], z [N, V], weight [V] -> y [N, V] in x.dtype; normalisation and gate in fp32.
"""
import torch
import torch.nn.functional as F

from ._registry import check_shape, define_op

SCHEMA = "(Tensor x, Tensor z, Tensor weight, float eps) -> Tensor"


def _validate(x, z, weight, eps):
    check_shape(z, tuple(x.shape), "gated_rms_norm z")
    check_shape(weight, (x.shape[-1],), "gated_rms_norm weight")


def reference_gated_rms_norm(x, z, weight, eps):
    dtype = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * y.to(dtype)
    return (y * F.silu(z.float())).to(dtype)


gated_rms_norm = define_op("gated_rms_norm", version=1, schema=SCHEMA, reference=reference_gated_rms_norm,
                           validate=_validate, fake=lambda x, z, w, eps: torch.empty_like(x))
