"""`onegraph serve` on a CUDA bf16 artifact of `tiny`, as a subprocess, driven by the official `openai`
client; once replaying captured CUDA graphs and once with --no-cuda-graphs (run on the H200 through the
device tool; skipped without CUDA; the server's Python dependencies travel as wheels, scripts/gpu_wheels.sh).

Per mode, two servers: the main one (8 slots, a deep queue) and a small one (1 slot, no queue, an API key)
for the 401 and 503 paths. What they must do:
- chat, completions, SSE streaming, n > 1 and seeded sampling give the token ids an in-process Engine over
  the same artifact gives (one slot, alone); stop strings cut the text where the stop first occurs;
- tool-call parsing: the real model's text passes through the tool-call parser unchanged, and a forced
  (scripted) output over this artifact's tokenizer parses into a call (the scripted engine of the CPU
  server tests: a real model cannot be made to emit a tool call);
- 400 for bad requests, 401 without the key, 503 (Retry-After) when the queue is full;
- 128 concurrent requests, half streamed, 16 clients disconnecting mid-stream: every completed greedy
  output equals the same request sent alone, /metrics counts exactly what completed;
- at the end every slot is free, /metrics is consistent, and SIGTERM (a stream in flight) exits 0 with no
  traceback on stderr.

DEVICE is the one switch for a dry run elsewhere (`"cpu"` exports a float32 CPU artifact); the committed
test targets CUDA. The export runs once per session; the whole file is meant to take under 5 minutes.
"""
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from test_server_api import SCRIPT, TOOLS, ScriptedEngine
from tp_helpers import free_port

DEVICE = "cuda"
DTYPE = {"cuda": "bfloat16", "cpu": "float32"}[DEVICE]

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")]

MODEL = "tiny"
KEY = "sekret"
MAX_SEQ_LEN = 512
SLOTS = 8
LONG = 480                          # tokens of a request that must still be running when its client leaves
SEGV_HINT = ("\nSIGSEGV: on the H200 image AOTInductor packages need "
             "LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6) (README, Devices)")


