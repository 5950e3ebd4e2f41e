"""The `onegraph` command line: init-tiny, generate, export, inspect, eval, draft-vocab, bench, bench-serve, serve.

User errors (missing directory, bad ids, unknown model_type, bad artifact, a missing extra, an unusable
device or port) print one line to stderr and exit 2 — never a traceback — and are checked before any
load, trace or compile. docs/cli.md holds every command's usage (tests/test_cli_help.py keeps it equal
to this parser's).
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
from pathlib import Path


class UserError(Exception):
    pass


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UserError("--prompt-ids is empty")
    return ids


def load_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"--prompt needs {path} (or pass --prompt-ids)")
    return Tokenizer.from_file(str(path))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    # the defaults are the README's command 1 (runtime/text.py says why): text on the first try, seeded
    from onegraph.runtime.text import DEFAULT_SAMPLING as d
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=d["temperature"], help="0: greedy")
    p.add_argument("--top-k", type=int, default=d["top_k"], help="0: all tokens")
    p.add_argument("--top-p", type=float, default=d["top_p"])
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's eos ids")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt")
    g.add_argument("--prompt-ids")


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """Artifact replay options shared by generate and serve."""
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="CUDA: call the lowered decode graphs directly instead of replaying captured CUDA graphs")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-speculation", dest="speculation", action="store_const", const=False, default=None,
                   help="decode one token per step even if the artifact has speculative (MTP draft / verify) graphs")
    g.add_argument("--speculation", dest="speculation", action="store_const", const=True,
                   help="require the artifact's speculative graphs (the default uses them where present)")
    p.add_argument("--tp-timeout", type=float, default=300.0,
                   help="tensor parallel (under torchrun): seconds a rank waits in a collective for a peer "
                        "before it fails")


def add_allow_unused_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-unused-weights", action="store_true",
                   help="load a checkpoint that holds tensors the model does not consume (logged) instead of "
                        "refusing it; quantized or non-float weights are refused regardless")


def check_sampling(args) -> None:
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from onegraph.custom_ops.sample import check_sampling as check     # the engine's own check, once
    try:
        check(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        raise UserError(str(e)) from None


def cmd_init_tiny(args) -> int:
    from onegraph.models.qwen3_5.tiny import write_tiny
    d = Path(args.dir)
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise UserError(f"{d} exists and is not an empty directory: init-tiny writes a new one (remove it or "
                        f"pick another DIR)")
    print(write_tiny(args.dir))
    return 0


def is_artifact(path: str) -> bool:
    from onegraph.runtime.artifact import is_artifact as has_manifest
    return has_manifest(path)


def parse_buckets(text: str, flag: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise UserError(f"{flag} must list positive integers, got {text!r}")
    return vals


def spec_tokens(k: int | None) -> int:
    """--speculative-tokens: absent -> 0 (no speculative graphs); given, it must be in 1..4."""
    from onegraph.graphs.spec import check_k
    try:
        return 0 if k is None else check_k(k, "--speculative-tokens")
    except ValueError as e:
        raise UserError(str(e)) from None


def draft_vocab_size(n: int | None) -> int:
    """--draft-vocab: absent -> 0 (the whole vocabulary); given, at least 1 (its upper bound is the model's)."""
    if n is not None and n < 1:
        raise UserError(f"--draft-vocab must be >= 1 (the ids the head drafts over), got {n}")
    return n or 0


def cmd_export(args) -> int:
    from onegraph.runtime.checks import require_backend, usable_device
    require_backend(args.backend)              # before the load and the trace: both take seconds to minutes
    usable_device(args.device)
    from onegraph.export.pipeline import DEFAULT_CACHE_DIR, ExportOptions, export, summary_text
    opts = ExportOptions(device=args.device, dtype=args.dtype, backend=args.backend,
                         batch_sizes=parse_buckets(args.batch_sizes, "--batch-sizes"),
                         prefill_chunks=parse_buckets(args.prefill_chunks, "--prefill-chunks"),
                         max_seq_len=args.max_seq_len, tp=args.tp, kernels=args.kernels,
                         eager_rounding=not args.fused_rounding, fp32_reduce=args.fp32_reduce,
                         allow_unused_weights=args.allow_unused_weights, quant=args.quant,
                         speculative_tokens=spec_tokens(args.speculative_tokens), weights=args.weights,
                         fp8_lm_head=args.fp8_lm_head, draft_vocab=draft_vocab_size(args.draft_vocab),
                         draft_vocab_file=args.draft_vocab_file, batch_invariant=args.batch_invariant)
    from onegraph.export.staging import ExportInterrupted
    from onegraph.export.workers import LoweringError
    try:
        s = export(args.model, args.out, opts, progress=not args.quiet, force=args.force,
                   cache_dir=None if args.no_cache else args.cache_dir or DEFAULT_CACHE_DIR, jobs=args.jobs)
    except LoweringError as e:                  # the message names the graph, the cause and the log
        print(f"onegraph export: error: {e}", file=sys.stderr)
        return 1
    except ExportInterrupted as e:
        print(f"onegraph export: interrupted by {e}; --out {args.out} is untouched", file=sys.stderr)
        return 128 + e.signum
    print(summary_text(s))
    return 0


def cmd_inspect(args) -> int:
    from onegraph.export.pipeline import inspect
    if is_artifact(args.artifact):
        from onegraph.runtime.artifact import verify
        m = verify(args.artifact, files=not args.no_verify)     # ArtifactError names the damage: exit 2
        print(inspect(args.artifact, m))
        print(memory_text(Path(args.artifact), m))
        if args.no_verify:
            print("files: not verified (--no-verify)")
        else:
            print(f"files: {len(m['files'])} verified (sha256), as the load checks them")
        return 0
    if args.artifact != "tiny" and not (Path(args.artifact) / "config.json").is_file():
        raise UserError(f"{args.artifact} is neither an onegraph artifact (no manifest.json) nor a checkpoint "
                        f"directory (no config.json)")
    from onegraph.checkpoint.load import describe_checkpoint
    text, refusal = describe_checkpoint(args.artifact)
    print(text, flush=True)
    if refusal is not None:
        raise refusal              # one line on stderr, exit 2: what load_model / export would say
    return 0


def memory_text(path: Path, m: dict) -> str:
    """inspect's memory lines: bytes per slot at the artifact's max_seq_len, and with this machine's free
    memory on the artifact's device the largest --max-slots that fits (runtime/memory.py)."""
    import torch
    from onegraph.runtime import artifact, memory
    dev = torch.device(m["device"]["type"])
    need = memory.needed_bytes(path, m, 0, dev.type)
    lines = [f"memory: {need['state_per_slot']} bytes ({need['state_per_slot'] / memory.MIB:.2f} MiB) of state per "
             f"slot at max_seq_len {m['max_seq_len']}; weights {memory.size(need['weights'])}"
             + (" per rank" if artifact.tp_size(m) > 1 else "")
             + f"; workspace estimate {memory.size(need['workspace'])}"]
    if dev.type == "cuda" and not torch.cuda.is_available():
        lines.append("  no CUDA device here: run inspect on the serving machine for the largest --max-slots")
    else:
        free = memory.free_bytes(dev)
        fit = memory.max_slots_fitting(path, m, free, dev.type)
        lines.append(f"  {memory.size(free)} free on {dev.type} here: the largest --max-slots that fits is {fit}")
        ctx = {n: memory.max_seq_len_fitting(path, m, free, dev.type, n) for n in (1, 4, 16, 64)}
        lines.append("  the largest --max-seq-len an export could take here, by --max-slots: "
                     + ", ".join(f"{n}: {t}" for n, t in ctx.items()))
    lines.append(prefix_cache_text(m))
    return "\n".join(lines)


def prefix_cache_text(m: dict) -> str:
    """inspect's prefix cache line: the bytes of one cached block (runtime/prefix_cache.py), or why it is off."""
    from onegraph.runtime import prefix_cache
    C = max(g["bucket"] for g in m["graphs"].values() if g["kind"] == "prefill")
    from onegraph.runtime.artifact import tp_size
    why = prefix_cache.unsupported(m["state"], tp_size(m))
    if why:
        return f"prefix cache: {why}"
    n = prefix_cache.block_bytes(m["state"], C)
    return f"prefix cache: {n} bytes ({n / (1 << 20):.2f} MiB) per cached block of {C} tokens"


def cmd_eval(args) -> int:
    if args.device is not None:
        from onegraph.runtime.checks import usable_device
        usable_device(args.device)
    from onegraph.commands.eval import evaluate
    res = evaluate(args.model, args.text, args.max_tokens, args.ctx, args.batch, args.dtype, args.device,
                   progress=True, quant=args.quant, fp8_lm_head=args.fp8_lm_head)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['model']} ({res['mode']}, {res['dtype']}): {res['bits_per_byte']:.4f} bits/byte, perplexity "
              f"{res['perplexity']:.4f} over {res['tokens']} tokens ({res['bytes']} bytes, {res['windows']} windows "
              f"of {res['ctx']}) of {res['text']}")
    return 0


