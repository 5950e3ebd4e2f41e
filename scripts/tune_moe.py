"""Tile sweep for the fused_moe decode kernels (custom_ops/triton/fused_moe.py) at the Qwen3.5-35B-A3B
shape on a CUDA device: µs per call for each (BI, BH, warps) of the SwiGLU kernel and (BH, BI, warps) of the
down kernel (fused_moe.SWIGLU_ONE and DOWN_ONE, the tiles of every decode token count), one kernel's tiles varied
at a time.

    python -m onegraph.scripts.tune_moe --batches 1,8 --out moe_tiles.json
    python -m onegraph.scripts.tune_moe --batches 1 --routing-prefix --out moe_routing_prefix.json

--routing-prefix: instead of the sweep, what finding the routing inside the SwiGLU kernel costs at the default
tiles: the op routing in-kernel, the op routing first with _route_kernel (fused_moe.PREROUTED forces either),
and that routing kernel alone; prefix_us = in-kernel - (route first - routing alone); model_routes_first: which
of the two fused_moe.route_first picks at that batch.

--distinct-experts 8,12,...: the cost of a speculative verify's MoE (K + 1 rows of one slot) against how many
distinct experts its rows read: per batch B and U, router logits that make the B tokens pick their top_k among
exactly U experts (token 0 picks k of them, the others add the remaining U - k between them and fill up from
token 0's), next to independent random routing (its mean distinct count recorded) and B = 1. Random routers make
B tokens read ~k*B experts; trained ones share experts between consecutive tokens. With --fp8 the same rows for
fused_moe_fp8 (the experts and shared expert quantized to block FP8 by checkpoint/quant.py).

--pair-table: the prefill MoE's pair-table kernel per token tile and warps at --batches tokens (pair_table()).

--grouped [plain|swap|all]: the grouped-GEMM kernels instead (custom_ops/triton/fused_moe_prefill.py, taken when
T*top_k > E: prefill chunks, decode batches past E / k), --batches are token counts T:

    python -m onegraph.scripts.tune_moe --grouped --batches 512 --out moe_grouped_t512.json
    python -m onegraph.scripts.tune_moe --grouped swap --batches 64 --out moe_grouped_b64.json

per T: the current tiles, then each candidate (BN cap, BK cap, warps, stages, swap) of one kernel, the other at its
current tile, set as its (kernel, rows class) entry (fused_moe_prefill.plan); in the "few" rows class (<= 4 rows
per expert) the best swap tiles again on 8-row blocks (BM_MIN 8); then the best SwiGLU and down tiles together,
their output against the current tiles' (max abs). µs per call and GB/s of the expert bytes a call must read (the
distinct routed experts' gate_up + down and the shared expert, bf16). plain: the (BN, BK) grid bench_moe_fp8 sweeps
for the FP8 kernels; swap: the transposed product (weight rows on the MMA's M), 4 warps per 64 weight rows.

Each timing is one CUDA graph of `copies` calls, each on its own copy of the layer's weights and its
own input (so its own experts): in a model every layer reads experts no earlier call left in L2. (A
sweep that called one layer's weights again and again let them sit in L2, and ranked the tiles by
latency from L2, not from memory.)
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch


def time_copies(fn, cases, reps: int = 10) -> float:
    """µs per call: one call per case, all captured in one CUDA graph, replayed `reps` times."""
    from onegraph.scripts.bench_ops import time_graph
    return time_graph(lambda: [fn(*c) for c in cases], (), 1, reps, 1) / len(cases)


def set_tiles(tiles) -> None:
    """fused_moe.decode_tiles reads SWIGLU_ONE / DOWN_ONE at every token count: tiles = (swiglu BI, BH, warps,
    down BH, BI, warps)."""
    from onegraph.custom_ops.triton import fused_moe as mod
    mod.SWIGLU_ONE, mod.DOWN_ONE = tuple(tiles[:3]), tuple(tiles[3:])


def forced_logits(B: int, U: int, E: int, k: int, g) -> torch.Tensor:
    """Router logits [B, E + 1] (bf16; the last column the shared-expert gate) whose top-k sets over the B tokens
    cover exactly U experts: token 0 takes pool[:k], the U - k others are split between tokens 1.., each filling
    up to k from pool[:k]. The chosen logits sit well above the rest (no near-ties)."""
    if not k <= U <= k * B:
        raise ValueError(f"{U} distinct experts cannot come from {B} tokens of top-{k}")
    pool = torch.randperm(E, generator=torch.Generator().manual_seed(U))[:U].tolist()
    rest, sets = pool[k:], [pool[:k]]
    for t in range(1, B):
        n = len(rest) // (B - t) + (1 if len(rest) % (B - t) else 0)
        own, rest = rest[:n], rest[n:]
        sets.append(own + [e for e in pool[:k] if e not in own][:k - len(own)])
    logits = torch.randn(B, E + 1, generator=g, device=g.device) * 0.5 - 4
    for t, chosen in enumerate(sets):
        logits[t, chosen] = 4 + torch.arange(k, device=g.device, dtype=torch.float32) * 0.25
    logits[:, E] = torch.randn(B, generator=g, device=g.device)
    return logits.to(torch.bfloat16)


def distinct_experts(fn, weights, batches, distinct, g, k: int, E: int) -> list[dict]:
    """--distinct-experts rows: µs per call at each (B, U), at B with random routing, and at B = 1."""
    from onegraph.scripts.bench_ops import MOE, rand
    H, rows = MOE["H"], []
    one = [(rand(g, 1, H), torch.nn.functional.linear(rand(g, 1, H), torch.cat([r, s])), *ex, k)
           for r, *ex, s in weights]
    rows.append({"B": 1, "distinct": k, "us": round(time_copies(fn, one), 2)})
    for B in batches:
        cases = []
        for router, *experts, sgw in weights:
            x = rand(g, B, H)
            cases.append((x, torch.nn.functional.linear(x, torch.cat([router, sgw])), *experts, k))
        seen = sum(len(set(c[1][:, :E].float().topk(k).indices.flatten().tolist())) for c in cases) / len(cases)
        rows.append({"B": B, "distinct": "random", "mean_distinct": seen, "us": round(time_copies(fn, cases), 2)})
        reach = [U for U in distinct if k <= U <= k * B]       # what B tokens of top-k can cover
        for U in reach:
            forced = [(rand(g, B, H), forced_logits(B, U, E, k, g), *c[2:]) for c in cases]
            rows.append({"B": B, "distinct": U, "us": round(time_copies(fn, forced), 2)})
        for r in rows[-len(reach) - 1:]:
            print(json.dumps(r), flush=True)
    return rows


def grouped_tiles(form: str) -> list[tuple]:
    """(BN cap, BK cap, warps, stages, swap) candidates of one grouped kernel: "plain", "swap" or "all". The caps
    divide 128 (the FP8 kernels' block: a tile takes one scale). Swap: BN weight rows are the MMA's M (wgmma: 64
    per warpgroup of 4 warps; 32 rows run mma.sync on 2 warps)."""
    plain = [(bn, bk, w, st, False) for bn, bk, w, st in itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4))
             if bn * bk <= 8192]
    swap = [(bn, bk, w, st, True) for (bn, w), bk, st in itertools.product(((32, 2), (64, 4), (128, 4), (128, 8)),
                                                                          (64, 128), (3, 4))]
    return {"plain": plain, "swap": swap, "all": plain + swap}[form]


def grouped_sweep(mod, fn, cases, P: int, E: int, nbytes: float, form: str, timer) -> list[dict]:
    """Rows of a sweep of `mod`'s grouped kernels (fused_moe_prefill or fused_moe_fp8_prefill: their TILES and
    BM_MIN) over the calls `cases` of `fn`, P routed pairs over E experts (module docstring, --grouped). Each row:
    {"grouped": {kernel: tile}, "class", ["bm_min"], "us", "GBps" (nbytes per call over its time) | "error"}; the
    combined rows add "max_abs_vs_current". timer(fn, cases) -> µs per call. The module's tables are restored."""
    from onegraph.custom_ops.triton.fused_moe_prefill import row_class      # both modules' rows classes
    cls = row_class(P, E)
    tiles0, bm0 = dict(mod.TILES), dict(mod.BM_MIN)
    ref = fn(*cases[0])
    rows = []

    def run(tiles: dict, bm=None, check=False) -> dict:
        row = {"grouped": {name: list(t) for name, t in tiles.items()}, "class": cls}
        if bm:
            row["bm_min"] = bm
        mod.TILES = {**tiles0, **{(name, cls): t for name, t in tiles.items()}}
        mod.BM_MIN = {**bm0, cls: bm} if bm else bm0
        try:
            us = timer(fn, cases)
            row.update(us=round(us, 2), GBps=round(nbytes / us / 1e3, 1))
            if check:
                row["max_abs_vs_current"] = (fn(*cases[0]).float() - ref.float()).abs().max().item()
        except Exception as e:  # a tile that does not compile: recorded, the sweep goes on
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        finally:
            mod.TILES, mod.BM_MIN = tiles0, bm0
        rows.append(row)
        return row

    def ranked(name: str, swap=None) -> list[dict]:
        """The timed rows of `name` alone (one form, or either), on the current BM_MIN, fastest first."""
        return sorted((r for r in rows if "us" in r and "bm_min" not in r and list(r["grouped"]) == [name]
                       and swap in (None, r["grouped"][name][4])), key=lambda r: r["us"])

    for name in ("swiglu", "down"):
        for c in grouped_tiles(form):
            run({name: c})
    few = -(-P // E) <= 8                             # <= 8 rows per expert: BM_MIN 8 makes 8-row blocks (not 16)
    if few and form != "plain":
        for name in ("swiglu", "down"):
            for r in ranked(name, True)[:3]:
                run({name: tuple(r["grouped"][name])}, bm=8)
    combos = []                                       # the best tiles of both kernels together: any form, then swap
    for swap in (None, True):
        if all(ranked(name, swap) for name in ("swiglu", "down")):
            tiles = {name: tuple(ranked(name, swap)[0]["grouped"][name]) for name in ("swiglu", "down")}
            if tiles not in combos:
                combos.append(tiles)
    for tiles in combos:
        for bm in (None, 8) if few else (None,):
            run(tiles, bm=bm, check=True)
    return rows


def grouped_main(args, weights, g, H: int, E: int, I: int, Is: int, k: int) -> list[dict]:
    """--grouped: per T, the bf16 grouped kernels at their current tiles, then grouped_sweep's rows."""
    from onegraph.custom_ops.triton import fused_moe_prefill as pre
    from onegraph.scripts.bench_ops import rand
    fn, out = torch.ops.onegraph.fused_moe_triton, []
    for T in args.batches:
        cases = []
        for router, *experts, sgw in weights:
            x = rand(g, T, H)
            cases.append((x, torch.nn.functional.linear(x, torch.cat([router, sgw])), *experts, k))
        distinct = sum(c[1][:, :E].float().topk(k).indices.unique().numel() for c in cases) / len(cases)
        nbytes = 2 * (distinct * 3 * I * H + 3 * Is * H)             # bf16 bytes of the experts a call reads
        P = T * k
        _, sw, dn = pre.plan(pre.TILES, pre.BM_MIN, P, E)
        us = time_copies(fn, cases)
        row = {"T": T, "class": pre.row_class(P, E), "distinct_experts": distinct, "expert_GB": round(nbytes / 1e9, 3),
               "current": {"swiglu": list(sw), "down": list(dn)}, "current_us": round(us, 2),
               "current_GBps": round(nbytes / us / 1e3, 1),
               "grouped": grouped_sweep(pre, fn, cases, P, E, nbytes, args.grouped, time_copies)}
        ok = [r for r in row["grouped"] if "us" in r]
        row["best"] = min(ok, key=lambda r: r["us"]) if ok else None
        print(f"T={T:5d} ({row['class']}, {distinct:.1f} experts, {row['expert_GB']} GB)  current {us:8.2f} us "
              f"({row['current_GBps']} GB/s)  best {json.dumps(row['best'])}", flush=True)
        for r in row["grouped"]:
            print("      ", json.dumps(r), flush=True)
        out.append(row)
    return out


def pair_table(batches, E: int, k: int, g) -> list[dict]:
    """--pair-table: _pair_table_kernel (fused_moe_prefill.routed_table) per (token tile BT, warps) at T tokens,
    the tables checked equal to the current tile's. Each of its E programs scans all T * k ids twice, BT tokens a
    step, so its time grows with T; a larger BT takes fewer, wider steps."""
    from onegraph.custom_ops.triton import fused_moe_prefill as fp
    rows = []
    for T in batches:
        idx = torch.rand(T, E, device="cuda", generator=g).topk(k).indices          # k distinct experts a token
        w = torch.rand(T, k, device="cuda", generator=g)
        ref = fp.routed_table(idx, w, E)
        row = {"T": T, "current": [fp.PAIR_BT, fp.PAIR_WARPS], "us": {}}
        for bt, warps in itertools.product((64, 256, 512, 1024), (4, 8)):
            got = fp.routed_table(idx, w, E, bt=bt, warps=warps)
            same = torch.equal(got[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(got[1][:4], ref[1][:4]))
            us = time_copies(lambda: fp.routed_table(idx, w, E, bt=bt, warps=warps), [()] * 8)
            row["us"][f"{bt},{warps}"] = round(us, 2) if same else f"table differs ({us:.2f} us)"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8])
    ap.add_argument("--copies", type=int, default=6, help="weight copies per graph (1.6 GB each at the 35B shape)")
    ap.add_argument("--routing-prefix", action="store_true", help="measure the in-kernel routing's cost (docstring)")
    ap.add_argument("--distinct-experts", type=lambda v: [int(x) for x in v.split(",")], default=[],
                    help="the verify's MoE against its distinct experts (docstring)")
    ap.add_argument("--fp8", action="store_true", help="--distinct-experts: the block-FP8 op (docstring)")
    ap.add_argument("--grouped", nargs="?", const="all", choices=("plain", "swap", "all"),
                    help="sweep the grouped-GEMM kernels at --batches tokens (T*top_k > E; docstring)")
    ap.add_argument("--pair-table", action="store_true", help="sweep the prefill pair-table kernel at --batches tokens")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from onegraph.scripts.bench_ops import MOE, rand
    H, E, I, Is, k = (MOE[x] for x in ("H", "E", "I", "Is", "top_k"))
    if args.pair_table:
        res = {"command": "python -m onegraph.scripts.tune_moe " + " ".join(sys.argv[1:] if argv is None else argv),
               "device": torch.cuda.get_device_name(),
               "rows": pair_table(args.batches, E, k, torch.Generator(device="cuda").manual_seed(0))}
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return 0
    if args.grouped and any(T * k <= E for T in args.batches):
        ap.error(f"--grouped times the grouped kernels: every T in --batches needs T * {k} > {E}")
    from onegraph.custom_ops.triton import fused_moe as mod
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [(rand(g, E, H, scale=H ** -0.5), rand(g, E, 2 * I, H, scale=H ** -0.5), rand(g, E, H, I, scale=I ** -0.5),
                rand(g, Is, H, scale=H ** -0.5), rand(g, Is, H, scale=H ** -0.5), rand(g, H, Is, scale=Is ** -0.5),
                rand(g, 1, H, scale=H ** -0.5)) for _ in range(args.copies)]
    base = mod.SWIGLU_ONE + mod.DOWN_ONE
    if args.grouped:
        res = {"command": "python -m onegraph.scripts.tune_moe " + " ".join(sys.argv[1:] if argv is None else argv),
               "device": torch.cuda.get_device_name(), "copies": args.copies,
               "rows": grouped_main(args, weights, g, H, E, I, Is, k)}
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return 0

    # 1-2 warps too: a routed program's in-kernel routing is j + 1 block reductions, cheaper the fewer warps
    # it spans, and smaller programs fit more per SM. Tiles whose fp32 accumulators would take more than 64
    # registers a thread (two [BI, BH] in kernel 1, [k, BH, BI] in kernel 2) are left out: they spill.
    k1 = [c for c in itertools.product((1, 2, 4, 8, 16), (128, 256, 512, 1024, 2048), (1, 2, 4, 8))
          if c[0] * c[1] <= 64 * 32 * c[2]]
    k2 = [c for c in itertools.product((1, 2, 4, 8), (128, 256, 512), (1, 2, 4, 8)) if 8 * c[0] * c[1] <= 64 * 32 * c[2]]
    res = {"command": "python -m onegraph.scripts.tune_moe " + " ".join(sys.argv[1:] if argv is None else argv),
           "default": base, "copies": args.copies, "rows": []}
    fn = torch.ops.onegraph.fused_moe_triton
    if args.distinct_experts:
        if args.fp8:                                      # (router, e4m3 + scale per weight..., sgw)
            from onegraph.checkpoint.quant import quantize
            fn = torch.ops.onegraph.fused_moe_fp8_triton
            weights = [(r, *(t for w in ws for t in quantize(w)), sgw) for r, *ws, sgw in weights]
        res["fp8"], res["device"] = args.fp8, torch.cuda.get_device_name()
        res["rows"] = distinct_experts(fn, weights, args.batches, args.distinct_experts, g, k, E)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return 0
    for B in args.batches:
        cases = []
        for router, *experts, sgw in weights:                 # fused_moe takes the logits: x @ [router; sgw].T
            x = rand(g, B, H)
            cases.append((x, torch.nn.functional.linear(x, torch.cat([router, sgw])), *experts, k))
        if args.routing_prefix:
            us = {}
            for first in (False, True):
                mod.PREROUTED = first
                try:
                    us[first] = time_copies(fn, cases)
                finally:
                    mod.PREROUTED = None
            alone = time_copies(lambda x, logits, *rest: mod.route_triton(logits[:, :E], k), cases)
            res["rows"].append({"B": B, "in_kernel_us": round(us[False], 2), "route_first_us": round(us[True], 2),
                                "routing_alone_us": round(alone, 2), "prefix_us": round(us[False] - (us[True] - alone), 2),
                                "model_routes_first": mod.route_first(B)})
            print(json.dumps(res["rows"][-1]), flush=True)
            continue
        start = base
        for which, grid in (("swiglu", k1), ("down", k2)):
            for cfg in grid:
                set_tiles(cfg + start[3:] if which == "swiglu" else start[:3] + cfg)
                try:
                    us = time_copies(fn, cases)
                except Exception as e:  # a config that does not compile: record and go on
                    us = None
                    print(which, cfg, type(e).__name__, str(e)[:200], file=sys.stderr)
                res["rows"].append({"B": B, "kernel": which, "cfg": cfg, "us": us})
                print(json.dumps(res["rows"][-1]), flush=True)
        set_tiles(start)
    if args.routing_prefix:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return 0
    res["best"] = {f"B{B} {w}": min((r for r in res["rows"] if r["B"] == B and r["kernel"] == w and r["us"]),
                                    key=lambda r: r["us"]) for B in args.batches for w in ("swiglu", "down")}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
