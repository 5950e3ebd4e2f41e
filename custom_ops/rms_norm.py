"""rms_norm: Qwen3.5's zero-centred RMSNorm, y = x / rms(x) * (1 + w), computed in fp32.

x [..., N], weight [N] -> y [..., N] in x.dtype. (1 + w) is applied before casting back, as the
reference model does ((x * w).to(dtype), not x.to(dtype) * w).
"""
import torch

from ._registry import check_shape, define_op

SCHEMA = "(Tensor x, Tensor weight, float eps) -> Tensor"


def _validate(x, weight, eps):
    check_shape(weight, (x.shape[-1],), "rms_norm weight")


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


rms_norm = define_op("rms_norm", version=1, schema=SCHEMA, reference=reference_rms_norm,
                     validate=_validate, fake=lambda x, w, eps: torch.empty_like(x))
