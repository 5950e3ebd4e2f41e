"""causal_conv_prefill: the GDN depthwise causal conv (+ SiLU) over a chunk of one slot.

x [T, C]; conv_state [S, C, W-1]; slot [1] int64; n_valid [1] int64 (tokens n_valid..T-1 are
padding); weight [C, W]. -> (y [T, C] in x.dtype, new_state_row [1, C, W-1]).
The sequence is state ‖ x; the new state is the last W-1 *valid* inputs, so a padded chunk
leaves the same state as an exact one.
"""
import torch
import torch.nn.functional as F

from ._registry import check_shape, define_op

SCHEMA = "(Tensor x, Tensor conv_state, Tensor slot, Tensor n_valid, Tensor weight) -> (Tensor, Tensor)"


def _validate(x, conv_state, slot, n_valid, weight):
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"causal_conv_prefill: expected x [T, C] and weight [C, W], got "
                         f"{list(x.shape)} and {list(weight.shape)}")
    C = x.shape[1]
    check_shape(weight, (C, None), "causal_conv_prefill weight")
    check_shape(conv_state, (None, C, weight.shape[1] - 1), "causal_conv_prefill conv_state")
    check_shape(slot, (1,), "causal_conv_prefill slot", torch.int64)
    check_shape(n_valid, (1,), "causal_conv_prefill n_valid", torch.int64)


def reference_causal_conv_prefill(x, conv_state, slot, n_valid, weight):
    W = weight.shape[1]
    seq = torch.cat([conv_state.index_select(0, slot)[0], x.t().to(conv_state.dtype)], dim=-1)  # [C, W-1+T]
    y = F.conv1d(seq[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]  # [C, T]
    y = F.silu(y).t().to(x.dtype).contiguous()
    # the last W-1 valid inputs sit at seq positions n_valid .. n_valid + W - 2
    idx = (n_valid + torch.arange(W - 1, device=x.device))[None, :].expand(seq.shape[0], W - 1)
    return y, torch.gather(seq, 1, idx)[None]


def _fake(x, conv_state, slot, n_valid, weight):
    return torch.empty_like(x), x.new_empty((1, x.shape[1], weight.shape[1] - 1), dtype=conv_state.dtype)


causal_conv_prefill = define_op("causal_conv_prefill", version=1, schema=SCHEMA,
                                reference=reference_causal_conv_prefill, validate=_validate, fake=_fake)