def prompt_ids(args, model_dir: Path, vocab: int):
    tok = load_tokenizer(model_dir) if (args.prompt is not None or (model_dir / "tokenizer.json").is_file()) else None
    if args.prompt is not None:
        ids = tok.encode(args.prompt).ids
        if not ids:
            raise UserError("--prompt encodes to no tokens")
    else:
        ids = parse_ids(args.prompt_ids)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UserError(f"prompt ids {bad[:5]} outside the vocabulary [0, {vocab})")
    return ids, tok


def emit(args, ids, token_ids, finish, tok, mode, extra=None) -> None:
    text = tok.decode(token_ids) if tok else None
    if args.json:
        print(json.dumps(dict({"token_ids": token_ids, "text": text, "finish_reason": finish, "prompt_ids": ids,
                               "mode": mode}, **(extra or {}))))
    else:
        print(text if text is not None else " ".join(map(str, token_ids)))


def cmd_generate(args) -> int:
    check_sampling(args)
    if not args.eager:
        if args.fp32_reduce:
            raise UserError("--fp32-reduce applies to --eager; an artifact runs with the option it was exported with")
        if args.allow_unused_weights:
            raise UserError("--allow-unused-weights applies to --eager (and export); an artifact holds only the "
                            "weights it uses")
        return generate_artifact(args)
    if args.speculation is not None:
        raise UserError("--speculation / --no-speculation apply to an artifact (export it with --speculative-tokens K)")
    if args.device not in (None, "cpu"):
        raise UserError(f"--device {args.device}: --eager runs on the CPU; export the model for {args.device} and "
                        f"generate from the artifact")
    import torch
    from onegraph.custom_ops.sample import Sampling
    from onegraph.graphs.eager import generate_eager
    from onegraph.checkpoint.load import load_model
    if is_artifact(args.model):
        raise UserError(f"{args.model} is an exported artifact: drop --eager to run its graphs")
    cfg, model, model_dir = load_model(args.model, args.dtype, fp32_reduce=args.fp32_reduce,
                                       allow_unused=args.allow_unused_weights)
    ids, tok = prompt_ids(args, model_dir, cfg.vocab_size)
    with torch.no_grad():
        res = generate_eager(model, ids, args.max_new_tokens,
                             Sampling(args.temperature, args.top_k, args.top_p, args.seed),
                             stop_ids=() if args.ignore_eos else cfg.eos_token_ids)
    emit(args, ids, res.token_ids, res.finish_reason, tok, "eager")
    return 0


