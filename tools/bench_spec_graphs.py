"""Speculative decoding through exported artifacts on the CPU: acceptance and tokens/s with and without it.

    python -m onegraph.tools.bench_spec_graphs --out FILE.json [--model tiny] [--ks 1,2,3,4] [--n-prompts 8]
                                               [--prompt-len 64] [--max-new-tokens 128] [--workdir DIR]

For each k an artifact of --model (default the trained builtin `tiny`) is exported with
--speculative-tokens k (batch bucket 1, prefill chunk 64, max_seq_len 256, fp32; into --workdir, reused
when it is already there; its decode and prefill graphs come from the compile cache after the first k).
Each held-out prompt (graphs/tiny_weights/heldout.txt, --n-prompts windows of --prompt-len bytes spread
evenly, never trained on) runs greedy through one Engine slot with speculation off (the artifact's decode
graphs) and on (its spec graphs), back to back; every speculative run must give the speculation-off ids
(else the tool exits 1). Intra-op threads: 1.

Per k: acceptance_length (tokens per round: accepted drafts + 1), accepted_mean (0..k), acceptance_rate
(accepted / drafted), tok_s on and off (generated tokens / summed request wall time, prefill included)
and their ratio. A round runs the head k times (1 layer) and the main model once over k+1 tokens, so on a
CPU, where a step's cost grows with its rows, the gain is bounded by how much cheaper k+1 rows in one pass
are than k+1 passes.
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

from .bench_spec import add_run_args, heldout_prompts


def artifact(model: str, k: int, workdir: Path) -> Path:
    from onegraph.export.pipeline import DEFAULT_CACHE_DIR, ExportOptions, export
    out = workdir / f"spec_k{k}"
    if not (out / "manifest.json").is_file():
        export(model, out, ExportOptions(batch_sizes=(1,), prefill_chunks=(64,), max_seq_len=256,
                                         speculative_tokens=k), progress=False, cache_dir=DEFAULT_CACHE_DIR)
    return out


def run(engine, prompts, max_new) -> tuple[list[list[int]], float, list[dict]]:
    ids, secs, spec = [], 0.0, []
    for p in prompts:
        t = time.perf_counter()
        r = engine.generate(p, max_new)
        secs += time.perf_counter() - t
        ids.append(r.token_ids)
        spec.append(r.speculation)
    return ids, secs, spec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onegraph.tools.bench_spec_graphs")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--workdir", type=Path, default=None)
    add_run_args(ap)
    args = ap.parse_args(argv)

    from onegraph.graphs.spec import check_k
    from onegraph.runtime import Engine
    torch.set_num_threads(1)
    ks = [check_k(int(k)) for k in args.ks.split(",")]
    prompts = heldout_prompts(args.prompts, args.n_prompts, args.prompt_len)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="onegraph-bench-spec-"))
    rows, off_all = [], []
    for k in ks:
        path = artifact(args.model, k, workdir)
        on = Engine.from_artifact(path, max_slots=1)
        off = Engine.from_artifact(path, max_slots=1, check_parity=False, speculation=False)
        try:
            run(on, prompts[:1], 8)                                     # warm-up (first-call costs)
            run(off, prompts[:1], 8)
            off_ids, off_s, _ = run(off, prompts, args.max_new_tokens)
            on_ids, on_s, spec = run(on, prompts, args.max_new_tokens)
        finally:
            on.close()
            off.close()
        if on_ids != off_ids:
            i = next(i for i, (a, b) in enumerate(zip(on_ids, off_ids)) if a != b)
            print(f"bench_spec_graphs: k={k} prompt {i} differs from speculation off", file=sys.stderr)
            return 1
        tokens = sum(map(len, on_ids))
        rounds = sum(s["rounds"] for s in spec)
        accepted = sum(s["accepted_mean"] * s["rounds"] for s in spec)
        off_all.append(tokens / off_s)
        rows.append({"k": k, "rounds": rounds, "accepted_mean": round(accepted / rounds, 4),
                     "acceptance_length": round(1 + accepted / rounds, 4),
                     "acceptance_rate": round(accepted / (rounds * k), 4),
                     "tok_s_on": round(tokens / on_s, 1), "tok_s_off": round(tokens / off_s, 1),
                     "speedup": round(off_s / on_s, 3), "tokens": tokens})
        print(f"k={k}: acceptance length {1 + accepted / rounds:.3f} ({rounds} rounds), {tokens / on_s:.1f} tok/s "
              f"on vs {tokens / off_s:.1f} off ({off_s / on_s:.2f}x)")
    res = {
        "command": "python -m onegraph.tools.bench_spec_graphs " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model, "prompts": f"{args.n_prompts} x {args.prompt_len} bytes of {args.prompts.name}, evenly spaced",
        "max_new_tokens": args.max_new_tokens, "sampling": "greedy", "device": "cpu", "dtype": "float32",
        "threads": 1, "mode": "exported artifacts (AOTInductor CPU), runtime Engine, 1 slot; speculation off = the "
                              "same artifact's decode graphs",
        "artifact": {"batch_sizes": [1], "prefill_chunks": [64], "max_seq_len": 256},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__},
        "metrics": "acceptance_length: tokens per round (accepted drafts + 1); accepted_mean: drafts accepted per "
                   "round (0..k); acceptance_rate: accepted / drafted; tok_s: generated tokens / summed request "
                   "wall seconds, prefill included; identical ids on and off for every prompt",
        "identical_to_speculation_off": True, "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
