"""`onegraph bench-serve`: a serving benchmark that drives any OpenAI-compatible server (onegraph or a peer)
with streamed completions and reports what vLLM's `bench serve` and SGLang's `bench_serving` report.

    onegraph bench-serve --base-url http://127.0.0.1:8000 --num-requests 200 --concurrency 32 \
        --input-len 32 --output-len 16 --seed 0 --out serve.json

Request mix (seeded: one --seed gives the same prompts, lengths, arrivals, sampling and disconnects):
random prompt token ids drawn uniformly from [0, --vocab-size) (default 256: valid in any vocabulary of 256
ids or more), sent as token ids so the server sees exactly --input-len tokens (`--tokenizer` decodes them to
text instead, as vLLM's random dataset does); lengths uniform in [L(1-r), L(1+r)] with --range-ratio r
(vLLM's --random-range-ratio). Or `--dataset FILE.jsonl`: text prompts from a file, one
{"prompt", "output_len"} a line, in a seeded order. Or a shared-prefix workload (SGLang's generated-shared-prefix):
`--shared-prefix-groups G --shared-prefix-len L`: G seeded system prompts of L random ids, request i starts with
group i mod G's and goes on with its own --input-len ids (the question); the JSON then reports the prefix cache's
hit rate (`usage.prompt_tokens_details.cached_tokens` over the prompt tokens) next to TTFT. `ignore_eos: true` (vLLM and SGLang's extension, which onegraph has) makes
every request produce its --output-len tokens; --no-ignore-eos leaves it out. Arrivals: a Poisson process of
--request-rate requests/s (exponential gaps), or all at once; --concurrency caps the requests in flight.

Definitions (as vLLM / SGLang; times from the request's send, on the client's clock):
- TTFT: to the first stream chunk that carries generated text (SGLang's rule: onegraph's and vLLM's chat
  streams open with an empty role chunk, which is not a token);
- ITL: the gap between consecutive text chunks, pooled over all requests (a chunk may carry several tokens);
- TPOT, per request: (e2e latency - TTFT) / (output tokens - 1), requests of one token left out;
- output tokens: `usage.completion_tokens` of the last chunk (`stream_options.include_usage`), else the
  `token_ids` the server returned, else the number of text chunks (the count used is in `tokens_counted_by`);
  input tokens likewise from `usage.prompt_tokens`, else the prompt's ids (none for a --dataset text);
- throughput: tokens of completed requests / the run's wall time (first send to last response);
- percentiles: numpy's linear interpolation over completed requests.

Errors never stop the run: each failed request is counted by kind (`http_503`, `connect`, `dropped`: the
stream ended without its final chunk, `first_token_timeout`, `timeout`, `stream_error`: an error event in the
stream, `bad_response`, or an exception's class name), with Retry-After values kept. Requests picked by
--disconnect-fraction close their connection after a seeded number of text chunks, on purpose: they count as
`disconnected`, not as errors and not in the latency figures. A dead --base-url or a nonsense value exits 2
with one line (cli.py prints the BenchServeError).
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


class BenchServeError(ValueError):
    """A bad argument or an unreachable server: one line, exit 2."""


def add_args(p) -> None:
    # numbers are parsed in check_args, not by argparse, so a nonsense value is one line rather than usage
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (with or without /v1)")
    p.add_argument("--model", default=None, help="model id to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-requests", required=True)
    p.add_argument("--concurrency", default=None, help="most requests in flight (default: no cap)")
    p.add_argument("--request-rate", default=None, help="Poisson arrivals, requests/s (default, or inf: all at once)")
    p.add_argument("--input-len", default=None, help="prompt tokens per request (required without --dataset)")
    p.add_argument("--output-len", required=True, help="max_tokens per request")
    p.add_argument("--range-ratio", default="0", help="lengths uniform in [L(1-r), L(1+r)] (default 0: exact)")
    p.add_argument("--vocab-size", default="256", help="prompt ids are drawn from [0, V)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (or a directory with one): send text prompts")
    p.add_argument("--dataset", default=None, metavar="FILE.jsonl", help="prompts from a file instead: one JSON "
                   "object a line, {\"prompt\": TEXT, \"output_len\": N (optional, else --output-len)}, taken in "
                   "a seeded order, cycling")
    p.add_argument("--api", default="completions", choices=["completions", "chat"],
                   help="/v1/completions (default) or /v1/chat/completions (text prompts: --tokenizer or --dataset)")
    p.add_argument("--shared-prefix-groups", default=None, metavar="G", help="shared-prefix workload: G groups, "
                   "each sharing a system prompt of --shared-prefix-len ids before each request's --input-len")
    p.add_argument("--shared-prefix-len", default=None, metavar="L", help="tokens of each group's shared prefix")
    p.add_argument("--seed", default="0")
    p.add_argument("--temperature", default="0", help="temperature of the unsampled share (default 0: greedy)")
    p.add_argument("--sampled-fraction", default="0", help="share of requests that sample at "
                   "--sample-temperature with a seed of their own (seeded sampling)")
    p.add_argument("--sample-temperature", default="0.8")
    p.add_argument("--disconnect-fraction", default="0", help="share of clients that hang up mid-stream")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (a server that refuses unknown fields)")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request, e.g. "
                   "'{\"return_token_ids\": true}' (onegraph, vLLM) to record output ids with --save-outputs")
    p.add_argument("--first-token-timeout", default="60", help="seconds to the first token before a request "
                   "counts as a first_token_timeout error")
    p.add_argument("--timeout", default="600", help="seconds a request may take in all")
    p.add_argument("--save-outputs", action="store_true", help="record every request (prompt, sampling, output "
                   "text and ids, timings, error) under `outputs`")
    p.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                   help="recorded under `metadata` in the JSON (e.g. server=\"onegraph serve DIR --max-slots 8\")")
    p.add_argument("--out", required=True, help="JSON result; a PNG of it is written next to it (commands/plot.py)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _num(args, name: str, kind=float, lo=None, lo_open=False, hi=None, none_ok=False):
    raw = getattr(args, name)
    flag = "--" + name.replace("_", "-")
    if raw is None:
        if none_ok:
            return None
        raise BenchServeError(f"{flag} is required")
    try:
        v = kind(raw)
    except (TypeError, ValueError):
        raise BenchServeError(f"{flag} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from None
    if isinstance(v, float) and not math.isfinite(v):
        raise BenchServeError(f"{flag} must be finite, got {raw!r}")
    if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
        rng = f"{'>' if lo_open else '>='} {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BenchServeError(f"{flag} must be {rng}, got {raw!r}")
    return v


@dataclass
class Config:
    base_url: str
    model: str | None
    api_key: str | None
    num_requests: int
    concurrency: int | None
    request_rate: float | None
    input_len: int
    output_len: int
    range_ratio: float
    vocab_size: int
    tokenizer: str | None
    dataset: list | None
    api: str
    seed: int
    temperature: float
    sampled_fraction: float
    sample_temperature: float
    disconnect_fraction: float
    ignore_eos: bool
    extra_body: dict
    first_token_timeout: float
    timeout: float
    save_outputs: bool
    quiet: bool
    shared_prefix_groups: int = 0     # 0: no shared-prefix workload
    shared_prefix_len: int = 0


def load_dataset(path: str) -> list[dict]:
    """--dataset: [{"prompt": str, "output_len": int | None}], refused in one line if malformed."""
    p = Path(path)
    if not p.is_file():
        raise BenchServeError(f"--dataset: no file {path}")
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchServeError(f"--dataset {path}:{n}: not JSON: {e}") from None
        out = obj.get("output_len") if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"] or \
                out is not None and (not isinstance(out, int) or out < 1):
            raise BenchServeError(f"--dataset {path}:{n}: need {{\"prompt\": non-empty text, \"output_len\": "
                                  f"int >= 1 (optional)}}")
        rows.append({"prompt": obj["prompt"], "output_len": out})
    if not rows:
        raise BenchServeError(f"--dataset {path} holds no prompt")
    return rows


def check_args(args) -> Config:
    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise BenchServeError(f"--extra-body is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise BenchServeError("--extra-body must be a JSON object")
    if args.api == "chat" and not (args.tokenizer or args.dataset):
        raise BenchServeError("--api chat sends text: pass --tokenizer or --dataset")
    dataset = load_dataset(args.dataset) if args.dataset else None
    all_at_once = str(args.request_rate).strip().lower() in ("inf", "+inf")     # vLLM's spelling of no rate
    url = args.base_url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise BenchServeError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    cfg = Config(
        base_url=url[:-3] if url.endswith("/v1") else url, model=args.model, api_key=args.api_key,
        num_requests=_num(args, "num_requests", int, 1),
        concurrency=_num(args, "concurrency", int, 1, none_ok=True),
        request_rate=None if all_at_once else _num(args, "request_rate", float, 0, lo_open=True, none_ok=True),
        input_len=_num(args, "input_len", int, 1, none_ok=dataset is not None), output_len=_num(args, "output_len", int, 1),
        range_ratio=_num(args, "range_ratio", float, 0, hi=0.999),
        vocab_size=_num(args, "vocab_size", int, 2), tokenizer=args.tokenizer, dataset=dataset, api=args.api,
        seed=_num(args, "seed", int), temperature=_num(args, "temperature", float, 0, hi=2),
        sampled_fraction=_num(args, "sampled_fraction", float, 0, hi=1),
        sample_temperature=_num(args, "sample_temperature", float, 0, lo_open=True, hi=2),
        disconnect_fraction=_num(args, "disconnect_fraction", float, 0, hi=1),
        ignore_eos=args.ignore_eos, extra_body=extra,
        first_token_timeout=_num(args, "first_token_timeout", float, 0, lo_open=True),
        timeout=_num(args, "timeout", float, 0, lo_open=True), save_outputs=args.save_outputs, quiet=args.quiet)
    if (args.shared_prefix_groups is None) != (args.shared_prefix_len is None):
        raise BenchServeError("--shared-prefix-groups and --shared-prefix-len go together")
    if args.shared_prefix_groups is not None:
        if dataset is not None:
            raise BenchServeError("--shared-prefix-groups makes random prompts: not with --dataset")
        cfg.shared_prefix_groups = _num(args, "shared_prefix_groups", int, 1)
        cfg.shared_prefix_len = _num(args, "shared_prefix_len", int, 1)
    if cfg.concurrency is None and cfg.request_rate is None and not all_at_once:
        raise BenchServeError("pass --concurrency C or --request-rate R (or both: Poisson arrivals, at most C in flight)")
    return cfg


# ---------------------------------------------------------------- the request mix
@dataclass
class Req:
    index: int
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int | None
    disconnect_after: int | None      # text chunks to read before hanging up; None: read to the end
    arrival_s: float                  # offset from the run's start (Poisson), 0 without --request-rate
    prompt_text: str | None = None


def make_requests(cfg: Config, decode=None) -> list[Req]:
    """Seeded; each property from its own stream, so e.g. a different --disconnect-fraction keeps the prompts."""
    g = [np.random.default_rng([cfg.seed & 0xFFFFFFFF, k]) for k in range(5)]
    n, r = cfg.num_requests, cfg.range_ratio

    def lengths(gen, L):
        return gen.integers(max(1, int(L * (1 - r))), int(L * (1 + r)) + 1, size=n)
    in_lens, out_lens = lengths(g[0], cfg.input_len or 1), lengths(g[1], cfg.output_len)
    sampled = g[2].random(n) < cfg.sampled_fraction
    seeds = g[2].integers(0, 2 ** 31, size=n)
    hang = g[3].random(n) < cfg.disconnect_fraction
    gaps = g[4].exponential(1.0 / cfg.request_rate, size=n) if cfg.request_rate else np.zeros(n)
    arrivals = np.cumsum(gaps) - gaps[0]
    order = g[0].permutation(len(cfg.dataset)) if cfg.dataset else None
    # shared-prefix groups from a stream of their own: the other properties stay those of the plain workload
    gp = np.random.default_rng([cfg.seed & 0xFFFFFFFF, 5])
    prefixes = [gp.integers(0, cfg.vocab_size, size=cfg.shared_prefix_len).tolist()
                for _ in range(cfg.shared_prefix_groups)]
    reqs = []
    for i in range(n):
        row = cfg.dataset[order[i % len(order)]] if cfg.dataset else None
        ids = [] if row else g[0].integers(0, cfg.vocab_size, size=int(in_lens[i])).tolist()
        if prefixes:
            ids = prefixes[i % len(prefixes)] + ids
        m = int(row["output_len"] or out_lens[i]) if row else int(out_lens[i])
        reqs.append(Req(i, ids, m, cfg.sample_temperature if sampled[i] else cfg.temperature,
                        int(seeds[i]) if sampled[i] else None,
                        int(g[3].integers(1, max(1, m // 2) + 1)) if hang[i] else None, float(arrivals[i]),
                        row["prompt"] if row else decode(ids) if decode else None))
    return reqs


# ---------------------------------------------------------------- one streamed request
@dataclass
class Result:
    index: int
    status: str = "error"             # "ok" | "disconnected" | "error"
    error: str | None = None          # kind, see the module docstring
    detail: str | None = None
    retry_after: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list = field(default_factory=list)
    chunks: int = 0
    text: str = ""
    token_ids: list | None = None
    usage: dict | None = None
    finish_reason: str | None = None


def _chunk_text(choice: dict, chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    d = choice.get("delta") or {}
    out = (d.get("content") or "") + (d.get("reasoning_content") or "")
    if d.get("tool_calls"):
        out += json.dumps(d["tool_calls"])
    return out


async def one_request(client, cfg: Config, req: Req) -> Result:
    import httpx
    chat = cfg.api == "chat"
    body = {"model": cfg.model, "max_tokens": req.max_tokens, "temperature": req.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt_text}]
    else:
        body["prompt"] = req.prompt_text if req.prompt_text is not None else req.prompt_ids
    if req.seed is not None:
        body["seed"] = req.seed
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    url = cfg.base_url + ("/v1/chat/completions" if chat else "/v1/completions")
    res = Result(req.index)
    loop = asyncio.get_running_loop()
    st = time.perf_counter()
    last = st
    done = saw_data = False
    try:
        async with asyncio.timeout(min(cfg.first_token_timeout, cfg.timeout)) as deadline:
            async with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    res.error, res.retry_after = f"http_{r.status_code}", r.headers.get("retry-after")
                    res.detail = (await r.aread())[:300].decode(errors="replace")
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    saw_data = True
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        obj = json.loads(data)
                    except json.JSONDecodeError:
                        res.error, res.detail = "bad_response", data[:300]
                        return res
                    if "error" in obj:
                        res.error, res.detail = "stream_error", json.dumps(obj["error"])[:300]
                        return res
                    if obj.get("usage"):
                        res.usage = obj["usage"]
                    for ch in obj.get("choices") or []:
                        if ch.get("token_ids") is not None:
                            res.token_ids = (res.token_ids or []) + list(ch["token_ids"])
                        if ch.get("finish_reason"):
                            res.finish_reason = ch["finish_reason"]
                        text = _chunk_text(ch, chat)
                        if not text:
                            continue
                        now = time.perf_counter()
                        if res.ttft_s is None:
                            res.ttft_s = now - st
                            deadline.reschedule(loop.time() + cfg.timeout - res.ttft_s)
                        else:
                            res.itl_s.append(now - last)
                        last = now
                        res.chunks += 1
                        res.text += text
                        if req.disconnect_after is not None and res.chunks >= req.disconnect_after:
                            res.status, res.e2e_s = "disconnected", now - st
                            return res          # leaving the block closes the connection mid-stream
        res.e2e_s = time.perf_counter() - st
        if not saw_data:
            res.error, res.detail = "bad_response", "not an SSE stream (no 'data:' line)"
        elif not done and res.finish_reason is None:
            res.error = "dropped"
        elif res.ttft_s is None:
            res.error, res.detail = "bad_response", "the stream carried no text"
        else:
            res.status = "ok"
    except TimeoutError:
        res.error = "first_token_timeout" if res.ttft_s is None else "timeout"
    except httpx.ConnectError as e:
        res.error, res.detail = "connect", str(e)[:300]
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        res.error, res.detail = "dropped", str(e)[:300]
    except Exception as e:                          # never stop the run for one request
        res.error, res.detail = type(e).__name__, str(e)[:300]
    return res


# ---------------------------------------------------------------- the run
def _client(cfg: Config, n_conn: int):
    import httpx
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(None, connect=10.0),
                             limits=httpx.Limits(max_connections=n_conn, max_keepalive_connections=n_conn))


async def resolve_model(cfg: Config) -> str:
    """GET /v1/models: reachability (a dead URL fails here, before any request) and the default --model."""
    import httpx
    async with _client(cfg, 1) as c:
        try:
            r = await c.get(cfg.base_url + "/v1/models", timeout=10.0)
        except httpx.HTTPError as e:
            raise BenchServeError(f"cannot reach {cfg.base_url}: {type(e).__name__}: {e}") from None
    if r.status_code == 200:
        try:
            ids = [m["id"] for m in r.json()["data"]]
        except (ValueError, KeyError, TypeError):
            ids = []
        if cfg.model is None and ids:
            return ids[0]
    if cfg.model is None:
        raise BenchServeError(f"{cfg.base_url}/v1/models answered {r.status_code} without a model id: pass --model")
    return cfg.model


async def run_requests(cfg: Config, reqs: list[Req]) -> tuple[list[Result], float]:
    from tqdm import tqdm
    sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    bar = tqdm(total=len(reqs), desc="bench-serve", unit="req", disable=cfg.quiet, file=sys.stderr)
    n_conn = cfg.concurrency or min(len(reqs), 1000)

    async with _client(cfg, n_conn) as client:
        t0 = time.perf_counter()

        async def go(req: Req) -> Result:
            wait = t0 + req.arrival_s - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            if sem is None:
                res = await one_request(client, cfg, req)
            else:
                async with sem:
                    res = await one_request(client, cfg, req)
            bar.update(1)
            return res
        results = await asyncio.gather(*(go(r) for r in reqs))
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


def _pct(xs_s: list[float]) -> dict:
    if not xs_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "min": None, "max": None, "n": 0}
    a = np.asarray(xs_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "min": float(a.min()), "max": float(a.max()), "n": int(a.size)}


def summarize(cfg: Config, reqs: list[Req], results: list[Result], duration: float) -> dict:
    ok = [(q, r) for q, r in zip(reqs, results) if r.status == "ok"]
    errors: dict[str, int] = {}
    for r in results:
        if r.status == "error":
            errors[r.error] = errors.get(r.error, 0) + 1
    counted_by: dict[str, int] = {}
    out_toks, in_toks, tpots, itls, cached = [], [], [], [], []
    for q, r in ok:
        u = r.usage or {}
        if isinstance(u.get("completion_tokens"), int):
            n, how = u["completion_tokens"], "usage"
        elif r.token_ids is not None:
            n, how = len(r.token_ids), "token_ids"
        else:
            n, how = r.chunks, "chunks"
        counted_by[how] = counted_by.get(how, 0) + 1
        out_toks.append(n)
        in_toks.append(u["prompt_tokens"] if isinstance(u.get("prompt_tokens"), int) else len(q.prompt_ids))
        c = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        if isinstance(c, int):
            cached.append((c, in_toks[-1]))
        if n > 1:
            tpots.append((r.e2e_s - r.ttft_s) / (n - 1))
        itls += r.itl_s
    res = {
        "base_url": cfg.base_url, "model": cfg.model, "api": cfg.api, "num_requests": cfg.num_requests,
        "concurrency": cfg.concurrency, "request_rate": cfg.request_rate, "input_len": cfg.input_len,
        "output_len": cfg.output_len, "range_ratio": cfg.range_ratio, "seed": cfg.seed,
        "sampled_fraction": cfg.sampled_fraction, "disconnect_fraction": cfg.disconnect_fraction,
        "ignore_eos": cfg.ignore_eos, "duration_s": duration,
        "completed": len(ok), "disconnected": sum(r.status == "disconnected" for r in results),
        "failed": sum(errors.values()), "errors": errors,
        "retry_after": sorted({r.retry_after for r in results if r.retry_after is not None}),
        "total_input_tokens": int(sum(in_toks)), "total_output_tokens": int(sum(out_toks)),
        "requests_s": len(ok) / duration, "input_tok_s": sum(in_toks) / duration,
        "output_tok_s": sum(out_toks) / duration, "total_tok_s": (sum(in_toks) + sum(out_toks)) / duration,
        "ttft_ms": _pct([r.ttft_s for _, r in ok]), "tpot_ms": _pct(tpots), "itl_ms": _pct(itls),
        "e2e_ms": _pct([r.e2e_s for _, r in ok]), "tokens_counted_by": counted_by,
        "first_errors": [f"{r.index}: {r.error}: {r.detail}" for r in results if r.status == "error"][:5],
        "shared_prefix_groups": cfg.shared_prefix_groups, "shared_prefix_len": cfg.shared_prefix_len,
        # over completed requests whose usage says: cached prompt tokens / their prompt tokens (None: none did)
        "cached_tokens": sum(c for c, _ in cached) if cached else None,
        "prefix_cache_hit_rate": sum(c for c, _ in cached) / max(1, sum(n for _, n in cached)) if cached else None,
    }
    if cfg.save_outputs:
        res["outputs"] = [dict(index=q.index, prompt_ids=q.prompt_ids, prompt_text=q.prompt_text,
                               max_tokens=q.max_tokens, temperature=q.temperature, seed=q.seed,
                               disconnect_after=q.disconnect_after, status=r.status, error=r.error,
                               finish_reason=r.finish_reason, text=r.text, token_ids=r.token_ids, usage=r.usage,
                               ttft_ms=None if r.ttft_s is None else r.ttft_s * 1e3,
                               e2e_ms=None if r.e2e_s is None else r.e2e_s * 1e3)
                          for q, r in zip(reqs, results)]
    return res


def _decoder(path: str):
    from tokenizers import Tokenizer
    p = Path(path)
    p = p / "tokenizer.json" if p.is_dir() else p
    if not p.is_file():
        raise BenchServeError(f"--tokenizer: no tokenizer.json at {p}")
    tok = Tokenizer.from_file(str(p))
    return lambda ids: tok.decode(ids, skip_special_tokens=False)


def run(cfg: Config, command: str = "") -> dict:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise BenchServeError("bench-serve needs httpx (pip install -e '.[bench]')") from None
    cfg.model = asyncio.run(resolve_model(cfg))
    reqs = make_requests(cfg, _decoder(cfg.tokenizer) if cfg.tokenizer else None)
    results, duration = asyncio.run(run_requests(cfg, reqs))
    return {"command": command, **summarize(cfg, reqs, results, duration)}


def command_line(args) -> str:
    """The command that made the JSON, rebuilt from the parsed options (defaults spelled out)."""
    import shlex
    parts = ["onegraph bench-serve"]
    for k, v in vars(args).items():
        if k in ("fn", "cmd", "ignore_eos") or v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, list):
            parts.append(" ".join([flag, *map(shlex.quote, v)]))
        else:
            parts.append(flag if v is True else f"{flag} {shlex.quote(str(v))}")
    if not args.ignore_eos:
        parts.append("--no-ignore-eos")
    return " ".join(parts)


def main(args) -> int:
    """cli.py's entry (an argparse namespace from add_args). Writes --out (+ a PNG), prints a summary."""
    cfg = check_args(args)
    meta = {}
    for kv in args.metadata or ():
        if "=" not in kv:
            raise BenchServeError(f"--metadata takes KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        meta[k] = v
    out = Path(args.out)
    if not out.parent.is_dir():
        raise BenchServeError(f"--out: no directory {out.parent}")
    res = run(cfg, command_line(args))
    if meta:
        res["metadata"] = meta
    out.write_text(json.dumps(res, indent=1) + "\n")
    f = lambda d: "-" if d["p50"] is None else f"{d['p50']:.1f}/{d['p90']:.1f}/{d['p99']:.1f}"  # noqa: E731
    print(f"completed {res['completed']}/{cfg.num_requests} (disconnected {res['disconnected']}, failed "
          f"{res['failed']} {res['errors'] or ''}) in {res['duration_s']:.1f} s: {res['requests_s']:.2f} req/s, "
          f"output {res['output_tok_s']:.1f} tok/s, input {res['input_tok_s']:.1f} tok/s; ms p50/p90/p99: "
          f"TTFT {f(res['ttft_ms'])}, TPOT {f(res['tpot_ms'])}, ITL {f(res['itl_ms'])}"
          + ("" if res["prefix_cache_hit_rate"] is None else f"; prefix cache hit rate {res['prefix_cache_hit_rate']:.3f}"))
    if not args.no_plot:
        try:
            from .plot import plot
            print(plot(out))
        except ImportError:
            print("bench-serve: no PNG: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(prog="python -m onegraph.commands.bench_serve", description=__doc__.splitlines()[0])
    add_args(ap)
    try:
        sys.exit(main(ap.parse_args()))
    except BenchServeError as e:
        print(f"bench-serve: error: {e}", file=sys.stderr)
        sys.exit(2)
