"""fused_moe_fp8 (custom_ops/fused_moe_fp8.py) and its Triton lowering (custom_ops/triton/fused_moe_fp8.py, the
decode kernels; fused_moe_fp8_prefill.py, T*k > E): block-FP8 experts read as e4m3 with in-kernel scales.

Where the kernels run: as in test_triton_ops.py (Triton's CPU interpreter without CUDA; compiled with CUDA,
plus the `cuda`-marked test at the 35B-A3B shape).
Shapes have several 128-blocks along H and I, partial edge blocks, and I not a multiple of 128 (so gate_up's
scale table is the gate rows' block rows then the up rows', not the grid of [2I, H]).
Two scale patterns:
- powers of two, different in every block (2^-9 .. 2^0): every dequantized weight fp32(q) * s is then a bf16
  value, and (x * s) . q == x . (q * s) exactly, so the kernels must equal fused_moe's bf16 kernels run on the
  dequantized weights (independent code, same tiles) — bit for bit on the interpreter. A scale read from the
  wrong block (row or column, gate or up, routed or shared) scales the weights by another power of two.
- amax / 448 per block, as a checkpoint stores (arbitrary fp32): against the op's reference.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from onegraph.custom_ops import PYTHON_CALLS, decompositions
from onegraph.custom_ops.fused_moe import reference_fused_moe
from onegraph.custom_ops.fused_moe_fp8 import dequantize_gate_up, reference_fused_moe_fp8
from onegraph.custom_ops.linear_fp8 import dequantize_blocks

from triton_env import CUDA, DEVICE, HAVE_TRITON, INTERPRETED, TTIR_WRITES, compare, cuda_us, kernels, needs_triton  # noqa: F401

ops = torch.ops.onegraph
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def cuda_test(fn):
    fn = pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="needs a CUDA device and triton")(fn)
    return pytest.mark.cuda(fn)


def nb(n):
    return math.ceil(n / 128)


def quantize(w):
    """w [..., N, K] fp32 -> (q e4m3, scale [..., ceil(N/128), ceil(K/128)] fp32): amax / 448 per block, the rule
    of checkpoint/quant.py `quantize` (and of transformers' quantizer up to the reciprocal)."""
    *lead, n, k = w.shape
    pad = torch.zeros(*lead, nb(n) * 128, nb(k) * 128, device=w.device)
    pad[..., :n, :k] = w
    amax = pad.view(*lead, nb(n), 128, nb(k), 128).abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    full = scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :n, :k]
    return (w / full).clamp(-448, 448).to(FP8), scale


def weight(shape, pow2, g):
    """An FP8 weight [..., N, K] whose dequantized values are O(1 / sqrt(K)) -> (q, scale). pow2: e4m3 values
    ~ N(0, 8^2) and a power-of-two scale per block, 2^-c .. 2^-(c+4) (c: the magnitude), so a block's weights
    differ from its neighbours' by up to 16x; else checkpoint-like amax / 448 scales."""
    *lead, n, k = shape
    if not pow2:
        return quantize(torch.randn(*shape, generator=g, device=g.device) * k ** -0.5)
    q = (torch.randn(*shape, generator=g, device=g.device) * 8).clamp(-448, 448).to(FP8)
    c = round(math.log2(8 * math.sqrt(k)))
    return q, torch.exp2(-(c + torch.randint(0, 5, (*lead, nb(n), nb(k)), generator=g, device=g.device)).float())


