"""Programmatic dependent launch (PDL) inside a captured CUDA graph, on a toy: what a replay boundary costs
with and without it (Hopper and later; H200: benchmarks/h200_pdl_toy.json).

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
primary block has started). µs per kernel per replay, and the outputs of all four must be equal."""
import argparse
import ctypes
import json

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

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


def cudart():
    for line in open("/proc/self/maps"):
        p = line.split()[-1]
        if "libcudart.so" in p:
            return ctypes.CDLL(p)
    raise RuntimeError("libcudart not loaded")


class EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


def make_programmatic(rt, graph: int, port: int) -> dict:
    """Every kernel->kernel edge of the graph becomes a programmatic edge; -> counts."""
    ver = ctypes.c_int()
    rt.cudaRuntimeGetVersion(ctypes.byref(ver))
    v2 = hasattr(rt, "cudaGraphGetEdges_v2") and ver.value < 13000
    get = rt.cudaGraphGetEdges_v2 if v2 else rt.cudaGraphGetEdges
    add = rt.cudaGraphAddDependencies_v2 if v2 else rt.cudaGraphAddDependencies
    rem = rt.cudaGraphRemoveDependencies_v2 if v2 else rt.cudaGraphRemoveDependencies
    g = ctypes.c_void_p(graph)
    n = ctypes.c_size_t(0)
    assert get(g, None, None, None, ctypes.byref(n)) == 0
    fr, to = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)()
    ed = (EdgeData * n.value)()
    assert get(g, fr, to, ed, ctypes.byref(n)) == 0, "cudaGraphGetEdges"
    def ntype(node):
        t = ctypes.c_int()
        assert rt.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)) == 0
        return t.value
    changed = 0
    for i in range(n.value):
        if ntype(fr[i]) == 0 and ntype(to[i]) == 0 and ed[i].type == 0:
            a, b = (ctypes.c_void_p * 1)(fr[i]), (ctypes.c_void_p * 1)(to[i])
            old = (EdgeData * 1)(ed[i])
            r = rem(g, a, b, old, ctypes.c_size_t(1))
            assert r == 0, f"cudaGraphRemoveDependencies: {r}"
            new = (EdgeData * 1)()
            new[0].from_port, new[0].type = port, 1          # the primary's programmatic port, type programmatic
            r = add(g, a, b, new, ctypes.c_size_t(1))
            assert r == 0, f"cudaGraphAddDependencies: {r}"
            changed += 1
    return {"edges": n.value, "programmatic": changed, "runtime": ver.value, "v2_api": v2}


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    out = ap.parse_args(argv).out
    rt = cudart()
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
        for name, pdl, edges, port in [("plain", 0, False, 0), ("plain_gdc_kernels", 2, False, 0),
                                       ("pdl_wait_only", 1, True, 1), ("pdl_early_trigger", 2, True, 1)]:
            bufs[0].copy_(x0)
            chain(pdl)()                                                  # compile + warm
            torch.cuda.synchronize()
            bufs[0].copy_(x0)
            g = capture(chain(pdl), keep=edges)
            if edges:
                res[name + "_edges"] = make_programmatic(rt, g.raw_cuda_graph(), port)
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
