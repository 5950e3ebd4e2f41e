"""Bits per byte and perplexity of a model or an artifact on a text, as llama.cpp's perplexity tool:
the teacher-forced log-likelihood of each token given the ones before it.

    onegraph eval MODEL|ARTIFACT [--text FILE] [--max-tokens N] [--ctx 256] [--batch B] [--dtype D] [--json]

Windowing: the text's tokens are cut into windows of `ctx` tokens that share one token with the next
(window w covers tokens w*(ctx-1) .. w*(ctx-1)+ctx-1; the last one is shorter). Each window runs from an
empty slot: its first token is prefilled (a prefill from position 0 resets the slot), the others are
fed by teacher-forced decode steps, and every token after the window's first is scored with the
logits the step before it gave. So every token of the text except the very first is scored exactly
once, with the 0..ctx-2 tokens before it in its window as context (llama.cpp scores only each window's
second half, with at least ctx/2 context; this scores all of it, so short-context tokens count too).
    bits_per_byte = sum of -log2 p(token) / the UTF-8 bytes those tokens cover
    perplexity    = exp(mean -ln p(token)) per token
A model directory (or `tiny`) runs eagerly; an artifact runs its own decode and prefill graphs through
the runtime's GraphExecutor, the same loop either way (the eager side is GraphExecutor.from_model).
Without --text: the builtin tiny model's bundled held-out text (models/qwen3_5/tiny_weights/heldout.txt,
Python standard library source never trained on).
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from onegraph.models.qwen3_5.tiny import TINY_WEIGHTS

HELDOUT_TEXT = TINY_WEIGHTS.parent / "heldout.txt"
DEFAULT_CTX = 256
EAGER_BATCH = 64


class EvalError(ValueError):
    pass


def token_windows(ids: list[int], ctx: int) -> list[list[int]]:
    """Windows of up to ctx tokens, each sharing its first token with the previous window's last."""
    if ctx < 2:
        raise EvalError(f"--ctx must be >= 2, got {ctx}")
    if len(ids) < 2:
        raise EvalError(f"the text has {len(ids)} token(s); scoring needs at least 2")
    step = ctx - 1
    return [ids[s:s + ctx] for s in range(0, len(ids) - 1, step)]


def encode(tok, text: str, max_tokens: int | None) -> tuple[list[int], int]:
    """-> (token ids, UTF-8 bytes covered by the scored ones: every token but the first)."""
    enc = tok.encode(text, add_special_tokens=False)
    n = len(enc.ids) if max_tokens is None else min(max_tokens, len(enc.ids))
    if n < 2:
        raise EvalError(f"the text encodes to {n} token(s); scoring needs at least 2")
    # char offsets: the scored text runs from the second token's start to the last token's end
    start, end = enc.offsets[1][0], enc.offsets[n - 1][1]
    return enc.ids[:n], len(text[start:end].encode("utf-8"))


def score(ex, windows: list[list[int]], batch: int, progress: bool = False) -> tuple[float, int]:
    """Teacher-forced -ln p over every window (see the module docstring) on a GraphExecutor with at
    least `batch` slots -> (sum of -ln p in nats, scored tokens)."""
    from tqdm import tqdm
    from onegraph.runtime.executor import Sampling
    nll, scored = 0.0, 0
    greedy = Sampling()
    total = sum(len(w) - 1 for w in windows)
    with torch.no_grad(), tqdm(total=total, unit="tok", disable=not progress, desc="eval") as bar:
        for g in range(0, len(windows), batch):
            group = windows[g:g + batch]
            for s, w in enumerate(group):               # slot s: the window's first token, from an empty state
                _, logits = ex.prefill(w[:1], s, greedy)
                nll -= float(torch.log_softmax(logits[0].float(), -1)[w[1]])
            scored += len(group)
            bar.update(len(group))
            for j in range(1, max(map(len, group)) - 1):
                rows = [s for s, w in enumerate(group) if j + 1 < len(w)]
                _, logits = ex.decode([group[s][j] for s in rows], rows, [j] * len(rows), [greedy] * len(rows))
                lp = torch.log_softmax(logits[:len(rows)].float(), -1)                       # [n, V]
                target = torch.tensor([group[s][j + 1] for s in rows], device=lp.device)
                nll -= float(lp.gather(1, target[:, None]).sum())
                scored += len(rows)
                bar.update(len(rows))
    return nll, scored


