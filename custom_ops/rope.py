"""rope: partial rotary position embedding (rotate-half form) on the first `rot` dims of each head.

x [N, H, D], positions [N] int64, inv_freq [rot/2] fp32 -> x' [N, H, D] in x.dtype.
cos/sin are computed in fp32 from positions * inv_freq and cast to x.dtype before use, as the
reference model does; dims rot..D pass through unchanged.
"""
import torch

from ._registry import check_shape, define_op

SCHEMA = "(Tensor x, Tensor positions, Tensor inv_freq) -> Tensor"


def _validate(x, positions, inv_freq):
    if x.dim() != 3:
        raise ValueError(f"rope x: expected shape [N, H, D], got {list(x.shape)}")
    check_shape(positions, (x.shape[0],), "rope positions", torch.int64)
    if 2 * inv_freq.shape[-1] > x.shape[-1]:
        raise ValueError(f"rope inv_freq: rotary dims {2 * inv_freq.shape[-1]} exceed head_dim {x.shape[-1]}")


def reference_rope(x, positions, inv_freq):
    rot = 2 * inv_freq.shape[0]
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]          # [N, rot/2]
    emb = torch.cat((freqs, freqs), dim=-1)                                  # [N, rot]
    cos = emb.cos().to(x.dtype)[:, None, :]                                  # [N, 1, rot]
    sin = emb.sin().to(x.dtype)[:, None, :]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((xr * cos + rotated * sin, xp), dim=-1)


rope = define_op("rope", version=1, schema=SCHEMA, reference=reference_rope, validate=_validate,
                 fake=lambda x, p, f: torch.empty_like(x))
