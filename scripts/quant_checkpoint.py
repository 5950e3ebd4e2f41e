"""Write a compressed-tensors checkpoint (the format llm-compressor writes; checkpoint/quant_ct.py) from a float
one: FP8 ("fp8-channel") or INT8 ("int8") W8A8, per-channel symmetric weights, dynamic per-token activations.

    python -m onegraph.scripts.quant_checkpoint SRC_DIR|tiny DST_DIR --scheme int8|fp8-channel [--experts]

The same modules as `export --quant` are quantized (checkpoint/quant.py FP8_MODULE minus KEEP_FLOAT: GDN
in_proj_qkv / in_proj_z / out_proj, attention q/k/v/o, a dense MLP), plus the shared expert's projections,
and with --experts the routed experts' per-expert keys (checkpoints that llm-compressor made from a model
whose experts are Linear modules have them). Everything else stays as it is and is listed in `ignore`.
Weight rule (compressed-tensors' symmetric observer, scale = amax / (range / 2)): int8 scale = amax / 127.5,
q = clamp(round(w / scale), -128, 127) (so -128 occurs); e4m3 scale = amax / 448, q = e4m3(w / scale).
Scales are written in the source weight's dtype, as llm-compressor does. Used by the accuracy benchmark and
the tests; a checkpoint for loading, not an export path.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DENSE = re.compile(r"^model\.layers\.\d+\.(linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|self_attn\.[qkvo]_proj"
                   r"|mlp\.(gate|up|down)_proj|mlp\.shared_expert\.(gate|up|down)_proj)\.weight$")
EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$", "re:.*in_proj_[ab]$"]


def config(scheme: str) -> dict:
    typ = "int" if scheme == "int8" else "float"
    args = {"num_bits": 8, "type": typ, "symmetric": True, "group_size": None, "block_structure": None,
            "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "int-quantized" if typ == "int" else "float-quantized",
            "quantization_status": "compressed", "global_compression_ratio": None, "kv_cache_scheme": None,
            "sparsity_config": {}, "transform_config": {}, "ignore": IGNORE, "version": "0.20.1",
            "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None, "format": None,
                                          "weights": dict(args, strategy="channel", dynamic=False),
                                          "input_activations": dict(args, strategy="token", dynamic=True,
                                                                    observer=None)}}}


def quantize(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] int8 | e4m3, scale [N, 1] in w.dtype)."""
    amax = w.float().abs().amax(dim=1, keepdim=True)
    half_range = 127.5 if scheme == "int8" else 448.0
    scale = torch.where(amax > 0, amax / half_range, torch.full_like(amax, torch.finfo(torch.float32).eps))
    scale = scale.to(w.dtype)
    v = w.float() / scale.float()
    if scheme == "int8":
        return v.round().clamp(-128, 127).to(torch.int8), scale
    return v.clamp(-448, 448).to(torch.float8_e4m3fn), scale


def write(src: str | Path, dst: str | Path, scheme: str, experts: bool = False) -> Path:
    from onegraph.checkpoint.load import model_dir
    src, dst = model_dir(src), Path(dst)
    if scheme not in ("int8", "fp8-channel"):
        raise ValueError(f"scheme must be int8 or fp8-channel, got {scheme!r}")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out = {}
    for k, v in tensors.items():
        if DENSE.match(k) or (experts and EXPERT.match(k)):
            base = k[: -len("weight")]
            out[k], out[base + "weight_scale"] = quantize(v, scheme)
        else:
            out[k] = v
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["quantization_config"] = config(scheme)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--scheme", required=True, choices=["int8", "fp8-channel"])
    p.add_argument("--experts", action="store_true", help="also quantize the routed experts (per-expert keys)")
    a = p.parse_args(argv)
    print(write(a.src, a.dst, a.scheme, a.experts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
