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
  float weights), where the model runs that projection through `Linear` (FP8_MODULE below), and a MoE
  layer's routed experts with its shared expert when all of them are e4m3 (onegraph::fused_moe_fp8; the
  per-expert scales fused by fuse_expert_scales). Other e4m3 weights — lm_head, MTP, a MoE layer only partly
  e4m3 — are dequantized at load to the compute dtype, exactly dtype(fp32(q) * scale) per block.
- `--quant fp8` on a float checkpoint: the FP8_MODULE projections except KEEP_FLOAT, and every MoE layer's
  routed experts (gate and up rows quantized apart, as a checkpoint stores them) and shared expert,
  quantized here.
  Kept float, as the official format keeps them: embeddings and lm_head (vocab-sized, the logits' scale;
  `--fp8-lm-head` quantizes the head too: quantize_lm_head),
  norms (vectors), the router `mlp.gate` and `shared_expert_gate` (routing decisions flip on small
  changes), and the GDN `in_proj_a` / `in_proj_b` (32 rows each at 35B: a fraction of a block whose outputs
  feed the exp/softplus decay and the sigmoid beta of the recurrence, for 0.3 % of the bytes).
  The official Qwen3.5 -FP8 config.json itself was not available to check here; this list follows the
  Qwen3-Next -FP8 precedent (in_proj_ba, mlp.gate, shared_expert_gate, embed_tokens, lm_head unconverted).
Weight-only: activations stay in the compute dtype (decode reads weights; their bytes halve).

Per-channel W8A8 schemes (compressed-tensors checkpoints, checkpoint/quant_ct.py; or `--quant int8|fp8-channel`):
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

from onegraph.checkpoint.experts import group_experts
from onegraph.custom_ops.linear_fp8 import dequantize_blocks as dequantize  # the op reference's own rule
from onegraph.custom_ops.linear_fp8 import BLOCK, expand_scale  # the op's block size

log = logging.getLogger("onegraph.quant")

