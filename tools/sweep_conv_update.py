"""Tile sweep of the GDN conv update (custom_ops/triton/causal_conv.py UPDATE_BC / UPDATE_WARPS) on a CUDA device.

    python -m onegraph.tools.sweep_conv_update --out benchmarks/h200_conv_update_sweep.json

At the 35B shape (C = 8192 channels, W = 4 taps, bf16 state [S, C, 3]) and B = 1, 8, 64 rows, in place as the
decode graphs run it: 30 layers' distinct inputs and states (one decode step's GDN layers) in one CUDA graph,
replayed; µs per layer. Each tile's y and new state are compared with the 256 x 4 tile's (they must be equal:
the tile only splits channels between programs).
"""
from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys

import torch

C, W, SLOTS, LAYERS = 8192, 4, 72, 30


def _layers(B: int) -> list[tuple]:
    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    return [(torch.randn(B, C, **bf), torch.randn(SLOTS, C, W - 1, **bf),
             torch.arange(B, device="cuda", dtype=torch.int64) + 3, torch.randn(C, W, **bf),
             torch.empty(B, C, **bf)) for _ in range(LAYERS)]


def _once(cc, tile, x, state, slots, w):
    cc.UPDATE_BC, cc.UPDATE_WARPS = tile
    st, y = state.clone(), torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cc.run_update(x, st, slots, w, y, st)
    return y, st


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_conv_update: needs a CUDA device", file=sys.stderr)
        return 2
    from onegraph.custom_ops.triton import causal_conv as cc
    from onegraph.tools.bench_ops import time_graph
    rows, best = [], {}
    for B in (int(b) for b in args.batches.split(",")):
        layers = _layers(B)
        ref = _once(cc, (256, 4), *layers[0][:4])
        for bc, warps in itertools.product((16, 32, 64, 128, 256, 512), (1, 2, 4, 8)):
            if bc * 4 < 32 * warps:                     # fewer [BC, 4] elements than threads
                continue
            got = _once(cc, (bc, warps), *layers[0][:4])
            same = all(torch.equal(a, b) for a, b in zip(got, ref))

            def step():
                for x, st, slots, w, y in layers:
                    cc.run_update(x, st, slots, w, y, st)
            us = time_graph(step, (), 5, 20, 1) / LAYERS
            rows.append({"B": B, "BC": bc, "warps": warps, "us_per_layer": round(us, 2), "same_as_256x4": same})
            print(json.dumps(rows[-1]), flush=True)
            if same and (B not in best or us < best[B]["us_per_layer"]):
                best[B] = rows[-1]
    out = {"command": "python -m onegraph.tools.sweep_conv_update " + shlex.join(sys.argv[1:] if argv is None else argv),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
           "best": {str(k): v for k, v in best.items()}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0 if all(r["same_as_256x4"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
