"""Parity rung 1 for the Triton lowering of gdn_prefill (custom_ops/triton/gdn_prefill.py):
`onegraph::gdn_prefill_triton` against `reference_gdn_prefill`.

Where the kernels run (as in tests/test_triton_ops.py):
- no CUDA device: in Triton's CPU interpreter (TRITON_INTERPRET=1 is set for THIS test process,
  before the kernels are defined), on small shapes (HK <= 2, HV <= 4, K, V <= 80), fp32 and bf16;
- a CUDA device: compiled, on the same shapes, plus the `cuda`-marked tests at Qwen3.5-35B-A3B
  shapes (HK = 16, HV = 32, K = V = 128, bf16, T = 64 and 512) and an AOTInductor package.
Two checks need no GPU but a real (non-interpreted) triton, so they run in a subprocess: the kernels
compile for sm_90 without register spills, and Inductor's mutation analysis sees them write only
their outputs and workspaces.

Tolerances (max abs error; outputs are O(0.1..1), the state O(1)):
- fp32: output and state 1e-4 (fp32 math in another order; measured ~5e-7 on the interpreter);
- bf16 x: the math is the same fp32 (the reference upcasts x), so the state keeps 1e-4; the output
  is rounded once to bf16 where the reference rounds, so it may differ by 1 bf16 ulp: 4e-3 (|out| < 1 here);
- 35B shapes on the GPU (K = 128 sums, T = 512): output 2e-2, state 1e-3.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from onegraph.custom_ops import PYTHON_CALLS, _registry
from onegraph.custom_ops.gdn_decode_step import gdn_gates
from onegraph.custom_ops.gdn_prefill import reference_gdn_prefill

from triton_env import CUDA, DEVICE, INTERPRETED, TTIR_WRITES, run_package_script  # noqa: E402, F401

pytest.importorskip("triton", reason="the Triton lowering needs triton (the `test` / `cuda` extra)")
from onegraph.custom_ops.triton import gdn_prefill as prefill_mod  # noqa: E402

runs_kernels = pytest.mark.skipif(not CUDA and not INTERPRETED,
                                  reason="kernels were defined without TRITON_INTERPRET and there is no GPU")
ops = torch.ops.onegraph


def close(got, ref, atol, what):
    got, ref = got.float().cpu(), ref.float().cpu()
    assert got.shape == ref.shape, f"{what}: shape {list(got.shape)} != {list(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = (got - ref).abs().max().item() if got.numel() else 0.0
    assert err <= atol, f"{what}: max abs error {err:.3g} > {atol:.3g}"


def prefill_args(T, S, HK, HV, K, V, dtype, seed, slot=None):
    """x [T, C] (post-conv q ‖ k ‖ v), gates from random a, b as the model computes them, a nonzero
    fp32 state [S, HV, K, V], slot [1]."""
    gen = torch.Generator().manual_seed(seed)
    C = 2 * HK * K + HV * V
    x = torch.randn(T, C, generator=gen)
    # per-head decay rates from fast (exp(A_log) ~ 1.6) to slow (~0.007): slow heads keep the initial
    # state alive through the whole prompt, so it is tested too
    A_log = torch.linspace(-5.0, 0.5, HV) + 0.1 * torch.randn(HV, generator=gen)
    g, beta = gdn_gates(torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen), A_log,
                        torch.randn(HV, generator=gen))
    rec = torch.randn(S, HV, K, V, generator=gen) * 0.5
    slot = S - 1 if slot is None else slot
    return [x.to(dtype).to(DEVICE), g.to(DEVICE), beta.to(DEVICE), rec.to(DEVICE),
            torch.tensor([slot], dtype=torch.int64, device=DEVICE), HK, 64]


def check(args, what, out_tol, state_tol=1e-4):
    out, state = ops.gdn_prefill_triton(*args)
    ref_out, ref_state = reference_gdn_prefill(*args)
    assert out.dtype == args[0].dtype and state.dtype == torch.float32
    close(out, ref_out, out_tol, f"{what} out")
    close(state, ref_state, state_tol, f"{what} state")
    return out, state


OUT_TOL = {torch.float32: 1e-4, torch.bfloat16: 4e-3}       # bf16: 1 ulp at |out| < 1


@runs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,S,HK,HV,K,V", [
    (1, 2, 2, 4, 16, 16),          # one token: a chunk of 63 padding rows
    (35, 3, 2, 4, 16, 32),         # less than a chunk
    (130, 2, 1, 2, 32, 24),        # three chunks, ragged tail, V not a power of 2
])
def test_matches_reference(T, S, HK, HV, K, V, dtype):
    check(prefill_args(T, S, HK, HV, K, V, dtype, seed=T), f"T={T}", OUT_TOL[dtype])


@runs_kernels
def test_key_dim_over_64():
    """K = 80: the state kernel's second 64-row half of S (partly masked), two chunks."""
    check(prefill_args(70, 2, 1, 2, 80, 16, torch.float32, seed=3), "K=80", 1e-4)


