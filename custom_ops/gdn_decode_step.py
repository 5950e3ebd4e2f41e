"""gdn_decode_step: one Gated DeltaNet token for B rows, fused: conv update + SiLU, gates, q/k L2
norm, the fp32 delta-rule state update and the read-out.

Inputs (HK key heads of dim K, HV value heads of dim V, HV a multiple of HK, C = 2*HK*K + HV*V):
  qkv [B, C] (in_proj_qkv output, pre-conv), a [B, HV], b [B, HV],
  conv_state [S, C, W-1], rec_state [S, HV, K, V] fp32, slots [B] int64,
  conv_weight [C, W], A_log [HV], dt_bias [HV], num_k_heads (HK).
Returns (out [B, HV, V] in qkv.dtype, new_conv_rows [B, C, W-1], new_rec_rows [B, HV, K, V] fp32).

Per head: beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias) (fp32);
S <- S * exp(g); S <- S + k (beta (v - S^T k))^T; out = S^T q, q scaled by K^-0.5.
Value head h reads key head h // (HV / HK). The caller scatters the new rows back at `slots`;
padding rows point at a scratch slot.
"""
import torch
import torch.nn.functional as F

from ._registry import check_shape, define_op
from .causal_conv_update import reference_causal_conv_update

SCHEMA = ("(Tensor qkv, Tensor a, Tensor b, Tensor conv_state, Tensor rec_state, Tensor slots, "
          "Tensor conv_weight, Tensor A_log, Tensor dt_bias, int num_k_heads) -> (Tensor, Tensor, Tensor)")


def _validate(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads):
    if rec_state.dim() != 4 or qkv.dim() != 2:
        raise ValueError(f"gdn_decode_step: expected qkv [B, C] and rec_state [S, HV, K, V], got "
                         f"{list(qkv.shape)} and {list(rec_state.shape)}")
    B, C = qkv.shape
    S, HV, K, V = rec_state.shape
    if HV % num_k_heads or C != 2 * num_k_heads * K + HV * V:
        raise ValueError(f"gdn_decode_step: qkv channels {C} != 2*{num_k_heads}*{K} + {HV}*{V} "
                         f"(or {HV} value heads not a multiple of {num_k_heads} key heads)")
    check_shape(rec_state, (S, HV, K, V), "gdn_decode_step rec_state", torch.float32)
    check_shape(a, (B, HV), "gdn_decode_step a")
    check_shape(b, (B, HV), "gdn_decode_step b")
    check_shape(conv_weight, (C, None), "gdn_decode_step conv_weight")
    check_shape(conv_state, (S, C, conv_weight.shape[1] - 1), "gdn_decode_step conv_state")
    check_shape(slots, (B,), "gdn_decode_step slots", torch.int64)
    check_shape(A_log, (HV,), "gdn_decode_step A_log")
    check_shape(dt_bias, (HV,), "gdn_decode_step dt_bias")


def l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gates(a, b, A_log, dt_bias):
    """a, b [..., HV] -> (g [..., HV] fp32 log-decay, beta [..., HV] fp32)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid().float()


def split_qkv(x, num_k_heads, K, HV, V):
    """x [N, C] -> q, k [N, HV, K] fp32 (key heads repeated to value heads, L2-normed, q scaled),
    v [N, HV, V] fp32."""
    kd = num_k_heads * K
    q, k, v = torch.split(x, [kd, kd, HV * V], dim=-1)
    rep = HV // num_k_heads
    q = q.reshape(-1, num_k_heads, K).repeat_interleave(rep, dim=1).float()
    k = k.reshape(-1, num_k_heads, K).repeat_interleave(rep, dim=1).float()
    q = l2norm(q) * (K ** -0.5)
    return q, l2norm(k), v.reshape(-1, HV, V).float()


def reference_gdn_decode_step(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias,
                              num_k_heads):
    _, HV, K, V = rec_state.shape
    x, new_conv = reference_causal_conv_update(qkv, conv_state, slots, conv_weight)
    q, k, v = split_qkv(x, num_k_heads, K, HV, V)                           # [B, HV, K|V]
    g, beta = gdn_gates(a, b, A_log, dt_bias)                                 # [B, HV]
    s = rec_state.index_select(0, slots) * g.exp()[..., None, None]          # [B, HV, K, V]
    kv_mem = (s * k[..., None]).sum(-2)                                       # [B, HV, V]
    delta = (v - kv_mem) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    out = (s * q[..., None]).sum(-2)                                          # [B, HV, V]
    return out.to(qkv.dtype), new_conv, s


def _fake(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads):
    B = qkv.shape[0]
    _, HV, K, V = rec_state.shape
    return (qkv.new_empty((B, HV, V)), conv_state.new_empty((B,) + tuple(conv_state.shape[1:])),
            rec_state.new_empty((B, HV, K, V)))


gdn_decode_step = define_op("gdn_decode_step", version=1, schema=SCHEMA, reference=reference_gdn_decode_step,
                            validate=_validate, fake=_fake)
