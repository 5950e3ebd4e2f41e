"""The GDN decode step + gated norm (custom_ops/triton/gdn_decode_step_norm.py) per batch, path by path, on a CUDA
device: the split path (conv update, step, norm: three launches) and the fused kernel walking V 16 / 32 / 64 / 128
columns at a time, each in place as the decode graphs run it.

    python -m onegraph.tools.sweep_gdn_decode --out benchmarks/h200_gdn_decode_sweep.json

At the 35B shape (HK 16, HV 32, K = V = 128, W = 4; bf16 activations, fp32 recurrent state): 30 layers' distinct
inputs and states (one decode step's GDN layers) in one CUDA graph, replayed; µs per layer, and the state bytes
read + written per layer over that time as a fraction of copy bandwidth. Each case's y and state rows are
compared with the whole-head fused kernel's (`max_diff`: the chunking changes no value, the split path only the
fp32 summation order). The launcher's picks (SPLIT_BELOW, CHUNK_V, CHUNK_FROM) are then set from `best`.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys

import torch

HK, HV, K, V, W, LAYERS = 16, 32, 128, 128, 4, 30
CASES = (("fused", 128), ("fused", 64), ("fused", 32), ("fused", 16), ("split", None))   # whole heads first: the reference


def _layers(B: int, layers: int = LAYERS, device: str = "cuda") -> list[list]:
    """Per layer the op's arguments (test layout: strided views of one fused projection row) with B + 8 slots."""
    g = torch.Generator(device=device).manual_seed(B)
    C, S = 2 * HK * K + HV * V, B + 8

    def rn(*shape, scale=1.0, dt=torch.bfloat16):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dt)

    out = []
    for _ in range(layers):
        fused = rn(B, C + HV * V + 2 * HV)
        qkv, z, b, a = fused.split([C, HV * V, HV, HV], dim=-1)
        slots = torch.randperm(S, generator=g, device=device)[:B]
        out.append([qkv, a, b, z, rn(S, C, W - 1), rn(S, HV, K, V, scale=0.5, dt=torch.float32), slots,
                    rn(C, W, scale=0.5), rn(HV, scale=0.5), rn(HV), rn(V), HK, 1e-6])
    return out


def _run(mod, args, path, block_v):
    """One in-place call -> y (the state rows are updated in args[4], args[5])."""
    y = args[0].new_empty((args[0].shape[0], HV, V))
    mod._launch(*args[:4], args[4], args[5], *args[6:], y, args[4], args[5], in_place=True,
                fused=path == "fused", block_v=block_v)
    return y


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,16,32,64,128")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_gdn_decode: needs a CUDA device", file=sys.stderr)
        return 2
    from onegraph.custom_ops.triton import gdn_decode_step_norm as mod
    from onegraph.tools.bench_ops import time_graph
    from onegraph.tools.bench_big import copy_bandwidth
    bw = copy_bandwidth(torch.device("cuda"))
    rows, best = [], {}
    for B in (int(b) for b in args.batches.split(",")):
        layers = _layers(B)
        first = [t.clone() if isinstance(t, torch.Tensor) else t for t in layers[0]]
        state_bytes = 2 * B * HV * K * V * 4                  # the recurrent state rows read and written
        ref = None
        for path, block_v in CASES:
            one = [t.clone() if isinstance(t, torch.Tensor) else t for t in first]
            y = _run(mod, one, path, block_v)
            got = (y.float(), one[5][one[6]])             # y, and the updated state rows
            ref = ref or got
            us = time_graph(lambda: [_run(mod, a, path, block_v) for a in layers], (), 5, 20, 1) / LAYERS
            rows.append({"B": B, "path": path, "block_v": block_v, "us_per_layer": round(us, 2),
                         "state_fraction_of_bandwidth": round(state_bytes / (us * 1e-6) / bw, 3),
                         "max_diff": max((a - b).abs().max().item() for a, b in zip(got, ref))})
            print(json.dumps(rows[-1]), flush=True)
            if B not in best or us < best[B]["us_per_layer"]:
                best[B] = rows[-1]
    out = {"command": "python -m onegraph.tools.sweep_gdn_decode " + shlex.join(sys.argv[1:] if argv is None else argv),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_GBps": round(bw / 1e9, 1),
           "launcher_now": {"SPLIT_BELOW": mod.SPLIT_BELOW, "CHUNK_V": mod.CHUNK_V, "CHUNK_FROM": mod.CHUNK_FROM},
           "rows": rows, "best": {str(k): v for k, v in best.items()}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
