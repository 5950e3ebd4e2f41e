"""A pruned draft vocabulary for speculation (`onegraph export --draft-vocab N`, graphs/spec.py prune_draft_vocab):
the first N ids of a ranking of the model's token ids, checked against the model.

A draft-vocab file (JSON, made by `onegraph draft-vocab`, commands/draft_vocab.py): {"tokenizer_sha256": sha256 of
the model's tokenizer.json, "ids": every id the corpus holds, most frequent first (ties: the lower id first),
"counts": their counts, "tokens": the corpus size in tokens}. The builtin `tiny` ships one made from its training
corpus (models/qwen3_5/tiny_weights/draft_vocab.json), its default.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from onegraph.models.qwen3_5.tiny import TINY_WEIGHTS

TINY_DRAFT_VOCAB = TINY_WEIGHTS.parent / "draft_vocab.json"


def tokenizer_sha256(model_path: Path) -> str:
    path = Path(model_path) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{model_path} has no tokenizer.json: a draft vocabulary is made and checked with it")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def draft_ids(model_spec, n: int, vocab: int, file: str | None) -> torch.Tensor:
    """The first n ids of the draft-vocab file (None: the builtin default, `tiny` only) -> [n] int64, checked
    against the model: its tokenizer's sha256, ids inside [0, vocab), no repeats, at least n of them."""
    from onegraph.checkpoint.load import model_dir
    model_path = model_dir(model_spec)
    if not 1 <= n <= vocab:
        raise ValueError(f"--draft-vocab must be in 1..{vocab} (the vocabulary), got {n}")
    if file is None:
        if str(model_spec) != "tiny":
            raise ValueError("--draft-vocab needs --draft-vocab-file (make one with `onegraph draft-vocab MODEL "
                             "TEXT... --out FILE`); only the builtin tiny has a default")
        file = str(TINY_DRAFT_VOCAB)
    try:
        data = json.loads(Path(file).read_text())
        ids, sha = data["ids"], data["tokenizer_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--draft-vocab-file {file}: not a draft-vocab JSON ({type(e).__name__}: {e})") from None
    if sha != tokenizer_sha256(model_path):
        raise ValueError(f"--draft-vocab-file {file} was made with another tokenizer (sha256 {str(sha)[:12]}..., the "
                         f"model's {tokenizer_sha256(model_path)[:12]}...)")
    if len(ids) < n:
        raise ValueError(f"--draft-vocab {n}: {file} ranks only {len(ids)} ids")
    out = torch.tensor(ids[:n], dtype=torch.int64)
    if out.min() < 0 or out.max() >= vocab or out.unique().numel() != n:
        raise ValueError(f"--draft-vocab-file {file}: its first {n} ids must be distinct ids in [0, {vocab})")
    return out


def ids_sha256(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()
