"""Projection GEMV vs cuBLAS at Qwen3.5-35B-A3B decode shapes, on a CUDA device; picks the GEMV tiles.

    python -m onegraph.scripts.bench_linear --out benchmarks/h200_linear.json
    python -m onegraph.scripts.bench_linear --fp8 --rows 1 --out benchmarks/h200_linear_fp8.json

--norm: add_rms_norm_linear at M = 1, the layer-input and post-attention norms folded into their projection
(custom_ops/triton/linear.py REGS: the normed row in registers, the whole row one K tile), per (BN, warps),
against the pair it replaces (the add_rms_norm kernel, then the GEMV at its tile) and the row-once form; with
`--rows 2,4,8` (more than one row) the prologue's tile sizes instead (bench_norm_rows).

--fp8: onegraph::linear_fp8's kernel (block-FP8 weights, custom_ops/triton/linear_fp8.py) on the FP8 model's
projections (models/qwen3_5/fuse.py: the GDN in_proj's FP8 run [qkv; z]; the attention's [q; k; v]; out/o_proj).
Rows above 128 (prefill chunks, `--fp8 --rows 512,2048`) sweep the larger tiles and the launch order's group of M
tiles, and add TFLOP/s.

Each measurement is one CUDA graph of `calls` launches on distinct copies of the weight (so L2 never
holds it), replayed `reps` times: µs per call and its fraction of the device's copy bandwidth. For every
(M == 1, K) class it reports the tile with the least time per decode step over that class's shapes — the tile
custom_ops/triton/linear.py's TILES must hold (a tile may depend on (M, K) only, see there).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F

# (name, N, K, uses per decode step through onegraph::linear): the 35B decode projections after
# models/qwen3_5/fuse.py; q_proj alone, the router and lm_head are measured for reference, not used to pick tiles
SHAPES = [("gdn_in_proj", 12352, 2048, 30), ("attn_qkv", 9216, 2048, 10), ("q_proj", 8192, 2048, 0),
          ("out_or_o_proj", 2048, 4096, 40), ("router", 256, 2048, 0), ("lm_head", 248320, 2048, 0)]
GEMV_TILES = [(bn, bk, w, s) for bn, bk, w, s in itertools.product((4, 8, 16, 32), (128, 256, 512, 1024), (4, 8),
                                                                   (1, 3)) if bn * bk <= 16384]
# a program's rows whole in one load (every byte of the program in flight behind one latency)
GEMV_TILES += [(bn, bk, w, 1) for bn, bk, w in itertools.product((1, 2, 4), (2048, 4096), (4, 8)) if bn * bk <= 8192]
DOT_TILES = list(itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 4)))
FP8_SHAPES = [("gdn_in_proj_qkvz", 12288, 2048, 30), ("attn_qkv", 9216, 2048, 10), ("out_or_o_proj", 2048, 4096, 40)]
# the FMA GEMV and the dot path at M = 1 (x padded to 16 rows on the tensor cores)
FP8_GEMV_TILES = [(1, bn, bk, w, s) for bn, bk, w, s in itertools.product((4, 8, 16, 32, 64), (256, 512, 1024),
                                                                         (4, 8), (1, 2, 3)) if bn * bk <= 32768]
# a program's rows whole in one load (K = 2048 / 4096: every byte of the program in flight behind one latency)
FP8_GEMV_TILES += [(1, bn, bk, w, 1) for bn, bk, w in itertools.product((1, 2, 4, 8), (2048, 4096), (2, 4, 8))
                   if bn * bk <= 16384]
FP8_DOT_TILES = [(16, bn, bk, w, s) for bn, bk, w, s in itertools.product((16, 32, 64, 128), (64, 128), (4, 8),
                                                                         (2, 3, 4, 5)) if bn * bk <= 16384]
# the dot path's transposed product (linear_fp8 SWAP: the upcast weight tile the MMA's A operand, from registers; x's
# rows its N): the weight rows a program are the MMA's M, 64 a warpgroup, so BN = 16 x warps
FP8_SWAP_TILES = [(16, bn, bk, bn // 16, s, True) for bn, bk, s in itertools.product((64, 128), (64, 128), (3, 4))]
FP8_DOT_TILES += FP8_SWAP_TILES
# 2..8 rows: the FMA path over all rows at once (BM < 16: the weight tile upcast once, BM rows of products; at
# most 64 accumulators a thread), beside the dot path's 16-row tiles that the class took before
FP8_ROWS_TILES = [(bm, bn, bk, w, 1) for bm, bn, bk, w in itertools.product((2, 4, 8), (1, 2, 4, 8, 16, 32),
                                                                           (256, 512, 1024, 2048, 4096), (4, 8))
                  if bm * bn * bk <= 64 * 32 * w]
FP8_ROWS_DOT_TILES = [(16, 32, 128, 4, 4), (16, 32, 128, 4, 5), (16, 16, 128, 4, 5), (16, 64, 128, 4, 4)]
FP8_ROWS_DOT_TILES += FP8_SWAP_TILES
FP8_MANY_TILES = [(bm, bn, bk, w, s) for bm, bn, bk, w, s in itertools.product((16, 32, 64), (32, 64, 128), (64, 128),
                                                                               (4, 8), (4,)) if bn * bk <= 8192]
FP8_MANY_TILES += [(bm, bn, 128, bn // 16, s, True) for bm, bn, s in itertools.product((16, 32, 64), (64, 128), (3, 4))]
# prefill rows (M > BATCH_MAX_M, compute-bound): larger tiles, plain and swapped, each in the launch order of 1 and of
# 8 M tiles a group (linear_fp8.GROUP_M): (BM, BN, BK, warps, stages, SWAP, GM); reported in TFLOP/s beside cuBLAS
# on the bf16 weight
FP8_PREFILL_TILES = [(bm, bn, bk, w, 3, False, gm) for bm, bn, bk, w, gm in
                     itertools.product((64, 128), (64, 128), (64, 128), (4, 8), (1, 8)) if bm * bn <= 4096 * w]
FP8_PREFILL_TILES += [(bm, bn, bk, bn // 16, s, True, gm) for bm, bn, bk, s, gm in
                      itertools.product((64, 128), (64, 128), (64, 128), (3, 4), (1, 8))]
# add_rms_norm_linear_fp8 at M = 1: the whole row one tile (BK = K), or the K-looped form (BK < K)
FP8_NORM_TILES = [(1, bn, 2048, w, 1) for bn, w in itertools.product((1, 2, 4, 8), (4, 8))]
FP8_NORM_TILES += [(1, bn, bk, w, s) for bn, bk, w, s in itertools.product((8, 16, 32, 64), (256, 512, 1024), (4, 8),
                                                                         (1, 2, 3)) if bn * bk <= 32768]


def copy_bandwidth(dev) -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (time.perf_counter() - t)


def time_calls(fn, ws, x, reps: int) -> float:
    """µs per call of fn(x, w) over a CUDA graph that calls it once per weight copy in ws."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w in ws[:2]:
            fn(x, w)                                   # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in ws:
            fn(x, w)
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps / len(ws) * 1e6


