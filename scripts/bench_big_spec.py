"""bench_big --speculative-tokens: the cost of one speculative round (graphs/spec_graphs.py `step`: the MTP
head drafts K tokens, the main model verifies K+1 rows per slot, accept, commit, head catch-up, one graph)
at a real shape with seeded random weights, against the 1-token decode step of the same model in the same
run.

Per K the round graph for bucket B is lowered like the decode graph (bench_big.lower), called with rows
0..B-1 (greedy), its input tokens gathered from a device-side last_tok and its next_ids scattered back (as
runtime/cuda_graphs.CapturedDecode does for a decode step), and on CUDA captured in a CUDA graph
(`Round`). Reported per K (bench_big's `speculative` list): K, layers, captured, round_ms, decode_ms, round_ms /
decode_ms, with --profile the draft / verify / commit / catch-up split from the profiler (`round_split_us`,
draft_ms_per_token, verify_ms), and ms per token at assumed acceptance lengths (tokens per round, up to
K + 1) = round_ms / acceptance_length (`ms_per_token_at`). Random weights give no meaningful acceptance (the head and the main model
are unrelated random networks, so almost every draft is rejected): no acceptance is measured or reported,
the acceptance lengths are assumptions. A round's cost hardly depends on how many drafts it accepts (the
commit gathers one snapshot per GDN layer whatever the count).

A cheap cross-check of the verify's cost: the verify pass is a decode step over B*(K+1) rows (plus one
GDN state update per position and the snapshots), so `bench_big --batch` with B*(K+1) approximates its
main-model part.
"""
from __future__ import annotations

import time

import torch

from onegraph.commands.bench_common import REGIONS, bytes_per_step
from onegraph.commands.bench_common import sync as _sync

ACCEPTANCE_LENGTHS = (2.0, 2.5, 3.0, 3.4)
NO_ACCEPTANCE = ("random weights: the MTP head and the main model are unrelated random networks, so their "
                 "acceptance is meaningless; none is measured or reported. ms_per_token_at uses "
                 "assumed acceptance lengths (tokens per round = accepted drafts + 1)")

ROUND_VS_DECODE = ("round_ms is one replay of the round graph with static rows and sampling inputs and its "
                   "next_ids scattered into last_tok on the device; the decode step it is compared with is the "
                   "runtime's captured step, which also copies its host staging in and its ids out (a few us of "
                   "small copies the round does not pay)")


@torch.no_grad()
def attach_random_head(model, device, seed: int = 1) -> None:
    """model.mtp := an MTP head of one layer at the model's shape, seeded random weights (bench_big's
    scales) in the model's dtype, on `device`."""
    from onegraph.models.qwen3_5.mtp import MtpHead
    from onegraph.models.qwen3_5.tiny import randomise_
    with torch.device("meta"):
        head = MtpHead(model.cfg, 1).to(model.embed_tokens.weight.dtype)
    head.to_empty(device=device)
    randomise_(head, device, seed)
    model.mtp = head


def _expert_share(cfg, rows: int) -> float:
    """Expected fraction of a layer's experts that `rows` tokens touch under uniform routing."""
    return 1 - (1 - cfg.top_k / cfg.num_experts) ** rows if cfg.num_experts else 1.0


def _bytes(params, cfg, rows: int) -> int:
    return sum(int(p.numel() * p.element_size() * (_expert_share(cfg, rows) if ".experts." in n else 1))
               for n, p in params)


def round_weight_bytes(model, B: int, k: int) -> int:
    """Weights one round reads: the main model over B*(k+1) rows (its embedding rows, every dense weight,
    the experts those rows touch, lm_head), lm_head k more times (one per draft), the head's layer k-1
    times over B rows (draft steps) and once over B*(k+1) rows (catch-up)."""
    cfg, T = model.cfg, k + 1
    head = [(n, p) for n, p in model.mtp.named_parameters()]
    lm = model.lm_head.weight if getattr(model, "lm_head", None) is not None else model.embed_tokens.weight
    return (bytes_per_step(model, B * T) + k * lm.numel() * lm.element_size()
            + (k - 1) * _bytes(head, cfg, B) + _bytes(head, cfg, B * T))


