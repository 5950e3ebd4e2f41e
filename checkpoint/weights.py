"""HF safetensors -> Qwen35Model state dict, refusing any checkpoint it does not understand.

Handles: single file or sharded (`model.safetensors.index.json`); key prefixes
`model.language_model.` (hub ConditionalGeneration) and `model.`; experts as per-expert keys
(`mlp.experts.E.{gate,up,down}_proj.weight`, fused here) or already fused (`gate_up_proj`,
`down_proj`). A missing tensor or a shape mismatch raises LoadError naming the key and both shapes.

Quantized checkpoints: `quant_method: fp8` (checkpoint/quant.py has the format): each e4m3 `X.weight` comes
with its `X.weight_scale_inv` block scales; `quant_method: compressed-tensors` (checkpoint/quant_ct.py: FP8 or
INT8 per-channel W8A8): each int8 / e4m3 `X.weight` with its `X.weight_scale` [N, 1]. A quantized parameter
(a projection the model runs quantized) takes both as they are, a float parameter takes the weight
dequantized at load (quant.dequantize_unheld).

Refused before any weight is read (from config.json and the safetensors headers only), because each
would otherwise run and answer wrongly:
- a `quantization_config` whose `quant_method` is not in SUPPORTED_QUANT_METHODS, or an fp8 one with
  another block size, format or a static activation scheme;
- a tensor that reaches a float parameter with a dtype outside FLOAT_DTYPES (float8 outside an fp8
  checkpoint, int8, packed int32, ...): a plain cast would drop its scales; an e4m3 weight without its
  `weight_scale_inv`;
- a tensor no parameter consumes (`*.weight_scale_inv`, `qzeros`, a stray key), unless it belongs to
  a SKIP_FAMILIES family the model has no parameters for (vision tower, MTP head: skipped with a
  logged count), or `allow_unused` is set (ignored with a logged count and examples).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open

from onegraph.checkpoint import quant, quant_ct
from onegraph.checkpoint.experts import group_experts

log = logging.getLogger("onegraph.weights")
# quant_method values (config.json `quantization_config`) this loader has a dequantization rule for
SUPPORTED_QUANT_METHODS: tuple[str, ...] = (quant.METHOD, quant_ct.METHOD)
# safetensors header dtypes a float parameter takes by a plain cast
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
# torch names of safetensors dtypes, for messages
DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
               "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8", "I16": "int16",
               "U16": "uint16", "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64", "BOOL": "bool"}
# families a text model without the matching parameters skips (checked against its parameter names, so a
# model that has e.g. `mtp.*` parameters loads those keys like any other)
SKIP_FAMILIES = {"vision": re.compile(r"^(model\.)?visual\."), "MTP": re.compile(r"^mtp\.")}
EXPERT = re.compile(r"^(.*layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
ALLOW_FLAG = "--allow-unused-weights"


class LoadError(ValueError):
    pass


def dtype_name(st_dtype: str) -> str:
    return DTYPE_NAMES.get(st_dtype, st_dtype)


def check_quantization(hf: dict) -> str | None:
    """A `quantization_config` (top level or in `text_config`) with an unsupported quant_method (or fields
    the loader does not read exactly) -> LoadError; else its scheme (checkpoint/quant.py SCHEMES: "fp8" for
    quant_method fp8, "fp8-channel" | "int8" for compressed-tensors; None: unquantized)."""
    text = hf.get("text_config")
    found = None
    for where, c in (("config.json", hf), ("config.json text_config", text if isinstance(text, dict) else {})):
        q = c.get("quantization_config")
        if q is None:
            continue
        method = q.get("quant_method") if isinstance(q, dict) else None
        if method not in SUPPORTED_QUANT_METHODS:
            supported = (f"quant_method one of {list(SUPPORTED_QUANT_METHODS)}" if SUPPORTED_QUANT_METHODS
                         else "unquantized float checkpoints only (F32/F16/BF16)")
            raise LoadError(f"{where} has a quantization_config with quant_method={method!r}, which the loader "
                            f"cannot dequantize; supported: {supported}")
        try:
            scheme = quant_ct.check_config(q, where) if method == quant_ct.METHOD else quant.check_config(q, where)
        except quant.QuantError as e:
            raise LoadError(str(e)) from None
        found = scheme or method
    return found


def _files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise LoadError(f"no safetensors weights in {path}")
    return found


def _strip(key: str) -> str:
    """Checkpoint key -> model-side name (prefix removed)."""
    for prefix in ("model.language_model.", "model."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key  # lm_head.weight, mtp.* and the like


def _target(name: str) -> str:
    """Model-side name -> the parameter it fills (a per-expert key fills its fused tensor)."""
    m = EXPERT.match(name)
    if m is None:
        return name
    return f"{m.group(1)}.{'down' if m.group(3) == 'down' else 'gate_up'}_proj"


@dataclasses.dataclass
class Census:
    """Every checkpoint tensor, from the safetensors headers (no weight read), sorted by what it is for."""
    path: Path
    files: dict[str, Path]                       # checkpoint key -> file
    dtypes: dict[str, str]                       # checkpoint key -> safetensors dtype ("BF16", "F8_E4M3", ...)
    consumed: dict[str, str]                     # checkpoint key -> model-side name it loads into
    skipped: dict[str, list[str]]                # family -> checkpoint keys
    unused: list[str]                            # checkpoint keys nothing consumes
    bad_dtype: list[tuple[str, str, str]]        # (checkpoint key, dtype, parameter) a plain cast would get wrong
    no_scale: list[str] = dataclasses.field(default_factory=list)   # quantized weights without their scale
    scheme: quant.Scheme | None = None                               # the checkpoint's (None: float)

    def check(self, allow_unused: bool = False) -> None:
        """Raise LoadError for what cannot load."""
        if self.no_scale:
            sch = self.scheme
            raise LoadError(f"tensor {self.no_scale[0]!r} is {str(sch.qdtype).replace('torch.', '')} but the checkpoint has no "
                            f"{self.no_scale[0][:-len('weight')]}{sch.scale} ({len(self.no_scale)} such tensors "
                            f"in {self.path})")
        if self.bad_dtype:
            key, dt, param = self.bad_dtype[0]
            raise LoadError(f"tensor {key!r} has dtype {dtype_name(dt)} but parameter {param!r} is float and the "
                            f"loader has no dequantization rule for it ({len(self.bad_dtype)} such tensors in "
                            f"{self.path}): a quantized checkpoint is not supported")
        if self.unused and not allow_unused:
            raise LoadError(f"{len(self.unused)} checkpoint tensors the model does not consume, e.g. "
                            f"{self.unused[:3]}, in {self.path}; refusing to load ({ALLOW_FLAG} ignores them)")

    def log(self) -> None:
        """The skipped families' counts (info) and, when allowed through, the unused tensors (warning)."""
        if self.skipped:
            n = sum(map(len, self.skipped.values()))
            log.info("skipped %d %s tensors", n, "/".join(self.skipped))
        if self.unused:
            log.warning("ignored %d unexpected tensors (%s), e.g. %s", len(self.unused), ALLOW_FLAG, self.unused[:3])

    def summary(self) -> str:
        by_dtype = Counter(map(dtype_name, self.dtypes.values()))
        lines = [f"tensors: {len(self.dtypes)} in {len(set(self.files.values()))} file(s); dtypes: "
                 + ", ".join(f"{d}×{n}" for d, n in by_dtype.most_common()),
                 f"  consumed: {len(self.consumed)}"]
        lines += [f"  skipped ({fam}): {len(keys)}" for fam, keys in self.skipped.items()]
        lines.append(f"  unused: {len(self.unused)}" + (f", e.g. {self.unused[:3]}" if self.unused else ""))
        if self.bad_dtype:
            lines.append(f"  non-float into float parameters: {len(self.bad_dtype)}, e.g. "
                         + ", ".join(f"{k} ({dtype_name(d)})" for k, d, _ in self.bad_dtype[:3]))
        return "\n".join(lines)


