"""qk_norm_rope: the gated attention layer's per-head q/k RMSNorm followed by partial rotary embedding.

q [N, Hq, D], k [N, KVH, D] (strided views of the fused q|k|v projection output are fine: the q
half of query ‖ gate has row stride 2*D per head), q_weight [D], k_weight [D], positions [N] int64,
inv_freq [rot/2] fp32, eps -> (q' [N, Hq, D], k' [N, KVH, D]) in q.dtype, contiguous.

Exactly the composition rope(rms_norm(x, w, eps), positions, inv_freq) applied to q and to k, with
the references of custom_ops/rms_norm.py and custom_ops/rope.py, so every rounding to the model
dtype happens where those two ops round (the norm's output, cos/sin, each product, the sum). One op
so the CUDA lowering is one kernel launch for both heads' norms and rotations.
"""
import torch

from ._registry import check_shape, define_op
from .rms_norm import reference_rms_norm
from .rope import reference_rope

SCHEMA = ("(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor positions, Tensor inv_freq, float eps)"
          " -> (Tensor, Tensor)")


def _validate(q, k, q_weight, k_weight, positions, inv_freq, eps):
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"qk_norm_rope: expected q [N, Hq, D] and k [N, KVH, D], got {list(q.shape)} "
                         f"and {list(k.shape)}")
    N, _, D = q.shape
    check_shape(k, (N, None, D), "qk_norm_rope k", q.dtype)
    check_shape(q_weight, (D,), "qk_norm_rope q_weight")
    check_shape(k_weight, (D,), "qk_norm_rope k_weight", q_weight.dtype)
    check_shape(positions, (N,), "qk_norm_rope positions", torch.int64)
    if inv_freq.dim() != 1 or 2 * inv_freq.shape[0] > D:
        raise ValueError(f"qk_norm_rope inv_freq: expected [rot/2] with rot <= head_dim {D}, got "
                         f"{list(inv_freq.shape)}")


def reference_qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps):
    return (reference_rope(reference_rms_norm(q, q_weight, eps), positions, inv_freq),
            reference_rope(reference_rms_norm(k, k_weight, eps), positions, inv_freq))


qk_norm_rope = define_op("qk_norm_rope", version=1, schema=SCHEMA, reference=reference_qk_norm_rope,
                         validate=_validate,
                         fake=lambda q, k, wq, wk, p, f, eps: (torch.empty(q.shape, dtype=q.dtype, device=q.device),
                                                               torch.empty(k.shape, dtype=q.dtype, device=q.device)))
