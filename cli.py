"""The `onegraph` command line: init-tiny, generate (more subcommands arrive with export/runtime).

User errors (missing directory, bad ids, unknown model_type, bad artifact) print one line to
stderr and exit 2 — never a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


class UserError(Exception):
    pass


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UserError("--prompt-ids is empty")
    return ids


def load_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"--prompt needs {path} (or pass --prompt-ids)")
    return Tokenizer.from_file(str(path))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's eos ids")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt")
    g.add_argument("--prompt-ids")


def check_sampling(args) -> None:
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise UserError("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")


def cmd_init_tiny(args) -> int:
    from onegraph.graphs.tiny import write_tiny
    print(write_tiny(args.dir))
    return 0


def cmd_generate(args) -> int:
    check_sampling(args)
    if not args.eager:
        raise UserError("artifact generation is not available yet; pass --eager")
    import torch
    from onegraph.graphs.eager import SamplingParams, generate_eager
    from onegraph.graphs.load import load_model
    cfg, model, model_dir = load_model(args.model, args.dtype)
    tok = None
    if args.prompt is not None:
        tok = load_tokenizer(model_dir)
        ids = tok.encode(args.prompt).ids
        if not ids:
            raise UserError("--prompt encodes to no tokens")
    else:
        ids = parse_ids(args.prompt_ids)
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise UserError(f"prompt ids {bad[:5]} outside the vocabulary [0, {cfg.vocab_size})")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    res = generate_eager(model, ids, args.max_new_tokens,
                         SamplingParams(args.temperature, args.top_k, args.top_p, args.seed),
                         stop_ids=() if args.ignore_eos else cfg.eos_token_ids)
    if tok is None and (model_dir / "tokenizer.json").is_file():
        tok = load_tokenizer(model_dir)
    text = tok.decode(res.token_ids) if tok else None
    if args.json:
        print(json.dumps({"token_ids": res.token_ids, "text": text, "finish_reason": res.finish_reason,
                          "prompt_ids": ids, "mode": "eager"}))
    else:
        print(text if text is not None else " ".join(map(str, res.token_ids)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="onegraph", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("init-tiny", help="write the builtin tiny model as an HF checkpoint dir")
    p.add_argument("dir")
    p.set_defaults(fn=cmd_init_tiny)
    p = sub.add_parser("generate", help="generate from a model dir / `tiny` (--eager) or an artifact")
    p.add_argument("model", help="HF-format directory, `tiny`, or an exported artifact directory")
    p.add_argument("--eager", action="store_true", help="run the eager model (no graphs)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_sampling_args(p)
    p.set_defaults(fn=cmd_generate)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (UserError, FileNotFoundError, ValueError) as e:
        print(f"onegraph {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
