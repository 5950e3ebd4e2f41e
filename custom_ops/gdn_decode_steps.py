"""gdn_decode_steps: T consecutive Gated DeltaNet decode tokens of each of B slots, keeping the state after every
one: a speculative verify's GDN layer (graphs/spec_graphs.py), one op where T gdn_decode_step calls read and
wrote the state T times.

Inputs (as gdn_decode_step, custom_ops/gdn_decode_step.py, with a position axis T):
  qkv [B, T, C] (pre-conv), a [B, T, HV], b [B, T, HV], conv_state [S, C, W-1], rec_state [S, HV, K, V] fp32,
  slots [B] int64, conv_weight [C, W], A_log [HV], dt_bias [HV], num_k_heads.
Returns (out [B, T, HV, V] in qkv.dtype, conv_after [T, B, C, W-1], rec_after [T, B, HV, K, V] fp32):
position j of row b is gdn_decode_step over qkv[b, j] from the state after position j-1 (the slot's rows of
conv_state / rec_state before position 0), and conv_after[j, b] / rec_after[j, b] is the state after it.
conv_state and rec_state are not written: the caller commits the snapshot of the accepted length.
"""
import torch

from ._registry import check_shape, define_op
from .gdn_decode_step import _validate as _validate_step, reference_gdn_decode_step

SCHEMA = ("(Tensor qkv, Tensor a, Tensor b, Tensor conv_state, Tensor rec_state, Tensor slots, "
          "Tensor conv_weight, Tensor A_log, Tensor dt_bias, int num_k_heads) -> (Tensor, Tensor, Tensor)")


def _validate(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads):
    if qkv.dim() != 3:
        raise ValueError(f"gdn_decode_steps: expected qkv [B, T, C], got {list(qkv.shape)}")
    B, T, _ = qkv.shape
    if T < 1:
        raise ValueError("gdn_decode_steps: qkv holds no position (T = 0)")
    check_shape(a, (B, T, None), "gdn_decode_steps a")          # the head count: gdn_decode_step's checks below
    check_shape(b, (B, T, None), "gdn_decode_steps b")
    _validate_step(qkv[:, 0], a[:, 0], b[:, 0], conv_state, rec_state, slots, conv_weight, A_log, dt_bias,
                   num_k_heads)


def reference_gdn_decode_steps(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads):
    B, T, _ = qkv.shape
    conv_j, rec_j = conv_state.index_select(0, slots), rec_state.index_select(0, slots)
    rows = torch.arange(B, device=qkv.device)                                  # the B rows of conv_j / rec_j
    outs, convs, recs = [], [], []
    for j in range(T):
        out, conv_j, rec_j = reference_gdn_decode_step(qkv[:, j], a[:, j], b[:, j], conv_j, rec_j, rows,
                                                       conv_weight, A_log, dt_bias, num_k_heads)
        outs.append(out)
        convs.append(conv_j)
        recs.append(rec_j)
    return torch.stack(outs, 1), torch.stack(convs), torch.stack(recs)


def _fake(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads):
    B, T, _ = qkv.shape
    _, HV, K, V = rec_state.shape
    return (qkv.new_empty((B, T, HV, V)), conv_state.new_empty((T, B) + tuple(conv_state.shape[1:])),
            rec_state.new_empty((T, B, HV, K, V)))


gdn_decode_steps = define_op("gdn_decode_steps", version=1, schema=SCHEMA, reference=reference_gdn_decode_steps,
                             validate=_validate, fake=_fake)
