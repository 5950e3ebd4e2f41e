"""attention_prefill's Triton kernel alone at the 35B shape (16 heads, 2 KV heads, D 256, bf16), one layer's call,
per (chunk T, start position) and tile: µs, TFLOP/s of the causal q k^T and p v products, and elements outside the
op's bf16 tolerance against the pure-torch reference.

    python -m onegraph.tools.bench_attention_prefill --out FILE.json [--cases 512:0,8192:0,2048:30720]

Each timing is 5 calls replayed in one CUDA graph. The tiles: the plan's (`plan`) and the variants it was picked from.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from .bench_common import emit

TILES = [(64, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (64, 32, 4, 4), (128, 64, 8, 2),
         (128, 32, 8, 3), (128, 64, 16, 2), (32, 64, 4, 3)]          # block_m, block_n, warps, stages


def graph_us(fn, n: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onegraph.tools.bench_attention_prefill", description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="512:0,8192:0,2048:30720", help="comma list of T:start_pos")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention_prefill: needs a CUDA device", file=sys.stderr)
        return 2
    from onegraph.custom_ops.attention_prefill import reference_attention_prefill
    from onegraph.custom_ops.triton import attention_prefill as ap_mod
    H, KVH, D, dev = 16, 2, 256, "cuda"
    rows = []
    for case in args.cases.split(","):
        T, start = (int(x) for x in case.split(":"))
        Tmax = max(4096, start + T)
        g = torch.Generator(device=dev).manual_seed(0)
        q, kc, vc = (torch.randn(*shape, device=dev, generator=g).bfloat16()
                     for shape in ((T, H, D), (2, KVH, Tmax, D), (2, KVH, Tmax, D)))
        slot, sp = torch.tensor([1], device=dev), torch.tensor([start], device=dev)
        ref = reference_attention_prefill(q, kc, vc, slot, sp, D ** -0.5).float()
        flops = 4 * H * D * float((torch.arange(T) + start + 1).sum())
        plan = ap_mod.plan(T, H // KVH, KVH, D, False)
        r = {"T": T, "start_pos": start, "plan": list(plan), "tiles": {}}
        for bm, bn, w, st in [plan] + [t for t in TILES if t != plan]:
            f = lambda: ap_mod.run(q, kc, vc, slot, sp, D ** -0.5, bm, bn, w, stages=st)   # noqa: E731
            try:
                err = (f().float() - ref).abs()
                us = graph_us(f)
            except Exception as e:                      # e.g. a tile over the shared-memory limit: recorded
                r["tiles"][f"{bm}x{bn} w{w} s{st}"] = f"{type(e).__name__}: {e}"[:120]
                continue
            r["tiles"][f"{bm}x{bn} w{w} s{st}"] = {"us": round(us, 1), "tflops": round(flops / us / 1e6, 1),
                                                  "viol": int((err > 1e-2 + 1e-2 * ref.abs()).sum())}
        print(r, file=sys.stderr, flush=True)
        rows.append(r)
    emit({"command": "python -m onegraph.tools.bench_attention_prefill " + " ".join(sys.argv[1:] if argv is None else argv),
          "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
