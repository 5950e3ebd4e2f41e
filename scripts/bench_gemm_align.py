"""The prefill / large-batch projection GEMM with an unaligned output row (the MoE router's E + 1 = 257 columns),
as aten's cuBLAS call vs custom_ops/triton/linear.py `project` (the weight padded to 16-byte rows), on CUDA.

    python -m onegraph.scripts.bench_gemm_align --out benchmarks/h200_gemm_align.json

Per M: µs per call of F.linear(x [M, 2048], w [257, 2048]) (cuBLAS picks an align-1 kernel for its 257-column
rows), of `project` (pad, aligned GEMM, first 257 columns copied out) and of the aligned 256-row GEMM alone (the
floor); one CUDA graph of one call per weight copy (`--copies`, so L2 does not hold the weight), replayed
`--reps` times (scripts/bench_linear.py time_calls).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,512,2048,8192", help="comma-separated M values")
    ap.add_argument("--n", type=int, default=257)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--copies", type=int, default=40)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from onegraph.custom_ops.triton.linear import project
    from onegraph.scripts.bench_linear import time_calls
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    ws = [torch.randn(args.n, args.k, device=dev, generator=g, dtype=torch.bfloat16) * args.k ** -0.5
          for _ in range(args.copies)]
    aligned = [w[: args.n - args.n % 8].contiguous() for w in ws]
    res = {"command": "python -m onegraph.scripts.bench_gemm_align " + " ".join(argv if argv is not None else sys.argv[1:]),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "N": args.n, "K": args.k, "rows": []}
    for M in (int(v) for v in args.rows.split(",")):
        x = torch.randn(M, args.k, device=dev, generator=g, dtype=torch.bfloat16)
        y0, y1 = F.linear(x, ws[0]), project(x, ws[0])
        r = {"M": M, "aten_us": round(time_calls(F.linear, ws, x, args.reps), 2),
             "project_us": round(time_calls(project, ws, x, args.reps), 2),
             f"aligned_{aligned[0].shape[0]}_rows_us": round(time_calls(F.linear, aligned, x, args.reps), 2),
             "max_abs_diff": float((y0.float() - y1.float()).abs().max())}
        res["rows"].append(r)
        print(json.dumps(r), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
