"""fused_moe: the sparse-MoE block after its router projection — top-k, renormalise, SwiGLU experts,
weighted combine, and the shared expert with its sigmoid gate.

x [T, H]; logits [T, E + 1] in x.dtype: x @ [router_w; shared_gate_w].T, the E router logits then the
shared expert's gate logit (one projection, models/qwen3_5/model.py SparseMoe: at decode it is the GEMV that
also applies the post-attention RMSNorm, custom_ops/add_rms_norm_linear.py, so the MoE block needs no
norm kernel and no GEMV of its own); gate_up [E, 2I, H] (gate rows first, then up); down [E, H, I];
shared_gate [Is, H]; shared_up [Is, H]; shared_down [H, Is]; top_k; fp32_out.
-> y [T, H] in x.dtype, or in fp32 when fp32_out.
Softmax of the router logits in fp32, top-k, renormalised, cast to x.dtype; each selected expert's
output is scaled by its weight after the down projection; the shared expert's output by
sigmoid(gate logit) in x.dtype.
fp32_out: everything up to the SwiGLU activations is unchanged (rounded to x.dtype); the
down projections, their weighting, the expert sum and the gated shared expert stay in fp32 and are
returned unrounded. Under tensor parallel each rank's output is a partial sum over its slice of the
intermediate dim; summing fp32 partials and rounding once makes the result independent of the TP
degree (models/qwen3_5/model.py `fp32_reduce`), where per-rank bf16 outputs would round differently per TP.
The reference reads only the selected experts' weights when T*top_k <= E (decode), and loops over
all experts with a per-token weight otherwise (prefill): both are static, traceable graphs.
"""
import torch
import torch.nn.functional as F

from ._registry import check_shape, define_op

SCHEMA = ("(Tensor x, Tensor logits, Tensor gate_up, Tensor down, Tensor shared_gate, Tensor shared_up, "
          "Tensor shared_down, int top_k, bool fp32_out=False) -> Tensor")


def _validate(x, logits, gate_up, down, shared_gate, shared_up, shared_down, top_k, fp32_out=False):
    if x.dim() != 2 or gate_up.dim() != 3:
        raise ValueError(f"fused_moe: expected x [T, H] and gate_up [E, 2I, H], got {list(x.shape)} "
                         f"and {list(gate_up.shape)}")
    T, H = x.shape
    E, I2, _ = gate_up.shape
    check_shape(logits, (T, E + 1), "fused_moe logits (router logits + the shared expert's gate logit)", x.dtype)
    check_shape(gate_up, (E, I2, H), "fused_moe gate_up")
    check_shape(down, (E, H, I2 // 2), "fused_moe down")
    Is = shared_gate.shape[0]
    check_shape(shared_gate, (Is, H), "fused_moe shared_gate")
    check_shape(shared_up, (Is, H), "fused_moe shared_up")
    check_shape(shared_down, (H, Is), "fused_moe shared_down")
    if not 0 < top_k <= E:
        raise ValueError(f"fused_moe top_k: expected 1..{E}, got {top_k}")


def route(logits, top_k):
    """logits [T, E] -> (weights [T, k] in logits.dtype, experts [T, k] int64)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, top_k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).to(logits.dtype), idx


def swiglu(x, gate_w, up_w, down_w, out_dtype=None):
    """down(silu(gate(x)) * up(x)); out_dtype fp32: the down projection's fp32 accumulation, unrounded
    (bf16 products are exact in fp32, so upcasting the operands is that accumulation)."""
    act = F.silu(F.linear(x, gate_w)) * F.linear(x, up_w)
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(act, down_w)
    return F.linear(act.to(out_dtype), down_w.to(out_dtype))


def reference_fused_moe(x, logits, gate_up, down, shared_gate, shared_up, shared_down, top_k, fp32_out=False):
    T = x.shape[0]
    E, I2, _ = gate_up.shape
    od = torch.float32 if fp32_out else x.dtype                              # the down products' dtype
    w, idx = route(logits[:, :E], top_k)
    if T * top_k <= E:
        gu = torch.einsum("th,tkih->tki", x, gate_up[idx])                  # [T, k, 2I]
        act = F.silu(gu[..., : I2 // 2]) * gu[..., I2 // 2:]
        y = torch.einsum("tki,tkhi->tkh", act.to(od), down[idx].to(od))      # [T, k, H]
        routed = (y * w[..., None].to(od)).sum(1)
    else:
        routed = torch.zeros_like(x, dtype=od)
        for e in range(E):
            we = (w * (idx == e)).sum(-1, keepdim=True)                      # [T, 1]
            gu = F.linear(x, gate_up[e])
            act = F.silu(gu[:, : I2 // 2]) * gu[:, I2 // 2:]
            routed = routed + F.linear(act.to(od), down[e].to(od)) * we.to(od)
    shared = swiglu(x, shared_gate, shared_up, shared_down, od)
    return routed + torch.sigmoid(logits[:, E:]).to(od) * shared


def _fake(x, logits, gate_up, down, shared_gate, shared_up, shared_down, top_k, fp32_out=False):
    return torch.empty_like(x, dtype=torch.float32 if fp32_out else x.dtype)


fused_moe = define_op("fused_moe", version=3, schema=SCHEMA, reference=reference_fused_moe,
                      validate=_validate, fake=_fake)