def lead_or_follow(args, artifact: str, max_slots: int):
    """The verified Artifact on the rank that runs the engine -> (Artifact, None); under torchrun ranks > 0
    replay rank 0's steps until it stops (runtime/ranks.py) -> (None, their exit code)."""
    from onegraph.runtime import launch, ranks
    if args.tp_timeout <= 0 and ranks.launched_by_torchrun():
        raise UserError(f"--tp-timeout must be > 0 seconds, got {args.tp_timeout}")
    try:
        art = launch.lead_or_follow(artifact, max_slots, args.device, args.cuda_graphs, args.tp_timeout)
    except ranks.FollowerError as e:   # rank 0 exited or stopped answering: one line, not a traceback
        print(f"onegraph {args.cmd}: error: {e}", file=sys.stderr)
        return None, 1
    return art, None if art is not None else 0


def generate_artifact(args) -> int:
    from onegraph.runtime import Engine, ranks
    if not is_artifact(args.model):
        raise UserError(f"{args.model} is not an exported artifact (no manifest.json); export it first with "
                        f"`onegraph export {args.model} --out DIR`, or pass --eager")
    if args.device is not None:                # before the load hashes every file
        from onegraph.runtime.checks import usable_device
        usable_device(args.device)
    art, code = lead_or_follow(args, args.model, max_slots=1)
    if code is not None:
        return code
    engine = Engine.from_artifact(art, max_slots=1, cuda_graphs=args.cuda_graphs, speculation=args.speculation)
    try:
        cfg = engine.artifact.model
        ids, tok = prompt_ids(args, Path(args.model), cfg["vocab_size"])
        stop = () if args.ignore_eos else tuple(cfg["eos_token_ids"])
        res = engine.generate(ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, stop)
    finally:
        engine.close()                 # also releases tensor-parallel followers
        ranks.leave()
    if engine.error is not None:       # e.g. a tensor-parallel peer died mid-step
        print(f"onegraph generate: error: the engine failed: {engine.error}", file=sys.stderr)
        return 1
    emit(args, ids, res.token_ids, res.finish_reason, tok, "artifact",
         {"fixture": engine.fixture_report, "timings": res.timings, "speculation": res.speculation})
    return 0


