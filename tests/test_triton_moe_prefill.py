"""Parity rung 1 for the prefill path of the Triton fused_moe lowering (custom_ops/triton/fused_moe_prefill.py,
taken when T*top_k > E) against `reference_fused_moe`, whose prefill branch loops over every expert.

Where the kernels run: as in test_triton_ops.py — without CUDA in Triton's CPU interpreter
(TRITON_INTERPRET=1 set for THIS test process before the kernels are defined) on small awkward shapes;
with CUDA compiled, plus the `cuda`-marked test at Qwen3.5-35B-A3B shapes (T = 512).

Tolerances (max abs error, |reference| is O(1)): fp32 1e-4 (fp32 accumulation in another order);
bf16: the kernels reproduce every rounding of the reference's prefill branch, so on the interpreter
they are bit-exact (asserted: at most 0.1% of elements differ, by at most 2e-2 = a few bf16 ulps);
on the GPU, cuBLAS (the eager reference) and the kernels sum the dot products in different orders, so
a rounding flips now and then: 3e-2 and 2% of elements there.
"""
from __future__ import annotations


import pytest
import torch

from onegraph.custom_ops import PYTHON_CALLS, decompositions
from onegraph.custom_ops.fused_moe import reference_fused_moe, route

from triton_env import CUDA, DEVICE, HAVE_TRITON, INTERPRETED, compare, kernels, needs_triton  # noqa: F401

if kernels.AVAILABLE:
    from onegraph.custom_ops.triton import fused_moe_prefill as prefill_mod
    from onegraph.custom_ops.triton.fused_moe import route_triton


def cuda_test(fn):
    fn = pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="needs a CUDA device and triton")(fn)
    return pytest.mark.cuda(fn)


ops = torch.ops.onegraph
BF16 = torch.bfloat16


