"""L2 prefetch at the batch-1 decode step, measured (H200: benchmarks/h200_l2_prefetch.json; not adopted).

    python -m onegraph.tools.bench_l2_prefetch OUT.json

A chain of 12 GDN layers at the Qwen3.5-35B-A3B shape, batch 1, each its own weights (in_proj GEMV with the norm
folded -> conv update, step, gated norm -> out_proj GEMV -> router GEMV with the norm folded -> fused_moe),
captured in one CUDA graph. Variants launch a kernel that prefetches the out_proj weights (and the router's and
the shared expert's) into L2 right after the in_proj GEMV, so that their DRAM reads would overlap the three
latency-bound GDN kernels: `cp.async.bulk.prefetch.L2` (128 KB a program, 1 KB a thread), the same with an
evict_last policy, or `prefetch.global.L2::evict_last` per 128-byte line. Also: the out_proj GEMV alone on 12
distinct weights (cold) vs one weight 12 times (L2-resident), and the prefetch kernel alone."""
import json, os, sys
import torch
import triton
import triton.language as tl

from onegraph.custom_ops.triton.add_rms_norm_linear import add_rms_norm_linear_triton  # noqa
from onegraph.custom_ops.triton.gdn_decode_step_norm import gdn_decode_step_norm_triton  # noqa
from onegraph.custom_ops.triton.linear import gemv
from onegraph.custom_ops.triton.fused_moe import fused_moe_triton  # noqa
from onegraph.tools.bench_common import replay_us

OPS = torch.ops.onegraph