def sweep(tiles, call, row: dict) -> dict:
    """µs of call(cfg) per tile; a tile that does not compile is not a candidate (inf, named in row)."""
    per = {}
    for cfg in tiles:
        try:
            per[cfg] = call(cfg)
        except Exception as e:
            per[cfg] = float("inf")
            row.setdefault("failed_tiles", []).append(f"{cfg}: {type(e).__name__}")
    return per


def record(rows: list, row: dict, per: dict, nbytes: int, bw: float,
           names=("tiles_us", "best_tile", "best_us", "best_bw")):
    """Row gets every tile's µs (sorted) and the best tile, its µs and its fraction of copy bandwidth under
    `names`; appended to rows and printed without the per-tile times."""
    times, best_k, us_k, bw_k = names
    best = min(per, key=per.get)
    row[times] = {",".join(map(str, c)): round(u, 2) for c, u in sorted(per.items(), key=lambda cu: cu[1])}
    row[best_k], row[us_k] = list(best), round(per[best], 2)
    row[bw_k] = round(nbytes / (per[best] * 1e-6) / bw, 3)
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != times}), flush=True)


NORM_SHAPES = [("gdn_in_proj", 12352, 2048, 30), ("attn_qkv", 9216, 2048, 10), ("router", 257, 2048, 40)]
# (BN, warps) with at most 64 weights a thread at K = 2048 (BN <= warps): more spills
NORM_ROW_TILES = [(bn, w) for bn, w in itertools.product((1, 2, 4, 8), (2, 4, 8)) if bn <= w]