def executor(spec: str, ctx: int, batch: int | None, dtype: str | None, device: str | None,
             quant: str | None = None, fp8_lm_head: bool = False):
    """-> (GraphExecutor, rows per step, tokenizer dir, mode, dtype name) for a model or an artifact."""
    from onegraph.runtime.executor import GraphExecutor
    from onegraph.runtime.artifact import Artifact, is_artifact
    if is_artifact(spec):
        art = Artifact.load(spec, device, defer_sha256=True)      # checkpoint hashed as the executor reads it
        m = art.manifest
        if art.tp != 1:
            raise EvalError(f"{spec} is a tensor-parallel artifact; eval runs TP-1 artifacts")
        if quant is not None:
            raise EvalError(f"--quant applies to a model; the artifact {spec} runs the weights it was exported with "
                            f"({m['options'].get('quant', 'none')})")
        if fp8_lm_head:
            raise EvalError(f"--fp8-lm-head applies to a model; the artifact {spec} runs the head it was exported with "
                            f"({'fp8' if m['options'].get('fp8_lm_head') else 'float'})")
        if dtype is not None:
            raise EvalError(f"--dtype applies to a model; the artifact {spec} runs in the dtype it was exported with "
                            f"({m['dtype']})")
        if ctx > m["max_seq_len"]:
            raise EvalError(f"--ctx {ctx} exceeds the artifact's max_seq_len {m['max_seq_len']}")
        biggest = max(g["bucket"] for g in m["graphs"].values() if g["kind"] == "decode")
        rows = min(batch or biggest, biggest)
        ex = GraphExecutor.from_artifact(art, max_slots=rows)
        return ex, rows, Path(spec), ex.path, m["dtype"]
    from onegraph.checkpoint.load import load_model
    dtype = dtype or "float32"
    _, model, path = load_model(spec, dtype, device or "cpu", quant=quant, fp8_lm_head=fp8_lm_head)
    rows = batch or EAGER_BATCH
    ex = GraphExecutor.from_model(model, {"decode": [rows], "prefill": [1]}, max_slots=rows, max_seq_len=ctx)
    return ex, rows, path, "eager", dtype


def evaluate(spec: str, text: str | None = None, max_tokens: int | None = None, ctx: int = DEFAULT_CTX,
             batch: int | None = None, dtype: str | None = None, device: str | None = None,
             progress: bool = False, quant: str | None = None, fp8_lm_head: bool = False) -> dict:
    """-> {bits_per_byte, perplexity, tokens (scored), bytes, nll_nats, windows, ctx, mode, dtype, ...}.
    quant: a model's projections' weights (load_model's; None: as the checkpoint); fp8_lm_head: its head too."""
    from tokenizers import Tokenizer
    if max_tokens is not None and max_tokens < 2:
        raise EvalError(f"--max-tokens must be >= 2, got {max_tokens}")
    if batch is not None and batch < 1:
        raise EvalError(f"--batch must be >= 1, got {batch}")
    source = str(text) if text else "builtin held-out (models/qwen3_5/tiny_weights/heldout.txt)"
    path = Path(text) if text else HELDOUT_TEXT
    if not path.is_file():
        raise EvalError(f"--text {path} is not a file")
    ex, rows, tok_dir, mode, dtype = executor(spec, ctx, batch, dtype, device, quant, fp8_lm_head)
    if not (tok_dir / "tokenizer.json").is_file():
        raise EvalError(f"{tok_dir} has no tokenizer.json to encode the text with")
    ids, n_bytes = encode(Tokenizer.from_file(str(tok_dir / "tokenizer.json")),
                          path.read_text(encoding="utf-8"), max_tokens)
    if max(ids) >= ex.vocab_size:
        raise EvalError(f"the tokenizer gives id {max(ids)} outside the model's vocabulary [0, {ex.vocab_size})")
    windows = token_windows(ids, ctx)
    t0 = time.perf_counter()
    nll, scored = score(ex, windows, rows, progress)
    return {"bits_per_byte": nll / math.log(2) / n_bytes, "perplexity": math.exp(nll / scored),
            "tokens": scored, "bytes": n_bytes, "nll_nats": nll, "windows": len(windows), "ctx": ctx,
            "rows_per_step": rows, "mode": mode, "dtype": dtype, "quant": quant, "fp8_lm_head": fp8_lm_head,
            "model": str(spec), "text": source,
            "seconds": round(time.perf_counter() - t0, 2)}


def add_args(p) -> None:
    p.add_argument("model", help="HF-format directory, `tiny`, or an exported artifact directory")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: tiny's bundled held-out text)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, help="window length in tokens (<= an artifact's max_seq_len)")
    p.add_argument("--batch", type=int, default=None,
                   help=f"windows per decode step (default: an artifact's largest decode bucket; eager {EAGER_BATCH})")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="a model's dtype (default float32); an artifact runs in the dtype it was exported with")
    p.add_argument("--device", default=None, help="default: cpu eager, an artifact's export device")
    from onegraph.checkpoint.quant import QUANT_CHOICES
    p.add_argument("--quant", default=None, choices=QUANT_CHOICES,
                   help="a model's projection weights (as `export --quant`; default: as the checkpoint)")
    p.add_argument("--fp8-lm-head", action="store_true", help="a model's output projection as block FP8 too "
                                                              "(as `export --fp8-lm-head`)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