def moe_args(T, H, E, I, Is, top_k, dtype, seed, hot=(), cold=()):
    """Random MoE inputs, router logits O(1). Skew through a feature every token carries (x[:, 0] = 4):
    experts in `hot` get +6 on their logit (picked by every token, yet the others keep weights ~1e-2,
    visible in the output), experts in `cold` get -6 (picked by none)."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale
    x, router = rn(T, H), rn(E, H, scale=H ** -0.5)
    x[:, 0] = 4.0
    router[list(hot), 0] = 1.5
    router[list(cold), 0] = -1.5
    t = lambda a: a.to(dtype).to(DEVICE)
    rest = [t(rn(E, 2 * I, H, scale=H ** -0.5)), t(rn(E, H, I, scale=I ** -0.5)), t(rn(Is, H, scale=H ** -0.5)),
            t(rn(Is, H, scale=H ** -0.5)), t(rn(H, Is, scale=Is ** -0.5))]
    logits = torch.nn.functional.linear(t(x), torch.cat([t(router), t(rn(1, H, scale=H ** -0.5))]))  # router ‖ shared gate
    return [t(x), logits, *rest, top_k]


CASES = [
    # T, H, E, I, Is, top_k, hot, cold
    (35, 48, 8, 24, 40, 3, (), (5,)),            # I != Is, neither a power of 2; one idle expert
    (65, 40, 16, 32, 16, 2, (3,), (0, 1, 2, 9)), # expert 3 hit by all 65 tokens (several M-tiles), 4 idle
    (200, 32, 16, 24, 24, 4, (7,), (0, 15)),     # BM = 64: expert 7 with 200 rows (4 tiles), others ragged
]


# every case in fp32 and bf16, except the 200-token one in bf16 on a CPU: the interpreter takes ~30 s for it and the
# bf16 roundings are the 35- and 65-token cases' (its 4-tile expert and BM = 64 are its fp32 run's); on a GPU all run
PARAMS = [pytest.param(*c, d, id=f"{c[0]}-{name}") for c in CASES for d, name in ((torch.float32, "fp32"), (BF16, "bf16"))
          if CUDA or c[0] < 200 or d == torch.float32]


@needs_triton
@pytest.mark.parametrize("T,H,E,I,Is,top_k,hot,cold,dtype", PARAMS)
def test_prefill_matches_reference(T, H, E, I, Is, top_k, hot, cold, dtype):
    args = moe_args(T, H, E, I, Is, top_k, dtype, seed=T, hot=hot, cold=cold)
    assert T * top_k > E                                          # the op takes its prefill path
    _, idx = route(args[1][:, :E], top_k)
    counts = torch.bincount(idx.flatten().cpu(), minlength=E)
    assert all(counts[e] == T for e in hot) and all(counts[e] == 0 for e in cold), counts
    got = ops.fused_moe_triton(*args)
    ref = reference_fused_moe(*args)
    if dtype == torch.float32:
        compare(got, ref, 1e-4, 1.0, f"fp32 T={T}")
    else:
        compare(got, ref, 2e-2, 1e-3, f"bf16 T={T}")
    # the op dispatched to the prefill kernels: same bits as calling them directly on the op's own router
    # output (fp32 on the H200: aten's softmax and the route kernel's can differ in the last bit)
    w, idx = route_triton(args[1][:, :E], top_k)
    assert torch.equal(got, prefill_mod.fused_moe_prefill(args[0], w, idx, *args[2:7], args[1]))
    # fp32_out: unrounded fp32 sums after the (still bf16-rounded) activations
    got32, ref32 = ops.fused_moe_triton(*args, True), reference_fused_moe(*args, True)
    assert got32.dtype == ref32.dtype == torch.float32
    compare(got32, ref32, 1e-4, 1.0, f"{dtype} fp32_out T={T}")
    assert torch.equal(got32, prefill_mod.fused_moe_prefill(args[0], w, idx, *args[2:7], args[1], torch.float32))


def aten_pair_table(idx, w, E, BM):
    """The pair table as aten ops (what fused_moe_prefill ran before its table kernel): per-token sort of the
    experts, a stable argsort of the pairs by expert, per-expert counts, cumsums and a searchsorted."""
    T, k = idx.shape
    P = T * k
    idx, perm = idx.sort(dim=1)
    w_pair = w.gather(1, perm).reshape(P)
    ids = idx.reshape(P)
    src = torch.argsort(ids, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=ids.device).scatter_add(0, ids, torch.ones_like(ids))
    seg_end = counts.cumsum(0)
    seg_start = seg_end - counts
    tiles = (counts + BM - 1) // BM
    tile_end = tiles.cumsum(0)
    tile_start = tile_end - tiles
    b = torch.arange(-(-P // BM) + min(E, P), dtype=torch.int64, device=ids.device)
    blk_e = torch.searchsorted(tile_end, b, right=True)
    ec = blk_e.clamp(max=E - 1)
    blk_row = seg_start[ec] + (b - tile_start[ec]) * BM
    blk_end = torch.where(blk_e < E, seg_end[ec], torch.zeros_like(blk_row))
    return w_pair, (src, blk_e, blk_row, blk_end), ids


@needs_triton
@pytest.mark.parametrize("T,E,k,hot,bm_min,BM", [(20, 6, 2, 2, 16, 16), (37, 16, 4, None, 16, 16),
                                                (3, 8, 3, None, 16, 16), (130, 64, 8, 5, 16, 32),
                                                (90, 64, 4, 5, 8, 8)])
@pytest.mark.parametrize("bt", [None, 16], ids=["tile", "bt16"])
def test_pair_table_kernel_is_the_aten_table(T, E, k, hot, bm_min, BM, bt):
    """routed_table (one Triton kernel) gives exactly the aten table: weights per pair, rows sorted by expert
    then token, blocks (idle experts, an expert spanning several blocks, the unused tail). Then the table's
    own properties: each used block inside one expert's run, every row covered once, unused blocks empty.
    bm_min 8 (a rows class's BM_MIN, for the swap tiles): 8-row blocks, the hot expert's 90 rows in 12.
    bt 16: 16 tokens a step, so each program's two scans take several steps (the count carried across them)."""
    g = torch.Generator().manual_seed(T)
    logits = torch.randn(T, E, generator=g)
    if hot is not None:
        logits[:, hot] += 4.0                               # one expert in every token: several blocks
    logits[:, 1] -= 9.0                                     # an idle expert
    w, idx = route(logits.to(BF16), k)
    idx, w = idx.to(DEVICE), w.to(DEVICE)
    w_pair, (src, blk_e, blk_row, blk_end, got_bm) = prefill_mod.routed_table(idx, w, E, bm_min, bt=bt)
    assert got_bm == BM
    want_w, want, ids = aten_pair_table(idx.cpu(), w.cpu(), E, BM)
    assert torch.equal(w_pair.cpu(), want_w)
    for got, ref, name in zip((src, blk_e, blk_row, blk_end), want, ("src", "blk_e", "blk_row", "blk_end")):
        assert torch.equal(got.cpu(), ref), (name, got.tolist(), ref.tolist())
    src, blk_e, blk_row, blk_end = (t.cpu() for t in (src, blk_e, blk_row, blk_end))
    R = ids.numel()
    seen = torch.zeros(R, dtype=torch.int64)
    for e, r0, r1 in zip(blk_e.tolist(), blk_row.tolist(), blk_end.tolist()):
        if e == E:
            assert r1 <= r0
            continue
        rows = torch.arange(r0, min(r0 + BM, r1))
        assert rows.numel() > 0 and (ids[src[rows]] == e).all()
        seen[rows] += 1
    assert (seen == 1).all()


SWAP = (64, 64, 4, 3, True)       # (BN cap, BK cap, warps, stages, swap): the transposed product


@needs_triton
@pytest.mark.parametrize("T,H,E,I,Is,top_k,hot,cold,dtype,tiles,bm_min", [
    # every grouped kernel swapped; rows class "mid" (14 rows per expert), BM 16; bf16 roundings, fp32_out
    pytest.param(35, 48, 8, 24, 40, 3, (), (5,), BF16, {"swiglu": SWAP, "down": SWAP}, {}, id="35-bf16"),
    # BM_MIN 8: the hot expert's 65 rows in 9 blocks of 8, the shared expert's 65 in 2 of 64
    pytest.param(65, 40, 16, 32, 16, 2, (3,), (0, 1, 2, 9), torch.float32, {"swiglu": SWAP, "down": SWAP},
                 {"mid": 8}, id="65-fp32-bm8"),
    # rows class "few" (2 rows per expert) by its own entry: SwiGLU swapped (128-row tile, 8 warps), down plain
    pytest.param(12, 32, 16, 24, 24, 2, (), (), BF16, {("swiglu", "few"): (128, 32, 8, 4, True)}, {"few": 8},
                 id="12-bf16-few"),
])
def test_swap_tiles_match_reference_and_plain_tiles(T, H, E, I, Is, top_k, hot, cold, dtype, tiles, bm_min,
                                                    monkeypatch):
    """The swap form (weight tile [BN, BK] @ x^T [BK, BM]) against the reference at test_prefill_matches_reference's
    tolerances, and against the plain tiles' output (the same products summed in another fp32 order: close)."""
    args = moe_args(T, H, E, I, Is, top_k, dtype, seed=T, hot=hot, cold=cold)
    assert T * top_k > E
    plain = ops.fused_moe_triton(*args)
    monkeypatch.setattr(prefill_mod, "TILES", {**prefill_mod.TILES, **tiles})
    monkeypatch.setattr(prefill_mod, "BM_MIN", bm_min)
    bm, sw, dn = prefill_mod.plan(prefill_mod.TILES, prefill_mod.BM_MIN, T * top_k, E)
    assert sw[4] and dn[4] == ("down" in tiles) and bm == bm_min.get(prefill_mod.row_class(T * top_k, E), 16)
    got, ref = ops.fused_moe_triton(*args), reference_fused_moe(*args)
    tol = (1e-4, 1.0) if dtype == torch.float32 else (2e-2, 1e-3)
    compare(got, ref, *tol, f"swap T={T}")
    compare(got, plain, *tol, f"swap vs plain T={T}")
    if T == 35:
        compare(ops.fused_moe_triton(*args, True), reference_fused_moe(*args, True), 1e-4, 1.0, "swap fp32_out")


@needs_triton
def test_grouped_sweep_rows(monkeypatch):
    """scripts/tune_moe.py grouped_sweep (the GPU sweeps of tune_moe --grouped and bench_moe_fp8) on the interpreter
    with a stand-in timer and two candidates a kernel: a row per candidate, the best swap tiles again on 8-row blocks
    ("few" rows class), the best tiles of both kernels together checked against the current output, a tile that
    fails recorded as an error; the module's tables restored."""
    from onegraph.scripts import tune_moe
    T, H, E, I, Is, k = 12, 32, 16, 24, 24, 2
    args = moe_args(T, H, E, I, Is, k, BF16, seed=T)
    cands = [(64, 64, 4, 3, False), (64, 32, 4, 3, True), (48, 64, 4, 3, True)]     # the last one malformed
    monkeypatch.setattr(tune_moe, "grouped_tiles", lambda form: cands)
    speed = {(64, 64, 4, 3, False): 2.0, (64, 32, 4, 3, True): 1.0}
    seen = []

    def timer(fn, cases):                             # "µs": the candidate's speed (the combined rows run fn)
        _, sw, dn = prefill_mod.plan(prefill_mod.TILES, prefill_mod.BM_MIN, T * k, E)
        seen.append((sw, dn))
        return speed[sw] + speed.get(dn, 3.0)

    tiles0 = dict(prefill_mod.TILES)
    rows = tune_moe.grouped_sweep(prefill_mod, ops.fused_moe_triton, [tuple(args)], T * k, E, 1e6, "all", timer)
    assert prefill_mod.TILES == tiles0 and prefill_mod.BM_MIN == {}          # restored
    assert [r["grouped"] for r in rows[:6]] == [{n: list(c)} for n in ("swiglu", "down") for c in cands]
    assert all("error" in r and "ValueError" in r["error"] for r in (rows[2], rows[5]))
    assert all(r["class"] == "few" and r["GBps"] == round(1e6 / r["us"] / 1e3, 1) for r in rows if "us" in r)
    assert [(r["grouped"], r.get("bm_min")) for r in rows[6:8]] == [({"swiglu": list(cands[1])}, 8),
                                                                    ({"down": list(cands[1])}, 8)]
    both = {"swiglu": list(cands[1]), "down": list(cands[1])}
    assert [(r["grouped"], r.get("bm_min")) for r in rows[8:]] == [(both, None), (both, 8)]
    assert all(r["max_abs_vs_current"] < 2e-2 for r in rows[8:])
    assert seen[-1] == (cands[1], cands[1])


@needs_triton
def test_plan_reads_class_entries_and_fails_closed():
    """plan: a (kernel, rows class) entry overrides the kernel's; BM_MIN by class (default 16); a malformed tile
    or BM_MIN raises ValueError naming it."""
    rc, plan = prefill_mod.row_class, prefill_mod.plan
    assert (rc(512, 256), rc(1024, 256), rc(4096, 256), rc(8192, 256), rc(16384, 256)) == \
        ("few", "few", "mid", "mid", "many")                  # the 35B shape: B = 64, 128; T = 512, 1024, 2048
    plain, swap = (64, 64, 4, 3, False), (128, 64, 8, 3, True)
    tiles = {"swiglu": plain, "down": plain, ("down", "few"): swap}
    assert plan(tiles, {"few": 8}, 512, 256) == (8, plain, swap)
    assert plan(tiles, {"few": 8}, 4096, 256) == (16, plain, plain)
    for bad in ((64, 64, 4, 3), (48, 64, 4, 3, True), (64, 8, 4, 3, True), (64, 64, 3, 3, False), (64, 64, 4, 3, 1)):
        with pytest.raises(ValueError, match="down tile of rows class 'few'"):
            plan({**tiles, ("down", "few"): bad}, {}, 512, 256)
    for bad in (4, 24, 128):
        with pytest.raises(ValueError, match="BM_MIN of rows class 'mid'"):
            plan(tiles, {"mid": bad}, 4096, 256)


@needs_triton
def test_dense_table_is_one_group():
    """The shared expert's table: the aten table of T pairs of one expert."""
    for T in (1, 5, 64, 200):
        src, blk_e, blk_row, blk_end, BM = prefill_mod.dense_table(T, prefill_mod.BM_MAX, DEVICE)
        _, want, _ = aten_pair_table(torch.zeros(T, 1, dtype=torch.int64), torch.ones(T, 1), 1, BM)
        for got, ref in zip((src, blk_e, blk_row, blk_end), want):
            assert torch.equal(got.cpu(), ref), (T, got.tolist(), ref.tolist())


@needs_triton
def test_prefill_opcheck():
    """Schema and fake-tensor checks of the triton_op at a prefill shape (the fake runs the aten
    block table on fake tensors: static shapes, no data-dependent sizes)."""
    args = moe_args(20, 32, 8, 16, 24, 2, torch.float32, seed=3)
    torch.library.opcheck(ops.fused_moe_triton.default, tuple(args), test_utils=("test_schema", "test_faketensor"))


class _Moe(torch.nn.Module):
    def forward(self, x, logits, gu, down, sg, su, sd):
        return ops.fused_moe(x, logits, gu, down, sg, su, sd, 3)


@needs_triton
def test_prefill_export_swaps_in_triton_op():
    """torch.export + the CUDA decomposition table at a prefill shape: the graph holds the triton_op
    (its aten block table traced with static shapes) and computes what eager does, calling no Python
    reference."""
    args = moe_args(24, 32, 8, 16, 24, 3, torch.float32, seed=4, hot=(1,))
    ep = torch.export.export(_Moe(), tuple(args[:7]), strict=False).run_decompositions(decompositions("cuda"))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "onegraph.fused_moe_triton.default" in targets and "onegraph.fused_moe.default" not in targets, targets
    before = dict(PYTHON_CALLS)
    got = ep.module()(*args[:7])
    assert dict(PYTHON_CALLS) == before, "a Python reference ran inside the lowered program"
    compare(got, reference_fused_moe(*args), 1e-4, 1.0, "exported")


# ---------------------------------------------------------------- CUDA only: 35B-A3B shape

@cuda_test
@pytest.mark.parametrize("T,hot", [(512, ()), (512, (17,))])
def test_fused_moe_prefill_35b(T, hot):
    """hot=(17,): expert 17 takes all 512 tokens (32 M-tiles of BM = 16), the others share the rest."""
    args = moe_args(T, 2048, 256, 512, 512, 8, BF16, seed=T, hot=hot)
    compare(ops.fused_moe_triton(*args), reference_fused_moe(*args), 3e-2, 2e-2, f"35B prefill T={T} hot={hot}")
    compare(ops.fused_moe_triton(*args, True), reference_fused_moe(*args, True), 3e-3, 1.0, f"35B prefill fp32_out T={T}")  # an act 1-ulp flip: ~3e-4