def fp8_args(T, H, E, I, Is, top_k, dtype, seed, pow2):
    """-> (fused_moe_fp8 args, fused_moe args with the dequantized weights rounded to dtype: exact for pow2),
    made on DEVICE (the 35B shape's 1.6 GB of weights are drawn on the GPU)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(T, H, generator=g, device=DEVICE).to(dtype)
    logits = torch.randn(T, E + 1, generator=g, device=DEVICE).to(dtype)
    (gq, gs), (uq, us) = weight((E, I, H), pow2, g), weight((E, I, H), pow2, g)
    gate_up, gate_up_scale = torch.cat([gq, uq], 1), torch.cat([gs, us], 1)    # [E, 2I, H], [E, 2*nb(I), nb(H)]
    down, down_scale = weight((E, H, I), pow2, g)
    sg, sg_s = weight((Is, H), pow2, g)
    su, su_s = weight((Is, H), pow2, g)
    sd, sd_s = weight((H, Is), pow2, g)
    args = [x, logits, gate_up, gate_up_scale, down, down_scale, sg, sg_s, su, su_s, sd, sd_s, top_k]
    deq = [dequantize_gate_up(gate_up, gate_up_scale), dequantize_blocks(down, down_scale),
           dequantize_blocks(sg, sg_s), dequantize_blocks(su, su_s), dequantize_blocks(sd, sd_s)]
    float_args = [x, logits, *(w.to(dtype) for w in deq), top_k]
    return args, float_args


# (T, H, E, I, Is, top_k): B = 1 and a B > 1 decode batch (T*k <= E: the decode kernels), and T*k > E (the grouped
# GEMMs). H = 192: 2 column blocks, the second partial; I = 136: gate and up 2 block rows each, the second
# partial; Is = 136 likewise (shared gate / up; the shared down's column blocks).
SHAPES = [(1, 192, 8, 136, 136, 2), (2, 192, 8, 136, 136, 2), (6, 192, 8, 136, 136, 2)]


def test_reference_is_fused_moe_on_the_dequantized_weights():
    """Pure torch: with power-of-two block scales the FP8 reference (fp32 weights, products rounded to bf16)
    equals fused_moe's bf16 reference on the dequantized weights up to summation order, in both branches."""
    for T, H, E, I, Is, k in SHAPES[::2]:
        args, float_args = fp8_args(T, H, E, I, Is, k, BF16, seed=T, pow2=True)
        args, float_args = [a.cpu() if torch.is_tensor(a) else a for a in args], \
                           [a.cpu() if torch.is_tensor(a) else a for a in float_args]
        compare(reference_fused_moe_fp8(*args), reference_fused_moe(*float_args), 4e-2, 0.05, f"T={T}")


@needs_triton
@pytest.mark.parametrize("T,H,E,I,Is,top_k,fp32_out", [(*SHAPES[0], False), (*SHAPES[0], True), (*SHAPES[1], False),
                                                       (*SHAPES[2], False), (*SHAPES[2], True)])
def test_kernels_equal_the_bf16_kernels_on_dequantized_weights(T, H, E, I, Is, top_k, fp32_out, monkeypatch):
    """Power-of-two block scales: the FP8 kernels compute exactly what fused_moe's bf16 kernels compute on the
    dequantized weights (decode: same tiles, the SwiGLU's scales applied to 128-column block sums, exact for a power
    of two; prefill: the per-K-tile scale is exact), so
    a scale from a wrong block shows as a large difference. Interpreter: bit for bit; GPU: tensor-core
    accumulation order may flip a rounding. At one token the FP8 kernels have tiles of their own: the bf16
    kernels run with those here, and with the FP8 grouped kernels' tile table (a swapped tile sums in another order)."""
    from onegraph.custom_ops.triton import fused_moe, fused_moe_fp8, fused_moe_fp8_prefill, fused_moe_prefill
    monkeypatch.setattr(fused_moe, "SWIGLU_ONE", fused_moe_fp8.ONE[0])
    monkeypatch.setattr(fused_moe, "DOWN_ONE", fused_moe_fp8.ONE[1])
    monkeypatch.setattr(fused_moe_prefill, "TILES", dict(fused_moe_fp8_prefill.TILES))
    args, float_args = fp8_args(T, H, E, I, Is, top_k, BF16, seed=10 + T, pow2=True)
    got = ops.fused_moe_fp8_triton(*args, fp32_out)
    want = ops.fused_moe_triton(*float_args, fp32_out)
    assert got.dtype == want.dtype == (torch.float32 if fp32_out else BF16)
    if INTERPRETED:
        assert torch.equal(got, want), f"T={T}: max diff {(got.float() - want.float()).abs().max().item():.3g}"
    elif fp32_out:   # fp32 outputs: the tensor cores' order moves the last bits of most elements (58 % at T = 6)
        compare(got, want, 3e-2, 1.0, f"T={T}")
    else:
        compare(got, want, 3e-2, 0.05, f"T={T}")
    # and the reference agrees (up to fp32 summation order before each bf16 rounding)
    ref = reference_fused_moe_fp8(*args, fp32_out)
    if fp32_out:     # activations rounded to bf16 as there, the rest fp32 in another summation order
        compare(got, ref, 1e-4, 1.0, f"T={T} fp32_out vs reference")
    else:
        compare(got, ref, 4e-2, 0.05, f"T={T} vs reference")