@runs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_bucket_leaves_the_same_state(dtype):
    """A bucket of T = 96 whose tokens >= n_valid = 70 have g = beta = 0 (how the model pads; their x
    stays random) leaves the state of the exact 70-token prefill, and the same first 70 outputs."""
    args = prefill_args(96, 2, 2, 4, 16, 16, dtype, seed=5)
    n_valid = 70
    args[1][n_valid:] = 0.0
    args[2][n_valid:] = 0.0
    exact = [args[0][:n_valid], args[1][:n_valid], args[2][:n_valid]] + args[3:]
    out_pad, state_pad = ops.gdn_prefill_triton(*args)
    out_exact, state_exact = check(exact, "exact", OUT_TOL[dtype])
    close(state_pad, state_exact, 1e-5, "padded-bucket state")
    close(out_pad[:n_valid], out_exact, 1e-5 if dtype == torch.float32 else 4e-3, "padded-bucket out")


@runs_kernels
@pytest.mark.parametrize("slot", [0, 2])
def test_reads_only_its_slot(slot):
    """The kernel starts from rec_state[slot] and reads no other slot (the others are NaN here)."""
    args = prefill_args(40, 4, 2, 4, 16, 16, torch.float32, seed=9, slot=slot)
    rec = args[3]
    poisoned = torch.full_like(rec, float("nan"))
    poisoned[slot] = rec[slot]
    out, state = ops.gdn_prefill_triton(*(args[:3] + [poisoned] + args[4:]))
    ref_out, ref_state = reference_gdn_prefill(*args)
    close(out, ref_out, 1e-4, f"slot {slot} out")
    close(state, ref_state, 1e-4, f"slot {slot} state")
    other = reference_gdn_prefill(*(args[:4] + [torch.tensor([(slot + 1) % 4], device=DEVICE)] + args[5:]))[1]
    assert (other - ref_state).abs().max() > 1e-2, "the test's slots do not differ"


@runs_kernels
@pytest.mark.parametrize("chunk_size", [16, 128])
def test_chunk_size_does_not_change_the_result(chunk_size):
    """The kernels use 64-token chunks whatever chunk_size says; the result is the recurrence's."""
    args = prefill_args(100, 2, 2, 4, 16, 16, torch.float32, seed=4)
    args[-1] = chunk_size
    check(args, f"chunk_size={chunk_size}", 1e-4)


def test_registered_as_the_triton_lowering():
    assert _registry.LOWERINGS[("gdn_prefill", "triton")] is ops.gdn_prefill_triton.default
    with pytest.raises(ValueError, match="key head dim"):
        ops.gdn_prefill_triton(*prefill_args(4, 1, 1, 2, 256, 16, torch.float32, seed=0))


class _Prefill(torch.nn.Module):
    """gdn_prefill as the model calls it: the new row written back at `slot` in place."""

    def forward(self, x, g, beta, rec, slot):
        out, new_rec = ops.gdn_prefill(x, g, beta, rec, slot, 2, 64)
        rec.index_copy_(0, slot, new_rec)
        return out


def _export_prefill(inputs):
    ep = torch.export.export(_Prefill(), tuple(t.clone() for t in inputs), strict=False)
    return ep.run_decompositions({_registry.REGISTRY["gdn_prefill"].overload: ops.gdn_prefill_triton.default})


@runs_kernels
def test_export_swaps_in_the_triton_op():
    """torch.export + run_decompositions puts gdn_prefill_triton in the graph (static T, traced with
    fake tensors), and the program computes what eager does without running the Python reference."""
    inputs = prefill_args(70, 3, 2, 4, 16, 16, torch.float32, seed=8)[:5]
    ep = _export_prefill(inputs)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "onegraph.gdn_prefill_triton.default" in targets and "onegraph.gdn_prefill.default" not in targets
    eager_in, lowered_in = [t.clone() for t in inputs], [t.clone() for t in inputs]
    ref = _Prefill()(*eager_in)
    before = dict(PYTHON_CALLS)
    got = ep.module()(*lowered_in)
    assert dict(PYTHON_CALLS) == before, "a Python reference ran inside the lowered program"
    close(got, ref, 1e-4, "exported out")
    close(lowered_in[3], eager_in[3], 1e-4, "state written in place")


# ------------------------------------------------- no GPU, real triton (subprocess, no interpreter)

