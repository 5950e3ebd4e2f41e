"""Decode latency of one real-shape graph (Qwen3.5-35B-A3B by default) on a CUDA device, with seeded
random weights built on the device: replayed CUDA graph of the lowered decode graph vs the same
onegraph model eager, and the bandwidth limit measured in the same run.

    python -m onegraph.scripts.bench_big --batch 1,64 --profile --out benchmarks/h200_35b.json
    python -m onegraph.scripts.bench_big --batch 1 --prefill 512,2048 --out ttft.json     # + TTFT per prompt length
    python -m onegraph.scripts.bench_big --batch 8 --prefill 512 --max-seq-len 34816 --interleave 8 --out il.json
    python -m onegraph.scripts.bench_big --batch 1,8 --transformers --out hf.json         # + transformers eager
    torchrun --nproc-per-node 2 -m onegraph.scripts.bench_big --batch 1,64 --out tp2.json # tensor parallel
    python -m onegraph.scripts.bench_big --batch 1 --layers 4 --speculative-tokens 1,2,3,4 --profile --out spec.json

--layers N builds only the first N decoder layers (the config's layer pattern; 4 = one 3 GDN + 1 attention
unit of the 35B model), which lowers in a fraction of the full graph's time; with --profile the JSON adds
figures projected to the full depth, labelled *_full_projection, and the method in "method".
--speculative-tokens K1,K2,.. adds a random MTP head and, per K and batch, times the speculative round graph
(draft K with the head, verify K+1 rows with the main model, accept, commit, catch up) against the decode
step of the same model: scripts/bench_big_spec.py. Random weights give no meaningful acceptance: none is
reported, only ms per token at assumed acceptance lengths. A cheap cross-check of the verify's cost: it is
a decode step over B*(K+1) rows, so --batch B*(K+1) approximates its main-model pass.
--shape tiny --device cpu --lower export runs the same code paths on the CPU in seconds (tests).

Under torchrun every rank builds the same seeded weights, keeps its shard (models/qwen3_5/tp.py's plan), lowers
its own decode graph (NCCL collectives as graph nodes) and replays it captured in a CUDA graph, with
the one broadcast per step that the TP runtime does; rank 0 writes the JSON.

The 69 GB of bf16 weights cannot be written to an artifact on the device's 64 GB disk, so this
bench lowers the decode graph into a temporary package and binds the in-memory weights to it
(the same AotiGraph + CapturedDecode path the runtime uses); nothing is saved but the JSON.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from onegraph.commands.bench_common import REGIONS, bytes_per_step, hf_decode_ms, shape_config, state_bytes_per_step
from onegraph.commands.bench_common import sync as _sync


LAYERS_METHOD = (
    "--layers N: the model has the first N of the full model's decoder layers (the same layer pattern), every "
    "other part at the full shape; measured figures (replay_ms_per_step, round_ms, weight bytes, bandwidth "
    "limits) are of that N-layer model. *_full_projection figures are projections, not measurements, from "
    "the profiler's device events of single steps (launch gaps included): decode: layers_span_ms = from the "
    "end of the step's first Triton kernel (the embedding gather) to the start of lm_head (its longest GEMM), "
    "per_layer_ms = layers_span_ms / N, step_ms_full_projection = replay_ms_per_step + (layers_full - N) * "
    "per_layer_ms (the final norm, one kernel, is counted as layer time: the projection errs high by "
    "(layers_full / N - 1) times its few us). Speculative round: split in time order at its sample calls "
    "(round_split_us: draft = up to the k-th, verify = up to the (k+1)-th, commit = up to the head catch-up's "
    "first GEMM, catch-up = the rest); round_ms_full_projection = round_ms + (layers_full / N - 1) * "
    "(verify_us - verify_fixed_us + commit_us), verify_fixed_us = the verify's lm_head and sample kernel "
    "time; the draft and the catch-up run the head only and do not scale with the main model's layers. Check: "
    "the same command without --layers measures the full decode step")


def copy_bandwidth(device, mib: int = 2048) -> float:
    """bytes moved (read + write) per second by a device-to-device copy."""
    a = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 20
    for _ in range(n):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * n / (time.perf_counter() - t)


def region_bytes(model, B: int) -> dict:
    """Weight bytes per decode step of the dense projections (every 2-D weight but the embedding and the
    MoE block's) and of the MoE block (router, the experts the batch touches, the shared expert)."""
    cfg, dense, moe = model.cfg, 0, 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name.startswith("mtp."):                 # the MTP head (--speculative-tokens): no decode step reads it
            continue
        if ".mlp." in name:
            if ".experts." in name:
                nbytes = int(nbytes * (1 - (1 - cfg.top_k / cfg.num_experts) ** B))
            moe += nbytes
        elif p.dim() == 2 and not name.endswith("embed_tokens.weight"):
            dense += nbytes
    return {"gemm": dense, "moe": moe}


def profile_regions(step, n: int):
    """-> (µs per step by region, top 15 kernels µs per step) from the torch profiler over n steps."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    per_kernel, largest_gemm, launches = {}, 0.0, 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            launches += 1
            per_kernel[ev.name] = per_kernel.get(ev.name, 0.0) + ev.device_time / n
            if any(p in ev.name.lower() for p in dict(REGIONS)["gemm"]):
                largest_gemm = max(largest_gemm, ev.device_time)
    regions = {}
    for name, us in per_kernel.items():
        low = name.lower()
        region = next((r for r, pats in REGIONS if any(p in low for p in pats)), "other")
        regions[region] = regions.get(region, 0.0) + us
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
    regions = {k: round(v, 1) for k, v in sorted(regions.items(), key=lambda kv: -kv[1])}
    regions["total"] = round(sum(per_kernel.values()), 1)
    regions["largest_single_gemm(lm_head)"] = round(largest_gemm, 1)
    regions["kernels_per_step"] = round(launches / n, 1)
    return regions, [{"kernel": k[:120], "us": round(v, 1)} for k, v in top]


def step_parity(model, cap, state, last_tok, rows: list[int], pos, samp, dev, steps: int = 1) -> dict:
    """`steps` replayed steps, each next to one eager step from the same state (random weights, greedy),
    teacher-forced by the replay (its state and ids carry on): ids equal and the max fp32 logit
    difference over all of them (the artifact fixture's bf16 bound is 0.25, or twice eager's own measured
    bf16-vs-fp32 gap where larger: runtime/fixture.py fixture_tolerance), and per step."""
    from onegraph.graphs.eager import router_margins
    from onegraph.runtime.executor import Sampling
    slots, per_step = torch.tensor(rows, device=dev), []
    for i in range(steps):
        p = [x + i for x in pos]
        saved = [s.clone() for s in state]
        with torch.no_grad(), router_margins(model) as margins:   # eager first (it leaves last_tok alone),
            ids_e, logits_e = model.decode(last_tok.index_select(0, slots), slots, torch.tensor(p, device=dev),
                                           *Sampling().tensors(len(rows), dev), *state)
        for s, v in zip(state, saved):
            s.copy_(v)
        ids_r, logits_r = (t.clone() for t in cap.step(rows, p, samp))   # then the replay, whose state carries on
        # the eager step's smallest router margin: read a differing id against it (runtime/fixture.py)
        per_step.append(dict(parity(ids_r, logits_r, ids_e, logits_e),
                             rows_ids_differ=int((ids_r != ids_e).sum()),
                             min_router_margin=round(min(margins, default=float("inf")), 5)))
    worst = max(per_step, key=lambda r: r["max_logit_diff"])
    return dict(worst, ids_equal=all(r["ids_equal"] for r in per_step), steps=steps,
                rows_ids_differ=sum(r["rows_ids_differ"] for r in per_step),
                differing_rows_max_top2_gap=max((r["differing_rows_max_top2_gap"] for r in per_step
                                                 if r["differing_rows_max_top2_gap"] is not None), default=None),
                min_top2_gap=min(r["min_top2_gap"] for r in per_step),
                min_router_margin=min(r["min_router_margin"] for r in per_step),
                per_step=per_step if steps > 1 else None)


@torch.no_grad()
def identical_experts_(model) -> None:
    """Every expert of each MoE layer := its expert 0. The MoE output is then expert0(x) times the sum of
    the normalised top-k weights (1) whichever experts the router picks, so a bf16 rounding that flips
    a near-tie in the router no longer moves the logits; what replay vs eager still differ by is the
    rest of the model's rounding."""
    from onegraph.models.qwen3_5.model import SparseMoe
    for m in model.modules():
        if isinstance(m, SparseMoe):
            m.experts.gate_up_proj[1:] = m.experts.gate_up_proj[:1]
            m.experts.down_proj[1:] = m.experts.down_proj[:1]


def parity(ids_r, logits_r, ids_e, logits_e) -> dict:
    """Lowered vs eager outputs: ids equal, max logit difference, and the scale it should be read against
    (logit std, smallest top-2 gap: a gap below the difference can flip a greedy id; and the widest eager
    top-2 gap among the rows whose ids differ, null if none: the gap a flip crossed)."""
    top2 = logits_e.float().topk(2, dim=-1).values                           # [B, 2]
    gap, differ = top2[:, 0] - top2[:, 1], (ids_r != ids_e).reshape(-1)
    return {"ids_equal": bool(torch.equal(ids_r, ids_e)),
            "max_logit_diff": round(float((logits_r.float() - logits_e.float()).abs().max()), 4),
            "logit_std": round(float(logits_e.float().std()), 3),
            "min_top2_gap": round(float(gap.min()), 4),
            "differing_rows_max_top2_gap": round(float(gap[differ].max()), 4) if differ.any() else None}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


class ExportedGraph:
    """--lower export: the traced, decomposed graph run as torch.export's module (no AOTInductor: seconds
    instead of a minute per graph on the CPU, for tests), with AotiGraph's run(inputs) -> outputs; state
    inputs are mutated in place as the lowered graph does."""

    def __init__(self, ep):
        self.module = ep.module()

    def run(self, inputs):
        with torch.no_grad():
            return list(self.module(*inputs))


class UncapturedDecode:
    """CapturedDecode's step() without a CUDA graph (--lower export, or the CPU): tokens gathered from
    last_tok, the graph called, last_tok[slots] = ids."""

    def __init__(self, graph, state, last_tok, dev):
        self.graph, self.state, self.last_tok, self.dev = graph, state, last_tok, dev

    def step(self, rows, positions, sampling):
        slots = torch.tensor(rows, device=self.dev)
        samp = [torch.cat(col) for col in zip(*(s.tensors(1, self.dev) for s in sampling))]   # 4 x [n]
        ids, logits = self.graph.run([self.last_tok.index_select(0, slots), slots,
                                      torch.tensor(positions, device=self.dev)] + samp + list(self.state))[:2]
        self.last_tok.index_copy_(0, slots, ids)
        return ids, logits


def _trace(model, kind: str, bucket: int, args, dev, r: dict, k: int = 0):
    from onegraph.export.entry import graph_spec
    from onegraph.export.trace import trace
    t = time.time()
    ep, hist = trace(model, graph_spec(model, kind, bucket, args.max_seq_len, model.embed_tokens.weight.dtype, k),
                     dev, args.kernels, fold_norms=not args.no_fold_norms,
                     batch_invariant=args.batch_invariant and kind in ("decode", "spec"))   # as export does
    r["trace_s"] = round(time.time() - t, 1)
    r["graph_nodes"] = sum(hist.values())
    return ep


def lower_all(model, wanted: list[tuple[str, int, int]], args, dev) -> dict:
    """Every decode and prefill graph of the run traced first, then lowered side by side in worker processes
    (export/workers.py, as `onegraph export` does: the in-memory weights shared with them, not copied), so a
    run of several 35B graphs (150-300 s each) fits one sitting. wanted: (kind, bucket, k), k a spec round's
    drafts (0 for decode / prefill) -> {(kind, bucket, k): (package, timings)}, which
    `lower` then binds. {} (each graph lowered in `lower`, one after another) with --jobs 1, one graph,
    --lower export or tensor parallel."""
    from onegraph.export.program import save_without_weights, weights_of
    from onegraph.export.workers import LoweringPool, auto_jobs
    jobs = min(len(wanted), args.jobs or auto_jobs(len(wanted), dev))
    if jobs < 2 or args.lower != "aoti" or model.tp > 1:
        return {}
    work = Path(tempfile.mkdtemp(prefix="bench_big_lower_"))
    pool, timings, done = LoweringPool(jobs, dev, 1, work / "logs"), {}, {}
    shared: dict = {}
    pool.share(0, shared)
    t0 = time.time()
    try:
        for kind, bucket, k in wanted:
            tag, r = f"{kind}_{bucket}_k{k}", {}
            ep = _trace(model, kind, bucket, args, dev, r, k)
            save_without_weights(ep, work / f"{tag}.program.pt2")
            # one shared dict, grown by each graph's weights before it is submitted (a spec round's add the MTP
            # head's); a worker gets it with its first task: spec graphs come first in `wanted`
            shared.update(weights_of(ep))
            del ep
            timings[tag] = r
            pool.submit(tag, 0, work / f"{tag}.program.pt2", work / f"{tag}.pt2", True)
        while pool.pending:
            for d in pool.poll(1.0):
                timings[d.tag]["compile_s"] = round(d.seconds, 1)
                done[d.tag] = work / f"{d.tag}.pt2"
                log(d.tag, "trace_s", timings[d.tag]["trace_s"], "compile_s", timings[d.tag]["compile_s"])
    finally:
        pool.close()
    log("lowered", len(done), "graphs in", jobs, "workers:", round(time.time() - t0, 1), "s")
    return {(kind, bucket, k): (done[f"{kind}_{bucket}_k{k}"], dict(timings[f"{kind}_{bucket}_k{k}"],
                                                                  lowered_in_parallel=jobs))
            for kind, bucket, k in wanted}


def lower(model, weights, kind: str, bucket: int, args, dev, r: dict, k: int = 0):
    """Trace + lower one graph (k: a spec round's drafts) and bind the in-memory weights -> AotiGraph (or,
    with --lower export, an ExportedGraph); timings go into r. A graph lower_all lowered is bound as it is."""
    from onegraph.export.aoti import lower_aoti
    from onegraph.runtime.executor import AotiGraph
    if (kind, bucket, k) in getattr(args, "prelowered", {}):
        pkg, timings = args.prelowered[(kind, bucket, k)]
        r.update(timings)
        return AotiGraph(pkg, weights, dev, args.loader_cls)
    ep = _trace(model, kind, bucket, args, dev, r, k)
    if args.lower == "export":
        return ExportedGraph(ep)
    t = time.time()
    pkg = lower_aoti(ep, Path(tempfile.mkdtemp()) / f"{kind}.pt2", eager_rounding=True)
    r["compile_s"] = round(time.time() - t, 1)
    log(kind, bucket, "trace_s", r["trace_s"], "compile_s", r["compile_s"])
    del ep
    return AotiGraph(pkg, weights, dev, args.loader_cls)


def bench_prefill(model, weights, T: int, args, dev, bw: float) -> dict:
    """TTFT of a T-token prompt into an empty slot as ONE prefill graph call of chunk T (the artifact's
    largest chunk bucket would be T), lowered vs the same model eager, plus ids/logits parity; the weight
    bytes the call reads (at T = 512 nearly every expert) and, with --profile, its kernel time by region."""
    from onegraph.models.qwen3_5.model import new_state
    from onegraph.runtime.executor import Sampling
    r = {"prompt_tokens": T}
    graph = lower(model, weights, "prefill", T, args, dev, r)
    state = new_state(model.cfg, 1, args.max_seq_len, model.embed_tokens.weight.dtype, dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    one = lambda v: torch.tensor([v], device=dev)  # noqa: E731
    head = [torch.randint(0, model.cfg.vocab_size, (T,), generator=g).to(dev), one(0), one(0), one(T),
            *Sampling().tensors(1, dev)]

    def timed(fn, reps):
        fn()
        _sync(dev)
        t = time.perf_counter()
        for _ in range(reps):
            out = fn()
        _sync(dev)
        return (time.perf_counter() - t) / reps * 1e3, out

    with torch.no_grad():
        ms, (ids_r, logits_r) = timed(lambda: graph.run(head + state), args.prefill_reps)
        ids_r, logits_r = ids_r.clone(), logits_r.clone()
        e_ms, (ids_e, logits_e) = timed(lambda: model.prefill(*head, *state), 1)
    nbytes = bytes_per_step(model, T)           # every expert some token of the chunk routes to, expected
    r.update({"ttft_ms": round(ms, 2), "prefill_tok_s": round(T / ms * 1e3, 1), "eager_ms": round(e_ms, 2),
              "speedup_vs_eager": round(e_ms / ms, 2),
              "parity_vs_eager": parity(ids_r, logits_r, ids_e, logits_e), "weight_bytes": nbytes,
              "bandwidth_limit_ms": round(nbytes / bw * 1e3, 3) if bw else None,
              "fraction_of_bandwidth_limit": round(nbytes / bw * 1e3 / ms, 3) if bw else None})
    if args.profile and dev.type == "cuda":
        with torch.no_grad():
            r["regions_us"], r["top_kernels_us"] = profile_regions(lambda: graph.run(head + state), args.prefill_reps)
        r["region_fraction_of_bandwidth"] = {k: round(nb / (r["regions_us"][k] * 1e-6) / bw, 3)
                                             for k, nb in region_bytes(model, T).items() if r["regions_us"].get(k)}
    del graph, state
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return r


def bench_interleave(model, weights, args, dev) -> dict:
    """scripts/bench_interleave.py's measurement through an Engine over this run's in-memory graphs (the weights
    do not fit the device's disk as an artifact): --interleave streams decode at the smallest --batch bucket that
    holds them while one --interleave-prompt-token prompt is admitted in chunks of each --interleave-chunk size,
    once with the engine's default budget (one chunk per step) and once whole (all its chunks back to back,
    the stall interleaving replaces: its TTFT is the chunked prompt's prefill time): the trade-off of the
    chunk between the streams' inter-token gaps and the prompt's TTFT."""
    from onegraph.export.entry import graph_spec
    from onegraph.graphs.signature import state_manifest
    from onegraph.runtime import Engine
    from onegraph.runtime.executor import GraphExecutor
    from .bench_interleave import budget_runs
    S, chunks, dtype = args.interleave, sorted(args.interleave_chunk), model.embed_tokens.weight.dtype
    B = min(b for b in args.batch if b >= S)
    graphs, meta = {}, {}
    for kind, bucket in [("decode", B)] + [("prefill", T) for T in chunks]:
        spec = graph_spec(model, kind, bucket, args.max_seq_len, dtype)
        graphs[spec.name], meta[spec.name] = lower(model, weights, kind, bucket, args, dev, {}), spec.manifest()
    ex = GraphExecutor({n: g.run for n, g in graphs.items()}, meta, state_manifest(model, args.max_seq_len, dtype),
                       S + 1, args.max_seq_len, model.cfg.vocab_size, dev)
    ex.path = f"{args.lower}-{dev.type}"
    if dev.type == "cuda" and args.lower == "aoti":
        ex._capture(graphs, copy_in=True)               # as GraphExecutor.from_artifact does
    eng = Engine(ex)                                    # its default budget: one chunk per step
    try:
        runs = budget_runs(eng, ["chunk", "whole"], S, args.interleave_prompt, 8, 0, chunks)
    finally:
        eng.close()
    r = {"streams": S, "decode_bucket": B, "prompt_tokens": args.interleave_prompt, "prefill_chunks": chunks,
         "path": ex.path, "runs": runs,
         "chunked_prefill_tok_s": {str(x["prefill_chunk"]): round(args.interleave_prompt / x["long_ttft_ms"] * 1e3, 1)
                                   for x in runs if x["budget"] == "whole"}}
    log(json.dumps(r))
    del eng, ex, graphs
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return r


def bench_batch(model, weights, B: int, args, dev, bw: float) -> dict:
    """Lower the decode graph for B rows, capture it, time replay and eager -> one result row."""
    from onegraph.models.qwen3_5.model import new_state
    from onegraph.runtime.cuda_graphs import CapturedDecode
    from onegraph.runtime.executor import Sampling
    from onegraph.runtime.ranks import StepBroadcast
    cfg, r = model.cfg, {"batch": B}
    graph = lower(model, weights, "decode", B, args, dev, r)
    t = time.time()
    state = new_state(cfg, B, args.max_seq_len, model.embed_tokens.weight.dtype, dev, model.tp)
    last_tok = torch.arange(1, B + 2, device=dev)                  # [B + 1]: slot B is the scratch slot
    slots = torch.arange(B, device=dev)
    eager_in = [last_tok[:B].clone(), slots, torch.full((B,), args.position, device=dev)] + Sampling().tensors(B, dev)
    # tensor parallel: the runtime's step broadcast (one packed buffer) first, led by rank 0, received by the others
    link = StepBroadcast({"decode": [(t.dtype, list(t.shape)) for t in eager_in]}, dev) if model.tp > 1 else None
    bcast = None if link is None else (lambda: link.lead("decode", eager_in)) if args.rank == 0 else link.receive

    def timed(step, n: int) -> float:
        for _ in range(3):
            step()
        _sync(dev)
        t = time.perf_counter()
        for _ in range(n):
            if bcast is not None:
                bcast()
            step()
        _sync(dev)
        return (time.perf_counter() - t) / n * 1e3

    with torch.no_grad():       # the lowered graph called directly, as the TP runtime does today
        uncaptured_ms = timed(lambda: graph.run(eager_in + state), args.steps)
    r["uncaptured_replay_ms_per_step"] = round(uncaptured_ms, 3)
    capture = dev.type == "cuda" and args.lower == "aoti"     # else (the CPU, tests) the same steps uncaptured
    r["captured"] = capture
    try:
        cap = CapturedDecode(graph.run_with_stream, B, state, last_tok, B, dev) if capture else \
            UncapturedDecode(graph, state, last_tok, dev)
    except Exception as e:                       # recorded in the JSON, not hidden: no captured rows then
        r["capture_error"] = f"{type(e).__name__}: {e}"[:500]
        log(json.dumps(r))
        return r
    r["load_and_capture_s"] = round(time.time() - t, 1)
    rows, pos, samp = list(range(B)), [args.position] * B, [Sampling()] * B
    r["parity_vs_eager"] = step_parity(model, cap, state, last_tok, rows, pos, samp, dev, args.parity_steps)
    replay_ms = timed(lambda: cap.step(rows, pos, samp), args.steps)
    if args.profile and dev.type == "cuda":
        if args.rank == 0:
            r["regions_us_per_step"], r["top_kernels_us_per_step"] = profile_regions(
                lambda: cap.step(rows, pos, samp), 10)
            reg = r["regions_us_per_step"]
            r["kernels_per_layer"] = round(reg["kernels_per_step"] / cfg.num_layers, 1)
            # achieved bandwidth of a region = its weight bytes / its kernel time, as a fraction of copy bandwidth
            r["region_fraction_of_bandwidth"] = {k: round(nb / (reg[k] * 1e-6) / bw, 3)
                                                 for k, nb in region_bytes(model, B).items() if reg.get(k)}
            if cfg.num_layers < args.layers_full:    # --layers: projected to the full depth (res["method"])
                from onegraph.scripts.bench_big_spec import decode_layers_us, device_events
                try:
                    spans = [decode_layers_us(e) for e in device_events(lambda: cap.step(rows, pos, samp), 5)]
                except ValueError as e:
                    r["projection_error"] = str(e)
                else:
                    per_layer_ms = sum(spans) / len(spans) / 1e3 / cfg.num_layers
                    r.update({"layers_span_ms": round(per_layer_ms * cfg.num_layers, 4),
                              "per_layer_ms": round(per_layer_ms, 4), "step_ms_full_projection": round(
                                  replay_ms + (args.layers_full - cfg.num_layers) * per_layer_ms, 3)})
        else:                                   # the same steps, so the collectives pair up
            for _ in range(10):
                cap.step(rows, pos, samp)
    with torch.no_grad():
        eager_ms = timed(lambda: model.decode(*eager_in, *state), args.eager_steps)
    nbytes = bytes_per_step(model, B)
    sbytes = state_bytes_per_step(model, B, args.position)
    r.update({"replay_ms_per_step": round(replay_ms, 3), "replay_tok_s": round(B / replay_ms * 1e3, 1),
              "eager_ms_per_step": round(eager_ms, 3), "replay_speedup_vs_eager": round(eager_ms / replay_ms, 2),
              "weight_bytes_per_step": nbytes, "bandwidth_limit_ms": round(nbytes / bw * 1e3, 3) if bw else None,
              "fraction_of_bandwidth_limit": round(nbytes / bw * 1e3 / replay_ms, 3) if bw else None,
              # the limit counted both ways: weights only, and weights + the state the step reads and writes
              "state_bytes_per_step": sbytes,
              "bandwidth_limit_with_state_ms": round((nbytes + sbytes) / bw * 1e3, 3) if bw else None,
              "fraction_of_limit_with_state": round((nbytes + sbytes) / bw * 1e3 / replay_ms, 3) if bw else None,
              "peak_memory_GB": round(torch.cuda.max_memory_allocated() / 1e9, 1) if dev.type == "cuda" else None})
    del cap, graph, state
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return r


def bench_transformers(cfg_dict: dict, batches: list[int], steps: int, dev) -> list[dict]:
    """transformers eager on the same config with its own seeded random weights (our scales; 69 GB in bf16):
    decode ms per step at each batch after a 32-token prompt. Records whether flash-linear-attention was
    importable (transformers then runs its GDN kernels instead of the pure-torch recurrence)."""
    import transformers as tf
    from onegraph.models.qwen3_5.tiny import randomise_
    with torch.device(dev):          # on the device directly: transformers computes its rope buffers
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(**cfg_dict), dtype=torch.bfloat16)
    with torch.no_grad():
        randomise_(model, dev)                           # the scales random_model gives ours
    rows = []
    for B in batches:
        ms = hf_decode_ms(model.eval(), B, steps, dev, prompt_len=32)
        rows.append({"batch": B, "transformers_eager_ms_per_step": round(ms, 2),
                     "transformers_tok_s": round(B / ms * 1e3, 1), "transformers": tf.__version__,
                     "fla_kernels": importlib.util.find_spec("fla") is not None})
        log(json.dumps(rows[-1]))
    del model
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=lambda v: [int(x) for x in v.split(",")], default=[1],
                    help="comma-separated batch sizes, one lowered graph each")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--position", type=int, default=1024, help="context length each row decodes at")
    ap.add_argument("--kernels", default="auto", choices=["auto", "reference"])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--eager-steps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="per-region kernel breakdown (torch profiler)")
    ap.add_argument("--prefill", type=lambda v: [int(x) for x in v.split(",")], default=[],
                    help="comma-separated prompt lengths: TTFT as one prefill graph of that chunk each")
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--interleave", type=int, default=0, metavar="STREAMS",
                    help="also: STREAMS decoding through an Engine over the in-memory graphs while a long prompt is "
                         "admitted (scripts/bench_interleave.py's figures; a --batch bucket must hold STREAMS)")
    ap.add_argument("--interleave-prompt", type=int, default=32768, help="the long prompt's tokens (--interleave)")
    ap.add_argument("--interleave-chunk", type=lambda v: [int(x) for x in v.split(",")], default=[2048],
                    help="its prefill chunks, comma-separated: one run per chunk (--interleave)")
    ap.add_argument("--transformers", action="store_true",
                    help="then transformers eager on the same config and batches (its own random weights)")
    ap.add_argument("--fp32-reduce", action="store_true", help="the export option of that name (TP-invariant sums)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the export option of that name: decode and round graphs of the ops' one-row plans (its "
                         "whole-step cost, run beside a run without it)")
    ap.add_argument("--parity-steps", type=int, default=1, help="replayed steps compared with eager, each")
    ap.add_argument("--identical-experts", action="store_true",
                    help="copy expert 0 into every expert of each layer: a router flip then cannot change the "
                         "output, which separates routing flips from every other numeric difference")
    ap.add_argument("--no-fold-norms", action="store_true",
                    help="keep the batch-1 layer-input norms as kernels (export/fold_norm.py): the before of a pair")
    ap.add_argument("--router", default="random", choices=["random", "decisive"],
                    help="decisive: random routers with wide top-k margins (models/qwen3_5/decisive.py), so parity rows "
                         "are not decided by router near-ties")
    ap.add_argument("--layers", type=int, default=0,
                    help="build only the first N decoder layers (the config's layer pattern); with --profile the "
                         "JSON adds figures projected to the full depth (see its 'method')")
    ap.add_argument("--speculative-tokens", type=lambda v: [int(x) for x in v.split(",")], default=[],
                    help="comma-separated K: per K and batch, a speculative round graph (MTP head drafts K, the "
                         "main model verifies K+1 rows) timed against the decode step (scripts/bench_big_spec.py)")
    ap.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                    help="with --speculative-tokens: the head drafts over N ids (export --draft-vocab; 0: all)")
    ap.add_argument("--shape", default="qwen3.5-35b-a3b", choices=["qwen3.5-35b-a3b", "tiny"],
                    help="the model config built with random weights (tiny: the builtin model's shape, for tests)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--lower", default="aoti", choices=["aoti", "export"],
                    help="export: run torch.export's traced graph uncaptured instead of an AOTInductor package "
                         "(the CPU tests: seconds instead of a minute per graph)")
    ap.add_argument("--quant", default="none", choices=["none", "fp8", "int8"],
                    help="quantize the random weights as `onegraph export --quant` does (before concatenation)")
    ap.add_argument("--fp8-lm-head", action="store_true",
                    help="with --quant fp8: the head as block FP8 too, as `onegraph export --fp8-lm-head` does")
    ap.add_argument("--jobs", type=int, default=0,
                    help="graphs lowered side by side in worker processes before any is timed (default: as many as "
                         "the machine's cores and memory allow, export/workers.py); 1: each lowered when it is timed")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.prefill and max(args.prefill) > args.max_seq_len:      # checked before minutes of lowering
        print(f"bench_big: --prefill {max(args.prefill)} exceeds --max-seq-len {args.max_seq_len}", file=sys.stderr)
        return 2
    if args.interleave and not (max(args.batch) >= args.interleave and max(args.interleave_chunk) <= args.max_seq_len
                                and args.interleave_prompt + 32 <= args.max_seq_len):
        print(f"bench_big: --interleave {args.interleave} needs a --batch bucket of at least {args.interleave} rows and "
              f"--interleave-prompt + 32 tokens (each stream's) within --max-seq-len", file=sys.stderr)
        return 2
    if args.fp8_lm_head and args.quant != "fp8":
        print("bench_big: --fp8-lm-head needs --quant fp8", file=sys.stderr)
        return 2
    if args.batch_invariant:                            # the export's own check of what the option covers
        from onegraph.export.pipeline import ExportOptions
        try:
            ExportOptions(device=args.device, kernels=args.kernels, quant=args.quant, fp32_reduce=args.fp32_reduce,
                          batch_invariant=True).validate_batch_invariant()
        except ValueError as e:
            print(f"bench_big: {e}", file=sys.stderr)
            return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_big: needs a CUDA device", file=sys.stderr)
        return 2
    from onegraph.graphs.spec import check_k
    try:
        for k in args.speculative_tokens:
            check_k(k)
    except ValueError as e:
        print(f"bench_big: --speculative-tokens: {e}", file=sys.stderr)
        return 2
    from onegraph.models.qwen3_5.config import ModelConfig
    from onegraph.models.qwen3_5.fuse import fuse_projections
    from onegraph.checkpoint.load import shard_model
    from onegraph.models.qwen3_5.tiny import random_model
    from onegraph.runtime.ranks import init_from_torchrun, leave, native
    try:
        hf, args.layers_full = shape_config(args.shape, args.layers)   # --layers: the first N of the same pattern
    except ValueError as e:
        print(f"bench_big: {e}", file=sys.stderr)
        return 2
    args.rank, tp = init_from_torchrun(args.device)    # (0, 1) unless launched by torchrun
    if tp > 1 and args.speculative_tokens:
        print("bench_big: --speculative-tokens runs at tp 1 (the MTP head is not sharded)", file=sys.stderr)
        return 2
    args.loader_cls = native().Loader if tp > 1 else None   # TP: the runtime's GIL-free runner
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    res = {"command": ("torchrun --nproc-per-node {} -m ".format(tp) if tp > 1 else "python -m ")
           + "onegraph.scripts.bench_big " + " ".join(sys.argv[1:] if argv is None else argv),
           "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None, "torch": torch.__version__, "tp": tp,
           "shape": args.shape, "dtype": args.dtype, "lower": args.lower,
           "layers": len(ModelConfig.from_hf(hf).layer_types), "layers_full": args.layers_full,
           "position": args.position, "kernels": args.kernels, "fp32_reduce": args.fp32_reduce,
           "batch_invariant": args.batch_invariant, "identical_experts": args.identical_experts, "quant": args.quant,
           "router": args.router, "fold_norms": not args.no_fold_norms, "fp8_lm_head": args.fp8_lm_head}
    t = time.time()
    cfg = ModelConfig.from_hf(hf)
    model = random_model(cfg, dtype, dev, fp32_reduce=args.fp32_reduce,   # every rank: the same weights
                         router=args.router)
    if args.identical_experts:
        identical_experts_(model)
    if args.quant != "none":
        from onegraph.checkpoint.quant import quantize_model
        res["quantized_weights"] = quantize_model(model, args.quant)
        if args.fp8_lm_head:
            from onegraph.checkpoint.quant import quantize_lm_head
            quantize_lm_head(model)
        torch.cuda.empty_cache()
    if tp > 1:
        full, model = model, shard_model(model, args.rank, tp)
        del full
        torch.cuda.empty_cache()
    fuse_projections(model)                             # as export does: after sharding
    if args.speculative_tokens:
        from onegraph.scripts.bench_big_spec import attach_random_head
        attach_random_head(model, dev)                  # model.mtp, unfused as export leaves it
        if args.draft_vocab:                            # random weights: which ids makes no difference to the cost
            from onegraph.graphs.spec import prune_draft_vocab
            prune_draft_vocab(model, torch.arange(args.draft_vocab))
            res["draft_vocab"] = args.draft_vocab
    res["params_B"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 2)
    res["build_s"] = round(time.time() - t, 1)
    log("build_s", res["build_s"])
    res["copy_bandwidth_GBps"] = round(copy_bandwidth(dev) / 1e9, 1) if dev.type == "cuda" else None
    if cfg.num_layers < args.layers_full:
        res["method"] = LAYERS_METHOD
    weights = {f"model.{n}": p for n, p in model.named_parameters()}
    weights.update({f"model.{n}": b for n, b in model.named_buffers()})
    out = Path(args.out)
    save = (lambda: out.write_text(json.dumps(res, indent=2) + "\n")) if args.rank == 0 else (lambda: None)
    out.parent.mkdir(parents=True, exist_ok=True)
    wanted = ([("spec", B, k) for B in args.batch for k in args.speculative_tokens] + [("decode", B, 0) for B in args.batch]
              + [("prefill", T, 0) for T in args.prefill])
    wanted += [("prefill", T, 0) for T in args.interleave_chunk if args.interleave and ("prefill", T, 0) not in wanted]
    args.prelowered = lower_all(model, wanted, args, dev)
    res["batches"] = []
    for B in args.batch:
        r = bench_batch(model, weights, B, args, dev, (res["copy_bandwidth_GBps"] or 0) * 1e9)
        res["batches"].append(r)
        log(json.dumps(r))
        save()                                           # partial results survive a kill
    if args.speculative_tokens:
        from onegraph.scripts.bench_big_spec import NO_ACCEPTANCE, ROUND_VS_DECODE, bench_round
        res["speculative"], res["acceptance"], res["round_vs_decode"] = [], NO_ACCEPTANCE, ROUND_VS_DECODE
        for B, decode_row in zip(args.batch, res["batches"]):
            for k in args.speculative_tokens:
                r = bench_round(model, weights, B, k, args, dev, decode_row, (res["copy_bandwidth_GBps"] or 0) * 1e9,
                                lower)
                res["speculative"].append(r)
                log(json.dumps(r))
                save()
    res["prefill"] = []
    for T in args.prefill:
        res["prefill"].append(bench_prefill(model, weights, T, args, dev, (res["copy_bandwidth_GBps"] or 0) * 1e9))
        log(json.dumps(res["prefill"][-1]))
        save()
    if args.interleave:
        res["interleave"] = bench_interleave(model, weights, args, dev)
        save()
    if args.transformers and tp == 1:
        del model, weights
        torch.cuda.empty_cache()
        res["transformers"] = bench_transformers(hf, args.batch, max(3, args.eager_steps), dev)
        save()
    leave()
    if args.rank == 0:
        print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
