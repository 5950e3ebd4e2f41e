"""Per-expert checkpoint tensors grouped by layer prefix and expert index: the step both the float weights
(checkpoint/weights.py fuse_experts) and their FP8 block scales (checkpoint/quant.py fuse_expert_scales)
take before stacking the experts into [E, ...] tensors."""
from __future__ import annotations

import torch


def group_experts(tensors: dict[str, torch.Tensor], match) -> tuple[dict, dict[str, torch.Tensor]]:
    """Split tensors by match(key) (a regex match of (prefix, expert index, gate|up|down), or None) ->
    ({prefix: {expert: {part: tensor}}}, the tensors that did not match)."""
    per: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for k, v in tensors.items():
        m = match(k)
        if m:
            per.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
        else:
            out[k] = v
    return per, out
