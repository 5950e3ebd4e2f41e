"""Programmatic dependent launch (PDL) in a captured CUDA graph: each kernel whose kernel waits for its
predecessor itself (griddepcontrol.wait as its first statement) is launched while that predecessor drains.

AOTInductor launches every kernel with cuLaunchKernel and no launch attributes, so PDL is added after
capture, before instantiation: `torch.cuda.CUDAGraph(keep_graph=True)` keeps the cudaGraph_t, and each
kernel -> kernel edge whose *destination* is one of the named waiting kernels becomes a programmatic edge
(cudaGraphEdgeData: type programmatic, from the source's programmatic port). The destination may then be
launched and scheduled as soon as every block of the source has exited (no kernel here triggers early), and
its gdc_wait holds it until the source has completed and its writes are visible, so the order of every
memory access is the one of the plain graph: the replay's results are bit-identical (tests check it).
Edges into any other node (Inductor's or ATen's kernels, copies, events) stay full dependencies.

Which kernels wait is a fact of how the artifact's graphs were compiled: custom_ops/triton/_common.py
launches every Triton kernel with PDL=True on a device that has griddepcontrol, and export records the
names per graph in the manifest ("pdl_waits"); an artifact without that record gets no programmatic edge.
Measured (H200, toy chain of 400 kernels): a kernel boundary costs 0.90 / 2.20 / 15.80 µs plain and
0.67 / 1.80 / 15.54 µs with programmatic edges at 32 KB / 8 MB / 64 MB per kernel
(benchmarks/h200_pdl_toy.json, `python -m onegraph.tools.bench_pdl`).
"""
from __future__ import annotations

import ctypes

KERNEL_NODE = 0                     # cudaGraphNodeTypeKernel == CU_GRAPH_NODE_TYPE_KERNEL
PROGRAMMATIC = 1                    # cudaGraphDependencyTypeProgrammatic
PORT_PROGRAMMATIC = 1               # cudaGraphKernelNodePortProgrammatic


class EdgeData(ctypes.Structure):
    """cudaGraphEdgeData (8 bytes)."""
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


def _loaded(name: str) -> ctypes.CDLL:
    """The copy of a CUDA library this process (torch) already loaded: the same runtime its graphs use."""
    for line in open("/proc/self/maps"):
        p = line.split()[-1]
        if name in p.rsplit("/", 1)[-1]:
            return ctypes.CDLL(p)
    raise RuntimeError(f"PDL: {name} is not loaded in this process (no CUDA context yet?)")


def _check(r: int, what: str) -> None:
    if r != 0:
        raise RuntimeError(f"PDL: {what} failed with CUDA error {r}")


def kernel_name(cu, node: int) -> str | None:
    """The function name of a kernel node (driver: cuGraphKernelNodeGetParams -> CUfunction ->
    cuFuncGetName), or None where the driver cannot name it (then its edges are left alone)."""
    get = getattr(cu, "cuGraphKernelNodeGetParams_v2", None) or cu.cuGraphKernelNodeGetParams
    params = (ctypes.c_void_p * 16)()          # CUDA_KERNEL_NODE_PARAMS(_v2): the CUfunction is its first field
    if get(ctypes.c_void_p(node), params) != 0 or not params[0]:
        return None
    name = ctypes.c_char_p()
    if cu.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params[0])) != 0 or not name.value:
        return None
    return name.value.decode()


def make_programmatic(graph: int, waits: set[str] | None) -> dict:
    """Rewrite the edges of an uninstantiated cudaGraph_t: kernel -> kernel edges whose destination's name is
    in `waits` (None: every kernel, only for kernels known to wait, e.g. bench_pdl's toy) become programmatic.
    -> counts (edges, programmatic, the names rewritten and the runtime version)."""
    rt, cu = _loaded("libcudart.so"), _loaded("libcuda.so")
    ver = ctypes.c_int()
    _check(rt.cudaRuntimeGetVersion(ctypes.byref(ver)), "cudaRuntimeGetVersion")
    v2 = ver.value < 13000                     # CUDA 12.3..12.x: the edge-data calls carry a _v2 suffix
    get = rt.cudaGraphGetEdges_v2 if v2 else rt.cudaGraphGetEdges
    add = rt.cudaGraphAddDependencies_v2 if v2 else rt.cudaGraphAddDependencies
    rem = rt.cudaGraphRemoveDependencies_v2 if v2 else rt.cudaGraphRemoveDependencies
    g = ctypes.c_void_p(graph)
    n = ctypes.c_size_t(0)
    _check(get(g, None, None, None, ctypes.byref(n)), "cudaGraphGetEdges")
    fr, to, ed = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)(), (EdgeData * n.value)()
    _check(get(g, fr, to, ed, ctypes.byref(n)), "cudaGraphGetEdges")

    types: dict[int, int] = {}
    names: dict[int, str | None] = {}

    def is_kernel(node: int) -> bool:
        if node not in types:
            t = ctypes.c_int()
            _check(rt.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)), "cudaGraphNodeGetType")
            types[node] = t.value
        return types[node] == KERNEL_NODE

    def waits_itself(node: int) -> bool:
        if waits is None:
            return True
        if node not in names:
            names[node] = kernel_name(cu, node)
        return names[node] in waits

    rewritten: dict[str, int] = {}
    for i in range(n.value):
        if ed[i].type != 0 or not (is_kernel(fr[i]) and is_kernel(to[i]) and waits_itself(to[i])):
            continue
        a, b = (ctypes.c_void_p * 1)(fr[i]), (ctypes.c_void_p * 1)(to[i])
        _check(rem(g, a, b, (EdgeData * 1)(ed[i]), ctypes.c_size_t(1)), "cudaGraphRemoveDependencies")
        new = (EdgeData * 1)()
        new[0].from_port, new[0].type = PORT_PROGRAMMATIC, PROGRAMMATIC
        _check(add(g, a, b, new, ctypes.c_size_t(1)), "cudaGraphAddDependencies")
        key = names.get(to[i]) or "?"
        rewritten[key] = rewritten.get(key, 0) + 1
    return {"edges": n.value, "programmatic": sum(rewritten.values()), "into": rewritten, "runtime": ver.value}
