"""Concatenated projections: the weights that read the same layer input become one weight.

At decode each projection is a GEMV, and at batch 1 a small one costs a fixed 3-5 us of launch and
ramp-up for a fraction of that in bytes (H200: in_proj_a / in_proj_b, 32 x 2048, took as long as a
33 MB matrix at half its bandwidth). So after loading (and after tensor-parallel sharding, which
splits each part by heads on its own), every layer's projections of one input are concatenated
along the output dimension:
  GatedDeltaNet  in_proj  = [in_proj_qkv; in_proj_z; in_proj_b; in_proj_a]   [C + HV*V + 2*HV, H]
  GatedAttention qkv_proj = [q_proj; k_proj; v_proj]                          [2*Hq*D + 2*KVH*D, H]
  SparseMoe      router   = [gate; shared_expert_gate]                        [E + 1, H]
and the module splits the output back into views. The checkpoint format stays the hub's; the artifact
stores the concatenated weights under these names, and `fuse_projections` is the only place that
knows the mapping. The CUDA GEMV chooses its tile from (rows, K) only, so a concatenated column is
computed exactly as the separate one was (custom_ops/triton/linear.py); aten's CPU GEMM may sum a
column in another order at M > 1 (fp32 differences of ~1e-6).

FP8 parts (checkpoint/quant.py: e4m3 weight + one scale per 128x128 block) concatenate weights and block scales
together, which is exact only where every part but the last is a whole number of 128-row blocks: then the
parts' scale rows stack into the fused weight's. A float part never joins an FP8 one. So the parts are
grouped into runs of consecutive parts that concatenate exactly, one projection per run, and the module
sees the runs' outputs concatenated (ConcatProj; a run of one is the plain projection, as before).
Requantizing a straddling block instead would change the checkpoint's values. Per-channel parts (int8 or
e4m3 with weight_scale [N, 1]) concatenate at any size (their scale rows stack), with parts of their own
kind only. Shapes:
  35B  GDN  qkv 8192 | z 4096 FP8, b 32 | a 32 bf16 (kept float) -> [qkv; z] + [b; a]
       attn q 8192 | k 512 | v 512 FP8 (all whole blocks)      -> [q; k; v]
  tiny GDN  qkv 256 | z 128 FP8, b 4 | a 4 float                 -> [qkv; z] + [b; a]
       attn q 256 | k 64 | v 64 FP8 (k is half a block)        -> [q; k] + [v]
"""
from __future__ import annotations

import torch
from torch import nn

from onegraph.checkpoint.quant import BLOCK, FP8
from onegraph.models.qwen3_5.linear import Linear

# module attribute -> (fused name, the parts in order)
FUSED = {"linear_attn": ("in_proj", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
         "self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "mlp": ("router", ("gate", "shared_expert_gate"))}        # a SparseMoe only (a dense MLP has no gate)


class ConcatProj(nn.Module):
    """Runs of concatenated projections of one input x [N, in] -> [N, sum of outs] (their outputs side by side)."""

    def __init__(self, runs: list[nn.Module]):
        super().__init__()
        self.runs = nn.ModuleList(runs)

    def forward(self, x):
        return torch.cat([run(x) for run in self.runs], dim=-1)


def _fp8(lin) -> bool:
    """Block FP8 (weight_scale_inv): concatenates along whole 128-row blocks only."""
    return lin.weight.dtype == FP8 and hasattr(lin, "weight_scale_inv")


def _kind(lin) -> tuple:
    """(weight dtype, scale name): parts concatenate with parts of the same kind only."""
    return lin.weight.dtype, _fp8(lin)


def runs(lins: list) -> list[list]:
    """The parts grouped into consecutive runs that concatenate exactly (module docstring)."""
    out = []
    for lin in lins:
        last = out[-1] if out else None
        if last is not None and _kind(last[0]) == _kind(lin) and (
                not _fp8(lin) or all(p.weight.shape[0] % BLOCK == 0 for p in last)):
            last.append(lin)
        else:
            out.append([lin])
    return out


def _concat(lins: list) -> nn.Module:
    if len(lins) == 1:
        return lins[0]
    w = torch.cat([lin.weight for lin in lins])
    bias = getattr(lins[0], "bias", None) is not None           # the MoE router `gate` has no bias attribute
    new = Linear(w.shape[1], w.shape[0], bias=bias, device="meta")
    new.weight = nn.Parameter(w, requires_grad=False)
    if _fp8(lins[0]):                        # [sum ceil(n_i/128), ceil(K/128)]: whole blocks but the last
        new.weight_scale_inv = nn.Parameter(torch.cat([lin.weight_scale_inv for lin in lins]), requires_grad=False)
    elif hasattr(lins[0], "weight_scale"):   # per-channel int8 / e4m3: [sum n_i, 1]
        new.weight_scale = nn.Parameter(torch.cat([lin.weight_scale for lin in lins]), requires_grad=False)
    if bias:
        new.bias = nn.Parameter(torch.cat([lin.bias for lin in lins]), requires_grad=False)
    return new


@torch.no_grad()
def fuse_projections(model: nn.Module) -> nn.Module:
    """Concatenate each layer's same-input projections in place (idempotent); returns the model."""
    for layer in model.layers:
        for attr, (fused, parts) in FUSED.items():
            mod = getattr(layer, attr, None)
            if mod is None or getattr(mod, fused, None) is not None or not all(hasattr(mod, p) for p in parts):
                continue
            lins = [getattr(mod, p) for p in parts]
            groups = [_concat(run) for run in runs(lins)]
            for p in parts:
                delattr(mod, p)
            setattr(mod, fused, groups[0] if len(groups) == 1 else ConcatProj(groups))
            mod.fused_sizes = [lin.weight.shape[0] for lin in lins]
    return model