FP8_ST = "F8_E4M3"
DTYPE_ST = {torch.float8_e4m3fn: FP8_ST, torch.int8: "I8"}


def header_dtypes(path: str | Path) -> tuple[dict[str, Path], dict[str, str]]:
    """-> (checkpoint key -> file, checkpoint key -> safetensors dtype), from the headers only."""
    files, dtypes = {}, {}
    for f in _files(Path(path)):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                files[key] = f
                dtypes[key] = sf.get_slice(key).get_dtype()
    return files, dtypes


def fp8_weights(path: str | Path, st_dtype: str = FP8_ST) -> set[str]:
    """Model-side names of the checkpoint's weights of safetensors dtype st_dtype (e4m3 by default:
    `layers.0.self_attn.q_proj.weight`, ...)."""
    return {_strip(k) for k, dt in header_dtypes(path)[1].items() if dt == st_dtype}


def census(path: str | Path, params: dict[str, torch.nn.Parameter], tied_lm_head: bool,
           quant_method: str | None = None) -> Census:
    """Sort every checkpoint tensor against `params` (the model's named_parameters) from the headers only.
    tied_lm_head: the model reads embed_tokens as lm_head, so a checkpoint's lm_head.weight is not needed.
    quant_method: the config's scheme (check_quantization): admits its quantized weights with their scales."""
    path = Path(path)
    sch = quant.SCHEMES[quant_method] if quant_method else None
    c = Census(path, {}, {}, {}, {}, [], [], scheme=sch)
    c.files, c.dtypes = header_dtypes(path)
    for key, dt in c.dtypes.items():
        name = _strip(key)
        target = _target(name)
        if sch and key.endswith("." + sch.scale):
            weight = key[: -len(sch.scale)] + "weight"
            if c.dtypes.get(weight) == sch.st_dtype and _target(_strip(weight)) in params:
                c.consumed[key] = name              # read with its weight (a quantized parameter, or dequantized)
                continue
        if target in params:
            c.consumed[key] = name
            p = params[target]
            if sch and dt == sch.st_dtype and key.endswith("weight"):
                if key[: -len("weight")] + sch.scale not in c.dtypes:
                    c.no_scale.append(key)
            elif dt not in FLOAT_DTYPES and p.is_floating_point() or (p.dtype in quant.QUANT_DTYPES and
                                                                       dt != DTYPE_ST.get(p.dtype)):
                c.bad_dtype.append((key, dt, target))
            continue
        if name == "lm_head.weight" and tied_lm_head:
            continue            # tied: embed_tokens is the head (as transformers loads it)
        fam = next((fam for fam, rx in SKIP_FAMILIES.items() if rx.match(key)), None)
        if fam is not None:
            c.skipped.setdefault(fam, []).append(key)
        else:
            c.unused.append(key)
    c.unused.sort()
    return c