_SM90_SCRIPT = """
import torch
from onegraph.custom_ops.triton import gdn_prefill as m
from onegraph.scripts import compile_check as cc
launches = []
m.launch = lambda kernel, grid, *a, **meta: launches.append((kernel, a, meta))   # record, don't run
bf = dict(dtype=torch.bfloat16, device="meta")
for T in (64, 2048):                                   # 35B-A3B: HK 16, HV 32, K = V = 128
    m.gdn_prefill_triton(torch.empty(T, 8192, **bf), torch.empty(T, 32, device="meta"),
                         torch.empty(T, 32, device="meta"), torch.empty(9, 32, 128, 128, device="meta"),
                         torch.empty(1, dtype=torch.int64, device="meta"), 16, 64)
seen = set()
for kernel, a, meta in launches:
    key = (kernel.fn.__name__, tuple(sorted(meta.items())))
    if key in seen:
        continue
    seen.add(key)
    c = cc.compile_launch(kernel, a, meta, 90)
    u = cc.ptxas_usage(c.asm["ptx"], 90)
    print(kernel.fn.__name__, meta.get("NT"), u, "smem", c.metadata.shared)
    assert u["spill_stores"] == 0 and c.metadata.shared <= cc.SMEM_LIMIT, (kernel.fn.__name__, u, c.metadata.shared)
print("SM90 OK", len(seen))
"""


def test_kernels_compile_for_sm90_without_spills():
    """Each kernel at the 35B-A3B launch configuration (T = 64 and 2048) compiles for sm_90 with
    Triton's compiler and bundled ptxas, without register spills and within shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "SM90 OK 4" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


_MUTATION_SCRIPT = TTIR_WRITES + """
from onegraph.custom_ops.triton import gdn_prefill as m
launches = []
m.launch = lambda kernel, grid, *a, **meta: launches.append((kernel, a, meta))
m.gdn_prefill_triton(torch.randn(130, 256), torch.randn(130, 4), torch.rand(130, 4), torch.randn(3, 4, 32, 32),
                     torch.tensor([1]), 2, 64)
for kernel, a, meta in launches:
    kw = dict(zip([n for n in kernel.arg_names if n not in meta], a))
    kw.update({k: v for k, v in meta.items() if k not in ("num_warps", "num_stages")})
    print(kernel.fn.__name__, sorted(writes(kernel, kw)))
"""


def test_inductor_sees_only_output_and_workspace_writes():
    """Inductor's TTIR mutation analysis understands every kernel and finds no write to an input
    (x, g, beta, rec_state, slot): AOTInductor then neither clones the state nor assumes every input
    mutated."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _MUTATION_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in res.stdout.strip().splitlines())
    assert lines == {"_wy_kernel": "['Ai', 'Att', 'G', 'u', 'w']", "_state_kernel": "['h', 'new_rec', 'u']",
                     "_out_kernel": "['out']"}, lines


# ---------------------------------------------------------------- CUDA only: 35B-A3B shapes, AOTInductor

@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("T", [64, 512])
def test_35b_shapes(T):
    check(prefill_args(T, 3, 16, 32, 128, 128, torch.bfloat16, seed=T, slot=1), f"35B T={T}", 2e-2, 1e-3)


_AOTI_SCRIPT = """
import sys, tempfile, torch
sys.path.insert(0, {tests!r})
import test_triton_gdn_prefill as t
from onegraph.custom_ops import PYTHON_CALLS
inputs = t.prefill_args(200, 3, 2, 4, 32, 32, torch.bfloat16, seed=1)[:5]
ep = t._export_prefill(inputs)
path = torch._inductor.aoti_compile_and_package(ep, package_path=tempfile.mkdtemp() + "/prefill.pt2")
pkg = torch._inductor.aoti_load_package(path)
eager_in, aoti_in = [x.clone() for x in inputs], [x.clone() for x in inputs]
ref = t._Prefill()(*eager_in)
before = dict(PYTHON_CALLS)
got = pkg(*aoti_in)
torch.cuda.synchronize()
assert dict(PYTHON_CALLS) == before, "Python reference called from the package"
t.close(got, ref, 1e-2, "aoti out")
t.close(aoti_in[3], eager_in[3], 1e-4, "aoti state")
print("AOTI OK")
"""


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_aoti_package(tmp_path):
    """The lowering compiled into an AOTInductor package (T static) runs, matches eager and writes the
    state in place without calling Python. A subprocess: on the H200 image loading a package segfaults
    unless LD_PRELOAD names the system libstdc++ (docs/design.md)."""
    run_package_script(tmp_path / "aoti.py", _AOTI_SCRIPT, "AOTI OK")
