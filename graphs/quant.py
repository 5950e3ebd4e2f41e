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

Per-channel W8A8 schemes (compressed-tensors checkpoints, graphs/quant_ct.py; or `--quant int8|fp8-channel`):
  X.weight        [N, K]  int8 ("int8") or float8_e4m3fn ("fp8-channel"), symmetric per output channel
  X.weight_scale  [N, 1]  a multiplier: w[n, k] = fp32(q[n, k]) * s[n] (checkpoints may store it bf16/fp16:
                          read exactly as fp32)
with activations quantized dynamically per token inside the op (onegraph::linear_w8a8_int8 / _fp8).
`quantize_channel` stores s = amax / 127 (int8) or amax / 448 (e4m3) per row (1 for an all-zero row) and
rounds w / s to nearest (even). The same modules as FP8 run quantized, the same KEEP_FLOAT stay float; any
other quantized checkpoint weight (experts, routers, lm_head) is dequantized at load, dtype(fp32(q) * s).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re

import torch

from onegraph.custom_ops.linear_fp8 import dequantize_blocks as dequantize  # the op reference's own rule
from onegraph.custom_ops.linear_fp8 import expand_scale

log = logging.getLogger("onegraph.quant")

METHOD = "fp8"                                 # quantization_config.quant_method, ExportOptions.quant
INT8, FP8_CHANNEL = "int8", "fp8-channel"      # the per-channel W8A8 schemes
QUANT_CHOICES = ("none", METHOD, INT8, FP8_CHANNEL)
BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max                 # 448
SCALE = "weight_scale_inv"
CHANNEL_SCALE = "weight_scale"


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A weight format: the quantized dtype (and its safetensors name), the scale tensor's name, a description."""
    name: str
    qdtype: torch.dtype
    st_dtype: str
    scale: str
    describe: str

    @property
    def block(self) -> bool:
        return self.scale == SCALE

    def scale_shape(self, shape) -> tuple[int, ...]:
        return scale_shape(shape) if self.block else (*shape[:-1], 1)


SCHEMES = {
    METHOD: Scheme(METHOD, torch.float8_e4m3fn, "F8_E4M3", SCALE,
                   "fp8: float8_e4m3fn weights, one fp32 scale per 128x128 block, activations in the model dtype "
                   "(weight-only)"),
    FP8_CHANNEL: Scheme(FP8_CHANNEL, torch.float8_e4m3fn, "F8_E4M3", CHANNEL_SCALE,
                        "fp8-channel: float8_e4m3fn weights, one fp32 scale per output channel, activations "
                        "quantized to e4m3 per token (dynamic)"),
    INT8: Scheme(INT8, torch.int8, "I8", CHANNEL_SCALE,
                 "int8 (W8A8): int8 weights, one fp32 scale per output channel (symmetric), activations quantized "
                 "to int8 per token (dynamic, symmetric), int32 dot products"),
}
QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8)
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


def check_pair(name: str, w: torch.Tensor, scale: torch.Tensor, scheme: Scheme | None = None) -> torch.Tensor:
    """A quantized weight and its scale as the scheme has them (QuantError naming the tensor otherwise)
    -> the scale as fp32 (a per-channel scale stored bf16/fp16 is read exactly)."""
    scheme = scheme or SCHEMES[METHOD]
    if w.dtype != scheme.qdtype:
        raise QuantError(f"tensor {name!r} is {w.dtype}, expected {scheme.qdtype} next to its {scheme.scale}")
    want = scheme.scale_shape(w.shape)
    dtypes = (torch.float32,) if scheme.block else (torch.float32, torch.bfloat16, torch.float16)
    if scale.dtype not in dtypes or tuple(scale.shape) != want:
        dt = str(scale.dtype).replace("torch.", "")
        what = f"one scale per {BLOCK}x{BLOCK} block" if scheme.block else "one scale per output channel"
        raise QuantError(f"{name[:-len('weight')]}{scheme.scale} is {dt} {list(scale.shape)} but {name} "
                         f"{list(w.shape)} needs float32 {list(want)} ({what})")
    return scale.float()


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


