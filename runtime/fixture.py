"""The parity fixture check run at every artifact load (rung 3 of the ladder, in production).

At export, eager recorded greedy ids and logits for a few prompts; here the loaded graphs must
reproduce them: logits within the dtype's tolerance and identical ids wherever eager's top-2 margin
is wider than twice that tolerance (below it, a legitimate rounding difference may flip a near-tie).

The MoE router has near-ties of its own: where eager's top-k router margin at a step (or in the
prompt's prefill) is below ROUTER_NEAR_TIE, a graph whose sums round differently may send a row to
another expert, and from that step on its logits legitimately differ by far more than the tolerance
(measured: a bf16 TP-2 all-reduce vs TP-1, router margin 0.008, logits 4.6 apart). Such a step
ends that prompt's comparison, and the report says where. A prompt whose prefill already differs
while eager routed it with wide margins, or fixtures in which no prompt got past its prefill,
still fail: a broken artifact must not hide behind near-ties.

The logit tolerance is measured on the model itself where it can be: for a bf16 / fp16 model, export
recorded per prompt `gap{i}`, eager's logits against the same eager computation in fp32 over the same
weights (export/pipeline.py fixture(), graphs/fp32_compute.py). The graph (fused kernels, other
reduction orders) is another low-precision rounding of that fp32 computation, about as far from it as
eager: a deep bf16 model's graph differs from eager by more than the dtype's fixed tolerance with every
id equal (tiny-width random models with decisive routers, CPU: up to 0.57 at 16 layers, 0.78 at 32),
and eager's fp32 gap tracks it. So the check holds the logits to max(the dtype's tolerance, GAP_FACTOR x
the largest gap). An fp32 artifact records no gap (its eager is the fp32 computation), nor does a
fixture exported before gaps were recorded: both are checked against the dtype's tolerance alone (an
older fixture's `spread{i}`, eager chunked against one shot, is not read: bf16 eager on the CPU gave 0).
"""
from __future__ import annotations

from pathlib import Path

from onegraph.checkpoint.quant import SCHEMES

from .artifact import ArtifactError

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25, "float16": 0.1}
# W8A8 artifacts (export --quant int8 | fp8-channel, checkpoint/quant.py) round every projection's input to 8 bits
# per row inside the graph: an ulp of difference in that input (the compiled graph sums a norm in another
# order) can move one activation across a rounding boundary, or a row's amax and so its scale, and each such
# flip moves the logits by about 1e-2 (tiny, fp32: 0.0118 at a 12-token prefill). Their logits are held to
# this, and their ids must still match wherever eager's top-2 margin exceeds twice it.
W8A8_SCHEMES, W8A8_TOLERANCE = tuple(n for n, s in SCHEMES.items() if s.w8a8), 0.05
# a quarter of the logit tolerance: router logits are dot products over the same hidden size, and the
# router logits of the flips seen (bf16) were 0.02 apart
ROUTER_NEAR_TIE = {k: v / 4 for k, v in TOLERANCE.items()}
# Eager and the graph are two low-precision roundings of one fp32 computation F: |graph - eager| <=
# |graph - F| + |F - eager|, and the graph, rounding the same values to the same dtype in another order,
# lands about as far from F as eager does, whose distance is the recorded gap: twice it allows the graph to
# sit on the far side of F from eager. Measured on CPU AOTInductor, bf16 tiny-width random models with
# decisive routers: the largest graph-vs-eager difference over the fixture is 1.65 x the largest gap at 16
# layers (0.565 vs 0.342), 1.13 x at 32 (0.777 vs 0.690); step by step the ratio reaches 1.74 and 2.04,
# which is why the bound takes the largest gap of the fixture, not each step's own.
GAP_FACTOR = 2.0


def fixture_tolerance(fx: dict, dtype: str, quant: str | None = None) -> tuple[float, float, str, float | None]:
    """A fixture's tensors, the artifact's dtype and --quant -> (logit tolerance, router near-tie, where
    the tolerance came from: "dtype" | "measured gap", the largest usable recorded gap or None when the
    fixture has none). A gap at a step where eager's router had a near-tie (this step or the prompt's
    prefill, the routing-flip rule) is not used: there the fp32 run may have picked another expert, which
    is no rounding gap."""
    import torch
    tol, near_tie = TOLERANCE[dtype], ROUTER_NEAR_TIE[dtype]
    if quant in W8A8_SCHEMES and tol < W8A8_TOLERANCE:
        tol, near_tie = W8A8_TOLERANCE, W8A8_TOLERANCE / 4
    gap, i = None, 0
    while f"prompt{i}" in fx:
        g = fx.get(f"gap{i}")
        if g is not None:
            g = g.float()
            margin = fx.get(f"router_margin{i}")
            if margin is not None:            # per step: min(this step's margin, the prefill's)
                margin = margin.float()[: len(g)]
                g = g[: len(margin)][torch.minimum(margin, margin[:1]) > near_tie]
            g = g[torch.isfinite(g)]          # NaN: steps after the two runs' ids parted (not comparable)
            gap = max(gap or 0.0, float(g.max()) if len(g) else 0.0)
        i += 1
    if gap is not None and GAP_FACTOR * gap > tol:
        return GAP_FACTOR * gap, near_tie, "measured gap", gap
    return tol, near_tie, "dtype", gap


