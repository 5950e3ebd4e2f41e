"""Decode inter-token latency of running streams while a long prompt is admitted, through the Engine.

    python -m onegraph.scripts.bench_interleave --artifact ART --streams 8 --prompt-len 32768 --out FILE.json

--streams requests decode (greedy, 16-token prompts); once each has --warmup tokens, one prompt of
--prompt-len tokens is submitted, and the streams are cancelled once it has its first token. For each
--chunks entry (the prefill chunk the prompt is fed in, one of the artifact's; default its largest) and each
--budgets entry (prompt tokens prefilled per engine step; `chunk`: the engine's default, one chunk;
`whole`: the whole prompt in one step, the stall interleaving replaces) it reports
the streams' inter-token gaps that overlap the long prompt's prefill (p50 / p90 / p99 / max ms), the long
prompt's time to first token, and the decode steps run between its chunks. One engine serves every
budget (set between runs, while it is idle).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np

from onegraph.commands.bench_common import emit


def pct(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    a = np.asarray(xs) * 1e3
    return {"n": len(xs), "p50": round(float(np.percentile(a, 50)), 3), "p90": round(float(np.percentile(a, 90)), 3),
            "p99": round(float(np.percentile(a, 99)), 3), "max": round(float(a.max()), 3)}


def one_run(eng, streams: int, prompt_len: int, warmup: int, seed: int) -> dict:
    rng = random.Random(seed)
    V, T = eng.vocab, eng.ex.max_seq_len
    stamps = [[] for _ in range(streams)]           # perf_counter per streamed token, on the engine thread
    warm, first, done = threading.Event(), [], [threading.Event() for _ in range(streams + 1)]

    def stream_emit(k):
        def emit(ev):
            if ev.token_id is not None:
                stamps[k].append(time.perf_counter())
                if all(len(s) >= warmup for s in stamps):
                    warm.set()
            if ev.finish_reason is not None:
                done[k].set()
        return emit

    def long_emit(ev):
        if ev.token_id is not None and not first:
            first.append(time.perf_counter())
        if ev.finish_reason is not None:
            done[streams].set()
    ids = [eng.submit([rng.randrange(V) for _ in range(16)], stream_emit(k), max_new_tokens=T - 16)
           for k in range(streams)]
    if not warm.wait(600):
        raise RuntimeError("the streams did not reach --warmup tokens in 600 s")
    before = eng.stats()["counters"].get("decode_steps_between_chunks", 0)
    t0 = time.perf_counter()
    eng.submit([rng.randrange(V) for _ in range(prompt_len)], long_emit, max_new_tokens=1)
    if not done[streams].wait(600):
        raise RuntimeError("the long prompt did not finish in 600 s")
    for rid in ids:
        eng.cancel(rid)
    for d in done:
        d.wait(60)
    t1 = first[0]
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if b > t0 and a < t1]   # overlapping the prefill
    steady = [b - a for s in stamps for a, b in zip(s, s[1:]) if b <= t0]
    return {"prefill_budget": eng.prefill_budget, "long_ttft_ms": round((t1 - t0) * 1e3, 3),
            "itl_during_prefill_ms": pct(gaps), "itl_before_ms": pct(steady),
            "decode_steps_between_chunks": eng.stats()["counters"].get("decode_steps_between_chunks", 0) - before}


def budget_runs(eng, budgets: list[str], streams: int, prompt_len: int, warmup: int, seed: int,
                chunks: list[int] | None = None) -> list[dict]:
    """one_run per prefill chunk (default: the engine's) and prefill budget (`chunk`: one chunk per step,
    `whole`: the whole prompt, or a token count), set on the idle engine between runs and restored after."""
    default, chunk0, runs = eng.prefill_budget, eng.ex.max_chunk, []
    try:
        for c in chunks or [chunk0]:
            eng.ex.set_max_chunk(c)
            for b in budgets:
                eng.prefill_budget = c if b == "chunk" else prompt_len if b == "whole" else int(b)
                runs.append(dict(one_run(eng, streams, prompt_len, warmup, seed), prefill_chunk=c, budget=b))
    finally:
        eng.prefill_budget = default
        eng.ex.set_max_chunk(chunk0)
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onegraph.scripts.bench_interleave", description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--warmup", type=int, default=8, help="tokens each stream has before the long prompt comes")
    ap.add_argument("--budgets", default="chunk,whole", help="comma-separated: chunk, whole, or token counts")
    ap.add_argument("--chunks", default=None, help="comma-separated prefill chunks to feed the prompt in (each one "
                                                   "of the artifact's; default its largest)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    from onegraph.runtime import Engine
    eng = Engine.from_artifact(args.artifact, max_slots=args.streams + 1, device=args.device, check_parity=False)
    try:
        if not 16 + 2 * args.warmup <= eng.ex.max_seq_len or not 1 <= args.prompt_len < eng.ex.max_seq_len:
            print(f"bench_interleave: error: --prompt-len must be in 1..{eng.ex.max_seq_len - 1} (the artifact's "
                  f"max_seq_len) and --warmup small enough for 16-token prompts", file=sys.stderr)
            return 2
        chunks = [int(c) for c in args.chunks.split(",")] if args.chunks else None
        bad = [c for c in chunks or [] if c not in eng.ex.prefill_buckets]
        if bad:
            print(f"bench_interleave: error: --chunks {bad[0]}: the artifact's prefill chunks are "
                  f"{', '.join(map(str, eng.ex.prefill_buckets))}", file=sys.stderr)
            return 2
        runs = budget_runs(eng, args.budgets.split(","), args.streams, args.prompt_len, args.warmup, args.seed,
                           chunks)
    finally:
        eng.close()
    import torch
    res = {"command": "python -m onegraph.scripts.bench_interleave " + " ".join(sys.argv[1:] if argv is None else argv),
           "artifact": str(Path(args.artifact).resolve()), "path": eng.ex.path, "streams": args.streams,
           "prompt_len": args.prompt_len, "prefill_chunks": eng.ex.prefill_buckets,
           "export_options": eng.artifact.options,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "host_load_average_1min": round(os.getloadavg()[0], 2), "runs": runs}     # other processes share a CPU
    emit(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
