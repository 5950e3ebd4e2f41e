"""The FP8 weight format: e4m3 weights with one fp32 scale per 128x128 block (the official Qwen -FP8
checkpoints' `quantization_config.quant_method == "fp8"`, DeepSeek-V3's layout), and which modules run it.

Format (checked against transformers 5.24 `integrations/finegrained_fp8.py` — `Fp8Quantize`,
`Fp8Dequantize`, serialized names `weight` + `weight_scale_inv` — and vLLM's `Fp8LinearMethod` block
quantization):
  X.weight            [N, K]                         float8_e4m3fn
  X.weight_scale_inv  [ceil(N/128), ceil(K/128)]     float32, a multiplier: w[n, k] = fp32(q[n, k]) * s[n//128, k//128]
  config.json quantization_config: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128], "modules_to_not_convert": [...]}
A block at the right or bottom edge is partial (vLLM's ceil grid). transformers' Fp8Dequantize derives the
block from `shape // grid`, which equals 128 only where N and K are multiples of 128 or below 128 (every
shape of the Qwen3.5 models and of `tiny`). Its quantizer stores 1 / (448 / amax) per block and scale 1 for
an all-zero block; `quantize` here stores amax / 448 (and 1 for a zero block) and rounds w / scale to
nearest e4m3.

Which modules are FP8 in an artifact:
- a pre-quantized checkpoint: exactly its e4m3 weights (the config's `modules_to_not_convert` are its
  float weights), where the model runs that projection through `Linear` (FP8_MODULE below). Other e4m3
  weights — routed experts, the shared expert (both read by fused_moe), lm_head, MTP — are dequantized at
  load to the compute dtype, exactly dtype(fp32(q) * scale) per block, until their kernels take FP8.
- `--quant fp8` on a float checkpoint: the FP8_MODULE projections except KEEP_FLOAT, quantized here (the
  experts and the shared expert stay in the compute dtype until fused_moe takes FP8).
  Kept float, as the official format keeps them: embeddings and lm_head (vocab-sized, the logits' scale),
  norms (vectors), the router `mlp.gate` and `shared_expert_gate` (routing decisions flip on small
  changes), and the GDN `in_proj_a` / `in_proj_b` (32 rows each at 35B: a fraction of a block whose outputs
  feed the exp/softplus decay and the sigmoid beta of the recurrence, for 0.3 % of the bytes).
  The official Qwen3.5 -FP8 config.json itself was not available to check here; this list follows the
  Qwen3-Next -FP8 precedent (in_proj_ba, mlp.gate, shared_expert_gate, embed_tokens, lm_head unconverted).
Weight-only: activations stay in the compute dtype (decode reads weights; their bytes halve).
"""
from __future__ import annotations

import logging
import math
import re

import torch

from onegraph.custom_ops.linear_fp8 import dequantize_blocks as dequantize  # the op reference's own rule
from onegraph.custom_ops.linear_fp8 import expand_scale

log = logging.getLogger("onegraph.quant")

METHOD = "fp8"                                 # quantization_config.quant_method, ExportOptions.quant
QUANT_CHOICES = ("none", METHOD)
BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max                 # 448
SCALE = "weight_scale_inv"
# model-side names of the projections that run through graphs/qwen3_5.py `Linear.forward` (ops.linear_fp8
# once FP8); every other weight is read by an op directly (fused_moe, the lm_head matmul) and stays float
FP8_MODULE = re.compile(r"^layers\.\d+\.(linear_attn\.(in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj)"
                        r"|self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$")
KEEP_FLOAT = re.compile(r"\.in_proj_[ab]$")    # of FP8_MODULE, what `--quant fp8` leaves float


class QuantError(ValueError):
    pass


def check_config(q: dict, where: str) -> None:
    """A `quant_method: fp8` quantization_config this loader reads exactly, else QuantError naming the field."""
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantError(f"{where} quantization_config fmt={fmt!r}: supported fmt 'e4m3' (float8_e4m3fn)")
    block = q.get("weight_block_size")
    if block is None or list(block) != [BLOCK, BLOCK]:
        raise QuantError(f"{where} quantization_config weight_block_size={block!r}: supported [{BLOCK}, {BLOCK}] "
                         f"(per-tensor and per-channel FP8 are not supported)")
    act = q.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise QuantError(f"{where} quantization_config activation_scheme={act!r}: supported 'dynamic' "
                         f"(weights only; static activation scales are not read)")


