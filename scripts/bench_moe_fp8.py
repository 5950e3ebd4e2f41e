"""µs per call of fused_moe (bf16 experts) vs fused_moe_fp8 (block-FP8 experts) at the Qwen3.5-35B-A3B MoE
shape (H 2048, E 256, I = Is 512, top-8) on one CUDA device, plus a few fp8 decode tile variants.

    python -m onegraph.scripts.bench_moe_fp8 [--batches 1,8,64] [--copies 6] [--grouped all] [--out ...json]

Timing as scripts/tune_moe.py: one CUDA graph of `copies` calls, each on its own copy of the layer's weights and
its own input (its own experts, not left in L2 by the call before), replayed; µs per call. GB/s: the expert
bytes a call must read (distinct routed experts' gate_up + down, and the shared expert) over its time.
B = 64 (T*k = 512 > E = 256) runs the grouped-GEMM path of both ops: there the FP8 grouped kernels' tiles are swept
(scripts/tune_moe.py grouped_sweep: each candidate of one kernel as its rows-class entry of
fused_moe_fp8_prefill.TILES, the best swap tiles on 8-row blocks, the best of both kernels together), --grouped
picking the candidates: plain, swap (the transposed product), all (default) or none. The swap sweep alone:

    python -m onegraph.scripts.bench_moe_fp8 --batches 64 --copies 6 --grouped swap --out h200_moe_fp8_b64_swap.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

import onegraph.custom_ops.triton  # noqa: F401  (registers the triton ops)
from onegraph.checkpoint.quant import quantize
from onegraph.custom_ops.triton import fused_moe_fp8 as fp8mod
from onegraph.scripts.bench_ops import MOE, rand, time_graph
from onegraph.scripts.tune_moe import grouped_sweep



def set_fp8_tiles(swiglu, down):
    """fused_moe_fp8.tiles (ONE, every decode token count)."""
    fp8mod.ONE = (tuple(swiglu), tuple(down))


def per_call(fn, cases, reps=10):
    return time_graph(lambda: [fn(*c) for c in cases], (), 1, reps, 1) / len(cases)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8, 64])
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--wide", action="store_true",
                    help="B = 1: every (rows, K tile, warps) of each kernel instead of the short list")
    ap.add_argument("--grouped", choices=("plain", "swap", "all", "none"), default="all",
                    help="B * top_k > E: which grouped-kernel tiles to sweep (tune_moe.grouped_tiles; none: only "
                         "the current ones)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    H, E, I, Is, k = (MOE[x] for x in ("H", "E", "I", "Is", "top_k"))
    g = torch.Generator(device="cuda").manual_seed(0)
    bf, f8 = [], []
    for _ in range(a.copies):
        router, sgw = rand(g, E, H, scale=H ** -0.5), rand(g, 1, H, scale=H ** -0.5)
        ws = [rand(g, E, 2 * I, H, scale=H ** -0.5), rand(g, E, H, I, scale=I ** -0.5), rand(g, Is, H, scale=H ** -0.5),
              rand(g, Is, H, scale=H ** -0.5), rand(g, H, Is, scale=Is ** -0.5)]
        bf.append((torch.cat([router, sgw]), ws))
        f8.append([t for w in ws for t in quantize(w)])   # gate_up's grid == gate rows' then up rows' (I % 128 == 0)
    ops = torch.ops.onegraph
    rows = []
    expert_bytes = (2 * I * H + H * I)                    # one expert, bytes per weight byte-size unit
    for B in a.batches:
        xs = [rand(g, B, H) for _ in range(a.copies)]
        logits = [torch.nn.functional.linear(x, r) for x, (r, _) in zip(xs, bf)]
        distinct = sum(torch.topk(lg[:, :E].float(), k).indices.unique().numel() for lg in logits) / a.copies
        nbytes = (distinct * expert_bytes + 3 * Is * H)    # weights read per call, in elements
        bf_cases = [(x, lg, *ws, k) for x, lg, (_, ws) in zip(xs, logits, bf)]
        f8_cases = [(x, lg, *q, k) for x, lg, q in zip(xs, logits, f8)]
        y_bf, y_f8 = ops.fused_moe_triton(*bf_cases[0]), ops.fused_moe_fp8_triton(*f8_cases[0])
        rel = ((y_bf.float() - y_f8.float()).norm() / y_bf.float().norm()).item()
        us_bf = per_call(ops.fused_moe_triton, bf_cases)
        row = {"B": B, "distinct_experts": distinct, "bf16_us": round(us_bf, 2),
               "bf16_GBps": round(2 * nbytes / us_bf / 1e3, 1), "fp8_vs_bf16_rel_l2": rel, "fp8": []}
        # decode tiles (swiglu BI, BH, warps, down BH, BI, warps): fused_moe_fp8.ONE, every decode token count
        base = fp8mod.tiles()
        variants = [None]
        if B * k <= E and B == 1 and a.wide:              # every swiglu tile at the current down tile, then down
            variants += [(sw, base[1]) for sw in itertools.product((2, 4, 8, 16, 32), (256, 512, 1024, 2048), (2, 4, 8))
                         if sw[0] * sw[1] <= 16384]
            variants += [(base[0], dn) for dn in itertools.product((1, 2, 4, 8, 16), (128, 256, 512), (2, 4, 8))]
        elif B * k <= E and B == 1:                       # swiglu tiles at the current down tile, then down tiles
            variants += [(sw, base[1]) for sw in ((2, 2048, 4), (4, 2048, 4), (4, 2048, 8), (8, 2048, 8),
                                                   (2, 1024, 2), (4, 1024, 4), (8, 1024, 4), (8, 512, 4),
                                                   (16, 512, 8), (16, 256, 4))]
            variants += [(base[0], dn) for dn in ((1, 512, 4), (2, 512, 2), (4, 512, 4), (4, 512, 8), (8, 512, 8),
                                                  (2, 256, 4), (4, 256, 4), (8, 256, 8), (16, 128, 8))]
        elif B * k <= E:
            variants += [((4, 512, 4), (4, 128, 4)), ((8, 512, 4), (4, 128, 4)), ((4, 512, 8), (4, 128, 4)),
                         ((4, 256, 4), (4, 256, 4)), ((4, 256, 4), (8, 128, 4)), ((4, 256, 4), (4, 256, 8)),
                         ((4, 512, 4), (4, 256, 4))]
        for v in variants:
            swiglu, down = v or base
            set_fp8_tiles(swiglu, down)
            try:
                us = per_call(ops.fused_moe_fp8_triton, f8_cases)
                row["fp8"].append({"tiles": {"swiglu": swiglu, "down": down}, "us": round(us, 2),
                                   "GBps": round(nbytes / us / 1e3, 1)})
            except Exception as e:  # a tile that does not compile: recorded, the sweep goes on
                row["fp8"].append({"tiles": {"swiglu": swiglu, "down": down},
                                   "error": f"{type(e).__name__}: {str(e)[:200]}"})
            finally:
                set_fp8_tiles(*base)
        if B * k > E and a.grouped != "none":         # the grouped kernels' (BN, BK, warps, stages, swap), BM_MIN
            from onegraph.custom_ops.triton import fused_moe_fp8_prefill as pre
            row["fp8"] += grouped_sweep(pre, ops.fused_moe_fp8_triton, f8_cases, B * k, E, nbytes, a.grouped, per_call)
        if B == 1:                                        # the best tiles again, routed by _route_kernel first
            from onegraph.custom_ops.triton import fused_moe as fm
            for r in sorted((r for r in row["fp8"] if "us" in r), key=lambda r: r["us"])[:3]:
                set_fp8_tiles(r["tiles"]["swiglu"], r["tiles"]["down"])
                fm.PREROUTED = True
                try:
                    us = per_call(ops.fused_moe_fp8_triton, f8_cases)
                    row["fp8"].append({"tiles": r["tiles"], "prerouted": True, "us": round(us, 2),
                                       "GBps": round(nbytes / us / 1e3, 1)})
                finally:
                    fm.PREROUTED = None
                    set_fp8_tiles(*base)
        best = min((r for r in row["fp8"] if "us" in r), key=lambda r: r["us"])
        print(f"B={B:3d}  distinct experts {distinct:5.1f}  bf16 {us_bf:7.2f} us ({row['bf16_GBps']} GB/s)  "
              f"fp8 default {row['fp8'][0].get('us')} us ({row['fp8'][0].get('GBps')} GB/s)  "
              f"fp8 best {best['us']} us {best.get('tiles', best.get('grouped'))}  fp8/bf16 rel L2 {rel:.2e}", flush=True)
        for r in row["fp8"][1:]:
            print("      ", json.dumps(r), flush=True)
        rows.append(row)
    res = {"command": "python -m onegraph.scripts.bench_moe_fp8 " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": torch.cuda.get_device_name(), "copies": a.copies, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
