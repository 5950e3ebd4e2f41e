"""What the prefix cache (runtime/prefix_cache.py) costs and saves in one process, on one thread:

    python -m onegraph.scripts.bench_prefix_cache ARTIFACT [--prompt-len N] [--reps R] [--out FILE.json]

- a prompt of N random ids prefilled from token 0 with and without the block stores of the cache (a prefill
  with nothing to reuse: the cost a workload without sharing pays), alternating, a new prompt each repetition;
- the copy of a hit of all the prompt's whole blocks into another slot (lookup + copies);
- the prefill after that hit (the last partial chunk, or one chunk), which a hit leaves to run.
Medians in ms over R repetitions. The cache's budget holds every block stored (no eviction).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onegraph.scripts.bench_prefix_cache", description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--prompt-len", type=int, default=224)
    ap.add_argument("--reps", type=int, default=80)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from onegraph.runtime.executor import GraphExecutor
    from onegraph.runtime.prefix_cache import block_bytes, for_executor
    torch.set_num_threads(1)
    ex = GraphExecutor.from_artifact(args.artifact, max_slots=2, check_parity=False)
    C, n = ex.prefill_buckets[-1], args.prompt_len
    if not 0 < n < ex.max_seq_len:
        raise SystemExit(f"--prompt-len must be in 1..{ex.max_seq_len - 1}, got {n}")
    blocks = -(-n // C) * (args.reps + 1)
    cache = for_executor(ex, blocks * block_bytes(ex.artifact.state, C))
    g = torch.Generator().manual_seed(0)
    vocab = ex.vocab_size

    def prefill(prompt, slot, start, store):
        i, chain = start, []
        while i < len(prompt):
            ex.prefill_chunk(prompt, i, slot)
            i += ex.chunk_tokens(len(prompt) - i)
            if store:
                cache.store(prompt, i, slot, chain)
        cache.release(chain)
    t = {"prefill_no_cache_ms": [], "prefill_with_stores_ms": [], "hit_copy_ms": [], "prefill_after_hit_ms": []}
    hit_tokens = 0
    for k in range(args.reps):
        p = torch.randint(0, vocab, (n,), generator=g).tolist()
        for store in ((False, True) if k % 2 else (True, False)):
            s = time.perf_counter()
            prefill(p, 0, 0, store)
            t["prefill_with_stores_ms" if store else "prefill_no_cache_ms"].append((time.perf_counter() - s) * 1e3)
        hit = []
        s = time.perf_counter()
        hit_tokens = cache.lookup(p, 1, hit)
        t["hit_copy_ms"].append((time.perf_counter() - s) * 1e3)
        s = time.perf_counter()
        prefill(p, 1, hit_tokens, False)
        t["prefill_after_hit_ms"].append((time.perf_counter() - s) * 1e3)
        cache.release(hit)
    res = {"command": "python -m onegraph.scripts.bench_prefix_cache " + " ".join(argv or []) if argv else None,
           "artifact": str(args.artifact), "prompt_len": n, "block_tokens": C, "block_bytes": cache.block_bytes,
           "hit_tokens": hit_tokens, "reps": args.reps, "threads": 1, "path": ex.path,
           **{k: statistics.median(v) for k, v in t.items()}}
    res["store_overhead"] = res["prefill_with_stores_ms"] / res["prefill_no_cache_ms"] - 1
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
