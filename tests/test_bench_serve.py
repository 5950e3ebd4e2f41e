"""`onegraph bench-serve` (commands/bench_serve.py): against a stub server that misbehaves (errors counted by
kind, the run finishes with its JSON), on bad input (exit 2, one line), its metric definitions, and the soak
of `onegraph serve` on the tiny artifact (tests/soak.py: 200 requests here, 1,000 by hand)."""
import asyncio
import json
import subprocess
import sys

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from onegraph.cli import main
from server_helpers import running

MODES = ("ok", "slow_first_token", "dropped", "busy", "error_event", "no_done", "not_sse")


def stub_app(modes=MODES) -> FastAPI:
    """An OpenAI-shaped /v1/completions whose n-th request misbehaves as modes[n % len(modes)]; no usage in
    the stream, so the tool counts text chunks (4 per request). /v1/chat/completions: a role chunk with empty
    content first (as onegraph and vLLM send), 3 content chunks, then the usage chunk."""
    app = FastAPI()
    seen = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append(body)

        async def sse():
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}}]})}\n\n"
            await asyncio.sleep(0.2)                # the role chunk is not the first token
            for i in range(3):
                ch = {"index": 0, "delta": {"content": f"c{i}"}, "finish_reason": "length" if i == 2 else None}
                yield f"data: {json.dumps({'choices': [ch]})}\n\n"
            usage = {"prompt_tokens": 17, "completion_tokens": 5, "total_tokens": 22}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        mode = modes[len(seen) % len(modes)]
        seen.append(body)
        if mode == "not_sse":                       # a server that ignores "stream": one JSON body
            return {"choices": [{"index": 0, "text": "whole", "finish_reason": "length"}]}
        if mode == "busy":
            return JSONResponse({"error": {"message": "at capacity", "type": "server_error", "param": None,
                                           "code": "queue_full"}}, status_code=503, headers={"Retry-After": "3"})

        async def sse():
            if mode == "slow_first_token":
                await asyncio.sleep(3)
            for i in range(4):
                if mode == "dropped" and i == 2:
                    raise RuntimeError("connection lost mid-stream")   # uvicorn aborts the chunked body
                if mode == "no_done" and i == 2:
                    return                                  # a clean end of the body, cut short
                if mode == "error_event" and i == 1:
                    yield 'data: {"error": {"message": "boom", "type": "server_error"}}\n\n'
                    yield "data: [DONE]\n\n"
                    return
                await asyncio.sleep(0.01)
                choice = {"index": 0, "text": f"t{i}", "finish_reason": "length" if i == 3 else None}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(sse(), media_type="text/event-stream")

    app.state.seen = seen
    return app


def bench_args(url, out, *extra):
    return ["bench-serve", "--base-url", url, "--num-requests", "12", "--input-len", "5", "--output-len", "4",
            "--out", str(out), "--quiet", "--no-plot", *extra]


def test_stub_misbehaving_errors_counted(tmp_path):
    """Concurrency 1 keeps the stub's order: 14 requests = each mode twice. The no_done stream ends cleanly
    but before its finish_reason and [DONE]: a dropped connection as much as the aborted one."""
    app = stub_app()
    out = tmp_path / "stub.json"
    with running(app, log_level="critical") as url:
        assert main(bench_args(url, out, "--concurrency", "1", "--first-token-timeout", "1", "--save-outputs",
                               "--seed", "3", "--num-requests", "14")) == 0
    res = json.loads(out.read_text())
    assert res["model"] == "stub"                   # taken from /v1/models
    assert res["completed"] == 2 and res["disconnected"] == 0
    assert res["errors"] == {"first_token_timeout": 2, "dropped": 4, "http_503": 2, "stream_error": 2,
                             "bad_response": 2}
    assert res["failed"] == 12 and res["retry_after"] == ["3"]
    assert res["tokens_counted_by"] == {"chunks": 2} and res["total_output_tokens"] == 8
    assert res["total_input_tokens"] == 10 and res["input_tok_s"] == pytest.approx(10 / res["duration_s"])
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert {"mean", "p50", "p90", "p99"} <= set(res[k])
    # the definitions, from the per-request record: TPOT = (e2e - TTFT) / (tokens - 1); 3 ITLs per request
    ok = [o for o in res["outputs"] if o["status"] == "ok"]
    tpots = sorted((o["e2e_ms"] - o["ttft_ms"]) / 3 for o in ok)
    assert res["tpot_ms"]["p50"] == pytest.approx(sum(tpots) / 2)
    assert res["itl_ms"]["n"] == 6 and res["ttft_ms"]["n"] == 2
    assert [o["text"] for o in ok] == ["t0t1t2t3"] * 2
    # what was sent: token-id prompts of --input-len, max_tokens, ignore_eos, usage asked for, streaming
    sent = app.state.seen
    assert len(sent) == 14 and all(len(b["prompt"]) == 5 and b["max_tokens"] == 4 and b["ignore_eos"]
                                   and b["stream"] and b["stream_options"] == {"include_usage": True} for b in sent)