@needs_triton
@pytest.mark.parametrize("T", [1, 3])
def test_route_first_is_bit_identical(T, monkeypatch):
    """In-kernel routing (below fused_moe.ROUTE_FIRST_FROM tokens) and _route_kernel first (from it on) give the
    FP8 kernels the same output bit for bit, at every T."""
    from triton_env import routed_both_ways
    args, _ = fp8_args(T, 136, 8, 128, 128, 2, BF16, seed=30 + T, pow2=False)      # H = 136: 2 column blocks
    in_kernel, first = routed_both_ways(ops.fused_moe_fp8_triton, args, monkeypatch)
    assert torch.equal(in_kernel, first)


@needs_triton
@pytest.mark.parametrize("T,H,E,I,Is,top_k", SHAPES[::2])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_kernels_match_reference_with_checkpoint_scales(T, H, E, I, Is, top_k, dtype):
    """amax / 448 block scales (arbitrary fp32, as checkpoints store them): the kernels against the op's
    reference. bf16: a rounding may flip where the fp32 sums differ in the last bits; fp32: 1e-4."""
    args, _ = fp8_args(T, H, E, I, Is, top_k, dtype, seed=20 + T, pow2=False)
    got, ref = ops.fused_moe_fp8_triton(*args), reference_fused_moe_fp8(*args)
    assert got.dtype == dtype
    if dtype == BF16:
        compare(got, ref, 3e-2, 0.05, f"T={T}")
    else:
        compare(got, ref, 1e-4, 1.0, f"T={T}")


@needs_triton
@pytest.mark.parametrize("T,H,E,I,Is,top_k,dtype,pow2,swiglu,down,bm_min", [
    # partial edge blocks (H 192, I 136); power-of-two scales: bit for bit the bf16 kernels' swap form
    (6, 192, 8, 136, 136, 2, BF16, True, (64, 128, 4, 3, True), (32, 64, 4, 3, True), {}),
    # whole blocks (H 256, I 128), checkpoint scales, tiles of one whole 128x128 block, 8-row blocks
    (8, 256, 8, 128, 128, 2, BF16, False, (128, 128, 8, 3, True), (128, 128, 8, 3, True), {"few": 8}),
    (8, 256, 8, 128, 128, 2, torch.float32, False, (128, 128, 8, 3, True), (128, 64, 4, 3, True), {"few": 8}),
])
def test_grouped_swap_tiles(T, H, E, I, Is, top_k, dtype, pow2, swiglu, down, bm_min, monkeypatch):
    """The grouped kernels' swap form (the upcast e4m3 tile [BN, BK] @ x^T [BK, BM], scaled per tile): against the
    op's reference (test_kernels_match_reference_with_checkpoint_scales' tolerances) and the plain tiles' output
    (the same products in another fp32 order: close). Power-of-two scales: against fused_moe's bf16 kernels, run
    swapped on the same tiles over the dequantized weights: bit for bit on the interpreter."""
    from onegraph.custom_ops.triton import fused_moe_fp8_prefill as pf, fused_moe_prefill as pm
    args, float_args = fp8_args(T, H, E, I, Is, top_k, dtype, seed=40 + T, pow2=pow2)
    assert T * top_k > E and pm.row_class(T * top_k, E) == "few"
    plain = ops.fused_moe_fp8_triton(*args)
    for mod in (pf, pm):
        monkeypatch.setattr(mod, "TILES", {**mod.TILES, ("swiglu", "few"): swiglu, ("down", "few"): down})
        monkeypatch.setattr(mod, "BM_MIN", bm_min)
    got, ref = ops.fused_moe_fp8_triton(*args), reference_fused_moe_fp8(*args)
    assert got.dtype == dtype
    tol = (3e-2, 0.05) if dtype == BF16 else (1e-4, 1.0)
    compare(got, ref, *tol, f"swap T={T} vs reference")
    compare(got, plain, *tol, f"swap T={T} vs plain tiles")
    if pow2:
        want = ops.fused_moe_triton(*float_args)
        if INTERPRETED:
            assert torch.equal(got, want), f"T={T}: max diff {(got.float() - want.float()).abs().max().item():.3g}"
        else:
            compare(got, want, 3e-2, 0.05, f"swap T={T} vs bf16 kernels")


