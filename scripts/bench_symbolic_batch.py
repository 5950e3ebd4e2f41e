"""One decode graph with a symbolic batch dim vs one graph per batch bucket: replay time per bucket (each captured
in its own CUDA graph), compile seconds, and whether the outputs agree. If one graph replays as fast, an artifact
would compile once instead of once per bucket.

    python -m onegraph.scripts.bench_symbolic_batch --shape 35b --layers 4 --batches 1,8,64 --out sym.json
    python -m onegraph.scripts.bench_symbolic_batch --shape tiny --device cpu --dtype float32 --lower export --out t.json

Per --kernels mode (auto: the hand-written Triton lowerings, as exported; reference: every op from its pure-torch
reference, Inductor writing the kernels): the per-bucket graphs are traced as the exporter traces them
(export/trace.py, B static), and one graph with B = Dim("B", min(batches)..max(batches)) traced at the largest
batch. All are lowered as the exporter lowers them (scripts/bench_lower_set.py Lowerer: its worker processes,
concurrently, so compile_s of each is measured under the same load).

The graph is only as symbolic as its ops' Python allows. Every decision an op takes from B at trace time (the
Triton GEMV's tile by M == 1, GEMV vs cuBLAS at M > 16, the MoE's grouped path at B * top_k > E, a launch plan
from next_pow2(B)) is a guard on B: torch.export's run_decompositions does not refuse one, it logs "Ignored
guard" and either keeps the branch the example took for every B in the range, or specializes B to the example
(int() of a size). The JSON therefore reports, per mode, the batch dim as traced (symbolic and its range, or
the value it was specialized to) and the guards logged on the way with their source lines; a specialized
"symbolic" graph is not lowered (it is the per-bucket graph of the example batch).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from onegraph.commands.bench_common import SHAPES, random_shape_model, replay_us
from onegraph.commands.bench_common import sync as _sync

GUARD_LOGGER = "torch.fx.experimental.symbolic_shapes"
GUARD_WORDS = ("guard added", "Ignored guard", "range_refined_to_singleton")
MAX_GUARDS = 30


@contextlib.contextmanager
def guard_messages():
    """Collect torch's shape-guard log lines (its `dynamic` log, INFO) while tracing -> list of str. The
    equalities that merely tie inputs together (check_shape, produce_guards) are left out."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if any(w in msg for w in GUARD_WORDS) and "check_shape" not in msg and "produce_guards" not in msg:
                msg = msg.split(", for more info")[0]
                if msg not in lines and len(lines) < MAX_GUARDS:
                    lines.append(msg[:300])

    log = logging.getLogger(GUARD_LOGGER)
    saved = log.handlers[:], log.level, log.propagate
    log.handlers = [Collect()]                  # the lines go to the JSON, not to stderr (torch's own handlers)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield lines
    finally:
        log.handlers, log.level, log.propagate = saved[0], saved[1], saved[2]


def batch_dim(ep) -> dict:
    """The traced decode graph's batch dim (its first user input, tokens [B]): symbolic with its range, or an int."""
    name = ep.graph_signature.user_inputs[0]
    node = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == name)
    b = node.meta["val"].shape[0]
    # a size specialized while decomposing keeps its SymInt, and its symbol is replaced by a number in the
    # shape env (range_constraints then no longer holds it)
    expr = b if isinstance(b, int) else b.node.shape_env.simplify(b.node.expr)
    if isinstance(expr, int) or expr.is_number:
        return {"symbolic": False, "specialized_to": int(expr)}
    vr = ep.range_constraints[expr]
    return {"symbolic": True, "range": [int(vr.lower), int(vr.upper) if vr.upper.is_finite else None]}


