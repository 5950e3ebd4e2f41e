"""`onegraph bench`: decode speed of replayed graphs vs the same model eager (and transformers eager
when installed), side by side in one run, written as JSON with the command that made it.

    onegraph bench --preset tiny --out benchmarks/cpu_tiny.json
    onegraph bench --preset tiny --device cuda --dtype bfloat16 --out benchmarks/h200_tiny.json
    torchrun --nproc-per-node 2 -m onegraph bench --preset tiny --artifact TP2_DIR --out tp2.json

Tensor parallel (under torchrun, an exported TP artifact): rank 0 times the replay while the others follow
its steps, then every rank runs its eager shard in lockstep (the eager side's collectives pair up), then
rank 0 times the engine while the others follow again; rank 0 writes the JSON.

Metrics: decode ms/token and tok/s per batch size for each mode (a step of B rows yields B tokens),
prefill ms for one chunk, and host µs per engine step (CPU time outside the graph call:
copy-in + bookkeeping + reading ids). Timing asserts never live in tests; this is where speed is
measured.
"""
from __future__ import annotations

import argparse
import importlib.util
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .bench_common import emit, hf_decode_ms
from .bench_common import sync as _sync


def time_decode(executor, B: int, steps: int, warmup: int = 5) -> float:
    """ms per decode step of B rows (slots 0..B-1, each prefilled with a short prompt; each step feeds
    the ids the last one sampled, which is also what a tensor-parallel leader may do)."""
    from onegraph.runtime.executor import Sampling
    for s in range(B):
        executor.prefill([1 + s, 2, 3], s)
    slots = list(range(B))
    for _ in range(warmup):
        executor.decode_step(slots, [3] * B, [Sampling()] * B)
    _sync(executor.device)
    t = time.perf_counter()
    for i in range(steps):
        executor.decode_step(slots, [3 + i % 8] * B, [Sampling()] * B)
    _sync(executor.device)
    return (time.perf_counter() - t) / steps * 1e3


def time_prefill(executor, T: int, reps: int = 3) -> float:
    prompt = [7] * T
    executor.prefill(prompt, 0)
    _sync(executor.device)
    t = time.perf_counter()
    for _ in range(reps):
        executor.prefill(prompt, 0)
    _sync(executor.device)
    return (time.perf_counter() - t) / reps * 1e3


def engine_host_us(artifact: Path, device: str, n_tokens: int = 64, runs: int = 5,
                   speculation: bool | None = None) -> dict:
    """Engine host µs per decode step (a speculative round where the engine speculates), the median of `runs`
    greedy generations of n_tokens (one run on a busy host can read 2x: measured 69 vs 36 µs back to back on
    the H200), with that run's output tok/s (wall of generate(), prefill included) and, speculating, its mean
    accepted length."""
    import statistics

    from onegraph.runtime import Engine
    eng = Engine.from_artifact(artifact, max_slots=1, device=device, check_parity=False, speculation=speculation)
    n_tokens = min(n_tokens, eng.artifact.max_seq_len - 3 - eng.spec)    # the prompt is 3 tokens
    per_run, tok_s, accepted = [], [], []
    try:
        eng.generate([1, 2, 3], 8)
        for _ in range(runs):
            eng.step_us.clear()
            eng.counters.clear()
            t = time.perf_counter()
            eng.generate([1, 2, 3], n_tokens)
            tok_s.append(n_tokens / (time.perf_counter() - t))
            stats = eng.stats()
            per_run.append(stats["step_us"])
            accepted.append((stats["speculation"] or {}).get("mean_accepted_length"))
    finally:
        eng.close()
    # CPU time per step outside device waits: the graph launch counts (it is host work), the wait for the
    # previous step's event does not (reported apart as device_wait)
    hosts = [sum(us.get(k, 0) for k in ("copy_in", "replay", "bookkeeping", "host_read")) for us in per_run]
    i = hosts.index(statistics.median_low(hosts))                    # the median run's breakdown
    return {"speculative_tokens": eng.spec, "host_us_per_step": round(hosts[i], 2),
            "host_us_per_run": [round(h, 2) for h in hosts], "replay_call_us_per_step": round(per_run[i].get("replay", 0), 2),
            "breakdown_us": {k: round(v, 2) for k, v in per_run[i].items()}, "tok_s": round(tok_s[i], 1),
            "mean_accepted_length": None if accepted[i] is None else round(accepted[i], 3)}