@needs_triton
def test_grouped_sweep_on_the_fp8_tables(monkeypatch):
    """bench_moe_fp8's grouped sweep (scripts/tune_moe.py grouped_sweep) drives fused_moe_fp8_prefill's TILES and
    BM_MIN: one swap candidate, a stand-in timer; the combined rows (both kernels swapped, BM 16 and 8) run the op
    and stay close to the current tiles' output; the tables are restored."""
    from onegraph.custom_ops.triton import fused_moe_fp8_prefill as pf
    from onegraph.scripts import tune_moe
    args, _ = fp8_args(8, 256, 8, 128, 128, 2, BF16, seed=48, pow2=False)
    swap = (128, 128, 8, 3, True)
    monkeypatch.setattr(tune_moe, "grouped_tiles", lambda form: [swap])
    tiles0 = dict(pf.TILES)
    rows = tune_moe.grouped_sweep(pf, ops.fused_moe_fp8_triton, [tuple(args)], 16, 8, 1e6, "swap",
                                  lambda fn, cases: 5.0)
    assert pf.TILES == tiles0 and pf.BM_MIN == {}
    both = {"swiglu": list(swap), "down": list(swap)}
    assert [(r["grouped"], r.get("bm_min")) for r in rows[-2:]] == [(both, None), (both, 8)]
    assert all(r["class"] == "few" and r["us"] == 5.0 for r in rows) and len(rows) == 6
    assert all(r["max_abs_vs_current"] < 3e-2 for r in rows[-2:])


def test_validation_names_the_bad_scale():
    args, _ = fp8_args(1, 192, 8, 136, 136, 2, BF16, seed=0, pow2=True)
    bad = list(args)
    bad[3] = args[3][:, :2]                               # gate_up_scale with the up rows' block rows missing
    with pytest.raises(ValueError, match="gate_up_scale"):
        torch.ops.onegraph.fused_moe_fp8(*bad)
    bad = list(args)
    bad[4] = args[4].to(BF16)                             # down not e4m3
    with pytest.raises(ValueError, match="fused_moe_fp8 down"):
        torch.ops.onegraph.fused_moe_fp8(*bad)


def test_cpu_lowering_is_the_reference():
    """CPU export decomposes the op into its reference (dequantize + fused_moe's roundings): CI runs the path."""
    table = decompositions("cpu")
    assert table[torch.ops.onegraph.fused_moe_fp8.default] is reference_fused_moe_fp8


@needs_triton
def test_export_swaps_in_the_triton_op():
    """The CUDA table maps the op to its triton_op; traced graphs keep it (no Python reference left)."""
    table = decompositions("cuda")
    assert table[torch.ops.onegraph.fused_moe_fp8.default] is torch.ops.onegraph.fused_moe_fp8_triton.default
    args, _ = fp8_args(1, 192, 8, 136, 136, 2, BF16, seed=1, pow2=True)

    class M(torch.nn.Module):
        def forward(self, *a):
            return torch.ops.onegraph.fused_moe_fp8(*a, 2)

    before = PYTHON_CALLS["fused_moe_fp8"]
    ep = torch.export.export(M(), tuple(args[:-1])).run_decompositions(table)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "onegraph.fused_moe_fp8_triton.default" in targets, targets
    assert PYTHON_CALLS["fused_moe_fp8"] == before


_MUTATION_SCRIPT = """
from onegraph.custom_ops.triton import fused_moe as bf16_mod, fused_moe_fp8 as m, fused_moe_fp8_prefill as pf
launches = []
m.launch = bf16_mod.launch = pf.launch = lambda kernel, grid, *a, **meta: launches.append((kernel, a, meta))
e4, f32, bf = torch.float8_e4m3fn, torch.float32, torch.bfloat16
t = lambda dt, *s: torch.empty(*s, dtype=dt, device="meta")        # recorded launches: never run
for T, swap in ((1, False), (6, False), (6, True)):  # the decode kernels, the grouped GEMMs (T*k > E), swapped
    pf.TILES = {name: (*tile[:4], swap) for name, tile in pf.TILES.items()}
    m.fused_moe_fp8_triton(t(bf, T, 192), t(bf, T, 9), t(e4, 8, 272, 192), t(f32, 8, 4, 2), t(e4, 8, 192, 136),
                           t(f32, 8, 2, 2), t(e4, 136, 192), t(f32, 2, 2), t(e4, 136, 192), t(f32, 2, 2),
                           t(e4, 192, 136), t(f32, 2, 2), 2)
for kernel, a, meta in launches:
    kw = dict(zip([n for n in kernel.arg_names if n not in meta], a))
    kw.update({k: v for k, v in meta.items() if k not in ("num_warps", "num_stages")})
    print(kernel.fn.__name__, sorted(writes(kernel, kw)))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_inductor_sees_only_output_and_workspace_writes():
    """Inductor's TTIR mutation analysis understands every kernel (the grouped ones in both forms, plain and swap)
    and finds no write to an input (x, logits, the e4m3 weights, their scales): AOTInductor then neither clones
    the expert weights nor assumes them mutated.
    A plain subprocess (compiled kernels, no GPU)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = TTIR_WRITES + _MUTATION_SCRIPT
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = {}
    for line in res.stdout.strip().splitlines():
        name, w = line.split(" ", 1)
        lines.setdefault(name, set()).add(w)
    assert lines == {"_moe_fp8_swiglu_kernel": {"['act', 'act_sh', 'route_i', 'route_w']"},
                     "_moe_fp8_down_kernel": {"['y']"}, "_route_kernel": {"['idx', 'w']"},
                     "_grouped_swiglu_fp8_kernel": {"['act']"}, "_grouped_down_fp8_kernel": {"['out']"},
                     "_combine_kernel": {"['out']"}}, lines


