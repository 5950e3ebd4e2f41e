"""Lowering time of an artifact's full graph set at a real shape, through the exporter's own stages, without a
checkpoint on disk: a seeded random model built in memory (the 35B shape: 69 GB of bf16, more than the H200
machine's 64 GB disk), every graph traced as `onegraph export` traces it (export/trace.py, largest first:
pipeline.lowering_order) and lowered by the exporter's worker processes (export/workers.py), the tracing of
the next graph overlapping the lowering of the previous ones. Nothing is written but the JSON (the .pt2
packages go to a temporary directory, removed at the end).

    python -m onegraph.scripts.bench_lower_set --shape 35b --out lower_35b.json       # decode 1..64 + prefill 16,64,256
    python -m onegraph.scripts.bench_lower_set --shape tiny --device cpu --batch-sizes 1,2 --prefill-chunks 16 --out t

Memory: a worker receives each program saved without its weights (export/program.py: the parameters as meta
tensors) and the weights once, through torch.multiprocessing: CUDA tensors as IPC handles (the 35B model's
69 GB stay in this process's GPU memory), CPU tensors in shared memory, so no worker holds a copy (the JSON
records the largest worker's peak RSS and the least free GPU memory). The workers bind the real tensors, as
the exporter's do, so what is timed is the exporter's lowering, whatever Inductor reads of the values.

Splitting: the JSON is rewritten after every graph, so a run killed by a time limit still says which graphs
were done and when. `--graphs decode_b1,prefill_t256` lowers a subset; `--resume` lowers only the graphs the
--out JSON does not hold yet and appends a run (each run's wall time is its own: the full set's wall time is
only measured by a single run).
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from onegraph.commands.bench_common import SHAPES, random_shape_model


class Lowerer:
    """Lowers traced programs into `work` as the exporter does: in `jobs` worker processes, or (jobs 1) in this
    process. submit(tag, ep) and poll() return the graphs finished meanwhile as export/workers.py Done rows."""

    def __init__(self, work: Path, device: torch.device, jobs: int):
        from onegraph.export.workers import LoweringPool
        self.work, self.device, self.jobs = work, device, jobs
        self.pool = LoweringPool(jobs, device, 1, work / "logs") if jobs > 1 else None
        self.shared = False

    def submit(self, tag: str, ep) -> list:
        from onegraph.export.aoti import lower_aoti
        from onegraph.export.program import save_without_weights, weights_of
        from onegraph.export.workers import Done
        out = self.work / f"{tag}.pt2"
        if self.pool is None:
            t = time.perf_counter()
            lower_aoti(ep, out)
            return [Done(tag, time.perf_counter() - t)]
        program = self.work / f"{tag}.program.pt2"
        save_without_weights(ep, program)
        if not self.shared:                     # every graph of one model binds the same weights: shared once
            self.pool.share(0, weights_of(ep))
            self.shared = True
        self.pool.submit(tag, 0, program, out, True)
        return self.pool.poll(0)

    def poll(self, timeout: float) -> list:
        return self.pool.poll(timeout) if self.pool is not None else []

    @property
    def pending(self) -> int:
        return self.pool.pending if self.pool is not None else 0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def worker_peak_rss_gb() -> float:
    """The largest peak RSS among this process's finished children (the workers, once closed), GB."""
    return round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6, 2)      # ru_maxrss: KiB


def device_free_gb(dev: torch.device) -> float | None:
    return round(torch.cuda.mem_get_info(dev)[0] / 1e9, 1) if dev.type == "cuda" else None


