"""The recipe from a checkpoint to an artifact's graph weights, one code path for export and for loading an
artifact whose weights are referenced instead of copied (`export --weights reference`, docs/design.md).

    checkpoint --load_tp1--> TP-1 model (load_model: dtype, quant, fp32_reduce, allow_unused, mtp; unfused)
               --rank_model--> this rank's model (shard_model when tp > 1, then fuse_projections)
               --state_tensors--> {"model.<name>": contiguous CPU tensor}   (parameters and buffers)

The weights a graph binds are not the checkpoint's tensors: the projections are concatenated, the experts
stacked, a float checkpoint may be quantized, a quantized one partly dequantized, a TP rank sliced. So a
referencing artifact records the recipe (the options below) and `tensors_sha256` of the result; the runtime
runs the same three functions on the verified checkpoint files and refuses a result whose digest differs
(the loading code changed since export, or a file changed after it was hashed).
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from onegraph.checkpoint.load import family, load_model, shard_model
from onegraph.checkpoint.weights import _files

RECIPE = "onegraph.checkpoint.recipe v1"      # recorded; a runtime refuses a recipe it does not implement
FIELDS = ("dtype", "quant", "fp32_reduce", "allow_unused", "mtp", "tp", "fp8_lm_head")


def recipe_of(dtype: str, quant: str, fp32_reduce: bool, allow_unused: bool, mtp: bool, tp: int,
              fp8_lm_head: bool = False) -> dict:
    """The options that decide the graph weights, as the manifest records them (quant: the resolved scheme)."""
    return {"recipe": RECIPE, "dtype": dtype, "quant": quant, "fp32_reduce": fp32_reduce,
            "allow_unused": allow_unused, "mtp": mtp, "tp": tp, "fp8_lm_head": fp8_lm_head}


def load_tp1(spec: str | Path, recipe: dict, device: str | torch.device = "cpu"):
    """-> (cfg, TP-1 model, checkpoint dir): the checkpoint loaded as the recipe says, projections not yet fused
    (a TP rank is sliced from the separate parts: models/qwen3_5/fuse.py)."""
    return load_model(spec, recipe["dtype"], device, fp32_reduce=recipe["fp32_reduce"],
                      allow_unused=recipe["allow_unused"], fuse=False, quant=recipe["quant"], mtp=recipe["mtp"],
                      fp8_lm_head=recipe.get("fp8_lm_head", False))


def rank_model(model, rank: int, tp: int):
    """Rank `rank`'s model (the TP-1 model itself at tp 1), its same-input projections concatenated."""
    out = model if tp == 1 else shard_model(model, rank, tp)
    family(model.cfg).fuse_projections(out)
    return out


def state_tensors(model) -> dict[str, torch.Tensor]:
    """What the graphs bind: every parameter and buffer as `model.<name>`, contiguous, on the CPU."""
    return {n: t.detach().contiguous().cpu() for n, t in
            list(model.named_parameters(prefix="model")) + list(model.named_buffers(prefix="model"))}


def graph_weights(spec: str | Path, recipe: dict, rank: int = 0) -> dict[str, torch.Tensor]:
    """Rank `rank`'s graph weights made from the checkpoint by the recipe (on the CPU)."""
    if recipe.get("recipe") != RECIPE:
        raise ValueError(f"weights recipe {recipe.get('recipe')!r}: this onegraph implements {RECIPE!r}; re-export")
    _, model, _ = load_tp1(spec, recipe)
    return state_tensors(rank_model(model, rank, recipe["tp"]))


def _tensor_sha256(t: torch.Tensor) -> bytes:
    # the raw bytes of a contiguous CPU tensor; hashlib releases the GIL on large buffers, so threads run in parallel
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().data).digest()


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes (what a safetensors file of them holds), the
    tensors hashed in parallel threads. Contiguous CPU tensors."""
    names = sorted(tensors)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        digests = list(pool.map(lambda n: _tensor_sha256(tensors[n]), names))
    h = hashlib.sha256()
    for name, d in zip(names, digests):
        t = tensors[name]
        h.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0".encode() + d)
    return h.hexdigest()


def checkpoint_files(path: Path) -> list[str]:
    """The files load_model reads from checkpoint directory `path`, relative to it: config.json, the shard
    index when there is one, and the safetensors files (checkpoint/weights.py)."""
    names = ["config.json"] + (["model.safetensors.index.json"] if (path / "model.safetensors.index.json").is_file()
                               else [])
    return names + [str(f.relative_to(path)) for f in _files(path)]
