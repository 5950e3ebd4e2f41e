"""The prefix cache (runtime/prefix_cache.py) at a real shape (Qwen3.5-35B-A3B by default, seeded random weights
built on the device, as scripts/bench_big.py builds them): TTFT of a prompt whose whole blocks but its last are
cached, against the same prompt prefilled from token 0, the copy of the hit on its own, and the hit's logits
against the miss's.

    python -m onegraph.scripts.bench_prefix_cache_big --prompts 8192,2048 --chunk 512 --out $OUT/prefix_big.json
    python -m onegraph.scripts.bench_prefix_cache_big --shape tiny --device cpu --dtype float32 --lower export \
        --prompts 64,40 --chunk 16 --max-seq-len 128 --out /tmp/p.json          # the CPU test's run

One prefill graph of --chunk tokens is lowered (bench_big.lower: AOTInductor, or --lower export's traced graph)
and its in-memory weights bound; it is the artifact's only (so largest) chunk, so a block is --chunk tokens
and a prompt of N tokens has P = (N - 1) // chunk * chunk tokens cached (8192 -> 7680, 2048 -> 1536 at 512):
the hit prefills its last chunk only. Per prompt length, each repetition draws a new prompt and
    - miss: the prompt prefilled from token 0 in slot 0 in chunks of --chunk, without the cache (the TTFT a
      workload without sharing pays), and again with the block stores after each chunk (their cost);
    - hit: lookup() copies the cached P tokens' KV rows and GDN state into slot 1 (hit_copy_ms: that copy
      alone, synchronized), then the prefill goes on from P (ttft_hit_ms: both);
    - the hit's last-chunk logits and sampled id against the miss's (bitwise), and a second miss against the
      first (the control: whether the graph itself is deterministic).
Medians over --reps in ms. Nothing is saved but the JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onegraph.scripts.bench_prefix_cache_big",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=lambda v: [int(x) for x in v.split(",")], default=[8192, 2048],
                    help="comma-separated prompt lengths; each has (N - 1) // chunk whole blocks cached")
    ap.add_argument("--chunk", type=int, default=512, help="the one prefill graph's chunk = the cache's block")
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shape", default="qwen3.5-35b-a3b", choices=["qwen3.5-35b-a3b", "tiny"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--lower", default="aoti", choices=["aoti", "export"])
    ap.add_argument("--router", default="decisive", choices=["random", "decisive"])
    ap.add_argument("--kernels", default="auto", choices=["auto", "reference"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    bad = [n for n in args.prompts if not args.chunk < n <= args.max_seq_len]
    if bad or args.chunk < 1 or args.reps < 1:        # one line, before minutes of lowering
        print(f"bench_prefix_cache_big: each prompt length must be in ({args.chunk}, --max-seq-len "
              f"{args.max_seq_len}] (a whole block cached, one token left), got {bad or args.prompts}; "
              f"--chunk and --reps >= 1", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_prefix_cache_big: needs a CUDA device", file=sys.stderr)
        return 2
    from onegraph.commands.bench_common import shape_config
    from onegraph.commands.bench_common import sync
    from onegraph.graphs.signature import state_manifest
    from onegraph.models.qwen3_5.config import ModelConfig
    from onegraph.models.qwen3_5.fuse import fuse_projections
    from onegraph.models.qwen3_5.model import new_state
    from onegraph.models.qwen3_5.tiny import random_model
    from onegraph.runtime.executor import Sampling
    from onegraph.runtime.prefix_cache import PrefixCache, block_bytes
    from .bench_big import lower, log

    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype, C = getattr(torch, args.dtype), args.chunk
    res = {"command": "python -m onegraph.scripts.bench_prefix_cache_big " + " ".join(sys.argv[1:] if argv is None
                                                                                       else argv),
           "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None, "torch": torch.__version__,
           "shape": args.shape, "dtype": args.dtype, "lower": args.lower, "router": args.router,
           "kernels": args.kernels, "chunk": C, "block_tokens": C, "max_seq_len": args.max_seq_len,
           "reps": args.reps}
    t = time.time()
    hf, res["layers"] = shape_config(args.shape, 0)            # always the full depth
    model = fuse_projections(random_model(ModelConfig.from_hf(hf), dtype, dev, router=args.router))
    res["build_s"] = round(time.time() - t, 1)
    weights = {f"model.{n}": p for n, p in model.named_parameters()}
    weights.update({f"model.{n}": b for n, b in model.named_buffers()})
    args.no_fold_norms, args.batch_invariant, args.loader_cls = False, False, None   # what bench_big.lower reads
    r_lower: dict = {}
    graph = lower(model, weights, "prefill", C, args, dev, r_lower)
    res["lowering"] = r_lower
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    # slots 0 (miss), 1 (hit), 2 (scratch, as the executor has one); the manifest's typed state rows
    meta = state_manifest(model, args.max_seq_len, dtype)
    state = new_state(model.cfg, 3, args.max_seq_len, dtype, dev)
    per = block_bytes(meta, C)
    n_blocks = sum(n // C for n in args.prompts) * args.reps   # every block each miss with stores writes
    cache = PrefixCache(state, meta, C, n_blocks * per, f"bench|{args.shape}|{args.dtype}|{dev}")
    res.update({"block_bytes": per, "cache_capacity_blocks": cache.capacity,
                "state_bytes_per_slot": sum(s[0].numel() * s.element_size() for s in state)})
    samp = Sampling().tensors(1, dev)
    one = lambda v: torch.tensor([v], device=dev)  # noqa: E731

    def chunk(prompt, i, slot):
        """GraphExecutor.prefill_chunk's call: prompt[i:i + C] (zero-padded) into `slot` at position i."""
        part = prompt[i:i + C]
        toks = torch.zeros(C, dtype=torch.int64, device=dev)
        toks[:len(part)] = torch.tensor(part, dtype=torch.int64, device=dev)
        with torch.no_grad():
            ids, logits = graph.run([toks, one(slot), one(i), one(len(part))] + samp + state)[:2]
        return ids, logits, i + len(part)

    def prefill(prompt, slot, start, chain=None):
        """-> (ms to the first token, ids, logits) of a prefill from `start`; chain: store each block."""
        sync(dev)
        t0, i = time.perf_counter(), start
        while i < len(prompt):
            ids, logits, i = chunk(prompt, i, slot)
            if chain is not None:
                cache.store(prompt, i, slot, chain)
        sync(dev)
        return (time.perf_counter() - t0) * 1e3, ids.clone(), logits.clone()

    g = torch.Generator().manual_seed(0)
    prefill(torch.randint(0, model.cfg.vocab_size, (C + 1,), generator=g).tolist(), 0, 0)   # warm-up
    res["prompts"] = []
    for N in args.prompts:
        t = {"ttft_miss_ms": [], "ttft_miss_with_stores_ms": [], "hit_copy_ms": [], "prefill_after_hit_ms": [],
             "ttft_hit_ms": []}
        equal = {"hit_ids_equal_miss": True, "hit_logits_equal_miss": True, "miss_logits_equal_repeat": True}
        max_diff, P = 0.0, 0
        for k in range(args.reps):
            p = torch.randint(0, model.cfg.vocab_size, (N,), generator=g).tolist()
            runs = {}
            for store in ((False, True) if k % 2 == 0 else (True, False)):   # alternating: neither always first
                stored = [] if store else None
                runs[store] = prefill(p, 0, 0, stored)           # the same miss, storing its blocks or not
                if store:
                    cache.release(stored)
            (ms, ids_m, logits_m), (ms_s, _, logits_s) = runs[False], runs[True]
            t["ttft_miss_ms"].append(ms)
            t["ttft_miss_with_stores_ms"].append(ms_s)
            equal["miss_logits_equal_repeat"] &= bool(torch.equal(logits_s, logits_m))
            hit = []
            sync(dev)
            t0 = time.perf_counter()
            P = cache.lookup(p, 1, hit)
            sync(dev)
            if P != (N - 1) // C * C:
                raise RuntimeError(f"a hit of {P} tokens, not the {(N - 1) // C * C} stored: the cache lost blocks")
            copy_ms = (time.perf_counter() - t0) * 1e3
            ms, ids_h, logits_h = prefill(p, 1, P)
            cache.release(hit)
            t["hit_copy_ms"].append(copy_ms)
            t["prefill_after_hit_ms"].append(ms)
            t["ttft_hit_ms"].append(copy_ms + ms)
            equal["hit_ids_equal_miss"] &= bool(torch.equal(ids_h, ids_m))
            equal["hit_logits_equal_miss"] &= bool(torch.equal(logits_h, logits_m))
            max_diff = max(max_diff, float((logits_h.float() - logits_m.float()).abs().max()))
        row = {"prompt_tokens": N, "cached_tokens": P, "prefilled_after_hit": N - P, "chunks_miss": -(-N // C),
               **{k: round(statistics.median(v), 3) for k, v in t.items()}, **equal,
               "hit_vs_miss_max_logit_diff": max_diff,
               # what the hit's copy moves: P KV rows of each attention tensor + one slot row of each GDN one
               "hit_copy_bytes": (P // C - 1) * sum(block_bytes([m], C) for m in meta if m["kind"] == "kv") + per}
        row["store_overhead"] = round(row["ttft_miss_with_stores_ms"] / row["ttft_miss_ms"] - 1, 4)
        row["ttft_hit_over_miss"] = round(row["ttft_hit_ms"] / row["ttft_miss_ms"], 4)
        row["hit_copy_GBps"] = round(2 * row["hit_copy_bytes"] / (row["hit_copy_ms"] * 1e-3) / 1e9, 1)  # read+write
        res["prompts"].append(row)
        log(json.dumps(row))
        out.write_text(json.dumps(res, indent=2) + "\n")      # partial results survive a kill
    res["cache"] = cache.stats()
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
