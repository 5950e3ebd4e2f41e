"""`onegraph draft-vocab MODEL TEXT [TEXT ...] --out FILE.json`: a model's token ids ranked by how often its
tokenizer emits them on a text corpus, the draft-vocab file `onegraph export --draft-vocab N --draft-vocab-file
FILE.json` takes its first N ids from (format: checkpoint/draft_vocab.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from onegraph.checkpoint.draft_vocab import tokenizer_sha256


def rank_ids(model_path: Path, texts: list[Path]) -> dict:
    """The draft-vocab JSON (checkpoint/draft_vocab.py) of the texts under the model's tokenizer."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
    counts = np.zeros(tok.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for t in texts:
        ids = np.asarray(tok.encode(Path(t).read_text(encoding="utf-8", errors="replace"),
                                    add_special_tokens=False).ids, dtype=np.int64)
        counts += np.bincount(ids, minlength=counts.size)[: counts.size]
    seen = np.nonzero(counts)[0]
    order = seen[np.lexsort((seen, -counts[seen]))]              # most frequent first, lower id on ties
    return {"tokenizer_sha256": tokenizer_sha256(model_path), "ids": order.tolist(),
            "counts": counts[order].tolist(), "tokens": int(counts.sum())}


def add_args(p) -> None:
    p.add_argument("model", help="HF-format directory or `tiny` (its tokenizer.json)")
    p.add_argument("texts", nargs="+", help="UTF-8 text files of the traffic the drafts should cover")
    p.add_argument("--out", required=True, help="the draft-vocab JSON to write")


def run(args) -> int:
    from onegraph.checkpoint.load import model_dir
    res = rank_ids(model_dir(args.model), [Path(t) for t in args.texts])
    Path(args.out).write_text(json.dumps(res) + "\n")
    print(f"{args.out}: {len(res['ids'])} ids ranked over {res['tokens']} tokens")
    return 0
