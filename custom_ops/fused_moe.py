"""fused_moe: the whole sparse-MoE block — router, top-k, renormalise, SwiGLU experts, weighted
combine, and the shared expert with its sigmoid gate.

x [T, H]; router_w [E, H]; gate_up [E, 2I, H] (gate rows first, then up); down [E, H, I];
shared_gate [Is, H]; shared_up [Is, H]; shared_down [H, Is]; shared_gate_w [1, H]; top_k.
-> y [T, H] in x.dtype.
Router logits in x.dtype, softmax in fp32, top-k, renormalised, cast to x.dtype; each selected
expert's output is scaled by its weight after the down projection.
The reference reads only the selected experts' weights when T*top_k <= E (decode), and loops over
all experts with a per-token weight otherwise (prefill): both are static, traceable graphs.
"""
import torch
import torch.nn.functional as F

from ._registry import check_shape, define_op

SCHEMA = ("(Tensor x, Tensor router_w, Tensor gate_up, Tensor down, Tensor shared_gate, Tensor shared_up, "
          "Tensor shared_down, Tensor shared_gate_w, int top_k) -> Tensor")


def _validate(x, router_w, gate_up, down, shared_gate, shared_up, shared_down, shared_gate_w, top_k):
    if x.dim() != 2 or gate_up.dim() != 3:
        raise ValueError(f"fused_moe: expected x [T, H] and gate_up [E, 2I, H], got {list(x.shape)} "
                         f"and {list(gate_up.shape)}")
    T, H = x.shape
    E, I2, _ = gate_up.shape
    check_shape(router_w, (E, H), "fused_moe router_w")
    check_shape(gate_up, (E, I2, H), "fused_moe gate_up")
    check_shape(down, (E, H, I2 // 2), "fused_moe down")
    Is = shared_gate.shape[0]
    check_shape(shared_gate, (Is, H), "fused_moe shared_gate")
    check_shape(shared_up, (Is, H), "fused_moe shared_up")
    check_shape(shared_down, (H, Is), "fused_moe shared_down")
    check_shape(shared_gate_w, (1, H), "fused_moe shared_gate_w")
    if not 0 < top_k <= E:
        raise ValueError(f"fused_moe top_k: expected 1..{E}, got {top_k}")


def route(x, router_w, top_k):
    """-> (weights [T, k] in x.dtype, experts [T, k] int64)."""
    probs = torch.softmax(F.linear(x, router_w), dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, top_k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).to(x.dtype), idx


def swiglu(x, gate_w, up_w, down_w):
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


def reference_fused_moe(x, router_w, gate_up, down, shared_gate, shared_up, shared_down, shared_gate_w, top_k):
    T = x.shape[0]
    E, I2, _ = gate_up.shape
    w, idx = route(x, router_w, top_k)
    if T * top_k <= E:
        gu = torch.einsum("th,tkih->tki", x, gate_up[idx])                  # [T, k, 2I]
        act = F.silu(gu[..., : I2 // 2]) * gu[..., I2 // 2:]
        y = torch.einsum("tki,tkhi->tkh", act, down[idx])                    # [T, k, H]
        routed = (y * w[..., None]).sum(1)
    else:
        routed = torch.zeros_like(x)
        for e in range(E):
            we = (w * (idx == e)).sum(-1, keepdim=True)                      # [T, 1]
            gu = F.linear(x, gate_up[e])
            routed = routed + F.linear(F.silu(gu[:, : I2 // 2]) * gu[:, I2 // 2:], down[e]) * we
    shared = swiglu(x, shared_gate, shared_up, shared_down)
    return routed + torch.sigmoid(F.linear(x, shared_gate_w)) * shared


fused_moe = define_op("fused_moe", version=1, schema=SCHEMA, reference=reference_fused_moe,
                      validate=_validate, fake=lambda x, *rest: torch.empty_like(x))