METHOD = "fp8"                                 # quantization_config.quant_method, ExportOptions.quant
INT8, FP8_CHANNEL = "int8", "fp8-channel"      # the per-channel W8A8 schemes
QUANT_CHOICES = ("none", METHOD, INT8, FP8_CHANNEL)
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
    def w8a8(self) -> bool:
        """Activations quantized per row inside the graph (W8A8), not weight-only: the parity fixture widens
        its logit tolerance for these (runtime/fixture.py)."""
        return self.scale == CHANNEL_SCALE

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
# model-side names of the projections that run through models/qwen3_5/model.py `Linear.forward` (ops.linear_fp8
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
    """w [..., N, K] float -> (q [..., N, K] e4m3, scale [..., ceil(N/128), ceil(K/128)] fp32), scale = amax / 448
    per block (1 for an all-zero block), q = e4m3(w / scale) rounded to nearest (|w / scale| <= 448)."""
    *lead, n, k = w.shape
    nb, kb = scale_shape((n, k))
    pad = torch.zeros(*lead, nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    pad[..., :n, :k] = w.float()
    amax = pad.view(*lead, nb, BLOCK, kb, BLOCK).abs().amax(dim=(-3, -1))             # [..., nb, kb]
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


# A main-model SparseMoe (models/qwen3_5/model.py; the MTP head's stays float) and its expert scale parameters:
# experts.gate_up_proj_scale_inv [E, 2*ceil(I/128), ceil(H/128)] (the gate rows' block scales, then the up
# rows': the checkpoint's per-expert gate_proj / up_proj weight_scale_inv concatenated, exact at any I) and
# experts.down_proj_scale_inv [E, ceil(H/128), ceil(I/128)], the layout onegraph::fused_moe_fp8 reads.
MOE_MODULE = re.compile(r"^layers\.\d+\.mlp$")
EXPERT_KEY = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
SHARED_PARTS = ("gate_proj", "up_proj", "down_proj")


def moe_modules(model: torch.nn.Module):
    """(name, SparseMoe) of the main model's MoE layers."""
    return [(n, m) for n, m in model.named_modules() if MOE_MODULE.match(n) and hasattr(m, "experts")]


@torch.no_grad()
def make_fp8_moe(moe: torch.nn.Module) -> None:
    """A SparseMoe's routed experts and shared expert -> block FP8 (read by onegraph::fused_moe_fp8): gate_up_proj
    [E, 2I, H] and down_proj [E, H, I] e4m3 with the scale parameters above, the shared expert's three `Linear`s
    as make_fp8 (any device, meta included; the values are filled by the loader or quantize_moe)."""
    ex = moe.experts
    E, I2, H = ex.gate_up_proj.shape
    nbi, nbh = math.ceil(I2 // 2 / BLOCK), math.ceil(H / BLOCK)
    dev = ex.gate_up_proj.device
    for name, shape, sshape in (("gate_up_proj", (E, I2, H), (E, 2 * nbi, nbh)),
                                ("down_proj", (E, H, I2 // 2), (E, nbh, nbi))):
        setattr(ex, name, torch.nn.Parameter(torch.empty(shape, dtype=FP8, device=dev), requires_grad=False))
        setattr(ex, name + "_scale_inv", torch.nn.Parameter(torch.empty(sshape, dtype=torch.float32, device=dev),
                                                            requires_grad=False))
    for part in SHARED_PARTS:
        make_fp8(getattr(moe.shared_expert, part))


def make_fp8_moes(model: torch.nn.Module, held: set[str]) -> int:
    """A pre-quantized checkpoint: every MoE layer whose routed experts and shared expert are all e4m3 in the
    checkpoint (held: model-side names of its e4m3 weights) takes them as FP8 (make_fp8_moe); a layer with any
    of them float keeps all float (the e4m3 ones dequantized at load). -> how many layers."""
    n = 0
    for name, moe in moe_modules(model):
        want = [f"{name}.experts.0.{p}" for p in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")]
        want += [f"{name}.shared_expert.{p}.weight" for p in SHARED_PARTS]
        if all(w in held for w in want):
            make_fp8_moe(moe)
            n += 1
    return n


def fuse_expert_scales(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert `...experts.E.{gate,up,down}_proj.weight_scale_inv` (of experts kept e4m3) -> the fused
    experts.gate_up_proj_scale_inv [E, 2*ceil(I/128), ceil(H/128)] and experts.down_proj_scale_inv; the other
    tensors unchanged (the weights are fused by checkpoint/weights.py fuse_experts as float ones are)."""
    per, out = group_experts(tensors, lambda k: EXPERT_KEY.match(k[: -len("_scale_inv")])
                             if k.endswith("." + SCALE) else None)
    for prefix, experts in per.items():
        n = max(experts) + 1
        missing = [f"{prefix}.{e}.{p}_proj.{SCALE}" for e in range(n) for p in ("gate", "up", "down")
                   if p not in experts.get(e, {})]
        if missing:
            raise QuantError(f"missing tensor {missing[0]!r} ({len(missing)} expert scales missing)")
        out[f"{prefix}.gate_up_proj_scale_inv"] = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]])
                                                               for e in range(n)])
        out[f"{prefix}.down_proj_scale_inv"] = torch.stack([experts[e]["down"] for e in range(n)])
    return out


@torch.no_grad()
def quantize_moe(moe: torch.nn.Module) -> None:
    """`--quant fp8` on a float SparseMoe: routed experts (gate rows and up rows quantized as the separate
    [I, H] weights a checkpoint holds, so their blocks never straddle the two) and the shared expert, block FP8."""
    ex, se = moe.experts, moe.shared_expert
    I = ex.gate_up_proj.shape[1] // 2
    (gq, gs), (uq, us) = quantize(ex.gate_up_proj[:, :I]), quantize(ex.gate_up_proj[:, I:])
    dq, ds = quantize(ex.down_proj)
    shared = [quantize(getattr(se, p).weight) for p in SHARED_PARTS]
    make_fp8_moe(moe)
    ex.gate_up_proj.data, ex.gate_up_proj_scale_inv.data = torch.cat([gq, uq], 1), torch.cat([gs, us], 1)
    ex.down_proj.data, ex.down_proj_scale_inv.data = dq, ds
    for p, (q, sc) in zip(SHARED_PARTS, shared):
        getattr(se, p).weight.data, getattr(se, p).weight_scale_inv.data = q, sc


def dequantize_unheld(tensors: dict[str, torch.Tensor], params: dict, dtype: torch.dtype,
                      scheme: Scheme | None = None, target=None) -> dict:
    """Model-side tensors -> the same, where every quantized weight whose parameter is float (experts, shared
    expert, lm_head, ... unless the model holds them quantized) is dequantized to `dtype` with its scale
    (dropped); quantized parameters keep theirs (as fp32). Per-expert keys are still per expert here
    (weights.fuse_experts runs after): target(name) is the parameter a key fills (default: its own name)."""
    scheme = scheme or SCHEMES[METHOD]
    target = target or (lambda name: name)
    out, n = {}, 0
    for name, t in tensors.items():
        if name.endswith("." + scheme.scale):
            continue
        if t.dtype == scheme.qdtype and name.endswith("weight"):
            base = name[: -len("weight")]
            scale = check_pair(name, t, tensors[base + scheme.scale], scheme)
            p = params.get(target(name))
            if p is not None and p.dtype == scheme.qdtype:
                out[name], out[base + scheme.scale] = t, scale
            else:
                out[name] = dequantize_any(t, scale, dtype, scheme)
                n += 1
            continue
        out[name] = t
    if n:
        log.info("dequantized %d %s weights to %s at load, dtype(q * scale): those the model does not run "
                 "quantized (lm_head, MTP, experts outside block FP8, ... until their kernels take them; every one "
                 "with quant='none')", n, scheme.name, str(dtype).replace("torch.", ""))
    return out


@torch.no_grad()
def quantize_model(model: torch.nn.Module, scheme: str = METHOD) -> int:
    """`--quant fp8|int8|fp8-channel` on a loaded float model: every FP8_MODULE projection not in KEEP_FLOAT
    (and not quantized already) takes the scheme's weight and scale, quantized from the loaded weight (already
    in the compute dtype: a bf16 checkpoint's own values); block fp8 also every MoE layer's routed experts and
    shared expert (quantize_moe: 5 weights a layer), as the official format. Runs before models/qwen3_5/fuse.py
    concatenates. -> how many weights."""
    sch = SCHEMES[scheme]
    n = 0
    if sch.block:                                    # the official format's experts: fused_moe_fp8
        for _, moe in moe_modules(model):
            if moe.experts.gate_up_proj.dtype not in QUANT_DTYPES:
                quantize_moe(moe)
                n += 5
    for name, mod in model.named_modules():
        if not is_fp8_module(name) or KEEP_FLOAT.search(name) or mod.weight.dtype in QUANT_DTYPES:
            continue
        quantize_linear(mod, sch)
        n += 1
    return n


@torch.no_grad()
def quantize_linear(lin: torch.nn.Module, sch: Scheme) -> None:
    """A loaded float `Linear` -> the scheme's weight and scale, quantized from its weight."""
    q, s = quantize(lin.weight) if sch.block else quantize_channel(lin.weight, sch)
    make_quantized(lin, sch)
    lin.weight.data = q
    getattr(lin, sch.scale).data = s


def quantize_lm_head(model: torch.nn.Module) -> None:
    """`--fp8-lm-head` (an export option the manifest records; off by default, as the official format keeps the
    head float): the output projection [vocab, H] as block FP8, through onegraph::linear_fp8 — at batch 1 it is
    the largest single read of a decode step (35B: 1.02 GB in bf16). A tied head (lm_head = embed_tokens) is
    untied first: the embedding lookup keeps the float table, the head reads its own e4m3 copy."""
    model.untie_head()
    quantize_linear(model.lm_head, SCHEMES[METHOD])


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
