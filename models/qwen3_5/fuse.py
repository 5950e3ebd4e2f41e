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
parts' scale rows stack into the fused weight's. A float part never joins an FP8 one's weight. So the parts are
grouped into runs of consecutive parts that concatenate exactly, one weight per run. A float run right after a
block-FP8 run rides in its launch as onegraph::linear_fp8's `tail` (Fp8WithTail: the float rows are extra
programs of the FP8 kernel, custom_ops/triton/linear_fp8.py), so an FP8 model's GDN in_proj is one launch as a
bf16 model's is (its own launch for the 64 x 2048 [b; a] cost ~2 us at batch 1, 30 a 35B step). Runs left
apart are one projection each and the module sees their outputs concatenated (ConcatProj; a run of one is the
plain projection, as before). Requantizing a straddling block instead would change the checkpoint's values.
Per-channel parts (int8 or e4m3 with weight_scale [N, 1]) concatenate at any size (their scale rows stack),
with parts of their own kind only, and take no tail. Shapes (launches separated by +):
  35B  GDN  qkv 8192 | z 4096 FP8, b 32 | a 32 bf16 (kept float) -> [qkv; z; tail b; a]   (Fp8WithTail)
       attn q 8192 | k 512 | v 512 FP8 (all whole blocks)      -> [q; k; v]
  tiny GDN  qkv 256 | z 128 FP8, b 4 | a 4 float                 -> [qkv; z; tail b; a]   (Fp8WithTail)
       attn q 256 | k 64 | v 64 FP8 (k is half a block)        -> [q; k] + [v]           (ConcatProj)
`projection_groups` describes the result for the artifact's manifest (export/pipeline.py, `onegraph inspect`).
"""
from __future__ import annotations

import torch
from torch import nn

from onegraph.checkpoint.quant import BLOCK, FP8
from onegraph.models.qwen3_5.linear import Linear, ops

# module attribute -> (fused name, the parts in order)
FUSED = {"linear_attn": ("in_proj", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
         "self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "mlp": ("router", ("gate", "shared_expert_gate"))}        # a SparseMoe only (a dense MLP has no gate)


class Fp8WithTail(nn.Module):
    """A block-FP8 run and the float run after it as one projection of x [M, in] -> [M, out + tail rows], one
    onegraph::linear_fp8 call: weight [out, in] e4m3, weight_scale_inv [ceil(out/128), ceil(in/128)] fp32,
    tail [tail rows, in] of the model dtype (the float run's weight)."""

    def __init__(self, fp8: nn.Module, tail: nn.Module):
        super().__init__()
        self.weight, self.weight_scale_inv, self.tail = fp8.weight, fp8.weight_scale_inv, tail.weight

    def forward(self, x):
        return ops.linear_fp8(x, self.weight, self.weight_scale_inv, self.tail)


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


def rows(proj: nn.Module) -> int:
    """The output columns of a fused projection (an Fp8WithTail's tail included)."""
    return proj.weight.shape[0] + (proj.tail.shape[0] if isinstance(proj, Fp8WithTail) else 0)


def _float(lin) -> bool:
    """A plain float projection (no scales, no bias, no fp32 output): what a tail can be."""
    return (lin.weight.dtype in (torch.float32, torch.bfloat16, torch.float16) and getattr(lin, "bias", None) is None
            and not getattr(lin, "fp32_out", False) and not hasattr(lin, "weight_scale"))


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


def _with_tails(groups: list[nn.Module]) -> list[nn.Module]:
    """Each block-FP8 projection followed by a float one becomes an Fp8WithTail (module docstring)."""
    out = []
    for g in groups:
        last = out[-1] if out else None
        if last is not None and not isinstance(last, Fp8WithTail) and _fp8(last) and _float(g) \
                and getattr(last, "bias", None) is None and not getattr(last, "fp32_out", False):
            out[-1] = Fp8WithTail(last, g)
        else:
            out.append(g)
    return out


@torch.no_grad()
def fuse_projections(model: nn.Module) -> nn.Module:
    """Concatenate each layer's same-input projections in place (idempotent); returns the model."""
    for layer in model.layers:
        for attr, (fused, parts) in FUSED.items():
            mod = getattr(layer, attr, None)
            if mod is None or getattr(mod, fused, None) is not None or not all(hasattr(mod, p) for p in parts):
                continue
            lins = [getattr(mod, p) for p in parts]
            groups = _with_tails([_concat(run) for run in runs(lins)])
            for p in parts:
                delattr(mod, p)
            setattr(mod, fused, groups[0] if len(groups) == 1 else ConcatProj(groups))
            mod.fused_sizes = [lin.weight.shape[0] for lin in lins]
    return model


def _dtype(t: torch.Tensor) -> str:
    return "e4m3" if t.dtype == FP8 else str(t.dtype).removeprefix("torch.")


def _describe(proj: nn.Module) -> str:
    """One launch as "<weight dtype> <rows>[ per-channel][ with <dtype> tail <rows>]": "e4m3 384 with float32 tail 8",
    "e4m3 64" (block scales), "int8 320 per-channel", "bfloat16 4104"."""
    desc = f"{_dtype(proj.weight)} {proj.weight.shape[0]}" + (" per-channel" if hasattr(proj, "weight_scale") else "")
    if isinstance(proj, Fp8WithTail):
        desc += f" with {_dtype(proj.tail)} tail {proj.tail.shape[0]}"
    return desc


def projection_groups(model: nn.Module) -> dict[str, dict[str, int]]:
    """The fused projections as launched: "<module>.<fused name>" -> {a layer's launches: number of layers}, the
    launches joined by " + " (35B FP8: {"linear_attn.in_proj": {"e4m3 12288 with bfloat16 tail 64": 30}, ...}; tiny
    FP8: {"self_attn.qkv_proj": {"e4m3 320 + e4m3 64": 1}, ...}; an unfused layer is not counted). For the
    artifact's manifest, so `onegraph inspect` shows how the projections run."""
    out: dict[str, dict[str, int]] = {}
    for layer in model.layers:
        for attr, (fused, _) in FUSED.items():
            proj = getattr(getattr(layer, attr, None), fused, None)
            if proj is None:
                continue
            launches = " + ".join(_describe(p) for p in (proj.runs if isinstance(proj, ConcatProj) else [proj]))
            per = out.setdefault(f"{attr}.{fused}", {})
            per[launches] = per.get(launches, 0) + 1
    return out
