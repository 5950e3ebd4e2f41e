"""attention_decode: one query token per row against that row's slot of the KV cache (GQA), times
the output gate.

q [B, H, D]; k_cache, v_cache [S, KVH, Tmax, D] (already holding this step's k/v: the model
writes them with index_put before the call); slots [B] int64; positions [B] int64; scale float;
gate [B, H, D] (the gate half of q_proj's query ‖ gate, a strided view is fine).
Row b attends cache[slots[b], :, j] for j <= positions[b]. -> attention(...) * sigmoid(gate)
[B, H, D] in q.dtype. Softmax in fp32, probabilities cast to q.dtype before the value matmul (as the
reference model); the attention output and sigmoid(gate) are each rounded to q.dtype before their
product, as the gated attention layer computes them. The gate is part of the op so the CUDA
lowering applies it in the combine kernel's epilogue instead of a separate elementwise launch.
"""
import torch

from ._registry import check_shape, define_op

SCHEMA = ("(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor positions, float scale, Tensor gate)"
          " -> Tensor")


def _validate(q, k_cache, v_cache, slots, positions, scale, gate):
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
    check_shape(gate, (B, H, D), "attention_decode gate", q.dtype)


def masked_attention(q, k, v, allowed, scale):
    """q [B, H, Q, D], k/v [B, KVH, T, D], allowed [B, 1, Q, T] bool -> [B, H, Q, D]."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def reference_attention_decode(q, k_cache, v_cache, slots, positions, scale, gate):
    T = k_cache.shape[2]
    k = k_cache.index_select(0, slots)                                       # [B, KVH, T, D]
    v = v_cache.index_select(0, slots)
    j = torch.arange(T, device=q.device)
    allowed = (j[None, :] <= positions[:, None])[:, None, None, :]           # [B, 1, 1, T]
    out = masked_attention(q[:, :, None, :], k, v, allowed, scale)           # [B, H, 1, D]
    return out[:, :, 0, :] * torch.sigmoid(gate)                             # [B, H, D]


attention_decode = define_op("attention_decode", version=2, schema=SCHEMA,
                             reference=reference_attention_decode, validate=_validate,
                             fake=lambda q, kc, vc, s, p, sc, g: torch.empty(q.shape, dtype=q.dtype, device=q.device))