def test_seeded_mix_is_reproducible_and_rate_mode(tmp_path):
    """Same --seed, same requests (prompts, sampling, seeds); a Poisson rate with a concurrency cap runs."""
    bodies = []
    for k in range(2):
        app = stub_app()
        with running(app, log_level="critical") as url:
            assert main(bench_args(url, tmp_path / f"r{k}.json", "--request-rate", "200", "--concurrency", "4",
                                   "--sampled-fraction", "0.5", "--seed", "11", "--first-token-timeout", "0.5")) == 0
        bodies.append(sorted(json.dumps(b, sort_keys=True) for b in app.state.seen))
    assert bodies[0] == bodies[1]
    sampled = [json.loads(b) for b in bodies[0] if '"seed"' in b]
    assert 0 < len(sampled) < 12 and all(b["temperature"] == 0.8 for b in sampled)
    res = json.loads((tmp_path / "r1.json").read_text())
    assert res["request_rate"] == 200 and res["completed"] + res["failed"] == 12
    with running(stub_app(("ok",)), log_level="critical") as url:   # vLLM's "inf": all at once, no cap
        assert main(bench_args(url, tmp_path / "inf.json", "--request-rate", "inf")) == 0
    res = json.loads((tmp_path / "inf.json").read_text())
    assert (res["request_rate"], res["concurrency"], res["completed"]) == (None, None, 12)


def test_chat_text_prompts_usage_and_ttft_past_the_role_chunk(tmp_path):
    """--api chat sends text (random ids decoded by --tokenizer), counts tokens by the final usage, and
    starts TTFT's clock-stop at the first content, not at the empty role chunk (sent 0.2 s earlier)."""
    from onegraph.models.qwen3_5.tiny import tiny_tokenizer
    tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))
    app = stub_app()
    out = tmp_path / "chat.json"
    with running(app, log_level="critical") as url:
        assert main(bench_args(url, out, "--concurrency", "2", "--api", "chat", "--tokenizer", str(tmp_path),
                               "--metadata", "server=stub", "--save-outputs")) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 12 and res["errors"] == {} and res["metadata"] == {"server": "stub"}
    assert res["tokens_counted_by"] == {"usage": 12}
    assert (res["total_input_tokens"], res["total_output_tokens"]) == (12 * 17, 12 * 5)
    assert res["ttft_ms"]["min"] >= 200
    assert all(o["text"] == "c0c1c2" for o in res["outputs"])
    msgs = [b["messages"] for b in app.state.seen]
    assert all(len(m) == 1 and m[0]["role"] == "user" and isinstance(m[0]["content"], str) for m in msgs)


