"""Batch-1 GEMVs whose weights stream through a TMA ring in shared memory (Gluon), launched and persistent,
against today's launched register-tile GEMV (H200: benchmarks/h200_gluon_chain.json).

    python -m onegraph.tools.bench_gluon_chain OUT.json

P = 12 dependent GEMVs (alternating [4096 x 2048] and [2048 x 4096] bf16, 16.8 MB each, the 35B out_proj's size),
as in the earlier persistent-chain measurement. G = 128 programs (one per SM at most); each owns 32 rows of a
[4096 x 2048] phase or 16 rows of a [2048 x 4096] one, i.e. 16 boxes of [16 x 256] bf16 (8 KB) a phase. A program
keeps S boxes in flight: box t + S - 1 is issued (TMA, async proxy) before box t is consumed, so in the persistent
form the next phase's weights stream while the program waits at the grid barrier for the previous phase's
outputs (the activations are the only thing a phase waits for). The launched form is the same loop, one phase
per launch."""
import json, sys, time
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, fence_async_shared

RB, BK, BOXES = 16, 256, 16          # box [RB, BK] bf16 = 8 KB; boxes per program per phase


@gluon.jit
def _issue(t, t0, desc_a, desc_b, ring, bars, pid, A: gl.constexpr, B: gl.constexpr, S: gl.constexpr,
           RB: gl.constexpr, BK: gl.constexpr, BOXES: gl.constexpr, CONTIG: gl.constexpr = False):
    """issue the TMA load of this program's box t (phase t // BOXES) into ring slot (t - t0) % S (t0: the launch's
    first box, whose slot is 0)."""
    p = t // BOXES
    j = t % BOXES
    q = p // 2
    bar = bars.index((t - t0) % S)
    mbarrier.expect(bar, RB * BK * 2)
    if CONTIG:           # descriptors over the weights viewed [-1, BK]: box j = the program's j-th contiguous 8 KB
        if p % 2 == 0:
            tma.async_copy_global_to_shared(desc_a, [(q * A + pid * (2 * RB)) * (B // BK) + j * RB, 0], bar,
                                            ring.index((t - t0) % S))
        else:
            tma.async_copy_global_to_shared(desc_b, [(q * B + pid * RB) * (A // BK) + j * RB, 0], bar,
                                            ring.index((t - t0) % S))
    elif p % 2 == 0:     # [A x B] phase: 2 row groups x 8 column boxes
        tma.async_copy_global_to_shared(desc_a, [q * A + pid * (2 * RB) + (j // 8) * RB, (j % 8) * BK], bar,
                                        ring.index((t - t0) % S))
    else:                # [B x A] phase: 1 row group x 16 column boxes
        tma.async_copy_global_to_shared(desc_b, [q * B + pid * RB, j * BK], bar, ring.index((t - t0) % S))


@gluon.jit
def _phase(IS_A: gl.constexpr, t, t0, t1, q, P0, desc_a, desc_b, ring, bars, xs, x, ya, yb, counter, pid,
           A: gl.constexpr, B: gl.constexpr, G: gl.constexpr, S: gl.constexpr, RB: gl.constexpr, BK: gl.constexpr,
           BOXES: gl.constexpr, BARRIER: gl.constexpr, L: gl.constexpr, XL: gl.constexpr, STEP: gl.constexpr, MODE: gl.constexpr):
    """one phase p = 2q (IS_A: ya[q] = wa[q] @ (x or yb[q - 1])) or 2q + 1 (yb[q] = wb[q] @ ya[q]): this program's
    16 boxes t .. t + 15 of the flat box sequence t0 .. t1 that this launch streams. Returns t + 16."""
    p = 2 * q + (0 if IS_A else 1)
    K: gl.constexpr = B if IS_A else A
    acc = gl.zeros([RB, BK], gl.float32, L)
    for j in gl.static_range(BOXES):
        if j % STEP == 0:
            # the slots boxes t + S - STEP .. t + S - 1 go into were read at steps t - STEP .. t - 1: every warp
            # done with them, then the async proxy
            gl.thread_barrier()
            fence_async_shared()
            for k in gl.static_range(STEP):
                if t + S - STEP + k < t1:
                    _issue(t + S - STEP + k, t0, desc_a, desc_b, ring, bars, pid, A, B, S, RB, BK, BOXES, MODE == 3)
        if j == 0:       # phase start: wait for the previous phase's outputs, stage x in shared memory (fp32)
            if BARRIER and MODE == 0:
                if p > P0:
                    c = gl.atomic_add(counter + p - 1, 0, sem="acquire")
                    while c < G:
                        c = gl.atomic_add(counter + p - 1, 0, sem="acquire")
            offs = gl.arange(0, K, layout=XL)
            if MODE >= 2:
                offs = offs * 0
            if IS_A:
                if q == 0:
                    xv = gl.load(x + offs)
                else:
                    xv = gl.load(yb + (q - 1) * B + offs, cache_modifier=".cg")
            else:
                xv = gl.load(ya + q * A + offs, cache_modifier=".cg")
            xs.slice(0, K).store(xv.to(gl.float32))
            gl.thread_barrier()
        u = t - t0
        mbarrier.wait(bars.index(u % S), (u // S) & 1)
        if MODE >= 2:       # stream only: the box is waited for, not read
            w = gl.zeros([RB, BK], gl.float32, L)
        else:
            w = ring.index(u % S).load(L).to(gl.float32)
        if IS_A:
            xk = xs.slice((j % 8) * BK, BK).load(gl.SliceLayout(0, L))
        else:
            xk = xs.slice(j * BK, BK).load(gl.SliceLayout(0, L))
        acc += w * xk[None, :]
        rows = gl.arange(0, RB, layout=gl.SliceLayout(1, L))
        if IS_A:
            if j % 8 == 7:
                gl.store(ya + q * A + pid * (2 * RB) + (j // 8) * RB + rows, gl.sum(acc, axis=1).to(gl.bfloat16))
                acc = gl.zeros([RB, BK], gl.float32, L)
        else:
            if j == BOXES - 1:
                gl.store(yb + q * B + pid * RB + rows, gl.sum(acc, axis=1).to(gl.bfloat16))
        t += 1
    if BARRIER:
        gl.thread_barrier()
        gl.atomic_add(counter + p, 1, sem="release")
    return t


@gluon.jit
def _ring_gemv(desc_a, desc_b, x, ya, yb, counter, P0, P1, A: gl.constexpr, B: gl.constexpr, G: gl.constexpr,
               S: gl.constexpr, RB: gl.constexpr, BK: gl.constexpr, BOXES: gl.constexpr, BARRIER: gl.constexpr,
               WARPS: gl.constexpr, STEP: gl.constexpr, MODE: gl.constexpr = 0):
    """phases P0 <= p < P1: even p = 2q: ya[q] = wa[q] @ (x if q == 0 else yb[q - 1]); odd p = 2q + 1:
    yb[q] = wb[q] @ ya[q]. BARRIER: wait for every program's arrival on counter[p - 1] before phase p
    (persistent form); without it each launch runs one phase. STEP: boxes refilled per block barrier. MODE (timing
    only, wrong outputs): 1 no grid-barrier wait, 2 also boxes not read (the TMA stream and the ring's waits), 3 as
    2 with each box 8 KB of contiguous weight rows."""
    pid = gl.program_id(0)
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])       # [WARPS, 256] per pass
    XL: gl.constexpr = gl.BlockedLayout([4], [32], [WARPS], [0])
    ring = gl.allocate_shared_memory(gl.bfloat16, [S, RB, BK], desc_a.layout)
    bars = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    xs = gl.allocate_shared_memory(gl.float32, [A], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for i in gl.static_range(S):
        mbarrier.init(bars.index(i), count=1)
    t0 = P0 * BOXES
    t1 = P1 * BOXES
    for i in gl.static_range(S - STEP):
        if t0 + i < t1:
            _issue(t0 + i, t0, desc_a, desc_b, ring, bars, pid, A, B, S, RB, BK, BOXES, MODE == 3)
    t = t0
    for q in range(P0 // 2, (P1 + 1) // 2):
        if 2 * q >= P0:
            t = _phase(True, t, t0, t1, q, P0, desc_a, desc_b, ring, bars, xs, x, ya, yb, counter, pid, A, B, G, S,
                       RB, BK, BOXES, BARRIER, L, XL, STEP, MODE)
        if 2 * q + 1 < P1:
            t = _phase(False, t, t0, t1, q, P0, desc_a, desc_b, ring, bars, xs, x, ya, yb, counter, pid, A, B, G,
                       S, RB, BK, BOXES, BARRIER, L, XL, STEP, MODE)
    for i in gl.static_range(S):
        mbarrier.invalidate(bars.index(i))


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
    from onegraph.custom_ops.triton.linear import gemv
    from onegraph.tools.bench_common import replay_us
    P, A, B, G = 12, 4096, 2048, 128
    assert A == G * 2 * RB and B == G * RB and B == 8 * BK and A == BOXES * BK
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
    gr, ref = capture(launches)
    res["register_gemv_launches_us_per_phase"] = round(replay_us(gr, 5, 50) / P, 2)
    print(json.dumps(res), flush=True)
    lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    da = TensorDescriptor(wa.view(-1, B), [P // 2 * A, B], [B, 1], [RB, BK], lay)
    db = TensorDescriptor(wb.view(-1, A), [P // 2 * B, A], [A, 1], [RB, BK], lay)
    variants = [(S, 4, STEP, True, mode) for mode in (2, 3) for S in (8, 16) for STEP in (1, 4)]
    t_start = time.time()
    dfa = TensorDescriptor(wa.view(-1, BK), [P // 2 * A * B // BK, BK], [BK, 1], [RB, BK], lay)
    dfb = TensorDescriptor(wb.view(-1, BK), [P // 2 * B * A // BK, BK], [BK, 1], [RB, BK], lay)
    for S, warps, STEP, persistent, mode in variants:
        d1, d2 = (dfa, dfb) if mode == 3 else (da, db)
        key = f"{'persistent' if persistent else 'launched'}_S{S}_w{warps}_step{STEP}_mode{mode}"
        ya = torch.empty(P // 2, A, device="cuda", dtype=torch.bfloat16)
        yb = torch.empty(P // 2, B, device="cuda", dtype=torch.bfloat16)
        counter = torch.zeros(P, device="cuda", dtype=torch.int32)
        meta = dict(A=A, B=B, G=G, S=S, RB=RB, BK=BK, BOXES=BOXES, WARPS=warps, STEP=STEP, MODE=mode, num_warps=warps)

        def run():
            if persistent:
                counter.zero_()
                _ring_gemv[(G,)](d1, d2, x, ya, yb, counter, 0, P, BARRIER=True, **meta)
            else:
                for p in range(P):
                    _ring_gemv[(G,)](d1, d2, x, ya, yb, counter, p, p + 1, BARRIER=False, **meta)
            return yb[-1:]
        try:
            gp, out = capture(run)
            us = replay_us(gp, 5, 50) / P
            gp.replay()
            torch.cuda.synchronize()
            res[key] = {"us_per_phase": round(us, 2),  # mode 3 reads the flat views' boxes (descriptors below)
                        "max_diff_vs_register_gemv": float((out.float() - ref.float()).abs().max())}
            if persistent:
                res[key]["counters_reached"] = counter.tolist() == [G] * P
        except Exception as e:          # a variant that does not compile or fit is recorded, not hidden
            res[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(key, json.dumps(res[key]), f"t={time.time() - t_start:.0f}s", flush=True)
        json.dump(res, open(sys.argv[1], "w"), indent=1)
    res["ref_absmax"] = float(ref.float().abs().max())
    json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