def scale_shape(shape) -> tuple[int, ...]:
    """[..., N, K] -> [..., ceil(N/128), ceil(K/128)]."""
    *lead, n, k = shape
    return (*lead, math.ceil(n / BLOCK), math.ceil(k / BLOCK))


def check_pair(name: str, w: torch.Tensor, scale: torch.Tensor) -> None:
    if w.dtype != FP8:
        raise QuantError(f"tensor {name!r} is {w.dtype}, expected float8_e4m3fn next to its {SCALE}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != scale_shape(w.shape):
        dt = str(scale.dtype).replace("torch.", "")
        raise QuantError(f"{name[:-len('weight')]}{SCALE} is {dt} {list(scale.shape)} but {name} {list(w.shape)} "
                         f"needs float32 {list(scale_shape(w.shape))} (one scale per {BLOCK}x{BLOCK} block)")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] e4m3, scale [ceil(N/128), ceil(K/128)] fp32), scale = amax / 448 per
    block (1 for an all-zero block), q = e4m3(w / scale) rounded to nearest (|w / scale| <= 448)."""
    n, k = w.shape
    nb, kb = scale_shape(w.shape)
    pad = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    pad[:n, :k] = w.float()
    amax = pad.view(nb, BLOCK, kb, BLOCK).abs().amax(dim=(1, 3))                       # [nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.float() / expand_scale(scale, n, k)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def is_fp8_module(name: str) -> bool:
    return FP8_MODULE.match(name) is not None


@torch.no_grad()
def make_fp8(lin: torch.nn.Module) -> None:
    """Turn a `Linear` (any device, meta included) into its FP8 form: weight [N, K] float8_e4m3fn and
    weight_scale_inv [ceil(N/128), ceil(K/128)] fp32 parameters (the values are filled by the loader)."""
    w = lin.weight
    lin.weight = torch.nn.Parameter(torch.empty(w.shape, dtype=FP8, device=w.device), requires_grad=False)
    lin.weight_scale_inv = torch.nn.Parameter(torch.empty(scale_shape(w.shape), dtype=torch.float32,
                                                          device=w.device), requires_grad=False)


def dequantize_unheld(tensors: dict[str, torch.Tensor], params: dict, dtype: torch.dtype) -> dict:
    """Model-side tensors -> the same, where every e4m3 weight whose parameter is float (experts, shared
    expert, lm_head, ...) is dequantized to `dtype` with its scale (dropped); FP8 parameters keep theirs.
    Per-expert keys are still per expert here (weights.fuse_experts runs after)."""
    out, n = {}, 0
    for name, t in tensors.items():
        if name.endswith("." + SCALE):
            continue
        if t.dtype == FP8 and not (name in params and params[name].dtype == FP8):
            base = name[: -len("weight")]
            check_pair(name, t, tensors[base + SCALE])
            out[name] = dequantize(t, tensors[base + SCALE], dtype)
            n += 1
            continue
        out[name] = t
        if t.dtype == FP8:
            base = name[: -len("weight")]
            check_pair(name, t, tensors[base + SCALE])
            out[base + SCALE] = tensors[base + SCALE]
    if n:
        log.info("dequantized %d e4m3 weights to %s at load, dtype(e4m3 * scale) per 128x128 block: those the model "
                 "does not run as FP8 (routed and shared experts, lm_head, ... until their kernels take FP8; every "
                 "one with quant='none')", n, str(dtype).replace("torch.", ""))
    return out


@torch.no_grad()
def quantize_model(model: torch.nn.Module) -> int:
    """`--quant fp8` on a loaded float model: every FP8_MODULE projection not in KEEP_FLOAT (and not FP8
    already) becomes e4m3 + block scales, quantized from the loaded weight (already in the compute dtype:
    a bf16 checkpoint's own values). Runs before graphs/fuse.py concatenates. -> how many."""
    n = 0
    for name, mod in model.named_modules():
        if not is_fp8_module(name) or KEEP_FLOAT.search(name) or mod.weight.dtype == FP8:
            continue
        q, s = quantize(mod.weight)
        make_fp8(mod)
        mod.weight.data, mod.weight_scale_inv.data = q, s
        n += 1
    return n