def prefix_cache_bytes(args, art) -> int | None:
    """serve's prefix cache pool for Engine.from_artifact: 0 with --no-prefix-cache, --prefix-cache-gb G's
    bytes (Engine refuses a G larger than the memory left free, or an artifact the cache cannot hold: exit 2),
    else None (the default budget, runtime/prefix_cache.py) where the cache holds the artifact's state, and 0
    (said in the log) where it does not: tensor parallel."""
    from onegraph.runtime import prefix_cache
    if not args.prefix_cache:
        return 0
    if args.prefix_cache_gb is not None:
        return int(args.prefix_cache_gb * (1 << 30))
    why = prefix_cache.unsupported(art.state, art.tp)
    if why:
        import logging
        logging.getLogger("onegraph.runtime").warning("onegraph prefix cache: off by default here: %s", why)
        return 0
    return None


# The third-party top-level modules that server/ and uvicorn import and no other command needs, with the pip name
# that installs each. A GPU host installed with `pip install --no-deps` may lack them; only `serve` imports them.
SERVER_PACKAGES = {"fastapi": "fastapi", "starlette": "fastapi", "pydantic": "pydantic", "uvicorn": "uvicorn",
                   "prometheus_client": "prometheus-client"}


def import_server():
    """(uvicorn, server.app.create_app, server.limits), or UserError naming the missing package and its
    `pip install`: one line, not the ImportError's traceback. Named, not `pip install 'onegraph[...]'`:
    they are onegraph's own dependencies, and installing onegraph's would replace a GPU host's CUDA torch
    with the CPU build it pins."""
    try:
        from onegraph.server.app import create_app        # fastapi first: the package a user knows by name
        from onegraph.server import limits
        import uvicorn
    except ModuleNotFoundError as e:
        top = (e.name or "").partition(".")[0]
        if top not in SERVER_PACKAGES:
            raise                      # not a server package: a real bug, shown as one
        raise UserError(f"{top} is not installed (the HTTP server needs it): pip install "
                        f"{' '.join(dict.fromkeys(SERVER_PACKAGES.values()))}") from None
    return uvicorn, create_app, limits


