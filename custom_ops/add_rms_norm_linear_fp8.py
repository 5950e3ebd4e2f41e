"""add_rms_norm_linear_fp8: add_rms_norm_linear with a block-FP8 weight (linear_fp8's): the residual add and
zero-centred RMSNorm, then the projection of the normed rows by an e4m3 weight with 128x128 block scales.

x [M, K], residual [M, K], norm_w [K], eps, w [N, K] float8_e4m3fn, scale [ceil(N/128), ceil(K/128)] fp32,
tail [Nt, K] x.dtype or None
-> (y [M, N + Nt] = linear_fp8(normed, w, scale, tail), normed [M, K], h [M, K] = x + residual), all in x.dtype;
(normed, h) are exactly add_rms_norm(x, residual, norm_w, eps).
Why: in an FP8 model a layer's input norm feeds an FP8 projection (the GDN in_proj's e4m3 run with its float
[b; a] tail, attention's [q; k; v]); at batch 1 export/fold_norm.py folds the norm into it as add_rms_norm_linear
does for bf16. The tail (linear_fp8's) keeps the float rows in the same launch, reading the same normed row.
Reference: the two ops' references composed.
"""
from ._registry import check_shape, define_op
from .add_rms_norm import reference_add_rms_norm
from .linear_fp8 import X_DTYPES, _validate as _validate_fp8, out_features, reference_linear_fp8

SCHEMA = ("(Tensor x, Tensor residual, Tensor norm_w, float eps, Tensor w, Tensor scale, Tensor? tail=None) "
          "-> (Tensor, Tensor, Tensor)")


def _validate(x, residual, norm_w, eps, w, scale, tail=None):
    check_shape(x, (None, None), "add_rms_norm_linear_fp8 x", X_DTYPES)
    check_shape(residual, tuple(x.shape), "add_rms_norm_linear_fp8 residual", x.dtype)
    check_shape(norm_w, (x.shape[1],), "add_rms_norm_linear_fp8 norm_w")
    _validate_fp8(x, w, scale, tail)


def reference_add_rms_norm_linear_fp8(x, residual, norm_w, eps, w, scale, tail=None):
    normed, h = reference_add_rms_norm(x, residual, norm_w, eps)
    return reference_linear_fp8(normed, w, scale, tail), normed, h


def _fake(x, residual, norm_w, eps, w, scale, tail=None):
    return x.new_empty((x.shape[0], out_features(w, tail))), x.new_empty(x.shape), x.new_empty(x.shape)


add_rms_norm_linear_fp8 = define_op("add_rms_norm_linear_fp8", version=2, schema=SCHEMA,
                                    reference=reference_add_rms_norm_linear_fp8, validate=_validate, fake=_fake)
