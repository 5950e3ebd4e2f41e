"""A persistent GEMV chain against one launch per GEMV, measured (H200: benchmarks/h200_persistent_chain.json; not
adopted).

    python -m onegraph.tools.bench_persistent_chain OUT.json

P = 12 dependent GEMVs at batch 1 (alternating [4096 x 2048] and [2048 x 4096] bf16, 16.8 MB each, the 35B
out_proj's size): P launches of today's GEMV in one CUDA graph, against one kernel of G programs (at most one per
SM, so all are resident) whose phases are separated by a grid barrier (a counter per phase: a release add after a
block barrier, an acquire spin; zeroed by a memset in the graph). Variants: the barrier alone, register tiles
(double-buffered [BN, K] loads) with or without bulk L2 prefetch of the next phase's rows, and dot-fed tiles whose
loads Triton pipelines through shared memory. Outputs are compared with the launched chain's."""
import json, sys
import torch
import triton
import triton.language as tl

from onegraph.custom_ops.triton.linear import gemv
from onegraph.tools.bench_common import replay_us


@triton.jit
def _pf(ptr, nbytes: tl.constexpr, NT: tl.constexpr):
    """bulk-prefetch nbytes (multiple of 16 * NT) from ptr into L2: NT threads, one contiguous slice each."""
    SUB: tl.constexpr = nbytes // NT
    off = tl.arange(0, NT).to(tl.int64) * SUB
    p = ptr.to(tl.pointer_type(tl.int8)) + off
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                              [p, tl.full([NT], SUB, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _phase(W, xin, yout, pid, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, BN: tl.constexpr):
    RP: tl.constexpr = N // G
    r0 = pid * RP
    ks = tl.arange(0, K)
    xv = tl.load(xin + ks, cache_modifier=".cg").to(tl.float32)
    rows = r0 + tl.arange(0, BN)
    w = tl.load(W + rows.to(tl.int64)[:, None] * K + ks[None, :])
    for t in range(1, RP // BN):
        rows_n = r0 + t * BN + tl.arange(0, BN)
        w_n = tl.load(W + rows_n.to(tl.int64)[:, None] * K + ks[None, :])
        tl.store(yout + rows, tl.sum(w.to(tl.float32) * xv[None, :], axis=1).to(yout.dtype.element_ty))
        w = w_n
        rows = rows_n
    tl.store(yout + rows, tl.sum(w.to(tl.float32) * xv[None, :], axis=1).to(yout.dtype.element_ty))


@triton.jit
def _wait(counter, p, G: tl.constexpr, SPIN: tl.constexpr):
    if SPIN == 0:                                     # acquire atomics
        c = tl.atomic_add(counter + p, 0, sem="acquire")
        it = 0
        while (c < G) & (it < 2000000):
            c = tl.atomic_add(counter + p, 0, sem="acquire")
            it += 1
    else:                                             # volatile loads, then one acquire
        c = tl.load(counter + p, volatile=True)
        it = 0
        while (c < G) & (it < 2000000):
            c = tl.load(counter + p, volatile=True)
            it += 1
        c = tl.atomic_add(counter + p, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _chain_kernel(x, wa, wb, ya, yb, counter, P: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
                  A: tl.constexpr, B: tl.constexpr, PREFETCH: tl.constexpr, SPIN: tl.constexpr,
                  WORK: tl.constexpr):
    """even phase q = p // 2: ya[q] = wa[q] @ (x if q == 0 else yb[q - 1]), wa [A, B] (N = A rows, K = B);
    odd phase: yb[q] = wb[q] @ ya[q], wb [B, A]."""
    pid = tl.program_id(0)
    if PREFETCH:
        _pf(wa + pid * (A // G) * B, (A // G) * B * 2, 128)
    for p in tl.static_range(P):
        q = p // 2
        if PREFETCH == 1 and p + 1 < P:
            if p % 2 == 0:      # next: odd phase q, rows of wb[q]
                _pf(wb + q * A * B + pid * (B // G) * A, (B // G) * A * 2, 128)
            else:               # next: even phase q + 1
                _pf(wa + (q + 1) * A * B + pid * (A // G) * B, (A // G) * B * 2, 128)
        if p > 0:
            _wait(counter, p - 1, G, SPIN)
        if not WORK:
            pass
        elif p % 2 == 0:
            if p == 0:
                _phase(wa, x, ya, pid, A, B, G, BN)
            else:
                _phase(wa + q * A * B, yb + (q - 1) * B, ya + q * A, pid, A, B, G, BN)
        else:
            _phase(wb + q * A * B, ya + q * A, yb + q * B, pid, B, A, G, BN)
        if PREFETCH == 2 and p + 1 < P:       # after this phase's loads: the next phase's rows stream during the wait
            if p % 2 == 0:
                _pf(wb + q * A * B + pid * (B // G) * A, (B // G) * A * 2, 128)
            else:
                _pf(wa + (q + 1) * A * B + pid * (A // G) * B, (A // G) * B * 2, 128)
        tl.debug_barrier()
        tl.atomic_add(counter + p, 1, sem="release")


@triton.jit
def _dot_phase(W, xin, yout, pid, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """yout[rows] = W[rows] @ xin, rows = this program's N // G, as tl.dot([RP, BK] weights, [BK, 16] x broadcast):
    a dot-fed loop, so Triton pipelines its loads through shared memory (num_stages)."""
    RP: tl.constexpr = N // G
    rows = pid * RP + tl.arange(0, RP)
    cols = tl.arange(0, 16)
    acc = tl.zeros([RP, 16], tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        w = tl.load(W + rows.to(tl.int64)[:, None] * K + ks[None, :])
        xv = tl.load(xin + ks[:, None] + 0 * cols[None, :], cache_modifier=".cg")
        acc = tl.dot(w, xv, acc)
    y = tl.sum(tl.where(cols[None, :] == 0, acc, 0.0), axis=1)
    tl.store(yout + rows, y.to(yout.dtype.element_ty))


@triton.jit
def _dot_chain_kernel(x, wa, wb, ya, yb, counter, P: tl.constexpr, G: tl.constexpr, A: tl.constexpr, B: tl.constexpr,
                   BK: tl.constexpr, PREFETCH: tl.constexpr):
    """_chain_kernel with dot-fed phases; PREFETCH: each program bulk-prefetches its next-phase rows into L2 after
    its phase's loop, before arriving and waiting."""
    pid = tl.program_id(0)
    for p in tl.static_range(P):
        q = p // 2
        if p > 0:
            _wait(counter, p - 1, G, 0)
        if p % 2 == 0:
            if p == 0:
                _dot_phase(wa, x, ya, pid, A, B, G, BK)
            else:
                _dot_phase(wa + q * A * B, yb + (q - 1) * B, ya + q * A, pid, A, B, G, BK)
        else:
            _dot_phase(wb + q * A * B, ya + q * A, yb + q * B, pid, B, A, G, BK)
        if PREFETCH and p + 1 < P:
            if p % 2 == 0:
                _pf(wb + q * A * B + pid * (B // G) * A, (B // G) * A * 2, 128)
            else:
                _pf(wa + (q + 1) * A * B + pid * (A // G) * B, (A // G) * B * 2, 128)
        tl.debug_barrier()
        tl.atomic_add(counter + p, 1, sem="release")


def rand(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


def capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        out = fn()
    return gr, out


def main():
    P, A, B = 12, 4096, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    x = rand(g, 1, B)
    wa = rand(g, P // 2, A, B, scale=B ** -0.5)
    wb = rand(g, P // 2, B, A, scale=A ** -0.5)
    res = {"P": P, "MB_per_phase": A * B * 2 / 1e6, "ideal_us_per_phase_at_4557GBps": round(A * B * 2 / 4557e3, 2)}

    def launches():
        h = x
        for q in range(P // 2):
            h = gemv(h, wa[q])
            h = gemv(h, wb[q])
        return h
    gl, ref = capture(launches)
    res["launches_us_per_phase"] = round(replay_us(gl, 5, 50) / P, 2)
    print(json.dumps(res), flush=True)
    # (name, kernel, grid, meta): barrier only (no GEMV work; spin by acquire atomics or volatile loads), register
    # tiles (BN rows x K, double-buffered; PREFETCH 1: the next phase's rows bulk-prefetched into L2 at a phase's
    # start, 2: after its loop), dot-fed tiles (loads pipelined through shared memory)
    reg = dict(SPIN=0, WORK=1, A=A, B=B, P=P)
    variants = [("barrier_only_atomic_spin", _chain_kernel, 128, dict(reg, BN=4, PREFETCH=0, WORK=0, num_warps=8)),
                ("barrier_only_volatile_spin", _chain_kernel, 128, dict(reg, BN=4, PREFETCH=0, WORK=0, SPIN=1, num_warps=8)),
                ("reg_G128_BN4_w8", _chain_kernel, 128, dict(reg, BN=4, PREFETCH=0, num_warps=8)),
                ("reg_G128_BN4_w8_prefetch_at_start", _chain_kernel, 128, dict(reg, BN=4, PREFETCH=1, num_warps=8)),
                ("reg_G128_BN4_w8_prefetch_after_loop", _chain_kernel, 128, dict(reg, BN=4, PREFETCH=2, num_warps=8)),
                ("reg_G256_BN4_w4", _chain_kernel, 256, dict(reg, BN=4, PREFETCH=0, num_warps=4)),
                ("dot_G128_BK256_w4_s4", _dot_chain_kernel, 128, dict(A=A, B=B, P=P, BK=256, PREFETCH=0, num_warps=4, num_stages=4)),
                ("dot_G128_BK256_w4_s4_prefetch", _dot_chain_kernel, 128, dict(A=A, B=B, P=P, BK=256, PREFETCH=1, num_warps=4,
                                                                           num_stages=4))]
    for key, kern, G, meta in variants:
        ya = torch.empty(P // 2, A, device="cuda", dtype=torch.bfloat16)
        yb = torch.empty(P // 2, B, device="cuda", dtype=torch.bfloat16)
        counter = torch.zeros(P, device="cuda", dtype=torch.int32)

        def persistent():
            counter.zero_()
            kern[(G,)](x, wa, wb, ya, yb, counter, G=G, **meta)
            return yb[-1:]
        gp, out = capture(persistent)
        us = replay_us(gp, 5, 50) / P
        gp.replay()
        torch.cuda.synchronize()
        res[key] = {"us_per_phase": round(us, 2), "counters_reached": counter.tolist() == [G] * P}
        if meta.get("WORK", 1):
            res[key]["max_diff_vs_launches"] = float((out.float() - ref.float()).abs().max())
        print(key, json.dumps(res[key]), flush=True)
    res["ref_absmax"] = float(ref.float().abs().max())
    json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
