"""causal_conv_update: one step of the GDN depthwise causal conv (+ SiLU) for B rows.

x [B, C]; conv_state [S, C, W-1] (the last W-1 inputs of every slot); slots [B] int64;
weight [C, W]. -> (y [B, C] in x.dtype, new_state_rows [B, C, W-1]).
The window is state ‖ x; y = silu(sum(window * weight)); the new state drops the oldest tap.
The caller writes new_state_rows back at `slots` (functional op: it mutates nothing).
"""
import torch
import torch.nn.functional as F

from ._registry import check_shape, define_op

SCHEMA = "(Tensor x, Tensor conv_state, Tensor slots, Tensor weight) -> (Tensor, Tensor)"


def _validate(x, conv_state, slots, weight):
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"causal_conv_update: expected x [B, C] and weight [C, W], got "
                         f"{list(x.shape)} and {list(weight.shape)}")
    B, C = x.shape
    check_shape(weight, (C, None), "causal_conv_update weight")
    check_shape(conv_state, (None, C, weight.shape[1] - 1), "causal_conv_update conv_state")
    check_shape(slots, (B,), "causal_conv_update slots", torch.int64)


def reference_causal_conv_update(x, conv_state, slots, weight):
    window = torch.cat([conv_state.index_select(0, slots), x[:, :, None].to(conv_state.dtype)], dim=-1)
    y = F.silu((window.to(weight.dtype) * weight[None]).sum(-1))             # [B, C]
    return y.to(x.dtype), window[:, :, 1:].contiguous()          # contiguous, as the fake says


def _fake(x, conv_state, slots, weight):
    return torch.empty_like(x), x.new_empty((x.shape[0], x.shape[1], weight.shape[1] - 1),
                                            dtype=conv_state.dtype)


causal_conv_update = define_op("causal_conv_update", version=1, schema=SCHEMA,
                               reference=reference_causal_conv_update, validate=_validate, fake=_fake)