def cmd_serve(args) -> int:
    """OpenAI-compatible HTTP server over one Engine. SIGTERM/SIGINT: stop accepting, cancel what
    is in flight (streams end with an error event), close the engine, exit 0."""
    import asyncio
    import contextlib
    import signal
    uvicorn, create_app, limits = import_server()        # first: its packages missing is a one-line error
    from onegraph.runtime import Engine, ranks
    from onegraph.runtime.checks import check_max_request_bytes, usable_device
    if not is_artifact(args.artifact):
        raise UserError(f"{args.artifact} is not an exported artifact (no manifest.json)")
    if args.max_slots < 1 or args.max_queue < 0:
        raise UserError("need --max-slots >= 1 and --max-queue >= 0")
    if args.prefill_budget is not None and args.prefill_budget < 1:
        raise UserError(f"--prefill-budget must be >= 1 tokens, got {args.prefill_budget}")
    check_max_request_bytes(args.max_request_bytes)
    if args.prefix_cache_gb is not None and not args.prefix_cache_gb > 0:     # also NaN
        raise UserError(f"--prefix-cache-gb must be > 0 GiB (--no-prefix-cache turns the cache off), got "
                        f"{args.prefix_cache_gb}")
    if args.device is not None:
        usable_device(args.device)
    # bind before the load (at 35B the load takes minutes): a bad or busy port costs nothing. Under
    # torchrun only rank 0 serves; the process group is not joined yet, so torchrun's RANK says which.
    sock = None
    if not ranks.launched_by_torchrun() or os.environ.get("RANK") == "0":
        sock = limits.bind(args.host, args.port)
    try:
        art, code = lead_or_follow(args, args.artifact, args.max_slots)   # tensor parallel: rank 0 serves
        if code is None:
            engine = Engine.from_artifact(art, max_slots=args.max_slots, max_queue=args.max_queue,
                                          cuda_graphs=args.cuda_graphs, speculation=args.speculation,
                                          prefill_budget=args.prefill_budget, prefill_chunk=args.prefill_chunk,
                                          prefix_cache_bytes=prefix_cache_bytes(args, art))
    except BaseException:              # a refused load: the port is free again at once
        if sock is not None:
            sock.close()
        raise
    if code is not None:               # a tensor-parallel follower, done
        return code
    name = args.served_model_name or Path(args.artifact).resolve().name
    app = create_app(engine, name, api_key=args.api_key, max_request_bytes=args.max_request_bytes)
    srv = app.state.server

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # runs as a signal handler: hand the work to the event loop, never take engine locks here
            srv.draining = True
            loop = getattr(self, "_loop", None)
            if loop is not None:
                loop.call_soon_threadsafe(srv.cancel_all)
            super().handle_exit(sig, frame)

        async def serve(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises a captured SIGTERM after shutting down (exit -15); a graceful
            # shutdown here is a success, so restore the handlers and return normally
            sigs = (signal.SIGINT, signal.SIGTERM)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=10))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        engine.close()                 # also releases tensor-parallel followers
        ranks.leave()
    return 0