def accepted(ep, model, batches: list[int], max_seq_len: int) -> tuple[list[int], dict]:
    """-> (the batches the program's guards accept, {refused batch: the failed guard}). ep.module() checks its
    guards before it runs; here they are checked alone, on meta inputs (only sizes matter)."""
    from onegraph.graphs.signature import graph_spec
    from onegraph.export.entry import example_inputs
    guards, ok, refused = getattr(ep.module(), "_guards_fn", None), [], {}
    if guards is None:                          # a torch without the module's guard check: trust no other batch
        raise RuntimeError("this torch's ExportedProgram.module() has no _guards_fn: the batches a symbolic graph "
                           "accepts cannot be checked")
    for B in batches:
        try:
            guards(*example_inputs(graph_spec(model, "decode", B, max_seq_len, torch.float32), "meta"))
            ok.append(B)
        except AssertionError as e:
            refused[str(B)] = str(e)[:300]
    return ok, refused


def trace_all(model, batches: list[int], kernels: str, args, dev) -> tuple[dict, dict, dict]:
    """-> (traced programs by tag, their trace rows, the symbolic report). Tags: static_<kernels>_b<B>, and
    symbolic_<kernels>_<i>: the symbolic graphs, each traced with B = Dim(min(batches), max(batches)) at the
    largest batch no earlier one accepts (at least 2), until every batch is covered or was the largest left
    when its round found no graph for it (an error, a specialized batch dim, a guard refusing it)."""
    from onegraph.export.trace import trace
    from onegraph.graphs.signature import graph_spec
    from torch.export import Dim
    dtype = model.embed_tokens.weight.dtype
    eps, rows = {}, {}
    for B in batches:
        t = time.time()
        tag = f"static_{kernels}_b{B}"
        eps[tag], hist = trace(model, graph_spec(model, "decode", B, args.max_seq_len, dtype), dev, kernels)
        rows[tag] = {"kernels": kernels, "batch": B, "trace_s": round(time.time() - t, 1), "nodes": sum(hist.values())}
    report: dict = {"dim": f"Dim('B', min={min(batches)}, max={max(batches)})", "segments": []}
    left = list(batches)
    while left:
        tag, t = f"symbolic_{kernels}_{len(report['segments'])}", time.time()
        # torch.export specializes a dim whose example is 1 (refused for a Dim): B = 1 is traced at 2
        seg: dict = {"tag": tag, "example_batch": max(left + [2]), "covers": []}
        report["segments"].append(seg)
        spec = graph_spec(model, "decode", seg["example_batch"], args.max_seq_len, dtype)
        top = max(left)
        try:
            with guard_messages() as guards:
                ep, hist = trace(model, spec, dev, kernels, batch=Dim("B", min=min(batches), max=max(batches)))
        except Exception as e:                 # recorded, not hidden: the per-bucket graphs are still measured
            seg.update(error=f"{type(e).__name__}: {e}"[:1500], guards=guards)
            left.remove(top)
            continue
        seg.update(batch_dim(ep), guards=guards)
        rows[tag] = {"kernels": kernels, "batch": "symbolic", "trace_s": round(time.time() - t, 1),
                     "nodes": sum(hist.values())}
        if seg["symbolic"]:
            try:
                seg["covers"], seg["refused"] = accepted(ep, model, left, args.max_seq_len)
            except RuntimeError as e:          # no guard check: no batch is served by this graph
                seg["error"] = str(e)
        else:
            rows[tag]["not_lowered"] = "the batch dim was specialized: this is the static graph of the example batch"
        if seg["covers"]:
            eps[tag] = ep
        # every round retires at least the largest batch left: covered, or with no symbolic graph
        left = [b for b in left if b not in seg["covers"] and b != top]
    uncovered = [b for b in batches if not any(b in g["covers"] for g in report["segments"])]
    # None: some batch has no symbolic graph (why: in the segment that had it as its largest batch left)
    report["graphs_needed"] = None if uncovered else sum(bool(g["covers"]) for g in report["segments"])
    report["uncovered"] = uncovered
    return eps, rows, report


def covers(tag: str, B: int, reports: dict) -> bool:
    if tag.startswith("static_"):
        return tag.endswith(f"_b{B}")
    seg = next(g for r in reports.values() for g in r["segments"] if g["tag"] == tag)
    return B in seg.get("covers", [])


