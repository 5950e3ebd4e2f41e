"""Compile every Triton kernel for a GPU target WITHOUT a GPU and report what the interpreter cannot
show: that it compiles at all, registers per thread, spills and shared memory, at the launch
configurations the lowerings pick for Qwen3.5-35B-A3B shapes.

    python -m onegraph.scripts.compile_check [--arch 90] [--json]

How: each lowering runs on meta tensors with its module's `launch` replaced by one recording (kernel, grid, args, meta)
instead of launching; each recorded launch is compiled with Triton's own compiler for
GPUTarget("cuda", arch, 32) (the wheel bundles ptxas) with the specialisations the runtime would
apply (16-aligned pointers, ints divisible by 16, ints equal to 1 folded). Registers and spills come
from `ptxas -v` on the generated PTX. Must run without TRITON_INTERPRET (a plain process).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.runtime.jit import JITFunction
from triton.backends.compiler import GPUTarget

from onegraph.custom_ops import _registry
from onegraph.custom_ops.triton import (attention_decode, attention_prefill, causal_conv, fused_moe, fused_moe_fp8,
                                        fused_moe_fp8_prefill, fused_moe_prefill, gdn_decode_step, gdn_decode_steps,
                                        gdn_prefill, linear, linear_fp8, linear_w8a8, norms, qk_norm_rope, rope,
                                        sample)

# every module that launches kernels: each one's `launch` global is replaced while a lowering runs
# (gdn_decode_step_norm launches through causal_conv, gdn_decode_step and norms)
MODULES = (attention_decode, attention_prefill, causal_conv, fused_moe, fused_moe_fp8, fused_moe_fp8_prefill,
           fused_moe_prefill, gdn_decode_step, gdn_decode_steps, gdn_prefill, linear, linear_fp8, linear_w8a8, norms,
           qk_norm_rope, rope, sample)
SMEM_LIMIT = 232448            # bytes per block on sm_90 (227 KiB opt-in)
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
          torch.int32: "i32", torch.float8_e4m3fn: "fp8e4nv", torch.int8: "i8"}


def cases(B: int):
    """(op name, args on the meta device) at 35B-A3B shapes for decode batch B."""
    m = dict(device="meta")
    bf = dict(dtype=torch.bfloat16, **m)
    S = B + 1
    yield "gdn_decode_step", (torch.empty(B, 8192, **bf), torch.empty(B, 32, **bf), torch.empty(B, 32, **bf),
                              torch.empty(S, 8192, 3, **bf), torch.empty(S, 32, 128, 128, dtype=torch.float32, **m),
                              torch.empty(B, dtype=torch.int64, **m), torch.empty(8192, 4, **bf),
                              torch.empty(32, **bf), torch.empty(32, **bf), 16)
    yield "gdn_decode_steps", (torch.empty(B, 4, 12352, **bf)[..., :8192], torch.empty(B, 4, 12352, **bf)[..., 8224:8256],
                               torch.empty(B, 4, 12352, **bf)[..., 8192:8224], torch.empty(S, 8192, 3, **bf),
                               torch.empty(S, 32, 128, 128, dtype=torch.float32, **m),
                               torch.empty(B, dtype=torch.int64, **m), torch.empty(8192, 4, **bf),
                               torch.empty(32, **bf), torch.empty(32, **bf), 16)     # a K = 3 verify's GDN layer
    gdn = (torch.empty(B, 12352, **bf)[:, :8192], torch.empty(B, 32, **bf), torch.empty(B, 32, **bf),
           torch.empty(B, 4096, **bf), torch.empty(S, 8192, 3, **bf),
           torch.empty(S, 32, 128, 128, dtype=torch.float32, **m),
           torch.empty(B, dtype=torch.int64, **m), torch.empty(8192, 4, **bf), torch.empty(32, **bf),
           torch.empty(32, **bf), torch.empty(128, **bf), 16, 1e-6)
    yield "gdn_decode_step_norm", gdn
    yield "gdn_decode_step_norm_inplace_triton", gdn          # its in-place twin (export/inplace.py)
    yield "fused_moe", (torch.empty(B, 2048, **bf), torch.empty(B, 257, **bf), torch.empty(256, 1024, 2048, **bf),
                        torch.empty(256, 2048, 512, **bf), torch.empty(512, 2048, **bf), torch.empty(512, 2048, **bf),
                        torch.empty(2048, 512, **bf), 8)
    f32, e4 = dict(dtype=torch.float32, **m), dict(dtype=torch.float8_e4m3fn, **m)   # FP8 experts: 128x128 block scales
    yield "fused_moe_fp8", (torch.empty(B, 2048, **bf), torch.empty(B, 257, **bf), torch.empty(256, 1024, 2048, **e4),
                            torch.empty(256, 8, 16, **f32), torch.empty(256, 2048, 512, **e4),
                            torch.empty(256, 16, 4, **f32), torch.empty(512, 2048, **e4), torch.empty(4, 16, **f32),
                            torch.empty(512, 2048, **e4), torch.empty(4, 16, **f32), torch.empty(2048, 512, **e4),
                            torch.empty(16, 4, **f32), 8)
    yield "add_rms_norm_linear", (torch.empty(B, 2048, **bf), torch.empty(B, 2048, **bf), torch.empty(2048, **bf), 1e-6,
                                  torch.empty(257, 2048, **bf))
    yield "add_rms_norm_linear", (torch.empty(B, 2048, **bf), torch.empty(B, 2048, **bf), torch.empty(2048, **bf), 1e-6,
                                  torch.empty(12352, 2048, **bf))   # the layer-input norm in the GDN in_proj
    yield "attention_decode", (torch.empty(B, 16, 256, **bf), torch.empty(S, 2, 4096, 256, **bf),
                               torch.empty(S, 2, 4096, 256, **bf), torch.empty(B, dtype=torch.int64, **m),
                               torch.empty(B, dtype=torch.int64, **m), 256 ** -0.5,
                               torch.empty(B, 16, 512, **bf)[..., 256:])       # gate: q_proj's strided half
    yield "linear", (torch.empty(B, 2048, **bf), torch.empty(12352, 2048, **bf))
    yield "linear", (torch.empty(B, 4096, **bf), torch.empty(2048, 4096, **bf))
    f8 = dict(dtype=torch.float8_e4m3fn, **m)
    yield "linear_fp8", (torch.empty(B, 2048, **bf), torch.empty(12352, 2048, **f8),
                         torch.empty(97, 16, dtype=torch.float32, **m))
    yield "linear_fp8", (torch.empty(B, 4096, **bf), torch.empty(2048, 4096, **f8),
                         torch.empty(16, 32, dtype=torch.float32, **m))
    yield "add_rms_norm_linear_fp8", (torch.empty(B, 2048, **bf), torch.empty(B, 2048, **bf), torch.empty(2048, **bf),
                                      1e-6, torch.empty(12288, 2048, **f8), torch.empty(96, 16, dtype=torch.float32, **m))
    # an FP8 checkpoint's GDN in_proj (models/qwen3_5/fuse.py): the e4m3 [qkv; z] with the bf16 [b; a] as its tail
    tail = torch.empty(64, 2048, **bf)
    yield "linear_fp8", (torch.empty(B, 2048, **bf), torch.empty(12288, 2048, **f8),
                         torch.empty(96, 16, dtype=torch.float32, **m), tail)
    yield "add_rms_norm_linear_fp8", (torch.empty(B, 2048, **bf), torch.empty(B, 2048, **bf), torch.empty(2048, **bf),
                                      1e-6, torch.empty(12288, 2048, **f8), torch.empty(96, 16, dtype=torch.float32, **m),
                                      tail)
    for w8 in (dict(dtype=torch.int8, **m), f8):                   # W8A8: per-channel scales, decode and prefill rows
        op = "linear_w8a8_int8" if w8["dtype"] == torch.int8 else "linear_w8a8_fp8"
        for rows, n, k in ((B, 12352, 2048), (B, 2048, 4096), (2048, 12352, 2048)):
            yield op, (torch.empty(rows, k, **bf), torch.empty(n, k, **w8), torch.empty(n, 1, dtype=torch.float32, **m))
    yield "rms_norm", (torch.empty(B, 2048, **bf), torch.empty(2048, **bf), 1e-6)
    yield "add_rms_norm", (torch.empty(B, 2048, **bf), torch.empty(B, 2048, **bf), torch.empty(2048, **bf), 1e-6)
    yield "gated_rms_norm", (torch.empty(B * 32, 128, **bf), torch.empty(B * 32, 128, **bf), torch.empty(128, **bf), 1e-6)
    yield "rope", (torch.empty(B, 16, 256, **bf), torch.empty(B, dtype=torch.int64, **m),
                   torch.empty(32, dtype=torch.float32, **m))
    qkv = torch.empty(B, 9216, **bf)                                          # q ‖ gate, k, v of the fused projection
    yield "qk_norm_rope", (qkv[:, :8192].view(B, 16, 512)[..., :256], qkv[:, 8192:8704].view(B, 2, 256),
                           torch.empty(256, **bf), torch.empty(256, **bf), torch.empty(B, dtype=torch.int64, **m),
                           torch.empty(32, dtype=torch.float32, **m), 1e-6)
    yield "causal_conv_update", (torch.empty(B, 8192, **bf), torch.empty(S, 8192, 3, **bf),
                                 torch.empty(B, dtype=torch.int64, **m), torch.empty(8192, 4, **bf))
    yield "sample", (torch.empty(B, 248320, dtype=torch.float32, **m), torch.empty(B, dtype=torch.float32, **m),
                     torch.empty(B, dtype=torch.int64, **m), torch.empty(B, dtype=torch.float32, **m),
                     torch.empty(B, dtype=torch.int64, **m), torch.empty(B, dtype=torch.int64, **m))
    # prefill ops at the largest chunk (2048 tokens), independent of B
    yield "attention_prefill", (torch.empty(2048, 16, 256, **bf), torch.empty(S, 2, 4096, 256, **bf),
                                torch.empty(S, 2, 4096, 256, **bf), torch.empty(1, dtype=torch.int64, **m),
                                torch.empty(1, dtype=torch.int64, **m), 256 ** -0.5)
    yield "gdn_prefill", (torch.empty(2048, 8192, **bf), torch.empty(2048, 32, dtype=torch.float32, **m),
                          torch.empty(2048, 32, dtype=torch.float32, **m),
                          torch.empty(S, 32, 128, 128, dtype=torch.float32, **m), torch.empty(1, dtype=torch.int64, **m),
                          16, 64)
    yield "causal_conv_prefill", (torch.empty(2048, 8192, **bf), torch.empty(S, 8192, 3, **bf),
                                  torch.empty(1, dtype=torch.int64, **m), torch.empty(1, dtype=torch.int64, **m),
                                  torch.empty(8192, 4, **bf))


def record_launches(name, args):
    launches = []

    def rec(kernel, grid, *a, **meta):
        launches.append((kernel, grid, a, meta))

    saved = [m.launch for m in MODULES]
    try:
        for m in MODULES:
            m.launch = rec
        # an op's registered Triton lowering, or a Triton op by its own name (an in-place twin export puts in)
        impl = _registry.LOWERINGS.get((name, "triton")) or getattr(torch.ops.onegraph, name).default
        impl(*args)
    finally:
        for m, s in zip(MODULES, saved):
            m.launch = s
    return launches


def compile_launch(kernel, args, meta, arch: int):
    meta = dict(meta)
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages") if k in meta}
    names = kernel.arg_names
    positional = [n for n in names if n not in meta]
    if len(positional) != len(args):
        raise TypeError(f"{kernel.fn.__name__}: {len(args)} positional args for {positional}")
    signature, constexprs, attrs = {}, {}, {}
    for i, n in enumerate(names):
        if n in meta:
            signature[n], constexprs[n] = "constexpr", meta[n]
            continue
        v = args[positional.index(n)]
        if isinstance(v, torch.Tensor):
            signature[n] = "*" + _TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            signature[n] = "i1"
        elif isinstance(v, int):
            if v == 1:
                signature[n], constexprs[n] = "constexpr", 1
                continue
            signature[n] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[n] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}.{n}: unsupported argument {v!r}")
    src = triton.compiler.ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def ptxas_usage(ptx: str, arch: int) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        out = subprocess.run([ptxas, "-v", f"--gpu-name={sm}", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    if out.returncode:
        raise RuntimeError(f"ptxas failed:\n{text}")
    grab = lambda pat: int(m.group(1)) if (m := re.search(pat, text)) else 0
    return {"registers": grab(r"Used (\d+) registers"), "spill_stores": grab(r"(\d+) bytes spill stores"),
            "spill_loads": grab(r"(\d+) bytes spill loads")}


def check(batches=(1, 8, 64), arch: int = 90) -> list[dict]:
    rows, seen = [], set()
    for B in batches:
        for name, args in cases(B):
            for kernel, grid, a, meta in record_launches(name, args):
                key = (kernel.fn.__name__, tuple(sorted(meta.items())),
                       tuple(type(x).__name__ if isinstance(x, torch.Tensor) else x for x in a))
                if key in seen:
                    continue
                seen.add(key)
                row = {"op": name, "B": B, "kernel": kernel.fn.__name__, "grid": list(grid),
                       "meta": {k: v for k, v in meta.items()}}
                try:
                    compiled = compile_launch(kernel, a, meta, arch)
                    row["shared_bytes"] = compiled.metadata.shared
                    row.update(ptxas_usage(compiled.asm["ptx"], arch))
                except Exception as e:            # noqa: BLE001  (reported per kernel; the exit status says)
                    row["error"] = f"{type(e).__name__}: {e}"
                rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="compile the Triton kernels for a GPU target, no GPU needed")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (H200: 90)")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    a = p.parse_args(argv)
    if not isinstance(norms._rms_norm_kernel, JITFunction):   # triton's interpreter mode replaced them
        raise SystemExit("compile_check: the kernels are interpreted, not JIT functions: run it in a process "
                         "without Triton's interpreter mode")
    rows = check(tuple(int(b) for b in a.batches.split(",")), a.arch)
    bad = [r for r in rows if "error" in r or r["spill_stores"] or r["shared_bytes"] > SMEM_LIMIT]
    if a.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['op']:>17} B={r['B']:<3} {r['kernel']:<24} grid={r['grid']!s:<16} "
                  + (r["error"][:300] if "error" in r else
                     f"regs={r['registers']:<4} spills={r['spill_stores']}/{r['spill_loads']} smem={r['shared_bytes']}"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