# ---------------------------------------------------------------- artifact, servers, reference engine
@pytest.fixture(scope="session")
def serve_artifact(tmp_path_factory):
    """Decode buckets 1 and 8, one 16-token prefill chunk (a longer prompt takes several): three graphs."""
    out = tmp_path_factory.mktemp("serve") / "tiny"
    r = subprocess.run([sys.executable, "-m", "onegraph", "export", "tiny", "--out", str(out), "--device", DEVICE,
                        "--dtype", DTYPE, "--batch-sizes", f"1,{SLOTS}", "--prefill-chunks", "16",
                        "--max-seq-len", str(MAX_SEQ_LEN), "--quiet"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:] + (SEGV_HINT if r.returncode == -11 else "")
    return out


class Serve:
    """`onegraph serve ART ...` on a free port; stdout and stderr go to one file (no pipe to fill)."""

    def __init__(self, art, log_path, *args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "onegraph", "serve", str(art), "--port", str(self.port),
                                      "--served-model-name", MODEL, "--log-level", "warning", *map(str, args)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def output(self) -> str:
        self.log.flush()
        return open(self.log_path).read()

    def wait_ready(self, timeout: float = 300):
        t0 = time.time()
        while True:
            rc = self.proc.poll()
            assert rc is None, f"serve exited {rc} before it answered:\n{self.output()[-4000:]}" + (
                SEGV_HINT if rc == -11 else "")
            assert time.time() - t0 < timeout, f"serve did not come up in {timeout} s:\n{self.output()[-4000:]}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module", params=[True, False], ids=["cuda_graphs", "no_cuda_graphs"])
def servers(request, serve_artifact, tmp_path_factory):
    """Both servers of one mode, started side by side (each loads, checks its fixture and captures)."""
    mode = [] if request.param else ["--no-cuda-graphs"]
    logs = tmp_path_factory.mktemp("serve_logs")
    main = Serve(serve_artifact, logs / "main.log", "--max-slots", SLOTS, "--max-queue", 256, *mode)
    small = Serve(serve_artifact, logs / "small.log", "--max-slots", 1, "--max-queue", 0, "--api-key", KEY, *mode)
    try:
        main.wait_ready()
        small.wait_ready()
        yield SimpleNamespace(main=main, small=small)
    finally:
        main.close()
        small.close()


@pytest.fixture(scope="module")
def engine(serve_artifact):
    """The reference: the same artifact in this process, one slot (every request alone), CUDA graphs on."""
    from onegraph.runtime import Engine
    eng = Engine.from_artifact(serve_artifact, max_slots=1, max_queue=16)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def codec(serve_artifact):
    from onegraph.runtime.codec import TextCodec
    return TextCodec.from_artifact(serve_artifact)


def eos(engine):
    return tuple(engine.ex.manifest["model"]["eos_token_ids"])


def chat_ids(codec, content):
    return codec.encode(codec.render_chat([{"role": "user", "content": content}]))


def scrape(url) -> dict:
    """/metrics -> {(sample name, sorted label items): value}, parsed by prometheus_client itself."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(m: dict, name: str, **labels) -> float:
    """Sum of a sample over the label sets that contain `labels`."""
    return sum(v for (n, ls), v in m.items() if n == name and set(labels.items()) <= set(ls))


def wait_idle(url, timeout: float = 30) -> dict:
    t0 = time.time()
    while True:
        m = scrape(url)
        if total(m, "onegraph_active_slots") == 0 and total(m, "onegraph_queue_depth") == 0:
            return m
        assert time.time() - t0 < timeout, f"slots still busy after {timeout} s: {m}"
        time.sleep(0.05)


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"], e
    return e


# ---------------------------------------------------------------- the API, one request at a time
def test_chat_and_completions_equal_engine(servers, engine, codec):
    cl = servers.main.client()
    assert [m.id for m in cl.models.list().data] == [MODEL]
    prompt = "Once upon a time"
    r = cl.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                              extra_body={"return_token_ids": True})
    want = engine.generate(codec.encode(prompt), 24, 0.0, stop_ids=eos(engine))
    assert r.choices[0].model_extra["token_ids"] == want.token_ids
    assert r.choices[0].text == codec.decode(want.token_ids)
    assert r.choices[0].finish_reason == want.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(codec.encode(prompt)), len(want.token_ids))

    content = "Hello there, who are you?"
    r = cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=24,
                                   temperature=0, extra_body={"return_token_ids": True})
    ids = chat_ids(codec, content)
    want = engine.generate(ids, 24, 0.0, stop_ids=eos(engine))
    assert r.choices[0].model_extra["token_ids"] == want.token_ids
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want.token_ids))


def test_sse_streams_equal_non_stream(servers):
    cl = servers.main.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=32, temperature=0)
    full = cl.chat.completions.create(**kw)
    chunks = list(cl.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (full.choices[0].message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]
    # serve's prefix cache (on by default): the streamed request reuses the whole 16-token blocks the first stored
    su, fu = chunks[-1].usage.model_dump(), full.usage.model_dump()
    assert su.pop("prompt_tokens_details")["cached_tokens"] == (fu["prompt_tokens"] - 1) // 16 * 16
    fu.pop("prompt_tokens_details")
    assert chunks[-1].choices == [] and su == fu

    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    full = cl.completions.create(**kw)
    chunks = list(cl.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_and_seeded_sampling(servers, engine, codec):
    """Choice i of a seeded request samples with seed + i: it equals the engine's run with that seed, the
    same request gives the same text again, and other seeds give other text."""
    cl = servers.main.client()
    kw = dict(model=MODEL, prompt="abc", max_tokens=16, temperature=1.0, n=2,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = cl.completions.create(**kw, seed=7)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 32
    for i, c in enumerate(r.choices):
        assert c.model_extra["token_ids"] == engine.generate(codec.encode("abc"), 16, 1.0, seed=7 + i).token_ids
    assert [c.text for c in cl.completions.create(**kw, seed=7).choices] == [c.text for c in r.choices]
    assert cl.completions.create(**{**kw, "n": 1}, seed=8).choices[0].text == r.choices[1].text
    others = {cl.completions.create(**{**kw, "n": 1}, seed=s).choices[0].text for s in (100, 200, 300)}
    assert len(others | {r.choices[0].text}) > 1, "four seeds gave one text: the seed is not reaching the sampler"
    chunks = list(cl.completions.create(**kw, seed=7, stream=True))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)]
    assert streamed == [c.text for c in r.choices]


def test_stop_strings(servers):
    cl = servers.main.client()
    kw = dict(model=MODEL, prompt="The", max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
    base = cl.completions.create(**kw).choices[0].text
    # a 3-character stop string that first occurs mid-output (several byte tokens)
    k = next(k for k in range(3, len(base) - 3) if base.find(base[k:k + 3]) == k and "\ufffd" not in base[k:k + 3])
    stop = base[k:k + 3]
    r = cl.completions.create(**kw, stop=[stop, "\x00zz"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == base[:k]
    assert r.usage.completion_tokens < 48
    chunks = list(cl.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == base[:k]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_tool_parser_passes_real_output_through(servers):
    """tiny's chat template ignores `tools`, so the prompt is the same with and without them: the model's
    text (no tool call in it) must come out of the tool-call parser unchanged."""
    cl = servers.main.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], max_tokens=40, temperature=0)
    plain = cl.chat.completions.create(**kw).choices[0]
    with_tools = cl.chat.completions.create(**kw, tools=TOOLS).choices[0]
    assert not with_tools.message.tool_calls
    assert with_tools.message.content == plain.message.content and with_tools.finish_reason == plain.finish_reason


def test_forced_tool_call(engine, codec):
    """A scripted output (the CPU server tests' engine) over this artifact's manifest and tokenizer."""
    from onegraph.server.app import create_app
    from server_helpers import running
    with running(create_app(ScriptedEngine(engine, codec, SCRIPT), MODEL)) as url:
        cl = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS,
                  max_tokens=200)
        ch = cl.chat.completions.create(**kw).choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content == "Checking."
        (call,) = ch.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
        # streamed as OpenAI does: the first delta of a call names it, later ones append to its arguments
        names, args = {}, collections.defaultdict(str)
        for c in cl.chat.completions.create(**kw, stream=True):
            for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                names.setdefault(tc.index, tc.function.name)
                args[tc.index] += tc.function.arguments or ""
        assert names == {0: "get_weather"} and json.loads(args[0]) == {"city": "Paris", "days": 2}


def test_400s(servers):
    url, cl = servers.main.url, servers.main.client()
    msgs = [{"role": "user", "content": "hi"}]
    openai_error(httpx.post(url + "/v1/chat/completions", content="{not json"), 400)
    assert openai_error(httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "logprobs": 3}),
                        400)["param"] == "logprobs"
    with pytest.raises(openai.NotFoundError) as e:                 # OpenAI's and vLLM's answer
        cl.chat.completions.create(model="nope", messages=msgs)
    assert e.value.status_code == 404 and e.value.code == "model_not_found", e.value.body
    for kw, param in [(dict(temperature=9), "temperature"),
                      (dict(max_tokens=MAX_SEQ_LEN), "max_tokens")]:
        with pytest.raises(openai.BadRequestError) as e:
            cl.chat.completions.create(**{"model": MODEL, "messages": msgs, **kw})
        assert e.value.status_code == 400 and (e.value.param or "").startswith(param), e.value.body
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_401_and_503(servers):
    """The small server: an API key, one slot and no queue. n=2 is refused whole (its second choice finds
    no slot and no queue room, whatever the first is doing): 503 with Retry-After, nothing left running."""
    small = servers.small
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    openai_error(httpx.post(small.url + "/v1/completions", json=body), 401)
    openai_error(httpx.post(small.url + "/v1/completions", json=body, headers={"Authorization": "Bearer no"}), 401)
    with pytest.raises(openai.AuthenticationError):
        small.client("wrong").models.list()
    ok = small.client(KEY)
    assert ok.completions.create(**body).usage.completion_tokens >= 1
    r = httpx.post(small.url + "/v1/completions", json={**body, "n": 2}, headers={"Authorization": f"Bearer {KEY}"})
    assert openai_error(r, 503)["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
    with pytest.raises(openai.InternalServerError) as e:
        ok.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
                                   stream=True)
    assert e.value.status_code == 503
    wait_idle(small.url)                                                      # the refused n=2's first choice
    assert ok.completions.create(**body).usage.completion_tokens >= 1         # is cancelled: the slot is free
    m = wait_idle(small.url)
    assert total(m, "onegraph_requests_total", status="401") == 2 + 1         # two raw posts, one /v1/models
    assert total(m, "onegraph_requests_total", status="503") == 2
    assert total(m, "onegraph_request_finished_total") == 2                   # the two completions that ran


# ---------------------------------------------------------------- 128 concurrent requests
def _distinct():
    """16 greedy requests: prompts of 12 to 119 tokens (1 to 8 prefill chunks of 16), 8 to 40 new tokens,
    completions and chat alternating; eos may stop some early, alone and in a batch alike."""
    out = []
    for i in range(16):
        text = f"request {i}: " + "the rain in spain falls mainly on the plain "[: 3 * i + 1] * (1 + i % 2)
        kind = "chat" if i % 2 else "completion"
        kw = dict(model=MODEL, max_tokens=8 + (5 * i) % 33, temperature=0, extra_body={"return_token_ids": True})
        kw.update({"messages": [{"role": "user", "content": text}]} if kind == "chat" else {"prompt": text})
        out.append((kind, kw))
    return out


async def _one(cl, kind, kw, stream: bool, leave_after: int | None):
    """-> dict(status=..., ids, text, finish, prompt_tokens) for a completed request; leave_after=k reads k
    chunks of a stream and closes the connection."""
    create = cl.chat.completions.create if kind == "chat" else cl.completions.create
    if not stream:
        r = await create(**kw)
        c = r.choices[0]
        return dict(status="done", ids=c.model_extra["token_ids"], finish=c.finish_reason,
                    text=c.message.content if kind == "chat" else c.text, prompt_tokens=r.usage.prompt_tokens)
    s = await create(**kw, stream=True, stream_options={"include_usage": True})
    text, ids, finish, usage, n = [], None, None, None, 0
    async for ch in s:
        n += 1
        if leave_after is not None and n >= leave_after:
            await s.close()                                   # the client goes away mid-stream
            return dict(status="left")
        if ch.usage:
            usage = ch.usage
        if ch.choices:
            c = ch.choices[0]
            text.append((c.delta.content if kind == "chat" else c.text) or "")
            if c.finish_reason:
                finish, ids = c.finish_reason, c.model_extra["token_ids"]
    return dict(status="done", ids=ids, finish=finish, text="".join(text), prompt_tokens=usage.prompt_tokens)


def test_128_concurrent_with_disconnects(servers, codec):
    srv = servers.main
    distinct = _distinct()
    solo = [srv.client().chat.completions.create(**kw) if kind == "chat" else srv.client().completions.create(**kw)
            for kind, kw in distinct]
    solo_ids = [r.choices[0].model_extra["token_ids"] for r in solo]
    leave_kw = dict(model=MODEL, prompt="go", max_tokens=LONG, temperature=0, extra_body={"ignore_eos": True})
    # job j: distinct request j % 16; odd j streamed; j % 8 == 3 a long stream whose client leaves after 2 chunks
    jobs = [("completion", leave_kw, True, 2) if j % 8 == 3 else (*distinct[j % 16], j % 2 == 1, None)
            for j in range(128)]
    before = wait_idle(srv.url)

    async def burst():
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300) as cl:
            return await asyncio.gather(*(_one(cl, *job) for job in jobs), return_exceptions=True)

    t0 = time.time()
    results = asyncio.run(burst())
    wall = time.time() - t0
    errors = [(j, r) for j, r in enumerate(results) if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of 128 requests failed; first: job {errors[0][0]}: {errors[0][1]!r}"
    done = [(j, r) for j, r in enumerate(results) if r["status"] == "done"]
    left = [j for j, r in enumerate(results) if r["status"] == "left"]
    assert len(done) == 112 and len(left) == 16
    for j, r in done:
        d = j % 16
        assert r["ids"] == solo_ids[d], (
            f"job {j} (request {d}, {'streamed' if j % 2 else 'plain'}): {r['ids']} vs alone {solo_ids[d]}")
        want = solo[d].choices[0]
        assert r["finish"] == want.finish_reason
        assert r["text"] == ((want.message.content if distinct[d][0] == "chat" else want.text) or "")

    after = wait_idle(srv.url)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    by = collections.Counter(kind for kind, *_ in jobs)
    assert total(delta, "onegraph_requests_total", endpoint="/v1/completions", status="200") == by["completion"]
    assert total(delta, "onegraph_requests_total", endpoint="/v1/chat/completions", status="200") == by["chat"]
    # a request whose client left is counted only if it ran to its end before the server noticed (LONG tokens)
    ran_out = total(delta, "onegraph_request_finished_total") - len(done)
    assert 0 <= ran_out < len(left), f"{ran_out} of {len(left)} abandoned streams ran to the end: none was cut short"
    assert total(delta, "onegraph_generation_tokens_total") == sum(len(r["ids"]) for _, r in done) + ran_out * LONG
    assert total(delta, "onegraph_prompt_tokens_total") == \
        sum(r["prompt_tokens"] for _, r in done) + ran_out * len(codec.encode(leave_kw["prompt"]))
    print(f"128 concurrent ({len(left)} clients leaving): {wall:.2f} s, {ran_out} abandoned streams ran out")


# ---------------------------------------------------------------- the end: idle, consistent, SIGTERM
def test_zz_idle_metrics_consistent_then_sigterm(servers):
    srv = servers.main
    m = wait_idle(srv.url)
    assert total(m, "onegraph_max_slots") == SLOTS
    finished = total(m, "onegraph_request_finished_total")
    assert finished > 0
    assert total(m, "onegraph_time_to_first_token_seconds_count") == finished
    assert total(m, "onegraph_e2e_request_latency_seconds_count") == finished
    assert total(m, "onegraph_generation_tokens_total") >= finished
    statuses = {dict(ls)["status"] for (n, ls) in m if n == "onegraph_requests_total"}
    assert statuses <= {"200", "400"}, f"unexpected statuses on the main server: {statuses}"
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"

    body = {"model": MODEL, "prompt": "go", "max_tokens": LONG, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", srv.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        srv.proc.send_signal(signal.SIGTERM)
        rest = [x for x in lines if x]                        # the stream ends: cancelled in flight
    assert rest[-1] == "data: [DONE]" and any('"cancelled"' in x for x in rest[-2:]), rest[-3:]
    servers.small.proc.send_signal(signal.SIGTERM)                # idle
    for s in (srv, servers.small):
        rc = s.proc.wait(timeout=60)
        out = s.output()
        assert rc == 0, f"serve exited {rc}:\n{out[-4000:]}"
        assert "Traceback" not in out, out[-4000:]
