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

The logit tolerance is measured on the model itself where it can be: export recorded, per prompt,
`spread{i}`, eager's own logits prefilled in two chunks against one shot (export/pipeline.py
fixture()). Both are the same computation rounded differently, and so is the graph (fused kernels,
other reduction orders): a deep bf16 model's graph differs from eager by more than the dtype's fixed
tolerance with every id equal (a 16-layer tiny-width random model, CPU: up to 0.57), so the check holds
the logits to max(the dtype's tolerance, SPREAD_FACTOR x the largest spread). Where the two eager runs
agree bit for bit the spread is 0 and the dtype's tolerance stands (bf16 on the CPU: 0 on tiny-width
models of 4 to 32 layers, whose graphs still differ by up to 0.78 at 32). A fixture without spreads (exported before they were recorded)
is checked against the dtype's tolerance alone.
"""
from __future__ import annotations

from pathlib import Path

from .artifact import ArtifactError

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25, "float16": 0.1}
# W8A8 artifacts (export --quant int8 | fp8-channel, graphs/quant.py) round every projection's input to 8 bits
# per row inside the graph: an ulp of difference in that input (the compiled graph sums a norm in another
# order) can move one activation across a rounding boundary, or a row's amax and so its scale, and each such
# flip moves the logits by about 1e-2 (tiny, fp32: 0.0118 at a 12-token prefill). Their logits are held to
# this, and their ids must still match wherever eager's top-2 margin exceeds twice it.
W8A8_SCHEMES, W8A8_TOLERANCE = ("int8", "fp8-channel"), 0.05
# a quarter of the logit tolerance: router logits are dot products over the same hidden size, and the
# router logits of the flips seen (bf16) were 0.02 apart
ROUTER_NEAR_TIE = {k: v / 4 for k, v in TOLERANCE.items()}
# The graph is a third rounding of the computation that eager's one-shot and chunked runs round two ways.
# If a rounding of it lands within s of the exact result, |graph - eager| <= |graph - exact| + |eager -
# exact| <= 2s, while the recorded spread (chunked vs one-shot) is one draw of such a difference and
# stands in for s: twice it allows the graph to sit on the far side of the exact result from eager.
SPREAD_FACTOR = 2.0


def fixture_tolerance(fx: dict, dtype: str, quant: str | None = None) -> tuple[float, float, str, float | None]:
    """A fixture's tensors, the artifact's dtype and --quant -> (logit tolerance, router near-tie, where
    the tolerance came from: "dtype" | "measured spread", the largest usable recorded spread or None when
    the fixture has none). A spread at a step where eager's router had a near-tie (this step or the
    prompt's prefill, the routing-flip rule) is not used: there the chunked run may have picked another
    expert, which is no rounding spread."""
    import torch
    tol, near_tie = TOLERANCE[dtype], ROUTER_NEAR_TIE[dtype]
    if quant in W8A8_SCHEMES and tol < W8A8_TOLERANCE:
        tol, near_tie = W8A8_TOLERANCE, W8A8_TOLERANCE / 4
    spread, i = None, 0
    while f"prompt{i}" in fx:
        s = fx.get(f"spread{i}")
        if s is not None:
            s = s.float()
            margin = fx.get(f"router_margin{i}")
            if margin is not None:            # per step: min(this step's margin, the prefill's)
                margin = margin.float()[: len(s)]
                s = s[: len(margin)][torch.minimum(margin, margin[:1]) > near_tie]
            s = s[torch.isfinite(s)]          # NaN: steps after the two runs' ids parted (not comparable)
            spread = max(spread or 0.0, float(s.max()) if len(s) else 0.0)
        i += 1
    if spread is not None and SPREAD_FACTOR * spread > tol:
        return SPREAD_FACTOR * spread, near_tie, "measured spread", spread
    return tol, near_tie, "dtype", spread


def check_fixture(executor, fixture: str | Path, dtype: str, quant: str | None = None) -> dict:
    """Replay the fixture file's prompts on `executor` (an artifact of `dtype`, exported with --quant
    `quant`) -> the report; ArtifactError naming the prompt and step that fails."""
    from safetensors.torch import load_file
    fx = load_file(str(fixture))
    tol, near_tie, source, spread = fixture_tolerance(fx, dtype, quant)
    said = describe_tolerance(tol, dtype, quant, source, spread)
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
              "eager_spread": spread, "routing_flips": routing_flips}
    if getattr(executor, "speculative_tokens", 0):
        report["speculation"] = check_speculation(executor, fx, tol)
    return report


def describe_tolerance(tol: float, dtype: str, quant: str | None, source: str, spread: float | None) -> str:
    """The tolerance and where it came from, for an error message: "0.25 (bfloat16 tolerance; eager's own
    chunked-vs-one-shot spread 0.0312)" or "0.9 (2 x eager's own chunked-vs-one-shot spread 0.45;
    bfloat16 tolerance 0.25)"."""
    measured = "no spread recorded" if spread is None else f"eager's own chunked-vs-one-shot spread {spread:.3g}"
    if source == "measured spread":
        return f"{tol:.3g} ({SPREAD_FACTOR:g} x {measured}; {dtype} tolerance {TOLERANCE[dtype]})"
    what = f"{quant} W8A8" if quant in W8A8_SCHEMES and tol == W8A8_TOLERANCE else dtype
    return f"{tol:.3g} ({what} tolerance; {measured})"


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