def bench_norm(args, dev, bw) -> dict:
    """--norm (module docstring): µs per call of each form, per shape, and the (BN, warps) with the least time per
    decode step over the shapes' uses."""
    import triton

    from onegraph.custom_ops.triton import linear as lin
    from onegraph.custom_ops.triton.norms import add_rms_norm_triton
    rows, totals = [], {}
    for name, N, K, uses in NORM_SHAPES:
        copies = max(2, min(20, (800 << 20) // (2 * N * K)))
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
        x, res = (torch.randn(1, K, device=dev, dtype=torch.bfloat16) for _ in range(2))
        nw = torch.randn(K, device=dev, dtype=torch.bfloat16) * 0.1
        row = {"M": 1, "name": name, "N": N, "K": K, "MB": round(2 * N * K / 1e6, 1)}
        pair = lambda a, w: lin.gemv(add_rms_norm_triton(a, res, nw, 1e-6)[0], w)     # noqa: E731
        row["pair_us"] = round(time_calls(pair, ws, x, args.reps), 2)
        row["row_once_us"] = round(time_calls(lambda a, w: lin.gemv(a, w, norm=(res, nw, 1e-6), cfg=lin.tile(1, K)),
                                              ws, x, args.reps), 2)
        per = sweep(NORM_ROW_TILES, lambda t: time_calls(
            lambda a, w: lin.gemv(a, w, norm=(res, nw, 1e-6), cfg=(t[0], triton.next_power_of_2(K), t[1], 1)),
            ws, x, args.reps), row)
        for t, us in per.items():
            totals[t] = totals.get(t, 0.0) + us * uses
        row["regs_current"] = list(lin.NORM_ROW_TILE)
        record(rows, row, per, 2 * N * K, bw, ("regs_us", "regs_best", "regs_best_us", "regs_best_bw"))
        del ws
        torch.cuda.empty_cache()
    best = min(totals, key=totals.get)
    return {"rows": rows, "best_norm_row_tile": {"tile": list(best), "us_per_step": round(totals[best], 2)}}


def bench_norm_rows(args, dev, bw) -> dict:
    """--norm --rows 2,4,...: add_rms_norm_linear above one row (its prologue makes the normed rows, [PM, KP] tiles of
    linear.PROLOGUE_ELEMS, then the dot loop) per PROLOGUE_ELEMS, against the pair (the add_rms_norm kernel, then the
    GEMV): the router ([E; shared gate], 257 rows) that reads the post-attention norm in every layer."""
    from onegraph.custom_ops.triton import linear as lin
    from onegraph.custom_ops.triton.norms import add_rms_norm_triton
    rows, saved = [], lin.PROLOGUE_ELEMS
    for M in [int(v) for v in args.rows.split(",")]:
        for name, N, K, uses in NORM_SHAPES:
            if args.shapes and name not in args.shapes:
                continue
            copies = max(2, min(20, (800 << 20) // (2 * N * K)))
            ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
            x, res = (torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(2))
            nw = torch.randn(K, device=dev, dtype=torch.bfloat16) * 0.1
            row = {"M": M, "name": name, "N": N, "K": K, "MB": round(2 * N * K / 1e6, 1), "current": saved}
            pair = lambda a, w: lin.gemv(add_rms_norm_triton(a, res, nw, 1e-6)[0], w)     # noqa: E731
            row["pair_us"] = round(time_calls(pair, ws, x, args.reps), 2)
            row["prologue_elems_us"] = {}
            try:
                for elems in (128, 512, 2048, 4096, 8192):
                    lin.PROLOGUE_ELEMS = elems
                    row["prologue_elems_us"][elems] = round(time_calls(
                        lambda a, w: lin.gemv(a, w, norm=(res, nw, 1e-6)), ws, x, args.reps), 2)
            finally:
                lin.PROLOGUE_ELEMS = saved
            rows.append(row)
            print(json.dumps(row), flush=True)
            del ws
            torch.cuda.empty_cache()
    return {"rows": rows}


def bench_fp8_norm(args, dev, bw) -> dict:
    """--fp8 --norm: add_rms_norm_linear_fp8 at M = 1 per tile against the pair it replaces (the add_rms_norm
    kernel, then the FP8 GEMV at its tile), on the FP8 projections that read a layer's input norm."""
    from onegraph.custom_ops.triton import linear_fp8 as lin8
    from onegraph.custom_ops.triton.norms import add_rms_norm_triton
    rows, totals = [], {}
    for name, N, K, uses in FP8_SHAPES[:2]:
        copies = max(2, min(20, (800 << 20) // (N * K)))
        ws = [(torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 2).to(torch.float8_e4m3fn) for _ in range(copies)]
        scale = torch.rand(-(-N // 128), -(-K // 128), device=dev) * 2.0 ** -6
        x, res = (torch.randn(1, K, device=dev, dtype=torch.bfloat16) for _ in range(2))
        nw = torch.randn(K, device=dev, dtype=torch.bfloat16) * 0.1
        row = {"M": 1, "name": name, "N": N, "K": K, "MB": round(N * K / 1e6, 1)}
        pair = lambda a, w: lin8.matmul(add_rms_norm_triton(a, res, nw, 1e-6)[0], w, scale)     # noqa: E731
        row["pair_us"] = round(time_calls(pair, ws, x, args.reps), 2)
        row["current_tile"] = list(lin8.norm_tile(K))
        row["current_us"] = round(time_calls(lambda a, w: lin8.matmul(a, w, scale, norm=(res, nw, 1e-6)),
                                             ws, x, args.reps), 2)
        per = sweep(FP8_NORM_TILES, lambda t: time_calls(
            lambda a, w: lin8.matmul(a, w, scale, t, norm=(res, nw, 1e-6)), ws, x, args.reps), row)
        for t, us in per.items():
            totals[t] = totals.get(t, 0.0) + us * uses
        record(rows, row, per, N * K, bw)
        del ws
        torch.cuda.empty_cache()
    best = min(totals, key=totals.get)
    return {"rows": rows, "best_fp8_norm_tile": {"tile": list(best), "us_per_step": round(totals[best], 2)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8", help="comma-separated M values")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--fp8", action="store_true", help="the block-FP8 projection kernel instead of the bf16 GEMV")
    ap.add_argument("--norm", action="store_true", help="add_rms_norm_linear's one-row form (module docstring); with --fp8 add_rms_norm_linear_fp8's")
    ap.add_argument("--shapes", type=lambda v: v.split(","), default=None,
                    help="only these shape names (default all; names in FP8_SHAPES / SHAPES)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_linear: needs a CUDA device", file=sys.stderr)
        return 2
    from onegraph.custom_ops.triton import linear as lin
    from onegraph.custom_ops.triton import linear_fp8 as lin8
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    res = {"command": "python -m onegraph.scripts.bench_linear " + " ".join(sys.argv[1:] if argv is None else argv),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_GBps": round(bw / 1e9, 1),
           "rows": []}
    if args.norm:
        res.update(bench_fp8_norm(args, dev, bw) if args.fp8 else bench_norm(args, dev, bw) if args.rows.strip(",") == "1"
                   else bench_norm_rows(args, dev, bw))
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
        return 0
    totals: dict = {}
    for M in [int(v) for v in args.rows.split(",")]:
        for name, N, K, uses in FP8_SHAPES if args.fp8 else SHAPES:
            if args.shapes and name not in args.shapes:
                continue
            nbytes = N * K * (1 if args.fp8 else 2)
            copies = max(2, min(20, (800 << 20) // nbytes))
            ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            row = {"M": M, "name": name, "N": N, "K": K, "MB": round(nbytes / 1e6, 1)}
            us = time_calls(F.linear, ws, x, args.reps)          # cuBLAS on the bf16 weight (twice the bytes)
            row["cublas_bf16_us"], row["cublas_bf16_bw"] = round(us, 2), round(2 * N * K / (us * 1e-6) / bw, 3)
            if args.fp8:                                           # e4m3 bytes + one fp32 scale per 128x128 block
                scale = torch.rand(-(-N // 128), -(-K // 128), device=dev) * 2.0 ** -6
                ws = [(w * 64).to(torch.float8_e4m3fn) for w in ws]
                run = lambda a, w, cfg=None: lin8.matmul(a, w, scale, cfg and cfg[:6],           # noqa: E731
                                                         group_m=cfg[6] if cfg and len(cfg) > 6 else None)
                tiles = (FP8_GEMV_TILES if M == 1 else
                         [t for t in FP8_ROWS_TILES if t[0] >= M] + FP8_ROWS_DOT_TILES if M <= 8 else
                         FP8_DOT_TILES if M <= lin8.GEMV_MAX_M else FP8_MANY_TILES
                         if M <= lin8.BATCH_MAX_M else FP8_PREFILL_TILES)
                cur = lin8.tile(M, K)            # (..., SWAP): as the swept tiles name it
                cur = cur + (lin8.GROUP_M["many"],) if M > lin8.BATCH_MAX_M else cur if cur[5] else cur[:5]
            else:
                run = lambda a, w, cfg=None: lin.gemv(a, w, cfg)   # noqa: E731
                tiles, cur = (GEMV_TILES if M == 1 else DOT_TILES), lin.tile(M, K)
            per = sweep(tiles, lambda t: time_calls(lambda a, w: run(a, w, t), ws, x, args.reps), row)
            if uses:                                            # µs per decode step of this class
                for t, us in per.items():
                    totals.setdefault((M, K), {}).setdefault(t, 0.0)
                    totals[(M, K)][t] += us * uses
            best = min(per, key=per.get)
            row["tiles_us"] = {",".join(map(str, c)): round(u, 2) for c, u in sorted(per.items(), key=lambda cu: cu[1])}
            row["best_tile"], row["best_us"] = list(best), round(per[best], 2)
            row["best_bw"] = round(nbytes / (per[best] * 1e-6) / bw, 3)
            row["current_tile"] = list(cur)
            row["current_us"] = round(per.get(cur, time_calls(lambda a, w: run(a, w), ws, x, args.reps)), 2)
            if args.fp8 and M > lin8.BATCH_MAX_M:               # compute-bound: TFLOP/s of the best tile and cuBLAS
                row["best_tflops"] = round(2 * M * N * K / (per[best] * 1e-6) / 1e12, 1)
                row["cublas_bf16_tflops"] = round(2 * M * N * K / (row["cublas_bf16_us"] * 1e-6) / 1e12, 1)
                # for scale: cuBLAS on FP8 tensor cores (e4m3 x and w, one scale each: W8A8, not this op's numerics)
                xq, one = x.to(torch.float8_e4m3fn), torch.ones((), device=dev)
                us = time_calls(lambda a, w: torch._scaled_mm(xq, w.t(), one, one, out_dtype=torch.bfloat16),
                                ws, x, args.reps)
                row["cublas_fp8_w8a8_us"], row["cublas_fp8_w8a8_tflops"] = round(us, 2), round(2 * M * N * K / us / 1e6, 1)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            del ws
            torch.cuda.empty_cache()
    res["best_tile_per_class"] = {f"M={M} K={K}": {"tile": list(min(t, key=t.get)), "total_us": round(min(t.values()), 2)}
                                  for (M, K), t in totals.items()}
    print(json.dumps(res["best_tile_per_class"], indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
