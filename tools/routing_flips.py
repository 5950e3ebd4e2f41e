"""How often bf16 rounding noise alone changes an MoE router's top-k expert set — the expected number of
routing flips per token between two correct bf16 implementations that round differently.

A router row of random weights (std H^-0.5, as tiny.random_model) sees x and x' = x with a 1-ulp bf16
change in a fraction of its elements (what a different fp32 accumulation order leaves after rounding to
bf16); the top-k sets of softmax(router(x)) are compared.

    python -m onegraph.tools.routing_flips --out benchmarks/routing_flips.json
    python -m onegraph.tools.routing_flips --model tiny --model tiny-random --out benchmarks/tiny_routing_margins.json

With --model (a checkpoint dir, `tiny`, or `tiny-random`: tiny's shape with seeded random weights) the
router rows are the model's own: every MoE layer's input for each token of the bundled held-out text
(fp32 eager prefill, windows of 256 tokens), its router weights, and per row the top-k margin (the k-th
minus the (k+1)-th router logit, as graphs/eager.py `router_margins`) and the same 1-ulp bf16 test.
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


def _flipped(x: torch.Tensor, W: torch.Tensor, k: int, frac: float, g: torch.Generator) -> torch.Tensor:
    """x [N, H] bf16 rows, W [E, H] bf16: does a 1-ulp change in a `frac` of x's elements change the top-k set?"""
    ulp = x.float().abs() * 2.0 ** -7
    sign = torch.randint(0, 2, x.shape, generator=g) * 2 - 1
    hit = torch.rand(x.shape, generator=g) < frac
    y = (x.float() + torch.where(hit, ulp * sign, 0.0)).bfloat16()
    top = lambda v: torch.softmax(F.linear(v, W), -1, dtype=torch.float32).topk(k).indices.sort(-1).values  # noqa: E731
    return (top(x) != top(y)).any(-1)


def model_rows(spec: str, ctx: int = 256, seed: int = 0) -> dict:
    """Router margins and bf16 flip rates of a model's own router rows over the bundled held-out text."""
    import tempfile
    from onegraph.custom_ops.sample import Sampling
    from onegraph.graphs.load import load_model
    from onegraph.graphs.qwen3_5 import SparseMoe, new_state
    from onegraph.tools.eval import HELDOUT_TEXT
    if spec == "tiny-random":
        from onegraph.graphs.config import ModelConfig
        from onegraph.graphs.qwen3_5 import Qwen35Model
        from onegraph.graphs.tiny import TINY_HF_CONFIG, random_hf_weights, write_checkpoint
        with torch.device("meta"):
            meta = Qwen35Model(ModelConfig.from_hf(TINY_HF_CONFIG))
        path = write_checkpoint(tempfile.mkdtemp(prefix="tiny-random-"), random_hf_weights(meta, seed))
    else:
        path = spec
    cfg, model, path = load_model(path)
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(HELDOUT_TEXT.read_text(encoding="utf-8")).ids
    moes = [m for m in model.modules() if isinstance(m, SparseMoe)]
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(moes))}
    hooks = [m.register_forward_pre_hook(lambda mod, a, i=i: inputs[i].append(a[0].detach()))
             for i, m in enumerate(moes)]
    with torch.no_grad():
        for s in range(0, len(ids), ctx):
            part = ids[s:s + ctx]
            state = new_state(cfg, 1, ctx, torch.float32)
            model.prefill(torch.tensor(part), torch.tensor([0]), torch.tensor([0]), torch.tensor([len(part)]),
                          *Sampling().tensors(1, "cpu"), *state)
    for h in hooks:
        h.remove()
    g = torch.Generator().manual_seed(seed)
    margins, flips = [], {0.01: [], 0.1: []}
    for i, m in enumerate(moes):
        x, W = torch.cat(inputs[i]), m.router_weight[:-1].detach()                  # [N, H] fp32, [E, H]
        top = F.linear(x, W).topk(m.top_k + 1, -1).values
        margins.append(top[:, -2] - top[:, -1])
        for frac in flips:
            flips[frac].append(_flipped(x.bfloat16(), W.bfloat16(), m.top_k, frac, g))
    mg = torch.cat(margins)
    row = {"model": spec, "hidden": cfg.hidden_size, "experts": cfg.num_experts, "top_k": cfg.top_k,
           "moe_layers": len(moes), "layer_tokens": int(mg.numel()),
           "margin_median": round(float(mg.median()), 4),
           "margin_below_1e-2": round(float((mg < 1e-2).float().mean()), 4),
           "margin_below_1e-3": round(float((mg < 1e-3).float().mean()), 4)}
    for frac, f in flips.items():
        p = float(torch.cat(f).float().mean())
        row[f"bf16_flip_rate_per_layer_token_at_{frac}"] = round(p, 4)
        row[f"bf16_expected_flips_per_token_at_{frac}"] = round(p * len(moes), 3)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--trials", type=int, default=4000)
    ap.add_argument("--model", action="append", default=[],
                    help="measure this model's own router rows instead (repeatable; `tiny-random` for random weights)")
    args = ap.parse_args(argv)
    if args.model:
        return _emit({"text": "graphs/tiny_weights/heldout.txt", "rows": [model_rows(m) for m in args.model]},
                     argv, args.out)
    rows = []
    for name, H, E, k, layers in (("qwen3.5-35b-a3b", 2048, 256, 8, 40), ("tiny", 64, 8, 2, 4)):
        for frac in (0.01, 0.1):
            p = flip_rate(H, E, k, frac, args.trials)
            rows.append({"shape": name, "hidden": H, "experts": E, "top_k": k, "moe_layers": layers,
                         "perturbed_fraction": frac, "flip_rate_per_layer_token": round(p, 4),
                         "expected_flips_per_token": round(p * layers, 3)})
    return _emit({"rows": rows}, argv, args.out)


def _emit(res: dict, argv, out) -> int:
    """The JSON (with the command that made it) to stdout and, with --out, to that file."""
    command = "python -m onegraph.tools.routing_flips " + " ".join(sys.argv[1:] if argv is None else argv)
    text = json.dumps({"command": command, **res}, indent=1)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
