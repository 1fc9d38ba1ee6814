"""`kvq serve` on the default model (CPU), through the real openai client and raw HTTP on loopback:
completions and chat (JSON and SSE), stop, seeds, n, errors, request limits, hostile and slow clients,
metrics, status, overload, disconnects, a bounded load test, and recovery from a failing engine step.
One server for the module (the API key, CORS and the CLI are tests/test_server_security.py's)."""

import asyncio
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvq.cli import main
from kvq.engine.llm_engine import EngineConfig
from kvq.server.launch import ServerThread, build_server
from kvq.server.loadgen import LoadSpec, run_load
from kvq.server.options import ServerOptions
from kvq.server.protocol import safe_text_end

MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 6
MAX_QUEUE_LEN = 10  # 16 live requests at most
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
# short deadlines, so that the slow-client tests are quick; everything else is the default
OPTIONS = ServerOptions(timeout_headers=1.5, timeout_body=1.5, max_request_bytes=4 * 2**20)


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(kv_cache_memory="64MiB", max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                          progress=False)
    app, engine = build_server(config, ["default", "smol"], max_queue_len=MAX_QUEUE_LEN, options=OPTIONS)
    thread = ServerThread(app)
    url = thread.start()
    yield url, engine
    thread.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _metrics(url: str) -> dict:
    """{(sample name, frozenset(labels)): value} from /metrics, parsed by prometheus_client."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _idle_check(url: str) -> dict:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        r = httpx.get(url + "/status").json()["requests"]
        if r["running"] + r["waiting"] + r["live_requests"] == 0:
            break
        time.sleep(0.05)
    return httpx.get(url + "/status", params={"check": 1}).json()


def _assert_clean(url: str) -> dict:
    st = _idle_check(url)
    assert st["integrity"] == {"ok": True, "error": None, "idle": True, "used_blocks": {"q": 0, "hp": 0},
                               "leaked_blocks": 0}, st["integrity"]
    return st


# -- the openai client ----------------------------------------------------------------------------
def test_completion_stream_and_json_agree_with_usage(client, server):
    tok = server[1].engine.tokenizer
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=8, temperature=0)
    c = r.choices[0]
    assert r.object == "text_completion" and r.model == "default" and c.index == 0
    assert c.finish_reason == "length" and c.text.strip()
    assert r.usage.prompt_tokens == len(tok(PROMPT)["input_ids"])
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8
    chunks = list(client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == c.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert len([ch for ch in chunks if ch.choices]) >= 2, "tokens must arrive over several chunks"


def test_chat_stream_and_json_agree(client):
    r = client.chat.completions.create(model="default", messages=CHAT, max_tokens=10, temperature=0)
    msg = r.choices[0].message
    assert r.object == "chat.completion" and msg.role == "assistant" and msg.content.strip()
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="default", messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_cuts_text_in_json_and_stream(client):
    full = client.completions.create(model="default", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = full.strip().split()[1]  # the second word of the greedy output
    want = full[:full.index(stop)]
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="default", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == want  # nothing of the stop string leaked


def test_seed_makes_sampling_reproducible_and_n_offsets_it(client):
    def sample(seed, n=1):
        r = client.completions.create(model="default", prompt="Once upon a time", max_tokens=10, temperature=1.0,
                                      seed=seed, n=n)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    a, b, c = sample(7), sample(7), sample(8)
    assert a == b and a != c
    assert sample(7, n=2) == a + c  # choice i samples with seed + i


def test_token_id_prompts_batch_and_return_token_ids(server):
    url, engine = server
    ids = engine.engine.tokenizer(PROMPT)["input_ids"]
    r = httpx.post(url + "/v1/completions", json={"prompt": [ids, ids[:3]], "max_tokens": 4, "temperature": 0,
                                                  "return_token_ids": True}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["prompt_token_ids"] == [ids, ids[:3]]
    assert all(len(c["token_ids"]) == 4 for c in r["choices"])
    assert r["usage"] == {"prompt_tokens": len(ids) + 3, "completion_tokens": 8, "total_tokens": len(ids) + 11}
    text = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0}).json()
    assert r["choices"][0]["text"] == text["choices"][0]["text"]  # token ids and text give the same output


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,param,needle", [
    (b'{"prompt": "x", ', None, "malformed JSON"),
    (b'[1, 2]', None, "JSON object"),
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens", "served with echo: true only"),
    (b'{"prompt": "x", "max_tokens": -1, "echo": true}', "max_tokens", "greater than or equal to 0"),
    (b'{"prompt": "x", "temperature": -0.5}', "temperature", "greater than or equal to 0"),
    (b'{"prompt": "x", "temperature": "hot"}', "temperature", "number"),
    (b'{"prompt": "x", "top_p": 0}', "top_p", "greater than 0"),
    (b'{"prompt": "x", "bogus": 1}', "bogus", "unknown field 'bogus'; valid fields:"),
    (b'{"prompt": "x", "logprobs": 21}', "logprobs", "at most 20 logprobs per token (--max-logprobs 20)"),
    (b'{"prompt": "x", "logprobs": 21, "echo": true, "stream": true}', "logprobs", "--max-logprobs 20"),
    (b'{"prompt": "x", "logit_bias": {}}', "logit_bias", "not supported"),
    (b'{"prompt": "x", "presence_penalty": 0.5}', "presence_penalty", "not supported"),
    (b'{"prompt": [1, "x"]}', "prompt", "list of token ids"),
    (b'{"prompt": []}', "prompt", "must not be empty"),
    (b'{"prompt": ""}', "prompt", "must not be empty"),
    (b'{"prompt": [[5, 6], []]}', "prompt", "prompt[1] is empty"),
    (b'{"max_tokens": 3}', "prompt", "Field required"),
    (json.dumps({"prompt": [300] * (MAX_MODEL_LEN + 1)}).encode(), "prompt", "exceeds max_model_len"),
    (b'{"prompt": [300, 301], "max_tokens": 600}', "max_tokens", "exceeds max_model_len"),
    (b'{"prompt": [[300], [300, 301]], "max_tokens": 511}', "max_tokens", "prompt[1]: the prompt (2 tokens)"),
    (b'{"prompt": [999999999]}', "prompt", "token ids must be in"),
])
def test_bad_completion_requests_get_openai_style_400(server, body, param, needle):
    r = httpx.post(server[0] + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert needle in err["message"] and err["param"] == param
    assert "sequence" not in err["message"]  # no internal ids or counters


def test_the_same_bad_request_twice_gets_the_same_message(server):
    """A message never carries a server-wide counter: the same bad request reads the same each time."""
    body = b'{"prompt": [300, 301], "max_tokens": 600}'
    msgs = [httpx.post(server[0] + "/v1/completions", content=body, headers={"content-type": "application/json"})
            .json()["error"]["message"] for _ in range(2)]
    assert msgs[0] == msgs[1]


@pytest.mark.parametrize("body,needle", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": CHAT, "max_tokens": 3, "max_completion_tokens": 4}, "differ"),
    ({"messages": CHAT, "tools": []}, "not supported"),
    ({"messages": CHAT, "max_tokens": 0}, "greater than or equal to 1"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs is 21; this server returns at most 20"),
])
def test_bad_chat_requests_get_400(server, body, needle):
    r = httpx.post(server[0] + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    if "top_logprobs" in body or body.get("max_tokens") == 0:
        assert r.json()["error"]["param"] == ("top_logprobs" if "top_logprobs" in body else "max_tokens")


def test_openai_client_raises_not_found_for_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    assert "served: default, smol" in e.value.body["message"]


# -- the edge: media type, routes, limits ---------------------------------------------------------
JSON_TYPE = {"content-type": "application/json"}


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


@pytest.mark.parametrize("method,path,headers,body,status,code,param", [
    # media type: a browser's cross-origin "simple" POST (text/plain, form) is never served
    ("POST", "/v1/completions", {"content-type": "text/plain"}, b'{"prompt": "x"}', 415, "unsupported_media_type",
     None),
    ("POST", "/v1/completions", {"content-type": "application/x-www-form-urlencoded"}, b"prompt=x", 415,
     "unsupported_media_type", None),
    ("POST", "/v1/chat/completions", {}, _json({"messages": CHAT}), 415, "unsupported_media_type", None),
    # routes: no trailing-slash redirects, no FastAPI 422s, no public API docs
    ("POST", "/v1/completions/", JSON_TYPE, b'{"prompt": "x"}', 404, None, None),
    ("GET", "/v1/models/", {}, b"", 404, None, None),
    ("GET", "/status?check=maybe", {}, b"", 400, "invalid_value", "check"),
    ("GET", "/v1/completions", {}, b"", 405, None, None),
    ("GET", "/docs", {}, b"", 404, None, None),
    ("GET", "/redoc", {}, b"", 404, None, None),
    ("GET", "/openapi.json", {}, b"", 404, None, None),
    ("POST", "/v1/completions", JSON_TYPE, _json({"model": "gpt-4", "prompt": "x"}), 404, "model_not_found", "model"),
    # limits, each checked before the work it bounds is built
    ("POST", "/v1/completions", JSON_TYPE, _json({"prompt": "x", "n": OPTIONS.max_n + 1}), 400, "invalid_value", "n"),
    ("POST", "/v1/completions", JSON_TYPE, _json({"prompt": "x", "n": 2**40}), 400, "invalid_value", "n"),
    ("POST", "/v1/completions", JSON_TYPE, _json({"prompt": ["a", "b", "c", "d", "e"], "n": 4}), 400, "invalid_value",
     None),  # 20 sequences > 16 admissible
    ("POST", "/v1/completions", JSON_TYPE, _json({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}), 400,
     "invalid_value", "stop"),
    ("POST", "/v1/completions", JSON_TYPE, _json({"prompt": "x", "stop": "s" * 257}), 400, "invalid_value", "stop"),
    ("POST", "/v1/completions", JSON_TYPE, _json({"prompt": "x", "stop_token_ids": list(range(257))}), 400,
     "invalid_value", "stop_token_ids"),
    ("POST", "/v1/completions", JSON_TYPE, _json({"prompt": "word " * 40_000}), 400, "context_length_exceeded",
     "prompt"),
    ("POST", "/v1/completions", JSON_TYPE, _json({"prompt": ["x", "word " * 40_000]}), 400,
     "context_length_exceeded", "prompt"),
    ("POST", "/v1/chat/completions", JSON_TYPE, _json({"messages": [{"role": "user", "content": "word " * 40_000}]}),
     400, "context_length_exceeded", "messages"),
])
def test_edge_errors_are_openai_shaped(server, method, path, headers, body, status, code, param):
    r = httpx.request(method, server[0] + path, headers=headers, content=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("not_found_error" if status == 404 and code is None else "invalid_request_error")
    assert err["code"] == code and err["param"] == param, err


def test_json_content_type_with_charset_is_served(server):
    r = httpx.post(server[0] + "/v1/completions", content=_json({"prompt": PROMPT, "max_tokens": 1}),
                   headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def test_no_cors_headers_without_allowed_origins(server):
    r = httpx.options(server[0] + "/v1/completions", headers={
        "origin": "https://evil.example", "access-control-request-method": "POST",
        "access-control-request-headers": "content-type"})
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


def _raw(url: str, data: bytes, *, timeout: float = 10.0) -> tuple[bytes, float]:
    """Send ``data`` on a new connection, then read until the server closes it: (all it sent, seconds).
    A server that never closes fails the test with socket.timeout."""
    u = httpx.URL(url)
    t0 = time.monotonic()
    with socket.create_connection((u.host, u.port), timeout=timeout) as s:
        if data:
            s.sendall(data)
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
    return out, time.monotonic() - t0


def _raw_status(out: bytes) -> tuple[int, dict | None]:
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body) if body.startswith(b"{") else None


def _head(extra: str = "Content-Length: 100") -> bytes:
    return f"POST /v1/completions HTTP/1.1\r\nHost: kvq\r\nContent-Type: application/json\r\n{extra}\r\n\r\n".encode()


def test_body_limit_is_enforced_while_reading(server):
    url = server[0]
    limit = OPTIONS.max_request_bytes
    out, _ = _raw(url, _head(f"Content-Length: {10**12}"))  # refused on its header: nothing is read
    status, body = _raw_status(out)
    assert status == 413 and body["error"]["code"] == "request_too_large" and str(limit) in body["error"]["message"]
    chunk = b"x" * (1 << 16)  # chunked: no Content-Length to trust; one byte over the limit in all
    chunks = [chunk] * (limit // len(chunk)) + [b"y"]
    data = _head("Transfer-Encoding: chunked") + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
    out, _ = _raw(url, data)
    status, body = _raw_status(out)
    assert status == 413 and body["error"]["code"] == "request_too_large"


def test_slow_and_idle_connections_are_cut_off(server):
    """An idle connection, half-sent headers, a slow second request on a kept-alive connection: closed
    after --timeout-headers; a half-sent body: 408 after --timeout-body.  None is held open."""
    url = server[0]
    keep_alive = b"GET /health HTTP/1.1\r\nHost: kvq\r\n\r\nGET /health HTTP/1.1\r\nHo"
    cases = {"idle": b"", "half headers": _head()[:30], "kept alive": keep_alive, "half body": _head() + b'{"pro'}
    with ThreadPoolExecutor(len(cases)) as pool:
        got = dict(zip(cases, pool.map(lambda d: _raw(url, d), cases.values())))
    for name in ("idle", "half headers"):
        out, took = got[name]
        assert out == b"" and 1.0 < took < OPTIONS.timeout_headers + 4, (name, out, took)
    out, took = got["kept alive"]  # closed by the header deadline, well before the 5 s keep-alive one
    assert out.count(b"HTTP/1.1 200") == 1 and took < OPTIONS.timeout_keep_alive - 1, (out, took)
    out, took = got["half body"]
    status, body = _raw_status(out)
    assert status == 408 and body["error"]["code"] == "request_timeout" and took < OPTIONS.timeout_body + 4
    assert httpx.get(url + "/health").status_code == 200


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_client_leaving_mid_body_is_one_log_line(server):
    url = server[0]
    logger, handler = logging.getLogger("uvicorn.error"), _Records()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        u = httpx.URL(url)
        with socket.create_connection((u.host, u.port), timeout=10) as s:
            s.sendall(_head() + b'{"prompt": "x"')  # 14 of 100 bytes, then gone
        deadline = time.monotonic() + 5
        while not handler.records and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # anything logged after that line (a traceback) would be here by now
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [r.getMessage() for r in handler.records]
    assert len(lines) == 1 and "disconnected after 14 bytes of the body" in lines[0], lines
    assert handler.records[0].exc_info is None


def test_huge_requests_are_refused_while_streams_and_health_go_on(server, monkeypatch):
    """n = 2**40, a 3 MB prompt and a slow tokenization, while a stream runs and /health is polled:
    the refusals are quick (and never wait behind the stuck tokenization), the big prompt is never
    tokenized, no text is tokenized on the engine thread, the stream keeps producing tokens while a
    tokenization is stuck, /health keeps answering."""
    url, engine = server
    _idle_check(url)
    real_encode = engine.engine.encode
    encoded = []  # (thread, chars, start, end) of every text tokenization

    def spy(prompt):
        t0 = time.monotonic()
        if isinstance(prompt, str) and prompt.startswith("SLOW"):
            time.sleep(2.0)  # as a tokenization that takes long: must hold up nobody else
        try:
            return real_encode(prompt)
        finally:
            if isinstance(prompt, str):
                encoded.append((threading.current_thread().name, len(prompt), t0, time.monotonic()))

    monkeypatch.setattr(engine.engine, "encode", spy)
    arrivals = []

    def stream():
        body = {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True, "return_token_ids": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            arrivals.extend(time.monotonic() for line in r.iter_lines() if line.startswith("data: {"))

    def post(body):
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        return r.status_code, r.json(), time.monotonic() - t0, time.monotonic()

    streamer = threading.Thread(target=stream)
    streamer.start()
    with ThreadPoolExecutor(3) as pool:
        deadline = time.monotonic() + 60
        while not arrivals and time.monotonic() < deadline:  # the stream is producing
            time.sleep(0.02)
        jobs = [pool.submit(post, b) for b in ({"prompt": "SLOW " + PROMPT, "max_tokens": 1},
                                               {"prompt": [PROMPT] * 4, "n": 2**40},
                                               {"prompt": "word " * 600_000})]
        health = []
        while not all(j.done() for j in jobs):
            t0 = time.monotonic()
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            health.append(time.monotonic() - t0)
            time.sleep(0.05)
        slow, huge_n, big = (j.result() for j in jobs)
    streamer.join(120)
    assert slow[0] == 200 and slow[1]["usage"]["completion_tokens"] == 1
    assert huge_n[0] == 400 and huge_n[1]["error"]["param"] == "n" and huge_n[2] < 5, huge_n
    assert big[0] == 400 and big[1]["error"]["code"] == "context_length_exceeded" and big[2] < 5, big
    assert max(health) < 3, health
    assert all(name.startswith("kvq-tokenize") for name, *_ in encoded), encoded
    assert max(chars for _, chars, *_ in encoded) < 10_000, "the 3 MB prompt was tokenized"
    start, end = next((t0, t1) for _, chars, t0, t1 in encoded if t1 - t0 >= 2.0)
    assert huge_n[3] < end and big[3] < end, "a refusal waited for another request's tokenization"
    during = sum(start + 0.25 < t < end - 0.25 for t in arrivals)
    assert during >= 3, f"the stream stalled while a prompt was tokenized: {during} chunks in {end - start:.1f} s"
    assert len(arrivals) >= 100  # every token (return_token_ids: a chunk each)


def test_model_without_tokenizer_needs_token_ids(server, monkeypatch):
    url, engine = server
    _idle_check(url)
    monkeypatch.setattr(engine.engine, "tokenizer", None)  # as a dummy-weight model
    r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT})
    assert r.status_code == 400 and "no tokenizer or chat template" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and "pass token ids" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": [300, 301], "max_tokens": 2, "return_token_ids": True})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2


def test_unknown_route_is_openai_style_404(server):
    r = httpx.get(server[0] + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own errors
        return e.code


def test_bad_cli_flags_exit_2(capsys):
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port must be in" in capsys.readouterr().err
    assert main(["serve", "--kv-cache-dtype", "fp9", "--port", "0"]) == 2
    assert "fp8_e4m3" in capsys.readouterr().err
    assert main(["serve", "--uvicorn-log-level", "loud"]) == 2
    assert _exit_code(["serve", "--no-such-flag"]) == 2
    for bad, why in (("21", "must be an integer in [0, 20]"), ("-1", "must be an integer in [0, 20]"),
                     ("many", "invalid int value")):
        assert main(["serve", "--port", "0", "--model", "/nonexistent/m.gguf", "--max-logprobs", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvq: error: ") and "--max-logprobs" in err and why in err, err
    assert _exit_code(["serve", "--help"]) == 0
    assert "--max-logprobs K" in capsys.readouterr().out


# -- models, health, status, metrics -------------------------------------------------------------
def test_models_health_status(server, client):
    url, engine = server
    assert [m.id for m in client.models.list().data] == ["default", "smol"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    st = _assert_clean(url)
    info = engine.engine.info
    assert len(st["kv_cache_dtype"]["per_layer"]) == engine.engine.plan.model.num_layers
    assert st["attention_backend"]["resolved"] == "torch" and st["max_model_len"] == MAX_MODEL_LEN
    assert st["kv_blocks"]["q"]["total"] == info["kv_pool"]["q_blocks"] == st["kv_pool"]["q_blocks"]
    assert st["kv_pool"]["bytes_per_block"] == engine.engine.plan.bytes_per_block
    assert st["max_live_requests"] == MAX_NUM_SEQS + MAX_QUEUE_LEN


def test_metrics_parse_and_count(server):
    url, engine = server
    before = _metrics(url)
    httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5})
    httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    m = _metrics(url)

    def delta(name, **labels):
        key = (name, frozenset(labels.items()))
        return m[key] - before.get(key, 0)

    assert delta("kvq_requests_total", outcome="success") == 1
    assert delta("kvq_requests_total", outcome="invalid") == 1
    assert m[("kvq_server_draining", frozenset())] == 0  # 1 while it drains: tests/test_server_shutdown.py
    assert delta("kvq_request_finished_total", finished_reason="length") == 1
    assert delta("kvq_generation_tokens_total") == 5
    assert delta("kvq_time_to_first_token_seconds_count") == 1
    assert delta("kvq_time_per_output_token_seconds_count") == 1
    assert delta("kvq_inter_token_seconds_count") == 4
    q = engine.engine.info["kv_pool"]["q_blocks"]
    assert m[("kvq_kv_blocks_capacity", frozenset({("pool", "q")}))] == q
    assert m[("kvq_kv_blocks_used", frozenset({("pool", "q")}))] == 0
    assert m[("kvq_kv_blocks_free", frozenset({("pool", "q")}))] == q
    for name in ("kvq_running_requests", "kvq_waiting_requests", "kvq_swapped_requests", "kvq_num_preemptions_total",
                 "kvq_kv_cache_bytes", "kvq_kv_cache_usage_ratio", "kvq_requests_swapped_total",
                 "kvq_requests_resumed_total", "kvq_swap_fallbacks_total", "kvq_cpu_offload_budget_bytes",
                 "kvq_kv_cpu_offload_blocks_total", "kvq_kv_cpu_offload_bytes_total", "kvq_kv_cpu_offload_failed_total",
                 "kvq_kv_cpu_offload_rejected_total", "kvq_kv_cpu_reload_blocks_total", "kvq_kv_cpu_tier_hits_total",
                 "kvq_cpu_offload_seconds_total", "kvq_cpu_reload_seconds_total", "kvq_kv_cpu_tier_blocks"):
        assert (name, frozenset()) in m, name
    assert m[("kvq_kv_cpu_offload_blocks_total", frozenset())] == 0  # no host memory: no CPU prefix cache
    assert m[("kvq_cpu_offload_blocks", frozenset({("pool", "q"), ("state", "capacity")}))] == 0  # no tier here
    fmt = [dict(k[1]) for k in m if k[0] == "kvq_kv_cache_format_info"]
    assert fmt == [{"requested": "auto", "k": "bfloat16", "v": "bfloat16", "block_size": "16"}]
    assert sum(1 for k in m if k[0] == "kvq_kv_cache_layer_format_info") == len(engine.engine.info["kv_cache_dtype"]
                                                                               ["per_layer"])
    assert m[("kvq_attention_backend_info", frozenset({("requested", "auto"), ("resolved", "torch")}))] == 1


# -- overload, disconnects, load ------------------------------------------------------------------
def test_overload_gets_429_not_a_hang(server):
    url, _ = server

    async def burst():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*[c.post(url + "/v1/completions", json={
                "prompt": [300 + i, 301], "max_tokens": 6, "ignore_eos": True}) for i in range(28)])

    t0 = time.monotonic()
    rs = asyncio.run(burst())
    codes = [r.status_code for r in rs]
    assert set(codes) == {200, 429} and codes.count(200) >= MAX_NUM_SEQS + MAX_QUEUE_LEN - 2, codes
    rejected = next(r for r in rs if r.status_code == 429).json()["error"]
    assert "overloaded" in rejected["message"] and rejected["type"] == "rate_limit_error"
    assert all(r.json()["usage"]["completion_tokens"] == 6 for r in rs if r.status_code == 200)
    assert time.monotonic() - t0 < 60
    _assert_clean(url)


def _aborted(url: str) -> float:
    return _metrics(url)[("kvq_request_finished_total", frozenset({("finished_reason", "abort")}))]


def test_stream_disconnect_aborts_and_frees_blocks_at_once(server):
    url, _ = server
    before = _aborted(url)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True, "return_token_ids": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # kept referenced: closing this iterator would close the connection
        while not next(lines).startswith("data:"):  # until the first token arrived
            pass
        live = httpx.get(url + "/status", params={"check": 1}).json()["integrity"]  # checked on the engine thread
        assert live["ok"] and not live["idle"] and live["used_blocks"]["q"] > 0
        t0 = time.monotonic()
    st = _assert_clean(url)  # 400 tokens at ~50 ms/step would take 20 s; the abort frees them within a step
    assert time.monotonic() - t0 < 5 and st["requests"]["running"] == 0
    assert _aborted(url) == before + 1


def test_non_streaming_disconnect_aborts(server):
    url, _ = server
    before = _aborted(url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True},
                   timeout=1.0)
    _assert_clean(url)
    assert _aborted(url) == before + 1


def test_bounded_load_with_disconnects_leaks_nothing(server):
    url, _ = server
    spec = LoadSpec(num_requests=24, concurrency=10, input_len=24, output_len=8, disconnect_fraction=0.25,
                    time_limit_s=90, seed=1)
    before = _metrics(url)
    res = asyncio.run(run_load(url, spec))
    m = _metrics(url)

    def delta(name, label, value):
        key = (name, frozenset({(label, value)}))
        return m[key] - before[key]

    assert res["timed_out"] == 0 and res["http_5xx"] == 0 and res["http_status"] == {"200": 24}, res
    assert res["malformed"] == {} and res["errors"] == 0, res
    assert res["disconnected"] == 6 and res["completed"] == 18
    assert res["integrity_ok"] is True and res["leaked_blocks"] == 0, res
    assert res["ttft_ms"]["p50"] > 0 and res["tpot_ms"]["p95"] >= res["tpot_ms"]["p50"] > 0
    # a client that left after the engine's last token may count as a success, never as anything else
    aborted = delta("kvq_requests_total", "outcome", "abort")
    assert aborted >= 1 and aborted + delta("kvq_requests_total", "outcome", "success") == 24
    assert delta("kvq_request_finished_total", "finished_reason", "abort") >= 1
    assert sum(delta("kvq_request_finished_total", "finished_reason", r) for r in ("abort", "length")) == 24


# -- logprobs -------------------------------------------------------------------------------------
def test_completion_logprobs_through_the_openai_client(client):
    """logprobs: k gives each output token's logprob and its top k, read by the openai client; the
    sampled token's logprob equals the engine's own (raw logprobs of the same logits)."""
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and len(top) >= 3 and max(top.values()) == pytest.approx(val, abs=1e-6)  # greedy: the top


def test_echo_logprobs_score_the_prompt(client):
    """echo + logprobs (lm-evaluation-harness's loglikelihood call): the prompt's tokens come first, the
    first with a null logprob, then the completion; the prompt's logprobs do not depend on max_tokens."""
    a = client.completions.create(model="default", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2,
                                  echo=True)
    b = client.completions.create(model="default", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                                  echo=True)
    la, lb = a.choices[0].logprobs, b.choices[0].logprobs
    assert a.choices[0].text.startswith(PROMPT) and la.token_logprobs[0] is None and la.top_logprobs[0] is None
    n_prompt = len(la.tokens) - 1
    assert n_prompt >= 4 and all(v is not None and v <= 0 for v in la.token_logprobs[1:])
    assert la.token_logprobs[:n_prompt] == lb.token_logprobs[:n_prompt]
    assert la.text_offset == sorted(la.text_offset)


def test_echo_streams_the_prompt_first_then_the_completion(client):
    """echo with stream (as vLLM serves it): each choice's first chunk is the prompt's text and, with
    logprobs, the prompt tokens' logprobs; then the generated chunks.  Joined, the stream is the JSON
    response: text, tokens, logprobs, top logprobs and text offsets."""
    kw = dict(model="default", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**kw).choices[0]
    chunks = [ch for ch in client.completions.create(**kw, stream=True, stream_options={"include_usage": True})]
    choices = [ch.choices[0] for ch in chunks if ch.choices]
    first = choices[0]
    assert first.text == PROMPT and first.finish_reason is None
    n_prompt = len(first.logprobs.tokens)
    assert first.logprobs.token_logprobs[0] is None and first.logprobs.tokens == whole.logprobs.tokens[:n_prompt]
    assert "".join(c.text for c in choices) == whole.text and whole.text.startswith(PROMPT)
    assert choices[-1].finish_reason == whole.finish_reason == "length"
    lp = {k: [x for c in choices for x in getattr(c.logprobs, k)] for k in ("tokens", "text_offset", "top_logprobs")}
    assert lp["tokens"] == whole.logprobs.tokens and lp["text_offset"] == whole.logprobs.text_offset
    assert len(lp["tokens"]) == n_prompt + 3 and lp["text_offset"][n_prompt] == len(PROMPT)
    streamed = [x for c in choices for x in c.logprobs.token_logprobs]
    assert streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-6)
    assert lp["top_logprobs"][1:] == whole.logprobs.top_logprobs[1:]
    assert chunks[-1].usage.completion_tokens == 3
    plain = [ch.choices[0].text for ch in client.completions.create(**{**kw, "logprobs": None}, stream=True)]
    assert plain[0] == PROMPT and "".join(plain) == whole.text  # echo without logprobs: text only