class Round:
    """The round graph called for rows 0..B-1 (greedy sampling): tokens = last_tok[slots] before it,
    last_tok[slots] = next_ids after it, both on the device. capture=True (CUDA): warm-up and capture on a
    side stream with every row at the scratch slot (the round resets the scratch slot's position), then
    the static slots are pointed at rows 0..B-1; a round is then one graph replay. Rows and sampling are
    static here, where the decode step (CapturedDecode) also copies its host staging in and its ids out
    (a few small copies in its graph): ROUND_VS_DECODE."""

    def __init__(self, graph, B: int, state: list, last_tok: torch.Tensor, scratch: int, dev, capture: bool):
        from onegraph.custom_ops.sample import Sampling
        self.B, self.dev = B, dev
        self.tokens = torch.zeros(B, dtype=torch.int64, device=dev)
        self.slots = torch.full((B,), scratch, dtype=torch.int64, device=dev)
        inputs = [self.tokens, self.slots] + Sampling().tensors(B, dev) + list(state)

        def body(run):
            torch.index_select(last_tok, 0, self.slots, out=self.tokens)
            out = run(inputs)
            last_tok.index_copy_(0, self.slots, out[0])
            return out

        self.graph = None
        if capture:
            from onegraph.runtime.cuda_graphs import stream_capsule
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            run = lambda xs: graph.run_with_stream(xs, stream_capsule(side))   # noqa: E731
            with torch.cuda.stream(side):
                for _ in range(2):                    # warm-up (lazy init) on the scratch slot
                    body(run)
            side.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=side):
                self.outs = body(run)
            torch.cuda.current_stream(dev).wait_stream(side)
        else:
            self._body = lambda: body(graph.run)
        last_tok[scratch] = 0
        self.slots.copy_(torch.arange(B, device=dev))

    def step(self) -> list[torch.Tensor]:
        """One round -> [next_ids [B], n_accepted [B], targets [B, K+1], drafts [B, K]] (a captured graph's
        static outputs: rewritten by the next round)."""
        if self.graph is not None:
            self.graph.replay()
            return self.outs
        return self._body()


def round_parity(model, k: int, rnd: Round, state: list, last_tok: torch.Tensor) -> dict:
    """One replayed round next to one eager round (graphs/spec_graphs.step) from the same state: every
    output equal, and the eager round's smallest MoE router margin (a differing id is read against it, as
    bench_big's decode parity does: random routers have near-ties that bf16 rounding can flip)."""
    from onegraph.custom_ops.sample import Sampling
    from onegraph.graphs import spec_graphs
    from onegraph.graphs.eager import router_margins
    B, dev = rnd.B, rnd.dev
    rows = torch.arange(B, device=dev)
    saved, saved_tok = [s.clone() for s in state], last_tok.clone()
    with torch.no_grad(), router_margins(model) as margins:
        eager = [t.clone() for t in spec_graphs.step(model, k, last_tok.index_select(0, rows), rows,
                                                     *Sampling().tensors(B, dev), *state)]
    for s, v in zip(state, saved):
        s.copy_(v)
    last_tok.copy_(saved_tok)
    replay = [t.clone() for t in rnd.step()]
    names = ("next_ids", "n_accepted", "targets", "drafts")
    equal = {n: bool(torch.equal(r, e)) for n, r, e in zip(names, replay, eager)}
    return {"exact": all(equal.values()), "equal": equal,
            "elements_differ": {n: int((r != e).sum()) for n, r, e in zip(names, replay, eager)},
            "min_router_margin": round(min(margins, default=float("inf")), 5),
            "rule": "exact match of every output; a difference is read against min_router_margin (random "
                    "routers' near-ties, as the decode parity's rows_ids_differ)"}


def timed(step, n: int, dev) -> float:
    for _ in range(3):
        step()
    _sync(dev)
    t = time.perf_counter()
    for _ in range(n):
        step()
    _sync(dev)
    return (time.perf_counter() - t) / n * 1e3


GEMM = dict(REGIONS)["gemm"]                                               # cuBLAS GEMMs, the projection GEMV
SAMPLE = ("_scan_kernel", "_pick_kernel")                                  # ops.sample's two kernels


def _picks(events: list, k: int) -> list[int]:
    """Indices of a round's sample calls (one _pick_kernel each): k drafts, then the verify's targets."""
    picks = [i for i, e in enumerate(events) if "_pick_kernel" in e[0]]
    if len(picks) != k + 1:
        raise ValueError(f"expected {k + 1} sample calls in a round of k={k}, found {len(picks)}")
    return picks


def _verify(events: list, picks: list[int], k: int) -> list:
    """The verify's events: after the k-th sample call, up to and with the (k+1)-th."""
    return events[picks[k - 1] + 1:picks[k] + 1]