def test_dataset_prompts(tmp_path):
    """--dataset: text prompts from a JSONL file in a seeded order, cycling; a line's output_len wins over
    --output-len; --input-len is not needed."""
    ds = tmp_path / "ds.jsonl"
    ds.write_text('{"prompt": "alpha", "output_len": 7}\n\n{"prompt": "beta"}\n{"prompt": "gamma", "output_len": 2}\n')
    app = stub_app()
    argv = bench_args("", tmp_path / "ds.json", "--concurrency", "3", "--api", "chat", "--dataset", str(ds))
    i = argv.index("--input-len")
    del argv[i:i + 2]
    with running(app, log_level="critical") as url:
        argv[argv.index("--base-url") + 1] = url
        assert main(argv) == 0
    sent = sorted((b["messages"][0]["content"], b["max_tokens"]) for b in app.state.seen)
    assert sent == sorted([("alpha", 7), ("beta", 4), ("gamma", 2)] * 4)
    assert json.loads((tmp_path / "ds.json").read_text())["completed"] == 12


@pytest.mark.parametrize("lines, msg", [("", "holds no prompt"), ("{bad\n", "ds.jsonl:1: not JSON"),
                                        ('{"prompt": "x", "output_len": 0}\n', "ds.jsonl:1: need")])
def test_bad_dataset_exit_2(tmp_path, capsys, lines, msg):
    (tmp_path / "ds.jsonl").write_text(lines)
    assert main(bench_args("http://127.0.0.1:9", tmp_path / "x.json", "--concurrency", "2", "--dataset",
                           str(tmp_path / "ds.jsonl"))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err, err


@pytest.mark.parametrize("extra, msg", [
    (["--concurrency", "2", "--request-rate", "-1"], "--request-rate must be > 0"),
    (["--concurrency", "2", "--request-rate", "nan"], "--request-rate must be finite"),
    (["--concurrency", "0"], "--concurrency must be >= 1"),
    (["--concurrency", "many"], "--concurrency must be an integer"),
    ([], "pass --concurrency C or --request-rate R"),
    (["--concurrency", "2", "--disconnect-fraction", "1.5"], "--disconnect-fraction must be in [0, 1]"),
])
def test_nonsense_values_exit_2_one_line(tmp_path, capsys, extra, msg):
    assert main(bench_args("http://127.0.0.1:9", tmp_path / "x.json", *extra)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err, err
    assert not (tmp_path / "x.json").exists()


def test_bad_lengths_exit_2(tmp_path, capsys):
    argv = bench_args("http://127.0.0.1:9", tmp_path / "x.json", "--concurrency", "2")
    argv[argv.index("--input-len") + 1] = "0"
    assert main(argv) == 2
    assert "--input-len must be >= 1" in capsys.readouterr().err


def test_dead_url_exit_2_one_line(tmp_path):
    """In a process of its own: exit status 2, one line on stderr, no traceback."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                       # nothing listens there now
    p = subprocess.run([sys.executable, "-m", "onegraph", *bench_args(f"http://127.0.0.1:{port}",
                        tmp_path / "x.json", "--concurrency", "2")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "cannot reach" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_soak_tiny_serve(tiny_artifact, tmp_path):
    """200 requests at concurrency 32 against `onegraph serve` on the tiny artifact: half greedy, half seeded
    sampling, 10 % of clients hanging up mid-stream. The rest see no error; each output equals its request
    alone through the engine; no slot or queue entry is left; /metrics agrees with what was sent; the
    server's resident memory grew < 5 %."""
    from soak import run_soak
    res = run_soak(tiny_artifact, tmp_path / "soak.json", num_requests=200)
    c = res["checks"]
    assert c["errors"] == {} and c["warmup_completed"] == 32
    assert c["completed"] + c["disconnected"] == 200 and 5 <= c["disconnected"] <= 40
    assert c["active_slots"] == 0 and c["queue_depth"] == 0
    assert c["http_200"] == 200 and c["http_other"] == 0 and c["finished_other"] == 0
    assert c["completed"] <= c["finished_length"] <= 200
    assert c["completed_tokens"] == 16 * c["completed"]
    assert c["generation_tokens"] == 16 * c["finished_length"]
    assert c["greedy_checked"] > 50 and c["greedy_differ"] == []
    assert c["sampled_checked"] > 50 and c["sampled_differ"] == []
    assert c["rss_growth"] < 0.05, c
