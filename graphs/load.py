"""load_model: an HF-format directory (or the builtin `tiny`) -> (ModelConfig, Qwen35Model)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from .config import ModelConfig
from .qwen3_5 import Qwen35Model
from .weights import load_into

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def model_dir(spec: str | Path) -> Path:
    """`tiny` -> a freshly written tiny checkpoint (deterministic); a directory -> itself."""
    if str(spec) == "tiny":
        from .tiny import write_tiny
        return write_tiny(Path(tempfile.mkdtemp(prefix="onegraph-tiny-")))
    path = Path(spec)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist (or pass 'tiny')")
    return path


def load_model(spec: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu"):
    path = model_dir(spec)
    cfg = ModelConfig.from_file(path)
    with torch.device("meta"):
        model = Qwen35Model(cfg)
    model.to_empty(device="cpu")
    model.inv_freq.copy_(Qwen35Model.rope_inv_freq(cfg))
    load_into(model, path, resolve_dtype(dtype))
    return cfg, model.to(device).eval(), path