def split_round(events: list, k: int) -> dict:
    """One round's device events in time order, each (name, start_us, end_us) -> its parts. The sample op
    ends with one _pick_kernel per call: k in the draft (one per draft token), then one for the verify's
    targets; what the graph runs after that is the commit (the GDN state gathers, up to the catch-up's
    first GEMM: its fc) and the head's catch-up. Spans (end of a part's last kernel - end of the previous
    part's) include the launch gaps; verify_fixed_us is the kernel time of the verify's parts that do not
    scale with the layer count (its lm_head, the largest GEMM there, and its sample kernels)."""
    picks = _picks(events, k)
    t0 = events[0][1]
    d_end, v_end = events[picks[k - 1]][2], events[picks[k]][2]
    tail = events[picks[k] + 1:]
    first_gemm = next((i for i, e in enumerate(tail) if any(p in e[0].lower() for p in GEMM)), len(tail))
    c_end = tail[first_gemm - 1][2] if first_gemm else v_end
    verify = _verify(events, picks, k)
    lm = max((e[2] - e[1] for e in verify if any(p in e[0].lower() for p in GEMM)), default=0.0)
    samp = sum(e[2] - e[1] for e in verify if any(p in e[0] for p in SAMPLE))
    dur = lambda es: sum(e[2] - e[1] for e in es)    # noqa: E731
    return {"draft_us": d_end - t0, "verify_us": v_end - d_end, "commit_us": c_end - v_end,
            "catch_up_us": (events[-1][2] - c_end) if tail else 0.0,
            "draft_kernel_us": dur(events[:picks[k - 1] + 1]), "verify_kernel_us": dur(verify),
            "verify_lm_head_us": lm, "verify_fixed_us": lm + samp, "kernels": len(events)}


def device_events(step, n: int) -> list[list[tuple]]:
    """n calls of step(), one torch-profiler session each (so a session's device events are one call's)
    -> per call its device events (kernels, copies) as (name, start_us, end_us) in time order."""
    from torch.profiler import ProfilerActivity, profile
    calls = []
    for _ in range(n):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        calls.append(sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                             if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e[1]))
    return calls


def decode_layers_us(events: list) -> float:
    """One decode step's device events in time order -> the span of its layers: from the end of its first
    Triton kernel (Inductor's triton_* or a hand-written _* kernel: the embedding gather, after the
    runtime's copies and token gather) to the start of lm_head (the step's longest GEMM), launch gaps
    included; the final norm is the one kernel of the span that is not a layer's."""
    lm = max((i for i, e in enumerate(events) if any(p in e[0].lower() for p in GEMM)),
             key=lambda i: events[i][2] - events[i][1], default=None)
    first = next((i for i, e in enumerate(events) if e[0].startswith(("triton_", "_"))), None)
    if lm is None or first is None or first >= lm:
        raise ValueError("no Triton kernel before the step's longest GEMM (lm_head): cannot bound its layers")
    return events[lm][1] - events[first][2]


def verify_kernels(events: list, k: int) -> dict:
    """One round's device events -> µs per kernel name over its verify (between the k-th and the (k+1)-th sample
    call, split_round's verify part): what a verify of K + 1 rows spends beyond a decode step."""
    out: dict = {}
    for name, t0, t1 in _verify(events, _picks(events, k), k):
        out[name[:120]] = out.get(name[:120], 0.0) + t1 - t0
    return out


def profile_round(step, n: int, k: int) -> dict:
    """n profiled rounds (device_events) -> the mean of split_round over them (µs), and `verify_top_kernels_us`:
    the 12 kernels of the verify with the most time (verify_kernels, mean over the rounds)."""
    calls = device_events(step, n)
    parts = [split_round(evs, k) for evs in calls]
    res = {key: round(sum(p[key] for p in parts) / n, 1) for key in parts[0]}
    per: dict = {}
    for evs in calls:
        for name, us in verify_kernels(evs, k).items():
            per[name] = per.get(name, 0.0) + us / n
    res["verify_top_kernels_us"] = {name: round(us, 1) for name, us in sorted(per.items(), key=lambda kv: -kv[1])[:12]}
    return res


