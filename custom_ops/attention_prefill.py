"""attention_prefill: causal attention of a chunk of T tokens of one slot over its KV cache.

q [T, H, D]; k_cache, v_cache [S, KVH, Tmax, D] (already holding the chunk's k/v); slot [1] int64;
start_pos [1] int64; scale. Token i sits at position start_pos + i and attends j <= start_pos + i.
-> out [T, H, D] in q.dtype.
"""
import torch

from ._registry import check_shape, define_op
from .attention_decode import masked_attention

SCHEMA = ("(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slot, Tensor start_pos, float scale)"
          " -> Tensor")


def _validate(q, k_cache, v_cache, slot, start_pos, scale):
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"attention_prefill: expected q [T, H, D] and k_cache [S, KVH, Tmax, D], got "
                         f"{list(q.shape)} and {list(k_cache.shape)}")
    S, KVH, Tm, D = k_cache.shape
    check_shape(q, (None, None, D), "attention_prefill q")
    check_shape(v_cache, (S, KVH, Tm, D), "attention_prefill v_cache")
    check_shape(slot, (1,), "attention_prefill slot", torch.int64)
    check_shape(start_pos, (1,), "attention_prefill start_pos", torch.int64)


def reference_attention_prefill(q, k_cache, v_cache, slot, start_pos, scale):
    T, Tm = q.shape[0], k_cache.shape[2]
    k = k_cache.index_select(0, slot)                                        # [1, KVH, Tm, D]
    v = v_cache.index_select(0, slot)
    pos = start_pos + torch.arange(T, device=q.device)                       # [T]
    allowed = (torch.arange(Tm, device=q.device)[None, :] <= pos[:, None])[None, None]  # [1,1,T,Tm]
    out = masked_attention(q.transpose(0, 1)[None], k, v, allowed, scale)   # [1, H, T, D]
    return out[0].transpose(0, 1).contiguous()


attention_prefill = define_op("attention_prefill", version=1, schema=SCHEMA,
                              reference=reference_attention_prefill, validate=_validate,
                              fake=lambda q, kc, vc, s, p, sc: torch.empty_like(q))