def bench_batch(model, graphs: dict, B: int, reports: dict, args, dev) -> dict:
    """Every graph that serves B, on one state: the same step from the same state (outputs compared with the
    first graph: ids exact, logits max |diff|), then µs per step (a captured CUDA graph's replay; the CPU: an
    uncaptured step)."""
    from onegraph.models.qwen3_5.model import new_state
    from onegraph.runtime.cuda_graphs import CapturedDecode
    from onegraph.runtime.executor import Sampling

    from .bench_big import UncapturedDecode
    state = new_state(model.cfg, B, args.max_seq_len, model.embed_tokens.weight.dtype, dev)
    last_tok = torch.arange(1, B + 2, device=dev)                 # [B + 1]: slot B is the scratch slot
    capture = dev.type == "cuda" and args.lower == "aoti"
    runners = {tag: (CapturedDecode(g.run_with_stream, B, state, last_tok, B, dev) if capture
                     else UncapturedDecode(g, state, last_tok, dev))
               for tag, g in graphs.items() if covers(tag, B, reports)}
    rows, pos, samp = list(range(B)), [args.position] * B, [Sampling()] * B
    saved, saved_tok = [s.clone() for s in state], last_tok.clone()
    outs = {}
    with torch.no_grad():
        for tag, r in runners.items():          # the same step from the same state for each
            for s, v in zip(state, saved):
                s.copy_(v)
            last_tok.copy_(saved_tok)
            outs[tag] = [t.clone() for t in r.step(rows, pos, samp)]
        first = next(iter(outs))               # the per-bucket graph of the first --kernels mode
        parity = {}
        for tag, (ids, logits) in outs.items():
            # a symbolic graph against the per-bucket graph of its own kernels, the others against the first
            vs = f"static_{tag.split('_')[1]}_b{B}" if tag.startswith("symbolic_") else first
            if tag != vs:
                parity[tag] = {"vs": vs, "ids_equal": bool(torch.equal(ids, outs[vs][0])),
                               "max_logit_diff": round(float((logits.float() - outs[vs][1].float()).abs().max()), 5)}
        us = {}
        for tag, r in runners.items():
            if capture:
                us[tag] = round(replay_us(r.graphs[0], 5, args.steps), 1)
            else:
                for _ in range(2):
                    r.step(rows, pos, samp)
                _sync(dev)
                t = time.perf_counter()
                for _ in range(args.steps):
                    r.step(rows, pos, samp)
                _sync(dev)
                us[tag] = round((time.perf_counter() - t) / args.steps * 1e6, 1)
    del runners, state
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"batch": B, "captured": capture, "us_per_step": us, "parity": parity}