def quantize_channel(w: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] scheme.qdtype, scale [N, 1] fp32), symmetric per row: scale = amax / 127
    (int8) or amax / 448 (e4m3), 1 for an all-zero row; q = w / scale rounded to nearest (even)."""
    qmax = 127.0 if scheme.qdtype == torch.int8 else FP8_MAX
    amax = w.float().abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    v = (w.float() / scale).clamp(-qmax, qmax)
    return (v.round() if scheme.qdtype == torch.int8 else v).to(scheme.qdtype), scale


def dequantize_any(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, scheme: Scheme) -> torch.Tensor:
    """dtype(fp32(q) * scale), per block or per channel (scale [..., N, 1] broadcasts over K)."""
    if scheme.block:
        return dequantize(w, scale, dtype)
    return (w.float() * scale.float()).to(dtype)


def is_fp8_module(name: str) -> bool:
    return FP8_MODULE.match(name) is not None


@torch.no_grad()
def make_quantized(lin: torch.nn.Module, scheme: Scheme) -> None:
    """Turn a `Linear` (any device, meta included) into the scheme's form: weight [N, K] scheme.qdtype and
    its fp32 scale parameter (weight_scale_inv [ceil(N/128), ceil(K/128)] or weight_scale [N, 1]; the values
    are filled by the loader)."""
    w = lin.weight
    lin.weight = torch.nn.Parameter(torch.empty(w.shape, dtype=scheme.qdtype, device=w.device), requires_grad=False)
    setattr(lin, scheme.scale, torch.nn.Parameter(torch.empty(scheme.scale_shape(w.shape), dtype=torch.float32,
                                                              device=w.device), requires_grad=False))


def make_fp8(lin: torch.nn.Module) -> None:
    make_quantized(lin, SCHEMES[METHOD])


def dequantize_unheld(tensors: dict[str, torch.Tensor], params: dict, dtype: torch.dtype,
                      scheme: Scheme | None = None) -> dict:
    """Model-side tensors -> the same, where every quantized weight whose parameter is float (experts, shared
    expert, lm_head, ...) is dequantized to `dtype` with its scale (dropped); quantized parameters keep
    theirs (as fp32). Per-expert keys are still per expert here (weights.fuse_experts runs after)."""
    scheme = scheme or SCHEMES[METHOD]
    out, n = {}, 0
    for name, t in tensors.items():
        if name.endswith("." + scheme.scale):
            continue
        if t.dtype == scheme.qdtype and name.endswith("weight"):
            base = name[: -len("weight")]
            scale = check_pair(name, t, tensors[base + scheme.scale], scheme)
            if name in params and params[name].dtype == scheme.qdtype:
                out[name], out[base + scheme.scale] = t, scale
            else:
                out[name] = dequantize_any(t, scale, dtype, scheme)
                n += 1
            continue
        out[name] = t
    if n:
        log.info("dequantized %d %s weights to %s at load, dtype(q * scale): those the model does not run "
                 "quantized (routed and shared experts, lm_head, ... until their kernels take them; every one "
                 "with quant='none')", n, scheme.name, str(dtype).replace("torch.", ""))
    return out


@torch.no_grad()
def quantize_model(model: torch.nn.Module, scheme: str = METHOD) -> int:
    """`--quant fp8|int8|fp8-channel` on a loaded float model: every FP8_MODULE projection not in KEEP_FLOAT
    (and not quantized already) takes the scheme's weight and scale, quantized from the loaded weight (already
    in the compute dtype: a bf16 checkpoint's own values). Runs before graphs/fuse.py concatenates. -> how many."""
    sch = SCHEMES[scheme]
    n = 0
    for name, mod in model.named_modules():
        if not is_fp8_module(name) or KEEP_FLOAT.search(name) or mod.weight.dtype in QUANT_DTYPES:
            continue
        q, s = quantize(mod.weight) if sch.block else quantize_channel(mod.weight, sch)
        make_quantized(mod, sch)
        mod.weight.data = q
        getattr(mod, sch.scale).data = s
        n += 1
    return n


def resolve(checkpoint: str | None, requested: str | None) -> str | None:
    """The projections' scheme in the model: checkpoint = the checkpoint's scheme (None: float), requested =
    load_model's `quant` (None: as the checkpoint; "none": all float). A checkpoint quantized one way and a
    request for another is refused (requantizing quantized weights would compound two roundings)."""
    if requested is not None and requested not in QUANT_CHOICES:
        raise ValueError(f"quant must be one of {list(QUANT_CHOICES)}, got {requested!r}")
    if requested is None:
        return checkpoint
    if requested == "none":
        return None
    if checkpoint is not None and checkpoint != requested:
        raise QuantError(f"--quant {requested} on a checkpoint already quantized as {checkpoint!r}: use --quant "
                         f"{checkpoint} (keep its weights) or --quant none (dequantize them)")
    return requested
