"""load_model: an HF-format directory (or the builtin `tiny`) -> (its family's config, its family's model).
The family comes from config.json's `model_type` (models/__init__.py family_of); nothing here names a model."""
from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from onegraph.checkpoint import quant as quantfmt
from onegraph.checkpoint.weights import Census, LoadError, census, check_quantization, fp8_weights, load_into
from onegraph.models import Family, family_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


@functools.lru_cache(maxsize=1)
@functools.cache
def _tiny_dir() -> Path:
    """The tiny checkpoint, written once per process (deterministic, so sharing it is safe) and removed when
    the process exits (every call used to write, and leave behind, a directory of its own)."""
    from onegraph.models.qwen3_5.tiny import write_tiny
    path = Path(tempfile.mkdtemp(prefix="onegraph-tiny-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return write_tiny(path)


def model_dir(spec: str | Path) -> Path:
    """`tiny` -> a freshly written tiny checkpoint (deterministic); a directory -> itself."""
    if str(spec) == "tiny":
        return _tiny_dir()
    path = Path(spec)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist (or pass 'tiny')")
    return path


def hf_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no config.json at {file}")
    return json.loads(file.read_text())


def read_config(path: Path):
    """config.json -> its family's config, after refusing a quantization the loader cannot dequantize."""
    quant_method(path)
    hf = hf_config(path)
    return family_of(hf.get("model_type")).config.from_hf(hf)


def family(cfg) -> Family:
    """The family of a config (its text model_type)."""
    return family_of(cfg.model_type)


def quant_method(path: Path) -> str | None:
    """The checkpoint's quantization_config quant_method (None: unquantized); LoadError if unsupported."""
    file = path / "config.json"
    return check_quantization(json.loads(file.read_text())) if file.is_file() else None


def meta_model(cfg, fp32_reduce: bool = False) -> nn.Module:
    """The TP-1 model on the meta device: its parameter names and shapes, no memory."""
    with torch.device("meta"):
        return family(cfg).model(cfg, fp32_reduce=fp32_reduce)


def check_checkpoint(spec: str | Path) -> tuple[object, Census]:
    """What load_model would read, from config.json and the safetensors headers only (no weight is read):
    -> (cfg, census); a quantization_config it cannot dequantize raises LoadError here. The caller runs
    census.check(allow_unused) for the tensor-level refusals."""
    path = model_dir(spec)
    cfg = read_config(path)
    params = dict(meta_model(cfg).named_parameters())
    return cfg, census(path, params, tied_lm_head="lm_head.weight" not in params, quant_method=quant_method(path))


def describe_checkpoint(spec: str | Path) -> tuple[str, LoadError | None]:
    """`onegraph inspect CHECKPOINT_DIR`: config summary + tensor census (headers only), and the error
    load_model would refuse it with (None: it loads)."""
    path = model_dir(spec)
    hf = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    quant = hf.get("quantization_config") or text.get("quantization_config")
    try:
        method = check_quantization(hf)
        refusal = None
    except LoadError as e:
        method, refusal = None, e
    hf = hf_config(path)
    cfg = family_of(hf.get("model_type")).config.from_hf(hf)
    params = dict(meta_model(cfg).named_parameters())
    c = census(path, params, tied_lm_head="lm_head.weight" not in params, quant_method=method)
    lines = [f"checkpoint {path}",
             f"model: {cfg.model_type} layers={cfg.num_layers} hidden={cfg.hidden_size} vocab={cfg.vocab_size} "
             f"experts={cfg.num_experts} tied={cfg.tie_word_embeddings}",
             f"quantization_config: {quant}", c.summary()]
    if method:
        lines.insert(3, f"quantization: {quantfmt.SCHEMES[method].describe}")
    if refusal is None:
        try:
            c.check()
        except LoadError as e:
            refusal = e
    lines.append(f"loads: {'refused' if refusal else 'yes'}")
    return "\n".join(lines), refusal


def load_model(spec: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
               tp: int = 1, rank: int = 0, group=None, fp32_reduce: bool = False, allow_unused: bool = False,
               fuse: bool = True, mtp: bool = False, quant: str | None = None, fp8_lm_head: bool = False):
    """-> (cfg, model, checkpoint dir). tp > 1: rank `rank`'s shard (models/qwen3_5/tp.py), whose collectives
    run over `group` (None: the default process group). fp32_reduce: Qwen35Model's option.
    fuse: concatenate the same-input projections (models/qwen3_5/fuse.py) after sharding; False only for a
    caller that shards the TP-1 model itself (export) and fuses each rank afterwards.
    allow_unused: load even if the checkpoint holds tensors the model does not consume (logged);
    without it they are refused (checkpoint/weights.py), as is a quantization_config it cannot read.
    mtp: also load the checkpoint's MTP head (`mtp.*`) as `model.mtp` (models/qwen3_5/mtp.py; TP-1 only, never
    exported); without it those keys are skipped.
    quant (checkpoint/quant.py SCHEMES): the weight format of the dense projections. None: as the checkpoint (an
    FP8 / compressed-tensors checkpoint's quantized projections stay quantized, its other quantized weights
    are dequantized); "none": every weight in `dtype` (a quantized checkpoint dequantized); "fp8" | "int8" |
    "fp8-channel": a float checkpoint's projections are quantized so, a checkpoint of that scheme kept as it
    is, a checkpoint quantized otherwise refused (quant.resolve).
    fp8_lm_head: the output projection as block FP8 too (checkpoint/quant.py quantize_lm_head; tp 1 only)."""
    path = model_dir(spec)
    cfg = read_config(path)
    fam = family(cfg)
    method = quant_method(path)
    try:
        scheme = quantfmt.resolve(method, quant)
    except quantfmt.QuantError as e:
        raise LoadError(str(e)) from None
    if tp != 1:
        fam.check_divisible(cfg, tp)                 # fail before reading any weights
        if scheme or fp8_lm_head:
            raise ValueError(f"quantized weights ({scheme or 'fp8 lm_head'}) with tp > 1 are not supported yet (the "
                             f"head split does not follow the scales); load with quant='none' (dequantized) or tp=1")
    model = meta_model(cfg, fp32_reduce)
    if mtp:
        if fam.attach_mtp is None:
            raise LoadError(f"model family {fam.name} has no MTP head: speculation is not available for it")
        fam.attach_mtp(model, path, tp)
    if scheme and method == scheme:                  # the checkpoint's quantized projections load as they are
        sch = quantfmt.SCHEMES[scheme]
        held = fp8_weights(path, sch.st_dtype)
        for name, mod in model.named_modules():
            if quantfmt.is_fp8_module(name) and f"{name}.weight" in held:
                quantfmt.make_quantized(mod, sch)
        if sch.block:                                # e4m3 experts + shared expert: onegraph::fused_moe_fp8
            quantfmt.make_fp8_moes(model, held)
    model.to_empty(device="cpu")
    model.inv_freq.copy_(fam.model.rope_inv_freq(cfg))
    load_into(model, path, resolve_dtype(dtype), allow_unused, quant_method=method)
    if scheme and method is None:
        n = quantfmt.quantize_model(model, scheme)
        quantfmt.log.info("quantized %d weights (projections; fp8: experts too): %s", n,
                          quantfmt.SCHEMES[scheme].describe)
    if fp8_lm_head:
        quantfmt.quantize_lm_head(model)
    if tp != 1:
        model = shard_model(model, rank, tp, group)
    if fuse:
        fam.fuse_projections(model)
    return cfg, model.to(device).eval(), path


def shard_model(model: nn.Module, rank: int, tp: int, group=None) -> nn.Module:
    """A TP-1 model -> the same family's model(cfg, tp, group) holding rank `rank`'s shard of its weights.
    (Reads the whole checkpoint first: fine for what fits one host's memory.)"""
    cfg = model.cfg
    sd = family(cfg).shard_state_dict({n: p.detach() for n, p in model.named_parameters()}, cfg, rank, tp)
    with torch.device("meta"):
        out = type(model)(cfg, tp, group, model.fp32_reduce)
    own = {}
    for name, p in out.named_parameters():
        t = sd.pop(name)                 # popped: a sliced copy is freed once cloned below
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"tp shard of {name!r} has shape {list(t.shape)}, the rank's model expects {list(p.shape)}")
        # a copy with its own storage (a view would keep the whole TP-1 tensor alive); the meta model
        # takes it as is, so a device holds the TP-1 model + this shard at most (35B: 69 + 35 GB)
        own[name] = t.clone(memory_format=torch.contiguous_format)
    out.load_state_dict(own, strict=False, assign=True)
    out.inv_freq = model.inv_freq.clone()
    return out.eval()