def transformers_ms(model_dir: Path, device: str, dtype: torch.dtype, steps: int) -> float | None:
    try:
        import transformers
    except ImportError:
        return None
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    return hf_decode_ms(model, 1, steps, device)


class BenchError(ValueError):
    """A bad bench request: one line on stderr, exit 2."""


def _tp_init(args) -> tuple[int, int]:
    """(rank, tp): (0, 1) outside torchrun. An existing --artifact must be for --dtype / --device (the eager
    side is built from them); under torchrun it must exist and be exported for exactly this many ranks
    (bench does not export per rank)."""
    from onegraph.runtime import ranks
    from onegraph.runtime.artifact import is_artifact, load_manifest, tp_size
    m = None
    if args.artifact and is_artifact(args.artifact):
        m = load_manifest(args.artifact, None)
        if (m["dtype"], m["device"]["type"]) != (args.dtype, torch.device(args.device).type):
            raise BenchError(f"artifact {args.artifact} is {m['dtype']} on {m['device']['type']}: pass --dtype "
                             f"{m['dtype']} --device {m['device']['type']}")
        buckets = sorted(g["bucket"] for g in m["graphs"].values() if g["kind"] == "decode")
        if max(args.batch_sizes) > buckets[-1]:        # refused before the eager model loads
            raise BenchError(f"--batch-sizes {','.join(map(str, args.batch_sizes))} exceeds artifact "
                             f"{args.artifact}'s largest decode bucket {buckets[-1]}: pass --batch-sizes "
                             f"{','.join(map(str, buckets))} (or a subset)")
    if not ranks.launched_by_torchrun():
        return 0, 1
    if m is None:
        raise BenchError("under torchrun, bench replays an exported tensor-parallel artifact: pass --artifact DIR "
                         "(onegraph export MODEL --tp N --out DIR)")
    rank, world = ranks.init_from_torchrun(m["device"]["type"])
    tp = tp_size(m)
    if tp != world:
        ranks.leave()
        raise BenchError(f"artifact {args.artifact} is exported for tp={tp}, launched with {world} ranks")
    return rank, world


