"""Speculative decoding with the MTP head, eager, on the CPU: acceptance and tokens/s with and without it.

    python -m onegraph.scripts.bench_spec [--model DIR ...] [--prompts FILE] [--n-prompts 8] [--prompt-len 64]
                                        [--max-new-tokens 128] [--ks 1,2,3,4] --out FILE.json

--model (repeatable; one entry in the JSON's `models` each): an HF-format directory whose checkpoint holds
`mtp.*` weights (a scripts/train_tiny.py checkpoint: its train_log.json's command and held-out losses are
copied into the entry), or `tiny-random-mtp` (the default): the builtin tiny model (models/qwen3_5/tiny.py, seed 0)
plus an MTP head with seeded random weights (`random_mtp_checkpoint`), whose drafts are noise, so its
acceptance only says the machinery runs.
Prompts: --n-prompts windows of --prompt-len bytes spread evenly over the held-out text (default
models/qwen3_5/tiny_weights/heldout.txt, source never trained on). Greedy, one slot, fp32, 1 thread; each
prompt runs speculation-off (graphs/eager.py generate_eager) then on for each k (graphs/spec.py
generate_spec); every speculative run must give the speculation-off ids (else the tool exits 1).

Metrics per k: accepted_mean (drafts accepted per verify, 0..k), acceptance_length (tokens emitted per
verify, accepted_mean + 1), tok_s (generated tokens / wall seconds, prefill included) and its ratio to
speculation-off. Eager CPU runs every op in Python at tiny sizes, where a verify of k+1 tokens costs
about as much as k+1 decode steps plus the head's draft steps; the speedup speculation exists for (one
memory-bound pass for several tokens) shows only in replayed graphs on a GPU, not here.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from onegraph.models.qwen3_5.tiny import TINY_WEIGHTS

HELDOUT_TEXT = TINY_WEIGHTS.parent / "heldout.txt"
RANDOM_MTP = "tiny-random-mtp"


def random_mtp_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """The builtin tiny checkpoint (the same main weights as `tiny` at seed 0) plus an MTP head with seeded
    random weights, in the hub layout (`mtp.*` keys after the main model's in the seeded stream)."""
    from onegraph.models.qwen3_5 import tiny
    from onegraph.models.qwen3_5.config import ModelConfig
    from onegraph.models.qwen3_5.mtp import MtpHead
    from onegraph.models.qwen3_5.model import Qwen35Model
    cfg = ModelConfig.from_hf(tiny.TINY_HF_CONFIG)
    with torch.device("meta"):
        model = Qwen35Model(cfg)
        model.mtp = MtpHead(cfg, tiny.TINY_HF_CONFIG["mtp_num_hidden_layers"])
    return tiny.write_checkpoint(out_dir, tiny.random_hf_weights(model, seed))


def heldout_prompts(path: Path, n: int, length: int) -> list[list[int]]:
    if not path.is_file():
        raise SystemExit(f"bench_spec: prompts file {str(path)!r} does not exist (pass --prompts FILE)")
    data = path.read_bytes()
    if len(data) < n * length:
        raise SystemExit(f"bench_spec: {path} has {len(data)} bytes, fewer than {n} prompts x {length}")
    step = len(data) // n
    return [list(data[i * step: i * step + length]) for i in range(n)]


def bench_model(spec: str, prompts: list[list[int]], ks: list[int], max_new: int, draft_vocab: int = 0,
                draft_vocab_file: str | None = None) -> dict | None:
    """Speculation off, then on for each k, over `prompts` -> the JSON entry (None: a run differed).
    draft_vocab > 0: the head drafts over that many ids (graphs/spec.py prune_draft_vocab)."""
    from onegraph.graphs.eager import generate_eager
    from onegraph.checkpoint.load import load_model
    from onegraph.graphs.spec import generate_spec
    if spec == RANDOM_MTP:
        path = random_mtp_checkpoint(tempfile.mkdtemp(prefix="onegraph-mtp-"))
        entry = {"model": f"{RANDOM_MTP}: builtin tiny (seed 0) + an MTP head with seeded random weights "
                          "(drafts are noise)"}
    else:
        path = Path(spec)
        entry = {"model": str(path)}
        log = path / "train_log.json"
        if log.is_file():
            t = json.loads(log.read_text())
            entry["trained_by"] = t.get("command")
            entry["final_held_out"] = (t.get("held_out") or [None])[-1]
    cfg, model, _ = load_model(path, mtp=True)
    if draft_vocab:
        from onegraph.checkpoint.draft_vocab import draft_ids
        from onegraph.graphs.spec import prune_draft_vocab
        prune_draft_vocab(model, draft_ids(spec, draft_vocab, cfg.vocab_size, draft_vocab_file))
    entry["draft_vocab"] = draft_vocab or cfg.vocab_size
    generate_eager(model, prompts[0], 8)                                  # warm-up (first-call costs)
    generate_spec(model, prompts[0], 8, ks[0])
    off_s, off_tokens, refs = 0.0, 0, []
    for p in prompts:
        t = time.perf_counter()
        ids = generate_eager(model, p, max_new).token_ids
        off_s += time.perf_counter() - t
        off_tokens += len(ids)
        refs.append(ids)
    off_tok_s = off_tokens / off_s
    rows = []
    for k in ks:
        secs, tokens, accepted = 0.0, 0, []
        for p, ref in zip(prompts, refs):
            t = time.perf_counter()
            r = generate_spec(model, p, max_new, k)
            secs += time.perf_counter() - t
            if r.token_ids != ref:
                first = next(i for i, (a, b) in enumerate(zip(r.token_ids + [-1], ref)) if a != b)
                print(f"bench_spec: {spec} k={k} differs from speculation-off at token {first}", file=sys.stderr)
                return None
            tokens += len(r.token_ids)
            accepted += r.accepted
        mean = sum(accepted) / len(accepted)
        rows.append({"k": k, "verifies": len(accepted), "accepted_mean": round(mean, 4),
                     "acceptance_length": round(mean + 1, 4), "tok_s": round(tokens / secs, 1),
                     "tok_s_vs_off": round(tokens / secs / off_tok_s, 3)})
        print(f"{spec} draft vocab {entry['draft_vocab']} k={k}: acceptance length {mean + 1:.3f} ({len(accepted)} verifies), "
              f"{tokens / secs:.1f} tok/s (off {off_tok_s:.1f})")
    entry.update({"identical_to_speculation_off": True, "off": {"tok_s": round(off_tok_s, 1), "tokens": off_tokens},
                  "speculative": rows})
    return entry


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The options both speculation benchmarks take (this one eager; benchmarks/cpu_tiny_spec.json records the artifacts' one)."""
    ap.add_argument("--prompts", type=Path, default=HELDOUT_TEXT)
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--out", type=Path, required=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onegraph.scripts.bench_spec")
    ap.add_argument("--model", action="append", help=f"checkpoint dir or {RANDOM_MTP} (default), repeatable")
    ap.add_argument("--draft-vocab", default="0", help="comma-separated draft vocabulary sizes (0: the whole "
                                                       "vocabulary), one entry per model and size")
    ap.add_argument("--draft-vocab-file", default=None, help="their ranking (default: tiny's builtin one)")
    add_run_args(ap)
    args = ap.parse_args(argv)

    from onegraph.graphs.spec import check_k
    torch.set_num_threads(1)
    ks = [check_k(int(k)) for k in args.ks.split(",")]
    prompts = heldout_prompts(args.prompts, args.n_prompts, args.prompt_len)
    models = []
    for spec in args.model or [RANDOM_MTP]:
        for n in (int(v) for v in args.draft_vocab.split(",")):
            entry = bench_model(spec, prompts, ks, args.max_new_tokens, n, args.draft_vocab_file)
            if entry is None:
                return 1
            models.append(entry)
    res = {
        "command": "python -m onegraph.scripts.bench_spec " + " ".join(argv if argv is not None else sys.argv[1:]),
        "prompts": f"{args.n_prompts} x {args.prompt_len} bytes of {args.prompts.name}, evenly spaced",
        "max_new_tokens": args.max_new_tokens, "sampling": "greedy", "device": "cpu", "dtype": "float32",
        "threads": 1, "mode": "eager (graphs/spec.py generate_spec vs graphs/eager.py generate_eager)",
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "metrics": "accepted_mean: drafts accepted per verify (0..k); acceptance_length: tokens emitted per "
                   "verify (accepted_mean + 1); tok_s: generated tokens / wall s, prefill included",
        "note": "eager CPU: a verify of k+1 tokens plus k head steps cost more Python time than k+1 decode "
                "steps save, so tok/s here does not show the graph speedup speculation is for",
        "models": models,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