# one example per subcommand: in its --help, and all of them in `onegraph --help`
EXAMPLES = {
    "init-tiny": "onegraph init-tiny checkpoints/tiny",
    "generate": 'onegraph generate artifacts/tiny --prompt "def fibonacci(n):" --max-new-tokens 32',
    "export": "onegraph export tiny --out artifacts/tiny --batch-sizes 1 --prefill-chunks 16",
    "bench": "onegraph bench --preset tiny --batch-sizes 1,4 --out bench.json",
    "bench-serve": "onegraph bench-serve --base-url http://127.0.0.1:8000 --num-requests 32 --concurrency 8 "
                   "--input-len 128 --output-len 64 --out serve.json",
    "inspect": "onegraph inspect artifacts/tiny",
    "eval": "onegraph eval artifacts/tiny --json",
    "draft-vocab": "onegraph draft-vocab tiny corpus.txt --out draft_vocab.json",
    "serve": "onegraph serve artifacts/tiny --port 8000",
}
REFERENCE_WIDTH = 110          # docs/cli.md's usage lines: fixed, whatever the terminal


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows every option's default, also for options without help text (argparse's
    ArgumentDefaultsHelpFormatter skips those), and keeps the examples' line breaks."""

    def _get_help_string(self, action):
        h = action.help or ""
        if ("%(default)" in h or not action.option_strings or action.nargs == 0     # a flag: its name says it
                or action.default in (None, argparse.SUPPRESS)):
            return h
        return f"{h} (default: %(default)s)".strip()

    def _format_action(self, action):
        if action.help is None and self._get_help_string(action):
            action = copy.copy(action)
            action.help = self._get_help_string(action)
        return super()._format_action(action)


def version_text() -> str:
    from importlib.metadata import version

    from onegraph import __version__
    return f"onegraph {__version__} (torch {version('torch')})"