@triton.jit
def _pf_bulk(w, nbytes, CHUNK: tl.constexpr, NT: tl.constexpr, HINT: tl.constexpr):
    pid = tl.program_id(0)
    SUB: tl.constexpr = CHUNK // NT
    off = pid.to(tl.int64) * CHUNK + tl.arange(0, NT).to(tl.int64) * SUB
    p = w.to(tl.pointer_type(tl.int8)) + off
    size = tl.minimum(tl.maximum(nbytes - off, 0), SUB).to(tl.int32)
    if HINT:
        tl.inline_asm_elementwise(
            "{ .reg .pred q; .reg .b64 pol; setp.gt.s32 q, $2, 0; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@q cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
            "=r,l,r", [p, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred q; setp.gt.s32 q, $2, 0; @q cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [p, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pf_lines(w, nbytes, CHUNK: tl.constexpr, NT: tl.constexpr):
    pid = tl.program_id(0)
    for i in tl.static_range(CHUNK // (NT * 128)):
        off = pid.to(tl.int64) * CHUNK + (i * NT + tl.arange(0, NT)).to(tl.int64) * 128
        p = w.to(tl.pointer_type(tl.int8)) + tl.minimum(off, nbytes - 128)
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [p],
                                  dtype=tl.int32, is_pure=False, pack=1)


def prefetch(ts, mode, chunk=131072):
    for t in ts:
        n = t.numel() * t.element_size()
        grid = (triton.cdiv(n, chunk),)
        if mode == "lines":
            _pf_lines[grid](t, n, CHUNK=chunk, NT=128, num_warps=4)
        else:
            _pf_bulk[grid](t, n, CHUNK=chunk, NT=128, HINT=mode == "bulk_hint", num_warps=4)


def rand(g, *shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32) * scale).to(dtype)


def make_layers(n, g):
    H, C, HV, K, V, W, E, I = 2048, 8192, 32, 128, 128, 4, 256, 512
    L = []
    for _ in range(n):
        L.append(dict(
            w_in=rand(g, C + HV * V + 2 * HV, H, scale=H ** -0.5), nw_in=rand(g, H, scale=0.1),
            conv_state=rand(g, 2, C, W - 1), rec_state=rand(g, 2, HV, K, V, scale=0.1, dtype=torch.float32),
            conv_w=rand(g, C, W, scale=0.5), A_log=rand(g, HV, scale=0.5), dt_bias=rand(g, HV), norm_w=rand(g, V),
            w_out=rand(g, H, HV * V, scale=(HV * V) ** -0.5), nw_post=rand(g, H, scale=0.1),
            w_r=rand(g, E + 1, H, scale=H ** -0.5),
            gate_up=rand(g, E, 2 * I, H, scale=H ** -0.5), down=rand(g, E, H, I, scale=I ** -0.5),
            sg=rand(g, I, H, scale=H ** -0.5), su=rand(g, I, H, scale=H ** -0.5), sd=rand(g, H, I, scale=I ** -0.5)))
    return L


def chain(L, x0, r0, slots, variant, pf_mode):
    x, res = x0, r0
    for l in L:
        if variant == "before":
            prefetch([l["w_out"]], pf_mode)
        y_in, normed, h = OPS.add_rms_norm_linear_triton(x, res, l["nw_in"], 1e-6, l["w_in"])
        if variant in ("out", "out_moe"):
            prefetch([l["w_out"]] + ([l["w_r"], l["sg"], l["su"], l["sd"]] if variant == "out_moe" else []), pf_mode)
        qkv, z, b, a = y_in.split([8192, 4096, 32, 32], -1)
        y, nc, nr = OPS.gdn_decode_step_norm_triton(qkv, a, b, z, l["conv_state"], l["rec_state"], slots, l["conv_w"],
                                                    l["A_log"], l["dt_bias"], l["norm_w"], 16, 1e-6)
        o = gemv(y.reshape(1, -1), l["w_out"])
        logits, normed2, h2 = OPS.add_rms_norm_linear_triton(o, h, l["nw_post"], 1e-6, l["w_r"])
        x = OPS.fused_moe_triton(normed2, logits, l["gate_up"], l["down"], l["sg"], l["su"], l["sd"], 8)
        res = h2
    return x


def capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            out = fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def kernel_profile(graph):
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    agg = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            agg[e.name] = agg.get(e.name, 0.0) + e.device_time_total / 5
    return {k: round(v, 1) for k, v in sorted(agg.items(), key=lambda kv: -kv[1])[:12]}


def main():
    out_path = sys.argv[1]
    n = 12
    g = torch.Generator(device="cuda").manual_seed(0)
    L = make_layers(n, g)
    x0, r0 = rand(g, 1, 2048), rand(g, 1, 2048)
    slots = torch.tensor([0], device="cuda")
    res = {"layers": n}
    # elementary: out_proj GEMV cold (12 distinct weights) vs L2-warm (one weight 12 times)
    ys = [rand(g, 1, 4096) for _ in range(n)]
    gc, _ = capture(lambda: [gemv(ys[i], L[i]["w_out"]) for i in range(n)])
    gw, _ = capture(lambda: [gemv(ys[i], L[0]["w_out"]) for i in range(n)])
    res["out_proj_cold_us"] = round(replay_us(gc, 5, 50) / n, 2)
    res["out_proj_l2_us"] = round(replay_us(gw, 5, 50) / n, 2)
    # the GEMV's time against its bytes (K = 2048, 12 distinct weights per graph): intercept = what a kernel costs
    # beyond its bytes, slope = the bandwidth it streams at
    fit = {}
    xs = [rand(g, 1, 2048) for _ in range(n)]
    for N in (8, 256, 1024, 2048, 4096, 8192, 12352, 32768):
        ws = [rand(g, N, 2048) for _ in range(n)]
        gn, _ = capture(lambda: [gemv(xs[i], ws[i]) for i in range(n)])
        fit[N] = round(replay_us(gn, 5, 50) / n, 2)
        del ws, gn
    res["gemv_k2048_us_by_rows"] = fit
    mb = [N * 2048 * 2 / 1e6 for N in fit]
    us = list(fit.values())
    slope, icpt = torch.linalg.lstsq(torch.tensor([[m, 1.0] for m in mb]), torch.tensor(us)[:, None]).solution[:, 0].tolist()
    res["gemv_fit"] = {"us_fixed": round(icpt, 2), "GBps": round(1e3 / slope, 0)}
    # prefetch alone: launch cost of the prefetch kernel (cold weights)
    for mode in ("bulk", "bulk_hint", "lines"):
        try:
            gp, _ = capture(lambda: [prefetch([L[i]["w_out"]], mode) for i in range(n)])
            res[f"prefetch_{mode}_alone_us"] = round(replay_us(gp, 5, 50) / n, 2)
            gpc, _ = capture(lambda: [(prefetch([L[i]["w_out"]], mode), gemv(ys[i], L[i]["w_out"])) for i in range(n)])
            res[f"prefetch_{mode}_then_gemv_us"] = round(replay_us(gpc, 5, 50) / n, 2)
        except Exception as e:
            res[f"prefetch_{mode}_error"] = repr(e)[:400]
    print(json.dumps(res), flush=True)
    ref = None
    for variant, mode in [("none", None), ("out", "bulk"), ("out_moe", "bulk"), ("out", "bulk_hint"),
                          ("out_moe", "bulk_hint"), ("before", "bulk"), ("out", "lines"), ("none", None)]:
        key = f"{variant}_{mode}"
        try:
            graph, y = capture(lambda: chain(L, x0, r0, slots, variant, mode))
            us = replay_us(graph, 5, 30) / n
            graph.replay(); torch.cuda.synchronize()
            if ref is None:
                ref = y.clone()
            res[key] = {"us_per_layer": round(us, 2), "equal": bool(torch.equal(y, ref))}
            if variant in ("none", "out_moe") and mode in (None, "bulk"):
                res[key]["kernels_us_per_replay"] = kernel_profile(graph)
        except Exception as e:
            res[key] = repr(e)[:400]
        print(key, json.dumps(res[key]), flush=True)
    json.dump(res, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
