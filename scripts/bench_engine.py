"""An artifact served through the Engine: load time by stage, the first request's TTFT, bs1 decode, and
output throughput at a fixed concurrency — the figures a user compares with vLLM / SGLang, next to the
graph-only ones of bench_big.

    python -m onegraph.scripts.bench_engine --artifact ART --concurrency 64 --input-len 512 --output-len 256 \
        --out FILE.json

1. load: `Engine.from_artifact(ART, max_slots=C)` timed whole, with the executor's own stages
   (`load_timings_s`: checkpoint files, weights, graph packages, capture, fixture ...). The load-time parity
   fixture runs unless --no-parity-check (then `fixture: "skipped"` is recorded: only for checkpoints whose
   fixture cannot pass, e.g. random routers with near-ties everywhere).
2. first request: one prompt of --input-len seeded random ids, --output-len greedy tokens, alone on the engine:
   TTFT (submit to first token), TPOT (mean gap after it) = the bs1 decode ms/token through the engine.
3. concurrency: --concurrency such requests submitted at once (the engine admits them all: max_slots =
   C), greedy, no early stop: output tok/s = tokens / wall, input tok/s, TTFT / TPOT / ITL percentiles,
   the engine's decode steps and prefill budget.
Timestamps are taken in the engine's emit callback (its thread), as bench_interleave does.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import threading
import time
from pathlib import Path

from onegraph.commands.bench_common import emit
from .bench_interleave import pct


def _run(eng, prompts: list[list[int]], out_len: int, timeout: float = 1800) -> dict:
    """All prompts submitted at once -> per-request stamps and wall seconds."""
    n = len(prompts)
    stamps, done = [[] for _ in range(n)], [threading.Event() for _ in range(n)]

    def on(k):
        def emit_(ev):
            if ev.token_id is not None:
                stamps[k].append(time.perf_counter())
            if ev.finish_reason is not None:
                done[k].set()
        return emit_
    t0 = time.perf_counter()
    subs = []
    for k, p in enumerate(prompts):
        subs.append(time.perf_counter())
        eng.submit(p, on(k), max_new_tokens=out_len)
    for d in done:
        if not d.wait(timeout):
            raise RuntimeError(f"a request did not finish in {timeout} s")
    wall = max(s[-1] for s in stamps if s) - t0
    ttft = [s[0] - t for s, t in zip(stamps, subs) if s]
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps if len(s) > 1]
    itl = [b - a for s in stamps for a, b in zip(s, s[1:])]
    tokens = sum(len(s) for s in stamps)
    return {"requests": n, "output_tokens": tokens, "wall_s": round(wall, 4),
            "output_tok_s": round(tokens / wall, 2), "input_tok_s": round(sum(map(len, prompts)) / wall, 2),
            "ttft_ms": pct(ttft), "tpot_ms": pct(tpot), "itl_ms": pct(itl)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onegraph.scripts.bench_engine", description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-parity-check", dest="check_parity", action="store_false",
                    help="skip the load-time parity fixture (recorded in the JSON)")
    ap.add_argument("--profile-load", type=int, default=0, metavar="N",
                    help="run the load under cProfile and record its N most expensive functions (cumulative "
                         "seconds, own seconds, calls) as load_profile: where a slow stage spends its time")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    if args.concurrency < 1 or args.input_len < 1 or args.output_len < 2 or args.profile_load < 0:
        print("bench_engine: error: need --concurrency >= 1, --input-len >= 1, --output-len >= 2", file=sys.stderr)
        return 2
    import torch

    from onegraph.runtime import Engine
    prof = cProfile.Profile() if args.profile_load else None
    t = time.perf_counter()
    if prof is not None:
        prof.enable()
    eng = Engine.from_artifact(args.artifact, max_slots=args.concurrency, device=args.device,
                               check_parity=args.check_parity)
    if prof is not None:
        prof.disable()
    load_s = time.perf_counter() - t
    try:
        if args.input_len + args.output_len > eng.ex.max_seq_len:
            print(f"bench_engine: error: --input-len + --output-len must be <= {eng.ex.max_seq_len} (the artifact's "
                  f"max_seq_len)", file=sys.stderr)
            return 2
        rng = random.Random(args.seed)
        prompt = lambda: [rng.randrange(eng.vocab) for _ in range(args.input_len)]   # noqa: E731
        first = _run(eng, [prompt()], args.output_len)
        bs1 = _run(eng, [prompt()], args.output_len)            # warm: the figure for bs1 decode
        conc = _run(eng, [prompt() for _ in range(args.concurrency)], args.output_len)
        stats = eng.stats()
    finally:
        eng.close()
    res = {"command": "python -m onegraph.scripts.bench_engine " + " ".join(sys.argv[1:] if argv is None else argv),
           "artifact": str(Path(args.artifact).resolve()), "path": eng.ex.path,
           "export_options": eng.artifact.options,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "load_s": round(load_s, 2), "load_timings_s": {k: round(v, 3) for k, v in eng.ex.load_timings_s.items()},
           "fixture": eng.fixture_report if args.check_parity else "skipped",
           "first_request": {"ttft_ms": first["ttft_ms"]["p50"], "tpot_ms": first["tpot_ms"]["p50"]},
           "bs1": {"ttft_ms": bs1["ttft_ms"]["p50"], "decode_ms_per_token": bs1["tpot_ms"]["p50"],
                   "tok_s": round(1e3 / bs1["tpot_ms"]["p50"], 1)},
           "concurrency": dict(conc, concurrency=args.concurrency, input_len=args.input_len,
                               output_len=args.output_len, prefill_budget=stats["prefill_budget"],
                               decode_steps=stats["counters"].get("decode_steps"))}
    if prof is not None:
        res["load_profile"] = top_functions(prof, args.profile_load)
    emit(res, args.out)
    return 0


def top_functions(prof: cProfile.Profile, n: int) -> list[dict]:
    """The n functions of a profile with the most cumulative time (C++ called from Python counts in its
    caller's own time): [{function, cumulative_s, own_s, calls}]."""
    stats = pstats.Stats(prof).stats             # {(file, line, name): (calls, ncalls, own, cumulative, callers)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][3], reverse=True)[:n]
    return [{"function": f"{Path(f).name}:{line}({name})", "cumulative_s": round(cum, 3), "own_s": round(own, 3),
             "calls": calls} for (f, line, name), (_, calls, own, cum, _) in rows]


if __name__ == "__main__":
    sys.exit(main())