_SWAP_SM90_SCRIPT = """
import re, torch
from onegraph.custom_ops.triton import fused_moe_fp8_prefill as pf, fused_moe_prefill as pm
from onegraph.scripts import compile_check as cc
launches = []
pf.TILES = {**pf.TILES, ("swiglu", "few"): (64, 128, 4, 3, True), ("down", "few"): (64, 128, 4, 3, True)}
pm.TILES = {**pm.TILES, ("swiglu", "few"): (64, 64, 4, 3, True), ("down", "few"): (64, 64, 4, 3, True)}
for name, args in cc.cases(64):                    # the 35B shape, a 64-token decode batch: the "few" rows class
    if name in ("fused_moe", "fused_moe_fp8"):
        launches += cc.record_launches(name, args)                  # recorded, not run (meta tensors)
for kernel, grid, a, meta in launches:
    if meta.get("SWAP"):
        c = cc.compile_launch(kernel, a, meta, 90)
        u = cc.ptxas_usage(c.asm["ptx"], 90)
        mma = sorted(set(re.findall(r"wgmma[.]mma_async[.]sync[.]aligned[.](m[0-9]+n[0-9]+k[0-9]+)", c.asm["ptx"])))
        print(kernel.fn.__name__, meta["BM"], meta["BN"], mma, u, "smem", c.metadata.shared)
        assert u["spill_stores"] == 0 and c.metadata.shared <= cc.SMEM_LIMIT, (kernel.fn.__name__, u)
        assert mma == ["m64n16k16"], (kernel.fn.__name__, mma)        # weight rows on wgmma's M, 16 rows its N
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_swap_tiles_compile_to_wgmma_for_sm90():
    """The point of the swap form, checked without a GPU: at a 64-token decode batch (BM = 16) the swapped grouped
    kernels (bf16 and FP8) compile for sm_90 to wgmma m64n16k16 (the plain form at BM = 16 is mma.sync m16n8k16),
    without spills, within shared memory. A plain subprocess (compiled kernels, Triton's bundled ptxas)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _SWAP_SM90_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert len(res.stdout.strip().splitlines()) == 4, res.stdout


# ---------------------------------------------------------------- CUDA: the 35B-A3B shape

@cuda_test
@pytest.mark.parametrize("T", [1, 8, 64])
def test_fused_moe_fp8_35b(T):
    """H = 2048, I = Is = 512, E = 256, top-8: T = 1, 8 run the decode kernels, T = 64 (T*k > E) the grouped
    GEMMs. Power-of-two scales: against the bf16 kernels on the dequantized weights; checkpoint scales:
    against the reference. Prints the µs of both ops (orientation; scripts/bench_moe_fp8.py measures)."""
    args, float_args = fp8_args(T, 2048, 256, 512, 512, 8, BF16, seed=T, pow2=True)
    got = ops.fused_moe_fp8_triton(*args)
    compare(got, ops.fused_moe_triton(*float_args), 3e-2, 0.05, f"35B T={T} vs bf16 kernels")
    compare(got, reference_fused_moe_fp8(*args), 3e-2, 0.05, f"35B T={T} vs reference")
    compare(ops.fused_moe_fp8_triton(*args, True), reference_fused_moe_fp8(*args, True), 3e-3, 1.0,
            f"35B T={T} fp32_out")
    args, _ = fp8_args(T, 2048, 256, 512, 512, 8, BF16, seed=100 + T, pow2=False)
    compare(ops.fused_moe_fp8_triton(*args), reference_fused_moe_fp8(*args), 3e-2, 0.05, f"35B T={T} checkpoint scales")
    print(f"35B T={T}: fused_moe_fp8 {cuda_us(lambda: ops.fused_moe_fp8_triton(*args)):.1f} us, "
          f"fused_moe bf16 {cuda_us(lambda: ops.fused_moe_triton(*float_args)):.1f} us")
