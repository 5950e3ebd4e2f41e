"""Benchmark the CUDA Triton lowerings against their pure-torch references at Qwen3.5-35B-A3B shapes.

For gdn_decode_step, fused_moe and attention_decode (bf16, decode batch B = 1, 8, 64 by default,
attention over a full 4k context) it measures, per implementation:
  - us per call, timed with CUDA events around a CUDA graph holding --graph-calls calls (replayed
    --iters times after --warmup replays): kernel time without Python launch overhead, as the runtime
    replays graphs; and, as a second number, a plain eager loop (launch overhead included);
  - bytes the op must move at least (state rows, selected experts' weights, the KV it attends...)
    and the achieved GB/s, next to a device-to-device copy bandwidth measured in the same run
    (read + write counted, as docs/design.md does);
  - the max abs difference of the Triton output from the eager reference.
Implementations: "triton" (torch.ops.onegraph.<op>_triton), "eager" (the reference), "compile"
(torch.compile of the reference; its compile time is reported). Writes JSON to --out, with the exact
command line. A failing case is recorded with its error (and printed); the exit status is then 1.

  python scripts/bench_ops.py --out bench_ops.json
  python scripts/bench_ops.py --out quick.json --ops gdn_decode_step --batches 1 --impls triton,eager
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
import traceback

import torch

from onegraph.commands.bench_common import replay_us

OPS = ("gdn_decode_step", "fused_moe", "attention_decode")
IMPLS = ("triton", "eager", "compile")

# Qwen3.5-35B-A3B (transformers Qwen3_5MoeTextConfig defaults)
GDN = dict(HK=16, HV=32, K=128, V=128, W=4)
MOE = dict(H=2048, E=256, I=512, Is=512, top_k=8)
ATTN = dict(H=16, KVH=2, D=256)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {OPS}")
    p.add_argument("--batches", default="1,8,64", help="comma list of decode batch sizes (MoE: tokens)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {IMPLS}")
    p.add_argument("--context", type=int, default=4096, help="attention: keys attended per row (= cache length)")
    p.add_argument("--warmup", type=int, default=10, help="graph replays before timing")
    p.add_argument("--iters", type=int, default=50, help="timed graph replays")
    p.add_argument("--graph-calls", type=int, default=20, help="op calls captured in one CUDA graph")
    p.add_argument("--eager-iters", type=int, default=100, help="timed calls of the eager (launch-bound) loop")
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth-reference copy")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.ops = _choices(a.ops, OPS, "--ops")
    a.impls = _choices(a.impls, IMPLS, "--impls")
    try:
        a.batches = [int(b) for b in a.batches.split(",") if b]
    except ValueError:
        p.error(f"--batches: expected comma-separated integers, got {a.batches!r}")
    if not a.batches or min(a.batches) < 1:
        p.error("--batches: need at least one batch size >= 1")
    for name in ("warmup", "iters", "graph_calls", "eager_iters", "context", "copy_mib"):
        if getattr(a, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')} must be positive")
    return a


def _choices(text, allowed, flag):
    got = [x for x in text.split(",") if x]
    bad = [x for x in got if x not in allowed]
    if bad or not got:
        raise SystemExit(f"{flag}: unknown {bad or 'empty list'}; choose from {', '.join(allowed)}")
    return got


# ---------------------------------------------------------------- inputs and bytes per op

def rand(g, *shape, scale=1.0, dtype=torch.bfloat16):
    """Random normal * scale, made on the generator's device (the MoE weights are 1.5 GB)."""
    return (torch.randn(*shape, generator=g, device=g.device, dtype=torch.float32) * scale).to(dtype)


def gdn_case(B, g):
    HK, HV, K, V, W = (GDN[k] for k in ("HK", "HV", "K", "V", "W"))
    C, S = 2 * HK * K + HV * V, B + 1
    args = (rand(g, B, C), rand(g, B, HV), rand(g, B, HV), rand(g, S, C, W - 1),
            rand(g, S, HV, K, V, scale=0.1, dtype=torch.float32),
            torch.randperm(S, generator=g, device=g.device)[:B], rand(g, C, W, scale=0.5), rand(g, HV, scale=0.5),
            rand(g, HV), HK)
    e = 2  # bf16 bytes
    moved = (B * C * e + 2 * B * HV * e            # qkv, a, b
             + 2 * B * C * (W - 1) * e + C * W * e  # conv rows read + written, conv weight
             + 2 * B * HV * K * V * 4               # fp32 state rows read + written
             + B * HV * V * e + 2 * HV * e)         # out, A_log, dt_bias
    return args, moved


_MOE_WEIGHTS = []


