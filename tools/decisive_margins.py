"""Router margins of seeded random models, default (`random`) vs `decisive` routing (graphs/decisive.py), on CPU.

    python -m onegraph.tools.decisive_margins --out benchmarks/decisive_router.json --case tiny:4:8 \
        --case qwen3.5-35b-a3b:2:256 --case qwen3.5-35b-a3b:40:16 --case qwen3.5-35b-a3b:40:64:2:128

A case is SHAPE:LAYERS:EXPERTS[:TOP_K[:MOE_INTERMEDIATE]] (tools/bench_common.py shape_config's first LAYERS
layers, EXPERTS routed experts, the shape's top_k and expert width unless given; the vocabulary cut to 4096
ids to fit the CPU: it changes no router input). 40:16 keeps the 35B's top-8 at full depth (1 sign channel);
40:64:2:128 has the 35B's 5 sign channels (E / k = 32 groups) at full depth.
Each model runs eager (bf16) greedy generation of a few prompts (prefill + decode steps); per router: the
smallest top-k margin (graphs/eager.py router_margins: k-th minus (k+1)-th logit over a call's rows), the
distinct top-k sets seen (decisive: one per sign pattern seen), |x_0| (a channel) at the MoE input; and the
final logits' top-2 gaps and largest |logit| (the rest of the model must stay O(1), not NaN, not degenerate).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

VOCAB = 4096
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 11], [100, 101, 102, 103], [9, 8, 7, 6, 5, 4, 3, 2, 1, 200, 201, 202]]
STEPS = 8


def case(spec: str, router: str, seed: int = 0) -> dict:
    from onegraph.graphs import decisive
    from onegraph.graphs.config import ModelConfig
    from onegraph.graphs.eager import generate_eager, router_margins
    from onegraph.graphs.qwen3_5 import SparseMoe
    from onegraph.graphs.tiny import random_model
    from onegraph.tools.bench_common import shape_config
    shape, layers, experts, *more = spec.split(":")
    hf, _ = shape_config(shape, int(layers))
    hf = dict(hf, num_experts=int(experts), vocab_size=min(hf["vocab_size"], VOCAB))
    if more:
        hf["num_experts_per_tok"] = int(more[0])
    if more[1:]:
        hf["moe_intermediate_size"] = int(more[1])
    cfg = ModelConfig.from_hf(hf)
    model = random_model(cfg, torch.bfloat16, "cpu", seed=seed, router=router)
    moes = [m for m in model.modules() if isinstance(m, SparseMoe)]
    sets, xj = [set() for _ in moes], [[] for _ in moes]

    def record(i):
        def hook(moe, args):
            x = args[0].float()
            top = torch.nn.functional.linear(x, moe.router_weight[:-1].float()).topk(moe.top_k, -1).indices
            sets[i].update(tuple(sorted(r)) for r in top.tolist())
            xj[i].append(x[:, 0].abs())
        return hook

    hooks = [m.register_forward_pre_hook(record(i)) for i, m in enumerate(moes)]
    per_prompt, gaps, big = [], [], 0.0
    try:
        for p in PROMPTS:
            with router_margins(model) as margins:
                r = generate_eager(model, p, STEPS)
            per_prompt.append(round(min(margins), 5))
            for lg in r.logits:
                if not torch.isfinite(lg).all():
                    raise RuntimeError(f"{spec} {router}: non-finite logits")
                t2 = lg.topk(2).values
                gaps.append(float(t2[0] - t2[1]))
                big = max(big, float(lg.abs().max()))
    finally:
        for h in hooks:
            h.remove()
    xs = [torch.cat(v) for v in xj]
    return {"router": router, "min_router_margin_per_prompt": per_prompt, "min_router_margin": min(per_prompt),
            "channels": decisive.channels(cfg.num_experts, cfg.top_k),
            "distinct_topk_sets_per_layer_min_max": [min(len(s) for s in sets), max(len(s) for s in sets)],
            "channel_abs_x0_min_max_first_last_layer": [round(float(xs[0].min()), 3), round(float(xs[0].max()), 3),
                                                     round(float(xs[-1].min()), 3), round(float(xs[-1].max()), 3)],
            "logits_top2_gap_min_median": [round(min(gaps), 4), round(statistics.median(gaps), 4)],
            "logits_abs_max": round(big, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", required=True, help="SHAPE:LAYERS:EXPERTS")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for spec in a.case:
        for router in ("random", "decisive"):
            row = dict(case=spec, **case(spec, router))
            print(json.dumps(row), flush=True)
            rows.append(row)
    rec = {"command": "python -m onegraph.tools.decisive_margins " + " ".join(sys.argv[1:] if argv is None else argv),
           "dtype": "bfloat16", "device": "cpu", "prompts": len(PROMPTS), "steps": STEPS,
           "bf16_fixture_router_near_tie": 0.0625, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            f.write(json.dumps(rec, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
