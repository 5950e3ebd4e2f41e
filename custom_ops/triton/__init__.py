"""CUDA lowerings of the hot decode ops: hand-written Triton kernels behind `torch.library.triton_op`.

Importing this package registers `onegraph::<op>_triton` for every op with a kernel and tells the
registry (`_registry.register_lowering(name, "triton", op)`); `_registry.decompositions("cuda")`
imports it lazily and maps each onegraph op to its Triton op, so `ep.run_decompositions(table)`
swaps them at export time and AOTInductor compiles the kernels into the artifact.

One file per op (kernel + launcher + triton_op), sharing `_common.py`:
  gdn_decode_step.py   one fused kernel: conv window + SiLU, gates, L2 norm, fp32 delta rule
  gdn_decode_step_norm.py  the same with the output gated RMSNorm folded in, and an in-place twin
  gdn_decode_steps.py  T positions of a speculative verify in one kernel, the state read once
  gdn_prefill.py       chunked delta rule: WY/UT transform, sequential state pass, output (3 kernels)
  fused_moe.py         routing from the given router logits, SwiGLU(gate_up) and down + combine
  fused_moe_prefill.py the T*k > E path of fused_moe: grouped GEMM over pairs sorted by expert
  fused_moe_fp8.py     fused_moe with block-FP8 experts (e4m3 bytes, block scales folded into the activations)
  fused_moe_fp8_prefill.py  its T*k > E path: the grouped GEMMs with e4m3 tiles, scaled per K step
  attention_decode.py  GQA flash-decoding (split over the KV length) + combine
  attention_prefill.py causal GQA flash attention of a chunk over its slot's KV cache
  norms.py             rms_norm, add_rms_norm, gated_rms_norm row kernels
  rope.py              partial rotary embedding
  qk_norm_rope.py      attention's q/k RMSNorm + partial rotary embedding in one launch
  causal_conv.py       causal_conv_update and causal_conv_prefill (depthwise conv + SiLU with state)
  sample.py            greedy / Gumbel-max sampling with top-k / top-p, no vocabulary sort
  linear.py            projection GEMV at decode sizes (tile by (M, K) only)
  add_rms_norm_linear.py  the residual add + RMSNorm folded into the projection GEMV's prologue
  linear_fp8.py        block-FP8 weight projection: e4m3 bytes and 128x128 scales applied in registers (a float
                       tail of rows in the same launch)
  add_rms_norm_linear_fp8.py  the same fold for a block-FP8 projection (one row: the normed row in registers)
  linear_w8a8.py       W8A8 projections (int8 / e4m3 per-channel weights, activations quantized per token)
Batch-invariant variants (export --batch-invariant; _registry's "triton_invariant" lowerings): every row with one
plan, whatever the batch (docs/design.md, "Batch invariance"):
  linear_invariant.py  one 16-row tl.dot tile for every M, M = 1 included (no FMA GEMV, no cuBLAS)
  add_rms_norm_linear_invariant.py  the norm kernel, then that GEMV (the router's input norm)
  linear_fp8_invariant.py  linear_fp8's 16-row dot tile for every M (the float tail in the same launch)
  add_rms_norm_linear_fp8_invariant.py  the norm kernel, then that projection
  fused_moe_fp8_invariant.py  the one-token FP8 decode kernels for every token count
  fused_moe_invariant.py  the one-token decode kernels for every token count (no grouped GEMM)
  attention_decode_invariant.py  the one-row split count
  gdn_decode_step_norm_invariant.py  the one-row V tile (and its in-place twin)
  gdn_decode_steps_invariant.py  the same for a speculative verify's GDN layer

Without triton installed nothing is registered (AVAILABLE is False, IMPORT_ERROR says why) and the
registry fails closed for every op whose CUDA lowering is "triton". This guarded import is the only
conditional import in the package: it exists so that `import onegraph.custom_ops` and the CPU export
path work on machines without triton.
"""
try:
    import triton  # noqa: F401
except ImportError as e:  # no triton: register no CUDA lowerings; the registry then fails closed
    AVAILABLE = False
    IMPORT_ERROR = f"{type(e).__name__}: {e}"
else:
    AVAILABLE = True
    IMPORT_ERROR = None
    from . import (add_rms_norm_linear, add_rms_norm_linear_fp8, attention_decode, attention_prefill,  # noqa: F401
                   causal_conv, fused_moe, fused_moe_fp8, gdn_decode_step, gdn_decode_step_norm, gdn_decode_steps,
                   gdn_prefill, linear, linear_fp8, linear_w8a8, norms, qk_norm_rope, rope, sample)
    from . import (add_rms_norm_linear_fp8_invariant, add_rms_norm_linear_invariant,  # noqa: F401
                   attention_decode_invariant, fused_moe_fp8_invariant, fused_moe_invariant,
                   gdn_decode_step_norm_invariant, gdn_decode_steps_invariant, linear_fp8_invariant,
                   linear_invariant)
