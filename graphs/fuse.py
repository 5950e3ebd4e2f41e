"""Concatenated projections: the weights that read the same layer input become one weight.

At decode each projection is a GEMV, and at batch 1 a small one costs a fixed 3-5 us of launch and
ramp-up for a fraction of that in bytes (H200: in_proj_a / in_proj_b, 32 x 2048, took as long as a
33 MB matrix at half its bandwidth). So after loading (and after tensor-parallel sharding, which
splits each part by heads on its own), every layer's projections of one input are concatenated
along the output dimension:
  GatedDeltaNet  in_proj  = [in_proj_qkv; in_proj_z; in_proj_b; in_proj_a]   [C + HV*V + 2*HV, H]
  GatedAttention qkv_proj = [q_proj; k_proj; v_proj]                          [2*Hq*D + 2*KVH*D, H]
and the module splits the output back into views. The checkpoint format stays the hub's; the artifact
stores the concatenated weights under these names, and `fuse_projections` is the only place that
knows the mapping. The CUDA GEMV chooses its tile from (rows, K) only, so a concatenated column is
computed exactly as the separate one was (custom_ops/triton/linear.py); aten's CPU GEMM may sum a
column in another order at M > 1 (fp32 differences of ~1e-6).
"""
from __future__ import annotations

import torch
from torch import nn

# module attribute -> (fused name, the parts in order)
FUSED = {"linear_attn": ("in_proj", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
         "self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj"))}


@torch.no_grad()
def fuse_projections(model: nn.Module) -> nn.Module:
    """Concatenate each layer's same-input projections in place (idempotent); returns the model."""
    from .qwen3_5 import Linear
    for layer in model.layers:
        for attr, (fused, parts) in FUSED.items():
            mod = getattr(layer, attr, None)
            if mod is None or getattr(mod, fused, None) is not None:
                continue
            lins = [getattr(mod, p) for p in parts]
            w = torch.cat([lin.weight for lin in lins])
            bias = lins[0].bias is not None
            new = Linear(w.shape[1], w.shape[0], bias=bias, device="meta")
            new.weight = nn.Parameter(w, requires_grad=False)
            if bias:
                new.bias = nn.Parameter(torch.cat([lin.bias for lin in lins]), requires_grad=False)
            for p in parts:
                delattr(mod, p)
            setattr(mod, fused, new)
            mod.fused_sizes = [lin.weight.shape[0] for lin in lins]
    return model
