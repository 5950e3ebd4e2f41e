"""HF safetensors -> Qwen35Model state dict.

Handles: single file or sharded (`model.safetensors.index.json`); key prefixes
`model.language_model.` (hub ConditionalGeneration) and `model.`; experts as per-expert keys
(`mlp.experts.E.{gate,up,down}_proj.weight`, fused here) or already fused (`gate_up_proj`,
`down_proj`); vision (`model.visual.*`) and MTP (`mtp.*`) keys skipped with a logged count.
A missing tensor or a shape mismatch raises LoadError naming the key and both shapes.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

log = logging.getLogger("onegraph.weights")
SKIP = (re.compile(r"^model\.visual\."), re.compile(r"^mtp\."), re.compile(r"^visual\."))
EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class LoadError(ValueError):
    pass


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


def _strip(key: str) -> str | None:
    for rx in SKIP:
        if rx.match(key):
            return None
    for prefix in ("model.language_model.", "model."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key  # lm_head.weight and the like


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """All text-model tensors under their model-side names (experts still per-expert)."""
    path = Path(path)
    out, skipped = {}, 0
    for f in _files(path):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                name = _strip(key)
                if name is None:
                    skipped += 1
                    continue
                out[name] = sf.get_tensor(key)
    if skipped:
        log.info("skipped %d vision/MTP tensors", skipped)
    return out


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down keys -> gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    per: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for k, v in tensors.items():
        m = EXPERT.match(k)
        if m:
            per.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
        else:
            out[k] = v
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


def load_into(model: torch.nn.Module, path: str | Path, dtype: torch.dtype) -> None:
    """Fill every parameter of `model` from the checkpoint at `path`, cast to dtype; strict."""
    tensors = fuse_experts(read_checkpoint(path))
    expected = dict(model.named_parameters())
    for name, p in expected.items():
        if name not in tensors:
            raise LoadError(f"missing tensor {name!r} (expected shape {list(p.shape)}) in {path}")
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise LoadError(f"shape mismatch for {name!r}: checkpoint {list(t.shape)}, model expects {list(p.shape)}")
        with torch.no_grad():
            p.data = t.to(dtype).contiguous()
    unused = sorted(set(tensors) - set(expected) - {"lm_head.weight"})
    if unused:
        log.warning("ignored %d unexpected tensors, e.g. %s", len(unused), unused[:3])