def reference(parser: argparse.ArgumentParser) -> str:
    """Every subcommand's usage, as docs/cli.md shows it (tests/test_cli_help.py compares the two)."""
    out = []
    for p in parser.subcommands.values():
        p.formatter_class = functools.partial(HelpFormatter, width=REFERENCE_WIDTH)
        out.append(p.format_usage().removeprefix("usage: ").rstrip())
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="onegraph", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
                                 epilog="examples:\n" + "\n".join(f"  {e}" for e in EXAMPLES.values())
                                 + "\n\nevery command's options: onegraph COMMAND --help, or docs/cli.md")
    ap.add_argument("--version", action="version", version=version_text())
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    add = sub.add_parser

    def add_parser(name, help):
        return add(name, help=help, description=help, formatter_class=HelpFormatter,
                   epilog=f"example:\n  {EXAMPLES[name]}")
    sub.add_parser = add_parser
    ap.subcommands = sub.choices
    p = sub.add_parser("init-tiny", help="write the builtin tiny model as an HF checkpoint dir")
    p.add_argument("dir", help="a new (or empty) directory")
    p.set_defaults(fn=cmd_init_tiny)
    p = sub.add_parser("generate", help="generate from a model dir / `tiny` (--eager) or an artifact")
    p.add_argument("model", help="HF-format directory, `tiny`, or an exported artifact directory")
    p.add_argument("--eager", action="store_true", help="run the eager model (no graphs)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--fp32-reduce", action="store_true", help="(--eager) the model option export records "
                   "with the same name: fp32 row-parallel sums, rounded once")
    add_allow_unused_arg(p)
    p.add_argument("--device", default=None, help="artifact device (default: the one it was exported for)")
    add_runtime_args(p)
    add_sampling_args(p)
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("export", help="trace, lower and package a model into an artifact directory")
    p.add_argument("model", help="HF-format directory or `tiny`")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "xpu"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--backend", default="aoti", choices=["aoti", "onnx"])
    p.add_argument("--batch-sizes", default="1,2,4,8")
    p.add_argument("--prefill-chunks", default="16,64,256")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--kernels", default="auto", choices=["auto", "reference"],
                   help="auto: hand-written Triton kernels on CUDA; reference: Inductor-generated from the references")
    p.add_argument("--fused-rounding", action="store_true",
                   help="let fused kernels keep fp32 intermediates (faster, no longer bit-close to eager in bf16)")
    p.add_argument("--fp32-reduce", action="store_true",
                   help="row-parallel projections (o_proj, out_proj, MoE/MLP down) keep their fp32 sums through the "
                        "TP all-reduce and round once: bf16 ids then do not depend on --tp (export every TP degree "
                        "you compare with it, TP-1 included)")
    from onegraph.checkpoint.quant import QUANT_CHOICES
    p.add_argument("--quant", default="auto", choices=("auto", *QUANT_CHOICES),
                   help="dense projections' weights in the artifact (docs/export.md, Quantization): auto (default: as the "
                        "checkpoint), none (--dtype; a quantized checkpoint is dequantized), fp8 (e4m3, 128x128 "
                        "block scales, weight-only), int8 (W8A8: per-channel int8 weights, int8 activations per "
                        "token) or fp8-channel (W8A8 e4m3, per-channel / per-token): a float checkpoint is "
                        "quantized, one of that scheme kept as it is, another refused; recorded in the manifest")
    p.add_argument("--fp8-lm-head", action="store_true",
                   help="the output projection as block FP8 too (e4m3, 128x128 scales; default: float, as the official "
                        "FP8 format keeps it): half its bytes at decode, for a measured bits-per-byte cost "
                        "(docs/benchmarks.md); --backend aoti, --tp 1; recorded in the manifest")
    p.add_argument("--batch-invariant", action="store_true",
                   help="decode graphs give every row the bits it gets alone, whatever the batch and its neighbours "
                        "(one-row kernel plans at every bucket; docs/design.md, Batch invariance): --device cuda, "
                        "--quant none, --tp 1, no --fp32-reduce / --fp8-lm-head / --speculative-tokens; costs speed "
                        "above one row; recorded in the manifest")
    p.add_argument("--speculative-tokens", type=int, default=None, metavar="K",
                   help="also export speculative graphs: the checkpoint's MTP head drafts K (1..4) tokens per round, "
                        "verified by the model in one pass (a checkpoint with mtp.* weights; --backend aoti, --tp 1)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="with --speculative-tokens: the MTP head drafts over the N ids of --draft-vocab-file ranked "
                        "first (tiny: a builtin ranking); the verify still decides every token over the whole "
                        "vocabulary, so the output is unchanged (recorded in the manifest with the ids' sha256)")
    p.add_argument("--draft-vocab-file", default=None, metavar="FILE",
                   help="a draft-vocab JSON made by `onegraph draft-vocab MODEL TEXT... --out FILE`")
    p.add_argument("--weights", default="copy", choices=["copy", "reference"],
                   help="copy (default): the graph weights in the artifact's weights.safetensors; reference: the "
                        "artifact records the checkpoint's files (absolute path, size, sha256) and the recipe, and "
                        "makes the weights from them at every load after verifying each file (docs/export.md)")
    add_allow_unused_arg(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--force", action="store_true", help="replace an existing artifact at --out")
    p.add_argument("--jobs", type=int, default=None,
                   help="graphs lowered at once, each in a worker process (default: as many as the cores and "
                        "free memory allow; 1: in this process)")
    p.add_argument("--cache-dir", default=None,
                   help="compiled graphs reused across exports, keyed by graph, weights, options and toolchain "
                        "(default: ~/.cache/onegraph/aoti)")
    p.add_argument("--no-cache", action="store_true", help="compile every graph; read and write no cache")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("bench", help="decode speed: replayed graphs vs eager (vs transformers), JSON out")
    from onegraph.commands.bench import add_args as bench_args
    bench_args(p)
    p.set_defaults(fn=lambda a: __import__("onegraph.commands.bench", fromlist=["main"]).main(a))

    p = sub.add_parser("bench-serve", help="serving benchmark of any OpenAI-compatible server: streamed "
                       "requests at a concurrency or a Poisson rate; tok/s, TTFT, TPOT, ITL; JSON + PNG out")
    from onegraph.commands.bench_serve import add_args as bench_serve_args
    bench_serve_args(p)
    p.set_defaults(fn=lambda a: __import__("onegraph.commands.bench_serve", fromlist=["main"]).main(a))

    p = sub.add_parser("inspect", help="print an artifact's manifest summary and per-graph op counts, or a "
                       "checkpoint directory's config, tensor census and whether it loads")
    p.add_argument("artifact", help="an exported artifact, a HF-format checkpoint directory, or `tiny`")
    p.add_argument("--no-verify", action="store_true", help="an artifact: skip the sha256 of every file (the "
                   "manifest's format and self-hash are still checked)")
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser("eval", help="bits per byte and perplexity of a model or an artifact on a text (teacher-forced)")
    from onegraph.commands.eval import add_args as eval_args
    eval_args(p)
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("draft-vocab", help="rank a model's token ids by frequency on a text corpus, for "
                                           "`export --draft-vocab N --draft-vocab-file FILE`")
    from onegraph.commands.draft_vocab import add_args as draft_vocab_args, run as draft_vocab_run
    draft_vocab_args(p)
    p.set_defaults(fn=draft_vocab_run)

    p = sub.add_parser("serve", help="serve an artifact over an OpenAI-compatible HTTP API")
    p.add_argument("artifact")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--max-slots", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--prefill-budget", type=int, default=None, metavar="TOKENS",
                   help="prompt tokens prefilled per engine step, between the running streams' decode steps "
                        "(default: the prefill chunk; at least one chunk runs per step)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                   help="feed prompts in chunks of at most TOKENS, one of the artifact's prefill chunks (default: "
                        "its largest). Smaller: shorter stalls of the running streams, a slower prompt; the "
                        "chunk partition sets a prompt's rounding, and the prefix cache's block")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prefix-cache-gb", type=float, default=None, metavar="G",
                   help="device memory for the prefix cache's blocks, in GiB (default: 10%% of the memory free "
                        "after the weights, the slots and the workspace, at most 64 max_seq_len prompts; refused with "
                        "tensor parallel, where it is off by default)")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="prefill every prompt from token 0 (no prefix cache)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: artifact dir name)")
    p.add_argument("--device", default=None, help="artifact device (default: the one it was exported for)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    from onegraph.runtime.checks import DEFAULT_MAX_REQUEST_BYTES
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="a larger request body is answered 413 before it is parsed")
    add_runtime_args(p)
    p.set_defaults(fn=cmd_serve)
    return ap


# Known third-party deprecation warnings (message, category, module that warns): torch's own code
# calling its deprecated APIs, nothing the user can act on. Matched narrowly; every other warning shows.
KNOWN_WARNINGS = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"copyreg|torch\..*"),
    (r"`torch\._prims_common\.check` is deprecated", FutureWarning, r"torch\..*"),
    # torch 2.11's .pt2 reader wraps a read-only mapping in torch.frombuffer (torch/export/pt2_archive)
    (r"The given buffer is not writable", UserWarning, r"torch\.export\..*"),
)


def quiet_known_warnings() -> None:
    import warnings
    for message, category, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:                       # a bare `onegraph`: what it can do, not a usage error
        parser.print_help()
        return 0
    quiet_known_warnings()
    try:
        code = args.fn(args)
        sys.stdout.flush()                     # here, where a closed pipe is caught, not at interpreter exit
        return code
    except (UserError, FileNotFoundError, ValueError, NotImplementedError) as e:
        print(f"onegraph {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:                    # `onegraph inspect ART | head`: the reader has what it wanted
        # stdout's buffer still holds what the reader will never take: point it at devnull so the flush at
        # exit does not raise again; 141 = 128 + SIGPIPE, what a shell tool dying of SIGPIPE reports
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
