"""Tile sweep for the fused_moe decode kernels (custom_ops/triton/fused_moe.py) at the Qwen3.5-35B-A3B
shape on a CUDA device: µs per call (CUDA-graph timing from bench_ops) for each (BI1, BH1, W1) of the
SwiGLU kernel and (BH2, BI2, W2) of the down kernel, one kernel's tiles varied at a time.

    python -m onegraph.tools.tune_moe --batches 1,8 --out moe_tiles.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from onegraph.custom_ops.triton import fused_moe as mod
    from onegraph.tools.bench_ops import moe_case, time_graph
    g = torch.Generator(device="cuda").manual_seed(0)
    base = (mod.BI1, mod.BH1, mod.W1, mod.BH2, mod.BI2, mod.W2)
    k1 = [(bi, bh, w) for bi, bh, w in itertools.product((8, 16, 32), (256, 512), (4, 8))]
    k2 = [(bh, bi, w) for bh, bi, w in itertools.product((4, 8, 16), (256, 512), (2, 4, 8))]
    res = {"command": "python -m onegraph.tools.tune_moe " + " ".join(sys.argv[1:]), "default": base, "rows": []}
    for B in args.batches:
        case, moved, _ = moe_case(B, g)
        fn = torch.ops.onegraph.fused_moe_triton
        for which, grid in (("swiglu", k1), ("down", k2)):
            for cfg in grid:
                mod.BI1, mod.BH1, mod.W1, mod.BH2, mod.BI2, mod.W2 = base
                if which == "swiglu":
                    mod.BI1, mod.BH1, mod.W1 = cfg
                else:
                    mod.BH2, mod.BI2, mod.W2 = cfg
                try:
                    us = time_graph(fn, case, 5, 20, 10)
                except Exception as e:  # a config that does not compile: record and go on
                    us = None
                    print(which, cfg, type(e).__name__, str(e)[:200], file=sys.stderr)
                res["rows"].append({"B": B, "kernel": which, "cfg": cfg, "us": us,
                                    "GBps": None if us is None else round(moved / us / 1e3, 1)})
                print(json.dumps(res["rows"][-1]), flush=True)
    mod.BI1, mod.BH1, mod.W1, mod.BH2, mod.BI2, mod.W2 = base
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
