"""How often bf16 rounding noise alone changes an MoE router's top-k expert set — the expected number of
routing flips per token between two correct bf16 implementations that round differently.

A router row of random weights (std H^-0.5, as tiny.random_model) sees x and x' = x with a 1-ulp bf16
change in a fraction of its elements (what a different fp32 accumulation order leaves after rounding to
bf16); the top-k sets of softmax(router(x)) are compared.

    python -m onegraph.tools.routing_flips --out benchmarks/routing_flips.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F


def flip_rate(H: int, E: int, k: int, frac: float, trials: int, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    W = (torch.randn(E, H, generator=g) * H ** -0.5).bfloat16()
    x = torch.randn(trials, H, generator=g).bfloat16()
    ulp = x.float().abs() * 2.0 ** -7                                  # bf16 spacing near |x| (8 bits)
    sign = torch.randint(0, 2, (trials, H), generator=g) * 2 - 1
    hit = torch.rand(trials, H, generator=g) < frac
    y = (x.float() + torch.where(hit, ulp * sign, 0.0)).bfloat16()
    top = lambda v: torch.softmax(F.linear(v, W), -1, dtype=torch.float32).topk(k).indices.sort(-1).values  # noqa: E731
    return float((top(x) != top(y)).any(-1).float().mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--trials", type=int, default=4000)
    args = ap.parse_args(argv)
    rows = []
    for name, H, E, k, layers in (("qwen3.5-35b-a3b", 2048, 256, 8, 40), ("tiny", 64, 8, 2, 4)):
        for frac in (0.01, 0.1):
            p = flip_rate(H, E, k, frac, args.trials)
            rows.append({"shape": name, "hidden": H, "experts": E, "top_k": k, "moe_layers": layers,
                         "perturbed_fraction": frac, "flip_rate_per_layer_token": round(p, 4),
                         "expected_flips_per_token": round(p * layers, 3)})
    res = {"command": "python -m onegraph.tools.routing_flips " + " ".join(sys.argv[1:] if argv is None else argv),
           "rows": rows}
    text = json.dumps(res, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