def main(argv=None) -> int:
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="35b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="only the first N decoder layers (0: all)")
    ap.add_argument("--batch-sizes", type=ints, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--prefill-chunks", type=ints, default=[16, 64, 256])
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--jobs", type=int, default=0, help="lowering workers (0: as the exporter sizes them)")
    ap.add_argument("--graphs", default="", help="comma-separated graph names (decode_b8, prefill_t64): a subset")
    ap.add_argument("--resume", action="store_true", help="skip the graphs --out already holds; append a run")
    ap.add_argument("--trace-only", action="store_true", help="trace and save the programs, lower nothing (tests)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_lower_set: needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    from onegraph.export.pipeline import lowering_order
    from onegraph.export.staging import interruptible
    from onegraph.export.trace import trace
    from onegraph.export.workers import auto_jobs, usable_cores
    from onegraph.graphs.signature import graph_spec
    out = Path(args.out)
    res = json.loads(out.read_text()) if args.resume and out.exists() else {"graphs": {}, "runs": []}
    specs = lowering_order([("decode", b) for b in sorted(set(args.batch_sizes))] +
                           [("prefill", t) for t in sorted(set(args.prefill_chunks))])
    names = {f"{k}_{'t' if k == 'prefill' else 'b'}{b}": (k, b) for k, b in specs}
    wanted = [n for n in args.graphs.split(",") if n] or list(names)
    unknown = [n for n in wanted if n not in names]
    if unknown:
        print(f"bench_lower_set: --graphs {unknown} are not in this set: {list(names)}", file=sys.stderr)
        return 2
    todo = [n for n in names if n in wanted and n not in res["graphs"]]
    dev = torch.device(args.device)
    t0 = time.time()
    model, full = random_shape_model(args.shape, args.layers, getattr(torch, args.dtype), dev)
    dtype = model.embed_tokens.weight.dtype
    jobs = 1 if args.trace_only else args.jobs or auto_jobs(len(todo), dev)
    run = {"command": "python -m onegraph.scripts.bench_lower_set " + " ".join(sys.argv[1:] if argv is None else argv),
           "graphs": todo, "jobs": jobs, "cores": usable_cores(),
           "compile_threads_per_worker": max(1, usable_cores() // jobs), "build_s": round(time.time() - t0, 1),
           "device_free_GB_min": device_free_gb(dev)}
    res.update({"shape": args.shape, "layers": len(model.cfg.layer_types), "layers_full": full, "dtype": args.dtype,
                "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                "torch": torch.__version__, "max_seq_len": args.max_seq_len,
                "params": sum(p.numel() for p in model.parameters())})
    res["runs"].append(run)
    out.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: out.write_text(json.dumps(res, indent=2) + "\n")  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="onegraph-lower-set-"))
    lowerer, started, traced = None, time.time(), {}

    def finished(done) -> None:
        for d in done:
            res["graphs"][d.tag] = dict(traced[d.tag], compile_s=round(d.seconds, 1),
                                        done_at_s=round(time.time() - started, 1),
                                        package_MB=round((work / f"{d.tag}.pt2").stat().st_size / 1e6, 2))
            run["device_free_GB_min"] = min(filter(None, [run["device_free_GB_min"], device_free_gb(dev)]),
                                            default=None)
            print(f"{d.tag}: compiled in {d.seconds:.1f} s, done at {time.time() - started:.1f} s",
                  file=sys.stderr, flush=True)
            save()

    save()
    try:
        with interruptible():                  # SIGTERM (a `timeout`): the workers are stopped, the JSON says so
            lowerer = None if args.trace_only else Lowerer(work, dev, jobs)
            for name in todo:
                kind, bucket = names[name]
                t = time.time()
                ep, hist = trace(model, graph_spec(model, kind, bucket, args.max_seq_len, dtype), dev)
                traced[name] = {"trace_s": round(time.time() - t, 1), "nodes": sum(hist.values())}
                if args.trace_only:
                    from onegraph.export.program import save_without_weights
                    save_without_weights(ep, work / f"{name}.program.pt2")
                    res["graphs"][name] = dict(traced[name], program_MB=round(
                        (work / f"{name}.program.pt2").stat().st_size / 1e6, 2))
                    save()
                    continue
                finished(lowerer.submit(name, ep))
                del ep
            while lowerer is not None and lowerer.pending:
                finished(lowerer.poll(5.0))
                run["device_free_GB_min"] = min(filter(None, [run["device_free_GB_min"], device_free_gb(dev)]),
                                                default=None)
        run["wall_s"] = round(time.time() - started, 1)
    except BaseException as e:
        run["interrupted"] = f"{type(e).__name__}: {e}"[:300] + f" after {time.time() - started:.1f} s"
        run["running_at_exit"] = lowerer.pool.running() if lowerer is not None and lowerer.pool else []
        raise
    finally:
        if lowerer is not None:
            lowerer.close()
        run["worker_peak_rss_GB"] = worker_peak_rss_gb()
        run["this_process_peak_rss_GB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)
        res["all_done"] = all(n in res["graphs"] for n in names)
        save()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: v for k, v in run.items() if k != "graphs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