def check_fixture(executor, fixture: str | Path, dtype: str, quant: str | None = None) -> dict:
    """Replay the fixture file's prompts on `executor` (an artifact of `dtype`, exported with --quant
    `quant`) -> the report; ArtifactError naming the prompt and step that fails."""
    from safetensors.torch import load_file
    fx = load_file(str(fixture))
    tol, near_tie, source, gap = fixture_tolerance(fx, dtype, quant)
    said = describe_tolerance(tol, dtype, quant, source, gap)
    worst, routing_flips, compared = 0.0, [], 0
    i = 0
    while f"prompt{i}" in fx:
        prompt, ref_ids, ref_logits = fx[f"prompt{i}"].tolist(), fx[f"ids{i}"].tolist(), fx[f"logits{i}"]
        margin = fx.get(f"router_margin{i}")
        ids, logits = executor.generate(prompt, len(ref_ids), slot=0)
        for step, (a, b) in enumerate(zip(logits, ref_logits)):
            diff = (a.float().cpu() - b).abs().max().item()
            top2 = b.topk(2).values
            if diff > tol:
                near = None if margin is None else min(margin[0], margin[step]).item()   # this step or the prefill
                if near is not None and near <= near_tie:
                    routing_flips.append({"prompt": i, "step": step, "logit_diff": round(diff, 4),
                                          "router_margin": round(near, 5)})
                    break              # a legitimate routing flip: the rest of the stream is not comparable
                raise ArtifactError(f"parity fixture: prompt {i} step {step}: logits differ from eager by "
                                    f"{diff:.3g} > {said}")
            worst = max(worst, diff)
            compared += step > 0
            if ids[step] != ref_ids[step] and (top2[0] - top2[1]).item() > 2 * tol:
                raise ArtifactError(f"parity fixture: prompt {i} first differing token at step {step}: "
                                    f"graph {ids[step]} vs eager {ref_ids[step]} (eager's top-2 gap "
                                    f"{(top2[0] - top2[1]).item():.3g} > twice {said})")
            if ids[step] != ref_ids[step]:
                break  # a legitimate near-tie flip: the rest of the stream is not comparable
        i += 1
    if routing_flips and not compared:
        raise ArtifactError(f"parity fixture: no prompt could be compared past its prefill (routing near-ties: "
                            f"{routing_flips})")
    report = {"prompts": i, "max_logit_diff": worst, "tolerance": tol, "tolerance_source": source,
              "eager_fp32_gap": gap, "routing_flips": routing_flips}
    if getattr(executor, "speculative_tokens", 0):
        report["speculation"] = check_speculation(executor, fx, tol)
    return report


def describe_tolerance(tol: float, dtype: str, quant: str | None, source: str, gap: float | None) -> str:
    """The tolerance and where it came from, for an error message: "0.25 (bfloat16 tolerance; eager's
    bf16-vs-fp32 gap 0.0312)" or "0.62 (2 x eager's bf16-vs-fp32 gap 0.31; bfloat16 tolerance 0.25)"."""
    w8a8 = quant in W8A8_SCHEMES and TOLERANCE[dtype] < W8A8_TOLERANCE
    base = f"{quant} W8A8 tolerance {W8A8_TOLERANCE}" if w8a8 else f"{dtype} tolerance {TOLERANCE[dtype]}"
    short = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    measured = "no fp32 gap recorded" if gap is None else f"eager's {short}-vs-fp32 gap {gap:.3g}"
    if source == "measured gap":
        return f"{tol:.3g} ({GAP_FACTOR:g} x {measured}; {base})"
    return f"{tol:.3g} ({base.rsplit(' ', 1)[0]}; {measured})"


def check_speculation(executor, fx: dict, tol: float) -> dict:
    """A speculative artifact's rounds (graphs/spec_graphs.py) must emit the graphs' own speculation-off
    ids for every fixture prompt, up to a near-tie of eager's logits (the rule above) -> the rounds' mean
    accepted drafts."""
    from onegraph.custom_ops.sample import Sampling
    rounds, accepted, i = 0, 0, 0
    while f"prompt{i}" in fx:
        prompt, ref_logits = fx[f"prompt{i}"].tolist(), fx[f"logits{i}"]
        want, _ = executor.generate(prompt, len(ref_logits), slot=0)
        ids, _ = executor.prefill(prompt, 0)
        got = [int(ids[0])]
        while len(got) < len(want):
            n_acc, targets = executor.spec_step([0], [Sampling()])
            a = int(n_acc[0])
            rounds, accepted = rounds + 1, accepted + a
            got += targets[0, :a + 1].tolist()
        diff = next((s for s, (x, y) in enumerate(zip(got, want)) if x != y), None)
        if diff is not None and float(ref_logits[diff].topk(2).values.diff().abs()) > 2 * tol:
            raise ArtifactError(f"parity fixture: prompt {i}: speculative decoding gives {got[diff]} at step {diff}, "
                                f"decode gives {want[diff]}")
        i += 1
    return {"rounds": rounds, "accepted_mean": accepted / max(1, rounds)}