def moe_case(T, g):
    from onegraph.custom_ops.fused_moe import route
    H, E, I, Is, k = (MOE[x] for x in ("H", "E", "I", "Is", "top_k"))
    if not _MOE_WEIGHTS:                           # made once, shared by every T
        _MOE_WEIGHTS.extend([rand(g, E, H, scale=H ** -0.5), rand(g, E, 2 * I, H, scale=H ** -0.5),
                             rand(g, E, H, I, scale=I ** -0.5), rand(g, Is, H, scale=H ** -0.5),
                             rand(g, Is, H, scale=H ** -0.5), rand(g, H, Is, scale=Is ** -0.5),
                             rand(g, 1, H, scale=H ** -0.5)])
    router, *experts, sgw = _MOE_WEIGHTS
    x = rand(g, T, H)
    logits = torch.nn.functional.linear(x, torch.cat([router, sgw]))          # [T, E + 1], the op's input
    args = (x, logits, *experts, k)
    _, idx = route(logits[:, :E], k)
    distinct = int(idx.unique().numel())
    e = 2
    moved = (distinct * 3 * I * H * e + 3 * Is * H * e                       # experts read, shared expert
             + 2 * T * H * e + T * (E + 1) * e)                             # x, y, logits
    return args, moved, {"distinct_experts": distinct}


def attn_case(B, g, context):
    H, KVH, D = ATTN["H"], ATTN["KVH"], ATTN["D"]
    S = B + 1
    positions = torch.full((B,), context - 1, dtype=torch.int64, device=g.device)   # every row: full context
    args = (rand(g, B, H, D), rand(g, S, KVH, context, D), rand(g, S, KVH, context, D),
            torch.randperm(S, generator=g, device=g.device)[:B], positions, D ** -0.5,
            rand(g, B, H, D))                                                           # the output gate
    e = 2
    moved = B * context * KVH * D * 2 * e + 3 * B * H * D * e
    return args, moved


# ---------------------------------------------------------------- timing

def copy_bandwidth(dev, mib, iters=20):
    n = mib * (1 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    s = start.elapsed_time(end) / 1e3 / iters
    return 2 * n / s / 1e9                       # read + write, GB/s


def time_graph(fn, args, warmup, iters, calls):
    """us per call: `calls` calls captured in one CUDA graph, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    return replay_us(graph, warmup, iters) / calls


def time_eager(fn, args, iters):
    for _ in range(3):
        fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def max_diff(a, b):
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_ops: needs a CUDA device (torch.cuda.is_available() is False)")
    try:
        import triton
    except ImportError as e:
        raise SystemExit(f"bench_ops: triton is not importable ({e}); install onegraph[cuda]")
    from onegraph.custom_ops import _registry
    _registry.decompositions("cuda")             # registers the Triton ops; fails closed naming the op
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(a.seed)

    report = {
        "command": shlex.join([sys.executable] + sys.argv) if argv is None else shlex.join(["bench_ops.py", *argv]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "dtype": "bfloat16",
        "shapes": {"gdn_decode_step": GDN, "fused_moe": MOE, "attention_decode": {**ATTN, "context": a.context}},
        "timing": {"warmup": a.warmup, "iters": a.iters, "graph_calls": a.graph_calls, "eager_iters": a.eager_iters},
        "copy_bandwidth_GBps": round(copy_bandwidth(dev, a.copy_mib), 1),
        "results": [],
    }
    bw = report["copy_bandwidth_GBps"]
    print(f"device {report['device']}: copy bandwidth {bw:.0f} GB/s (read + write)", flush=True)
    refs = {name: _registry.REGISTRY[name].reference for name in OPS}
    errors = 0
    for op in a.ops:
        for B in a.batches:
            extra = {}
            try:
                if op == "gdn_decode_step":
                    args, moved = gdn_case(B, g)
                elif op == "fused_moe":
                    args, moved, extra = moe_case(B, g)
                else:
                    args, moved = attn_case(B, g, a.context)
                expected = refs[op](*args)
            except Exception as e:                # noqa: BLE001  (recorded, printed, exit status 1)
                errors += 1
                report["results"].append({"op": op, "B": B, "error": f"inputs: {type(e).__name__}: {e}"})
                traceback.print_exc()
                continue
            for impl in a.impls:
                row = {"op": op, "B": B, "impl": impl, "bytes": moved, **extra}
                try:
                    if impl == "triton":
                        fn = getattr(torch.ops.onegraph, f"{op}_triton")
                    elif impl == "eager":
                        fn = refs[op]
                    else:
                        fn = torch.compile(refs[op], dynamic=False)
                        t0 = time.perf_counter()
                        fn(*args)
                        torch.cuda.synchronize()
                        row["compile_s"] = round(time.perf_counter() - t0, 2)
                    row["max_abs_diff_vs_eager"] = max_diff(fn(*args), expected)
                    us = time_graph(fn, args, a.warmup, a.iters, a.graph_calls)
                    row.update(us_per_call=round(us, 2), GBps=round(moved / us / 1e3, 1),
                               fraction_of_copy_bw=round(moved / us / 1e3 / bw, 3))
                    row["eager_loop_us_per_call"] = round(time_eager(fn, args, a.eager_iters), 2)
                except Exception as e:            # noqa: BLE001
                    errors += 1
                    row["error"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                report["results"].append(row)
                print(json.dumps(row), flush=True)
            del args, expected
            torch.cuda.empty_cache()
    report["errors"] = errors
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {a.out} ({len(report['results'])} rows, {errors} errors)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
