"""gdn_decode_step_norm: one Gated DeltaNet decode token with the layer's output norm folded in:
gdn_decode_step, then gated_rms_norm over each value head's V values. One op, so the CUDA lowering
is one kernel per layer instead of two (at batch 1 each launch costs about as much as the work).

Inputs: those of gdn_decode_step (custom_ops/gdn_decode_step.py) plus
  z [B, HV*V] (in_proj_z output, the gate; may be a strided view of the fused projection output),
  norm_weight [V] (plain w, not 1 + w), eps.
Returns (y [B, HV, V] in qkv.dtype, new_conv_rows [B, C, W-1], new_rec_rows [B, HV, K, V] fp32), where
  out, new_conv_rows, new_rec_rows = gdn_decode_step(qkv, a, b, conv_state, rec_state, slots, ...)
  y = gated_rms_norm(out.reshape(-1, V), z.reshape(-1, V), norm_weight, eps).reshape(B, HV, V)
exactly (the reference is that composition, so a CPU artifact computes the values it did before the
fold). The caller scatters the new rows back at `slots` (an export pass may turn that into an in-place
update: export/inplace.py).
"""
import torch

from ._registry import check_shape, define_op
from .gdn_decode_step import _validate as _validate_step

SCHEMA = ("(Tensor qkv, Tensor a, Tensor b, Tensor z, Tensor conv_state, Tensor rec_state, Tensor slots, "
          "Tensor conv_weight, Tensor A_log, Tensor dt_bias, Tensor norm_weight, int num_k_heads, float eps) "
          "-> (Tensor, Tensor, Tensor)")


def _validate(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads,
              eps):
    _validate_step(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads)
    _, HV, _, V = rec_state.shape
    check_shape(z, (qkv.shape[0], HV * V), "gdn_decode_step_norm z")
    check_shape(norm_weight, (V,), "gdn_decode_step_norm norm_weight")


def reference_gdn_decode_step_norm(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias,
                                   norm_weight, num_k_heads, eps):
    # through the two registered ops, so an export that keeps gdn_decode_step (ONNX translates it) still
    # finds it here; their own references make the CPU decomposition
    ops = torch.ops.onegraph
    out, new_conv, new_rec = ops.gdn_decode_step(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log,
                                                 dt_bias, num_k_heads)
    V = out.shape[-1]
    y = ops.gated_rms_norm(out.reshape(-1, V), z.reshape(-1, V), norm_weight, eps)
    return y.reshape(out.shape), new_conv, new_rec


def _fake(qkv, a, b, z, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, norm_weight, num_k_heads, eps):
    B = qkv.shape[0]
    _, HV, K, V = rec_state.shape
    return (qkv.new_empty((B, HV, V)), conv_state.new_empty((B,) + tuple(conv_state.shape[1:])),
            rec_state.new_empty((B, HV, K, V)))


gdn_decode_step_norm = define_op("gdn_decode_step_norm", version=1, schema=SCHEMA,
                                 reference=reference_gdn_decode_step_norm, validate=_validate, fake=_fake)