def read_checkpoint(c: Census) -> dict[str, torch.Tensor]:
    """The consumed tensors under their model-side names (experts still per-expert)."""
    out = {}
    for f in sorted(set(c.files[k] for k in c.consumed)):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                if key in c.consumed:
                    out[c.consumed[key]] = sf.get_tensor(key)
    return out


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down keys -> gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    per, out = group_experts(tensors, EXPERT.match)
    for prefix, experts in per.items():
        n = max(experts) + 1
        for e in range(n):
            for part in ("gate", "up", "down"):
                if part not in experts.get(e, {}):
                    raise LoadError(f"missing tensor {prefix}.{e}.{part}_proj.weight")
                want, got = tuple(experts[0][part].shape), tuple(experts[e][part].shape)
                if got != want:
                    raise LoadError(f"shape mismatch for {prefix}.{e}.{part}_proj.weight: checkpoint {list(got)}, "
                                    f"expert 0 has {list(want)}")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down"] for e in range(n)])
    return out


def load_into(model: torch.nn.Module, path: str | Path, dtype: torch.dtype, allow_unused: bool = False,
              quant_method: str | None = None) -> None:
    """Fill every parameter of `model` from the checkpoint at `path`, cast to dtype; strict (see the module
    docstring: allow_unused only lets tensors that nothing consumes through, logged). FP8 parameters
    (checkpoint/quant.py make_quantized) take their quantized weight and fp32 scales as they are."""
    expected = dict(model.named_parameters())
    c = census(path, expected, tied_lm_head="lm_head.weight" not in expected, quant_method=quant_method)
    c.check(allow_unused)
    c.log()
    tensors = read_checkpoint(c)
    if quant_method is not None:
        try:
            tensors = quant.dequantize_unheld(tensors, expected, dtype, quant.SCHEMES[quant_method], _target)
            tensors = quant.fuse_expert_scales(tensors)            # experts kept e4m3 (fused_moe_fp8)
        except quant.QuantError as e:
            raise LoadError(f"{e} in {path}") from None
    tensors = fuse_experts(tensors)
    for name, p in expected.items():
        if name not in tensors:
            raise LoadError(f"missing tensor {name!r} (expected shape {list(p.shape)}) in {path}")
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise LoadError(f"shape mismatch for {name!r}: checkpoint {list(t.shape)}, model expects {list(p.shape)}")
        keep = p.dtype in quant.QUANT_DTYPES or name.endswith(("_scale_inv", ".weight_scale"))  # q, fp32 scales
        with torch.no_grad():
            p.data = (t if keep else t.to(dtype)).contiguous()
