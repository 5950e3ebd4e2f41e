"""attention_decode: one query token per row against that row's slot of the KV cache (GQA).

q [B, H, D]; k_cache, v_cache [S, KVH, Tmax, D] (already holding this step's k/v: the model
writes them with index_put before the call); slots [B] int64; positions [B] int64; scale float.
Row b attends cache[slots[b], :, j] for j <= positions[b]. -> out [B, H, D] in q.dtype.
Softmax in fp32, probabilities cast to q.dtype before the value matmul (as the reference model).
"""
import torch

from ._registry import check_shape, define_op

SCHEMA = ("(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor positions, float scale)"
          " -> Tensor")


def _validate(q, k_cache, v_cache, slots, positions, scale):
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"attention_decode: expected q [B, H, D] and k_cache [S, KVH, Tmax, D], got "
                         f"{list(q.shape)} and {list(k_cache.shape)}")
    B, H, D = q.shape
    S, KVH, T, _ = k_cache.shape
    check_shape(k_cache, (S, KVH, T, D), "attention_decode k_cache")
    check_shape(v_cache, (S, KVH, T, D), "attention_decode v_cache")
    if H % KVH:
        raise ValueError(f"attention_decode: {H} query heads not a multiple of {KVH} kv heads")
    check_shape(slots, (B,), "attention_decode slots", torch.int64)
    check_shape(positions, (B,), "attention_decode positions", torch.int64)


def masked_attention(q, k, v, allowed, scale):
    """q [B, H, Q, D], k/v [B, KVH, T, D], allowed [B, 1, Q, T] bool -> [B, H, Q, D]."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def reference_attention_decode(q, k_cache, v_cache, slots, positions, scale):
    T = k_cache.shape[2]
    k = k_cache.index_select(0, slots)                                       # [B, KVH, T, D]
    v = v_cache.index_select(0, slots)
    j = torch.arange(T, device=q.device)
    allowed = (j[None, :] <= positions[:, None])[:, None, None, :]           # [B, 1, 1, T]
    out = masked_attention(q[:, :, None, :], k, v, allowed, scale)           # [B, H, 1, D]
    return out[:, :, 0, :]


attention_decode = define_op("attention_decode", version=1, schema=SCHEMA,
                             reference=reference_attention_decode, validate=_validate,
                             fake=lambda q, kc, vc, s, p, sc: torch.empty_like(q))