def test_max_tokens_0_with_echo_scores_the_prompt_only(client):
    """The loglikelihood call of older lm-evaluation-harness versions (max_tokens 0, echo, logprobs 10):
    the prompt, its logprobs, no generated token (the engine computes one; the server drops it), the
    same prompt logprobs as with a generated token; JSON and streamed."""
    kw = dict(model="default", prompt=PROMPT, temperature=0, echo=True, logprobs=10)
    zero = client.completions.create(**kw, max_tokens=0)
    one = client.completions.create(**kw, max_tokens=1)
    c, lp = zero.choices[0], zero.choices[0].logprobs
    assert c.text == PROMPT and c.finish_reason == "length"
    assert zero.usage.completion_tokens == 0 and zero.usage.prompt_tokens == one.usage.prompt_tokens
    n_prompt = zero.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt == len(one.choices[0].logprobs.tokens) - 1
    assert lp.token_logprobs[0] is None and lp.token_logprobs == one.choices[0].logprobs.token_logprobs[:n_prompt]
    assert all(len(t) >= 10 for t in lp.top_logprobs[1:])
    chunks = list(client.completions.create(**kw, max_tokens=0, stream=True, stream_options={"include_usage": True}))
    choices = [ch.choices[0] for ch in chunks if ch.choices]
    assert "".join(ch.text for ch in choices) == PROMPT and choices[-1].finish_reason == "length"
    assert [x for ch in choices for x in ch.logprobs.token_logprobs][1:] == pytest.approx(lp.token_logprobs[1:])
    assert chunks[-1].usage.completion_tokens == 0
    assert client.completions.create(model="default", prompt=PROMPT, max_tokens=0, echo=True).choices[0].text == PROMPT