def lower_graphs(eps: dict, res: dict, weights: dict, args, dev, work: Path, save) -> dict:
    """-> graph objects by tag: AOTInductor packages (the exporter's workers, concurrently) bound to the
    in-memory weights, or (--lower export) the traced programs run as torch.export modules. Each compile_s goes
    into res["graphs"] as it is done (saved: a run stopped by a time limit keeps them)."""
    from onegraph.export.staging import interruptible
    from onegraph.export.workers import auto_jobs, usable_cores
    from onegraph.runtime.executor import AotiGraph

    from .bench_big import ExportedGraph
    from .bench_lower_set import Lowerer
    if args.lower == "export":
        return {tag: ExportedGraph(ep) for tag, ep in eps.items()}
    jobs = args.jobs or auto_jobs(len(eps), dev)
    res["lowering"] = {"jobs": jobs, "compile_threads_per_worker": max(1, usable_cores() // jobs)}
    t0 = time.time()

    def finished(done) -> None:
        for d in done:
            res["graphs"][d.tag]["compile_s"] = round(d.seconds, 1)
            save()

    with interruptible():                      # SIGTERM (a `timeout`): the workers are stopped
        lowerer = Lowerer(work, dev, jobs)
        try:
            for tag, ep in eps.items():
                finished(lowerer.submit(tag, ep))
            while lowerer.pending:
                finished(lowerer.poll(5.0))
        finally:
            lowerer.close()
    res["lowering"]["wall_s"] = round(time.time() - t0, 1)
    return {tag: AotiGraph(work / f"{tag}.pt2", weights, dev) for tag in eps}


def summarize(res: dict) -> dict:
    """Per kernels mode: the symbolic graphs needed for all batches, each batch's symbolic replay time over its
    per-bucket graph's, and the symbolic graphs' compile seconds against the per-bucket graphs' sum."""
    out, g = {}, res["graphs"]
    for k in res["kernels"]:
        ratios = {}
        for row in res["replay"]:
            us = row["us_per_step"]
            for tag in us:
                if tag.startswith(f"symbolic_{k}_"):
                    ratios[str(row["batch"])] = round(us[tag] / us[f"static_{k}_b{row['batch']}"], 3)
        sym_c = [r.get("compile_s") for t, r in g.items() if t.startswith(f"symbolic_{k}_") and "not_lowered" not in r]
        static_c = [g[f"static_{k}_b{B}"].get("compile_s") for B in res["batches"]]
        out[k] = {"symbolic_graphs_needed": res["symbolic"][k]["graphs_needed"],
                  "symbolic_over_static_replay": ratios or None,
                  "symbolic_compile_s_sum": round(sum(sym_c), 1) if sym_c and None not in sym_c else None,
                  "static_compile_s_sum": round(sum(static_c), 1) if None not in static_c else None}
    return out


def main(argv=None) -> int:
    ints = lambda v: sorted({int(x) for x in v.split(",")})  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="35b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="only the first N decoder layers (0: all)")
    ap.add_argument("--batches", type=ints, default=[1, 8, 64])
    ap.add_argument("--kernels", default="auto,reference", help="comma-separated: auto, reference")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--position", type=int, default=1024, help="context length each row decodes at")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--lower", default="aoti", choices=["aoti", "export"],
                    help="export: run the traced programs uncaptured, no AOTInductor (CPU tests: seconds)")
    ap.add_argument("--jobs", type=int, default=0, help="lowering workers (0: as the exporter sizes them)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    kernels = [k for k in args.kernels.split(",") if k]
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_symbolic_batch: needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    if not kernels or set(kernels) - {"auto", "reference"} or min(args.batches) < 1 or len(args.batches) < 2:
        print("bench_symbolic_batch: --kernels takes auto and/or reference; --batches two or more positive ints",
              file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    t = time.time()
    model, full = random_shape_model(args.shape, args.layers, getattr(torch, args.dtype), dev)
    cmd = " ".join(sys.argv[1:] if argv is None else argv)
    res = {"command": "python -m onegraph.scripts.bench_symbolic_batch " + cmd,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "shape": args.shape, "layers": len(model.cfg.layer_types), "layers_full": full, "dtype": args.dtype,
           "batches": args.batches, "kernels": kernels, "lower": args.lower, "position": args.position,
           "build_s": round(time.time() - t, 1), "symbolic": {}, "graphs": {}, "replay": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: out.write_text(json.dumps(res, indent=2) + "\n")  # noqa: E731
    eps = {}
    for k in kernels:
        e, rows, report = trace_all(model, args.batches, k, args, dev)
        eps.update(e)
        res["graphs"].update(rows)
        res["symbolic"][k] = report
        save()
    weights = {f"model.{n}": p for n, p in model.named_parameters()}
    weights.update({f"model.{n}": b for n, b in model.named_buffers()})
    with tempfile.TemporaryDirectory(prefix="onegraph-symbolic-") as work:
        graphs = lower_graphs(eps, res, weights, args, dev, Path(work), save)
        del eps
        save()
        for B in args.batches:
            res["replay"].append(bench_batch(model, graphs, B, res["symbolic"], args, dev))
            print(json.dumps(res["replay"][-1]), file=sys.stderr, flush=True)
            save()
    res["summary"] = summarize(res)
    save()
    print(json.dumps(res["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