def run(args) -> dict | None:
    """-> the results (None on tensor-parallel ranks > 0)."""
    from onegraph.export.pipeline import ExportOptions, export
    from onegraph.checkpoint.load import load_model, model_dir
    from onegraph.runtime import ranks
    from onegraph.runtime.artifact import is_artifact
    from onegraph.runtime.executor import GraphExecutor
    torch.set_num_threads(args.threads)
    rank, tp = _tp_init(args)
    src = model_dir(args.preset)
    batch = tuple(sorted(set(args.batch_sizes)))
    artifact = Path(args.artifact) if args.artifact else Path(tempfile.mkdtemp(prefix="onegraph-bench-")) / "art"
    t = time.time()
    if not is_artifact(artifact):
        export(str(src), artifact, ExportOptions(device=args.device, dtype=args.dtype, batch_sizes=batch,
                                                 prefill_chunks=(args.prefill_chunk,), max_seq_len=args.max_seq_len,
                                                 speculative_tokens=args.speculative_tokens,
                                                 draft_vocab=args.draft_vocab),
               progress=not args.quiet)
    export_s = time.time() - t
    try:
        # 1. replay: rank 0 times it, the other ranks replay the steps it broadcasts
        replay = GraphExecutor.from_artifact(artifact, max_slots=max(batch), device=args.device, check_parity=False)
        if rank == 0:
            r_ms = {B: time_decode(replay, B, args.steps) for B in batch}
            prefill_ms = time_prefill(replay, args.prefill_chunk)
            replay.stop_followers()
        else:
            replay.follow()
        del replay
        # 2. eager: every rank its own shard, the same calls in the same order
        _, model, _ = load_model(src, args.dtype, args.device, tp=tp, rank=rank)
        eager = GraphExecutor.from_model(model, {"decode": list(batch), "prefill": [args.prefill_chunk]},
                                         max_slots=max(batch), max_seq_len=args.max_seq_len)
        e_ms = {B: time_decode(eager, B, max(3, args.steps // 10)) for B in batch}
        # 3. the engine's host time per step (rank 0's Engine leads a fresh executor on every rank)
        if rank > 0:
            GraphExecutor.from_artifact(artifact, max_slots=1, device=args.device, check_parity=False).follow()
            return None
        engine = engine_host_us(artifact, args.device)       # speculating where the artifact has the graphs
        spec_off = engine_host_us(artifact, args.device, speculation=False) if engine["speculative_tokens"] else None
    finally:
        ranks.leave()
    rows = [{"batch": B, "replay_ms_per_step": round(r_ms[B], 4), "eager_ms_per_step": round(e_ms[B], 4),
             "replay_tok_s": round(B / r_ms[B] * 1e3, 1), "eager_tok_s": round(B / e_ms[B] * 1e3, 1),
             "replay_speedup_vs_eager": round(e_ms[B] / r_ms[B], 2)} for B in batch]
    tf_ms = transformers_ms(src, args.device, model.embed_tokens.weight.dtype, max(3, args.steps // 10)) \
        if args.transformers and tp == 1 else None
    launcher = f"torchrun --nproc-per-node {tp} -m onegraph bench " if tp > 1 else "onegraph bench "
    return {
        "command": launcher + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "tp": tp, "preset": args.preset, "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "export_seconds": round(export_s, 1), "decode": rows,
        "prefill_ms": {str(args.prefill_chunk): round(prefill_ms, 3)},
        "engine": engine,
        "engine_speculation_off": spec_off,
        "transformers_eager_ms_per_token_bs1": None if tf_ms is None else round(tf_ms, 3),
    }


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1, else argparse's one-line usage error (not a traceback later)."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


def batch_sizes(text: str) -> list[int]:
    """--batch-sizes "1,4" -> [1, 4]; anything but positive integers is argparse's one-line usage error."""
    try:
        return [positive_int(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}") from None


def add_args(p) -> None:
    p.add_argument("--preset", default="tiny",
                   help="`tiny`, an HF-format model directory, or `qwen3.5-35b-a3b` (CUDA: the real shape with "
                        "random bf16 weights built on the device, lowered and replayed in memory; scripts/bench_big.py)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch-sizes", type=batch_sizes, default=[1, 4])
    p.add_argument("--prefill-chunk", type=positive_int, default=64)
    p.add_argument("--max-seq-len", type=positive_int, default=256)
    p.add_argument("--steps", type=positive_int, default=200)
    p.add_argument("--threads", type=positive_int, default=1, help="intra-op threads (1 for tiny CPU runs: less noise)")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                   help="export the MTP draft/verify graphs too; the engine is then timed with speculation on and off")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N", help="with --speculative-tokens: as export's")
    p.add_argument("--artifact", help="reuse (or create) the artifact at this path")
    p.add_argument("--no-transformers", dest="transformers", action="store_false")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--quiet", action="store_true")


def main(args) -> int:
    if args.preset == "qwen3.5-35b-a3b":           # real shape, random weights built on the GPU: scripts/bench_big.py
        if not args.out:
            print("bench: --out is required for the qwen3.5-35b-a3b preset", file=sys.stderr)
            return 2
        # a measurement script, not part of the installed package: run as a process, present in a source checkout
        if importlib.util.find_spec("onegraph.scripts.bench_big") is None:
            print("bench: the qwen3.5-35b-a3b preset runs scripts/bench_big.py, which only a source checkout of "
                  "onegraph has (pip install -e .)", file=sys.stderr)
            return 2
        return subprocess.call([sys.executable, "-m", "onegraph.scripts.bench_big", "--batch",
                                ",".join(map(str, args.batch_sizes)), "--profile", "--out", args.out])
    try:
        res = run(args)
    except BenchError as e:
        print(f"onegraph bench: error: {e}", file=sys.stderr)
        return 2
    if res is None:                                # a tensor-parallel follower: rank 0 reports
        return 0
    emit(res, args.out)
    return 0