def test_logprobs_up_to_max_logprobs(client):
    """The default --max-logprobs (20) is served in full; 21 is the table's 400 above."""
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=20)
    assert len(r.choices[0].logprobs.top_logprobs[0]) >= 20
    r = client.chat.completions.create(model="default", messages=CHAT, max_tokens=1, temperature=0, logprobs=True,
                                       top_logprobs=20)
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 20


def test_chat_logprobs_json_and_stream(client):
    r = client.chat.completions.create(model="default", messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content
    chunks = list(client.chat.completions.create(model="default", messages=CHAT, max_tokens=4, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=CHAT, max_tokens=2, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


# -- the engine loop survives a failing step -----------------------------------------------------
def test_failing_step_fails_its_requests_and_the_engine_recovers(server, monkeypatch):
    url, engine = server
    runner = engine.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return real(*a, **k)

    monkeypatch.setattr(runner, "execute", flaky)
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}, timeout=30)
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    ok = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    st = _assert_clean(url)
    assert st["recoveries"] == 1 and st["alive"]


def test_an_output_json_cannot_carry_is_a_clear_500_and_the_server_goes_on(server, monkeypatch):
    """A NaN in an output (a fault upstream: the soak's elastic phase on a GPU met one, from stale KV
    bytes) is never sent as a bare 500 nor as "NaN" in an event: the JSON answer is an OpenAI-style 500,
    the stream ends with an error event and [DONE]; later requests are served and nothing leaks."""
    import kvq.server.app as app_module
    url, _ = server
    real = app_module.completion_logprobs

    def with_nan(*a, **k):
        out = real(*a, **k)
        if out["token_logprobs"]:
            out["token_logprobs"][0] = float("nan")
        return out

    monkeypatch.setattr(app_module, "completion_logprobs", with_nan)
    body = {"prompt": PROMPT, "max_tokens": 3, "logprobs": 1, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 500 and err["type"] == "server_error" and "NaN" in err["message"], r.text
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as s:
        events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
    assert "NaN" not in "".join(events[:-2]) and events[-1] == "[DONE]", events
    assert json.loads(events[-2])["error"]["type"] == "server_error", events
    def broken(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(app_module, "completion_logprobs", broken)  # any other fault: OpenAI-shaped too
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 500 and "RuntimeError" in r.json()["error"]["message"], r.text
    monkeypatch.undo()
    ok = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["token_logprobs"]) == 3
    _assert_clean(url)


def test_unrecoverable_engine_gives_503(server, monkeypatch):  # last: it stops the module's engine
    url, engine = server
    monkeypatch.setattr(engine.engine.runner, "execute", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("gpu")))
    monkeypatch.setattr(engine.engine.scheduler, "check_integrity", lambda: (_ for _ in ()).throw(AssertionError()))
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True}, timeout=30)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and "error" in events[-1] and r.text.rstrip().endswith("data: [DONE]")
    deadline = time.monotonic() + 5
    while httpx.get(url + "/health").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and "could not recover" in health.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


# -- pure helpers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,stop,finished,end", [
    ("hello wor", ("world",), False, 6),  # "wor" may begin "world"
    ("hello wor", ("world",), True, 9),
    ("abc", (), False, 3),
    ("ab\ufffd", (), False, 2),  # an incomplete character
    ("xabca", ("abcab",), False, 1),
    ("no match", ("zz",), False, 8),
])
def test_safe_text_end_holds_back_what_a_stop_string_may_cut(text, stop, finished, end):
    assert safe_text_end(text, stop, finished) == end