def bench_round(model, weights, B: int, k: int, args, dev, decode_row: dict, bw: float, lower) -> dict:
    """Lower the round graph of k drafts for bucket B, capture (CUDA) and time it -> one result row.
    decode_row: bench_big's decode row of the same B and model (its replay_ms_per_step)."""
    from onegraph.models.qwen3_5.model import new_state
    from onegraph.graphs.spec_graphs import spec_state_spec
    cfg, dtype = model.cfg, model.embed_tokens.weight.dtype
    r = {"batch": B, "K": k, "layers": cfg.num_layers}
    graph = lower(model, weights, "spec", B, args, dev, r, k=k)
    t = time.time()
    state = new_state(cfg, B, args.max_seq_len, dtype, dev)
    spec = [torch.zeros(s.shape, dtype=s.dtype, device=dev) for s in spec_state_spec(model, B, args.max_seq_len, dtype)]
    g = torch.Generator(device="cpu").manual_seed(0)
    spec[-2][:B] = torch.randn(B, cfg.hidden_size, generator=g).to(dev, dtype)     # spec.y: the head's last output
    spec[-1][:B] = args.position                                                    # spec.pos: committed length
    state += spec
    last_tok = torch.zeros(B + 1, dtype=torch.int64, device=dev)
    last_tok[:B] = torch.arange(1, B + 1)
    capture = dev.type == "cuda" and args.lower == "aoti"
    try:
        rnd = Round(graph, B, state, last_tok, B, dev, capture)
    except Exception as e:                      # recorded in the JSON, not hidden; timed uncaptured then
        r["capture_error"] = f"{type(e).__name__}: {e}"[:500]
        capture = False
        rnd = Round(graph, B, state, last_tok, B, dev, capture)
    r["load_and_capture_s"] = round(time.time() - t, 1)
    r["parity_vs_eager"] = round_parity(model, k, rnd, state, last_tok)
    round_ms = timed(rnd.step, args.steps, dev)
    decode_ms = decode_row.get("replay_ms_per_step")
    r.update({"captured": capture, "round_ms": round(round_ms, 3), "decode_ms": decode_ms,
              "round_over_decode_step": round(round_ms / decode_ms, 3) if decode_ms else None,
              "ms_per_token_at": {str(a): round(round_ms / a, 3) for a in ACCEPTANCE_LENGTHS + (float(k + 1),)
                                  if a <= k + 1}})
    nbytes = round_weight_bytes(model, B, k)
    r.update({"round_weight_bytes": nbytes, "round_bandwidth_limit_ms": round(nbytes / bw * 1e3, 3) if bw else None})
    if args.profile and dev.type == "cuda":
        try:
            split = profile_round(rnd.step, 5, k)
        except ValueError as e:
            r["round_split_error"] = str(e)
        else:
            r["round_split_us"] = split
            r["draft_ms_per_token"] = round(split["draft_us"] / k / 1e3, 4)
            r["verify_ms"] = round(split["verify_us"] / 1e3, 3)
            r["verify_over_decode_step"] = round(split["verify_us"] / 1e3 / decode_ms, 3) if decode_ms else None
            layers, full = cfg.num_layers, args.layers_full
            if layers < full:        # bench_big LAYERS_METHOD: what scales with the main model's layers is
                scale = full / layers - 1                   # the verify less its lm_head and sample, and the commit
                layer_us = split["verify_us"] - split["verify_fixed_us"]
                full_ms = round_ms + scale * (layer_us + split["commit_us"]) / 1e3
                verify_ms = (split["verify_us"] + scale * layer_us) / 1e3
                r["round_ms_full_projection"] = round(full_ms, 3)
                r["ms_per_token_at_acceptance_full_projection"] = {str(a): round(full_ms / a, 3)
                                                                  for a in ACCEPTANCE_LENGTHS}
                r["verify_ms_full_projection"] = round(verify_ms, 3)
                dfull = decode_row.get("step_ms_full_projection")
                if dfull:
                    r["round_over_decode_step_full_projection"] = round(full_ms / dfull, 3)
                    r["verify_over_decode_step_full_projection"] = round(verify_ms / dfull, 3)
    if args.eager_steps:
        from onegraph.custom_ops.sample import Sampling
        from onegraph.graphs import spec_graphs
        rows = torch.arange(B, device=dev)
        samp = Sampling().tensors(B, dev)
        with torch.no_grad():
            r["eager_round_ms"] = round(timed(lambda: spec_graphs.step(model, k, last_tok.index_select(0, rows),
                                                                        rows, *samp, *state), args.eager_steps, dev), 3)
    del rnd, graph, state
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return r
