"""Programmatic dependent launch (PDL) inside a captured CUDA graph, on a toy: what a replay boundary costs
with and without it (Hopper and later; benchmarks/h200_pdl_toy.json).

    python -m onegraph.tools.bench_pdl --out FILE.json

Why: AOTInductor's C++ wrapper launches every kernel with cuLaunchKernel and no launch attributes, so a
captured decode step (about 10 kernels per layer at batch 1) pays a full launch boundary per kernel. PDL can
be added after capture instead: torch.cuda.CUDAGraph(keep_graph=True) exposes the cudaGraph_t before
instantiation, and each kernel->kernel edge can be replaced by a programmatic edge (cudaGraphEdgeData: type
programmatic, from the primary's programmatic port). That is only correct when every dependent kernel runs
griddepcontrol.wait before touching its predecessor's output: Triton's gdc_wait (our kernels would call it
first; Inductor's own kernels get it from its `triton.enable_pdl` option).
The toy: a chain of K = 400 launches of one elementwise Triton kernel (y = a x + b, ping-pong buffers) at
three sizes, captured as (1) plain, (2) plain with the griddepcontrol instructions compiled in (they are
no-ops without PDL: their cost), (3) programmatic edges with gdc_wait only (the dependent launches as the
primary's blocks exit), (4) programmatic edges with gdc_launch_dependents first (it launches as soon as every
primary block has started). µs per kernel per replay, and the outputs of all four must be equal.

--gemv: the same on the 35B decode's projections at batch 1 through onegraph::linear's own GEMV
(custom_ops/triton/linear.py), whose one-tile programs load their weights before the wait: a chain of `copies`
× (GDN in_proj with its input norm folded [12352, 2048] -> out_proj [2048, 4096] -> the router with the
post-attention norm folded [257, 2048]) on distinct weight copies, each reading the previous one's output,
captured with the kernels compiled at PDL 0 (twice: the plain control), 1 and 2, with and without programmatic
edges: µs per chain, per kernel, the fraction of copy bandwidth, and whether the outputs of 3 replays on new
inputs each equal plain's."""
import argparse
import json

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..runtime.pdl import make_programmatic
from .bench_common import replay_us


@triton.jit
def axpb(x, y, N, a, b, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL == 2:
        gdc_launch_dependents()
    if PDL >= 1:
        gdc_wait()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    v = tl.load(x + i, mask=m, other=0.0)
    tl.store(y + i, v * a + b, mask=m)


def capture(fn, keep):
    g = torch.cuda.CUDAGraph(keep_graph=keep)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.capture_begin()
        fn()
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    return g


def gemv_chain(copies: int) -> dict:
    """--gemv (module docstring) -> one result row."""
    from onegraph.custom_ops.triton import _common
    from onegraph.custom_ops.triton.linear import gemv
    d, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=d).manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, device=d, generator=g) * 0.02).to(dt)   # noqa: E731
    layers = [(rnd(12352, 2048), rnd(2048, 4096), rnd(257, 2048), rnd(2048), rnd(2048)) for _ in range(copies)]
    nbytes = sum(t.numel() * t.element_size() for L in layers for t in L[:3])
    h0, r0 = rnd(1, 2048) * 50, rnd(1, 2048) * 50
    bufs = {}

    def chain():
        h, res = h0, r0
        outs = []
        for w_in, w_out, w_router, n1, n2 in layers:
            y, _, hres = gemv(h, w_in, norm=(res, n1, 1e-6))          # [1, 12352], the normed row's h = h + res
            o = gemv(y[:, :4096], w_out)                              # [1, 2048]
            logits, _, h = gemv(o, w_router, norm=(hres, n2, 1e-6))   # [1, 257]; h: o + hres
            res = hres
            outs.append(logits)
        bufs["out"] = torch.cat(outs)
    row = {"copies": copies, "kernels": 3 * copies, "weight_MB": round(nbytes / 1e6, 1)}
    outs = {}
    for name, mode, edges in [("plain", 0, False), ("plain_again", 0, False)] + \
            [(f"pdl{m}_{e}", m, e == "edges") for m in (1, 2, 3, 4) for e in ("no_edges", "edges")]:
        _common.PDL_MODE = mode
        chain()                                                       # compile + warm
        torch.cuda.synchronize()
        gr = capture(chain, keep=edges)
        if edges:
            row[name + "_edges"] = make_programmatic(gr.raw_cuda_graph(), {"_gemv_kernel"})
            gr.instantiate()
        seen = []
        for k in range(3):          # new inputs each replay: a read that did not wait would see the last replay's
            h0.copy_(torch.randn(h0.shape, device=d, generator=torch.Generator(device=d).manual_seed(k)).to(dt) * 50)
            gr.replay()
            seen.append(bufs["out"].clone())
        torch.cuda.synchronize()
        outs[name] = torch.stack(seen)
        us = replay_us(gr, 3, 50)
        row[name + "_us"] = round(us, 2)
        row[name + "_us_per_kernel"] = round(us / (3 * copies), 3)
        row[name + "_GBps"] = round(nbytes / us / 1e3, 1)
        row[name + "_equal_plain"] = bool(torch.equal(outs["plain"], outs[name]))
        print(name, row[name + "_us"], row[name + "_equal_plain"], flush=True)
    _common.PDL_MODE = 0
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gemv", action="store_true", help="the 35B projections' GEMV chain (docstring)")
    ap.add_argument("--copies", type=int, default=12)
    a = ap.parse_args(argv)
    out = a.out
    if a.gemv:
        row = gemv_chain(a.copies)
        row.update(command=f"python -m onegraph.tools.bench_pdl --gemv --copies {a.copies} --out " + out,
                   gpu=torch.cuda.get_device_name(), torch=torch.__version__)
        json.dump(row, open(out, "w"), indent=1)
        return 0
    K = 400
    rows = []
    for N, BLOCK in [(4096, 1024), (1 << 20, 1024), (8 << 20, 2048)]:
        bufs = [torch.randn(N, device="cuda"), torch.empty(N, device="cuda")]
        def chain(pdl):
            def f():
                for k in range(K):
                    src, dst = bufs[k % 2], bufs[(k + 1) % 2]
                    axpb[(triton.cdiv(N, BLOCK),)](src, dst, N, 0.999, 0.001, BLOCK=BLOCK, PDL=pdl)
            return f
        x0 = bufs[0].clone()
        res = {"N": N, "bytes_per_kernel": 8 * N}
        outs = {}
        for name, pdl, edges in [("plain", 0, False), ("plain_gdc_kernels", 2, False),
                                 ("pdl_wait_only", 1, True), ("pdl_early_trigger", 2, True)]:
            bufs[0].copy_(x0)
            chain(pdl)()                                                  # compile + warm
            torch.cuda.synchronize()
            bufs[0].copy_(x0)
            g = capture(chain(pdl), keep=edges)
            if edges:
                res[name + "_edges"] = make_programmatic(g.raw_cuda_graph(), None)
                g.instantiate()
            bufs[0].copy_(x0)
            g.replay()
            torch.cuda.synchronize()
            outs[name] = bufs[K % 2].clone()
            res[name + "_us_per_kernel"] = round(replay_us(g, 3, 30) / K, 3)
        res["outputs_equal"] = all(torch.equal(outs["plain"], o) for o in outs.values())
        print(json.dumps(res))
        rows.append(res)
    json.dump({"command": "python -m onegraph.tools.bench_pdl --out " + out, "gpu": torch.cuda.get_device_name(),
               "kernels_per_graph": K, "rows": rows}, open(out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
