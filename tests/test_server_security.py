"""`kvq serve`'s exposure: the API key (with the real openai client), which paths it guards, CORS,
API docs, and the flags behind them (bad ones exit 2 before the model loads, as does a port in use).

Served by a tiny dummy-weight model (no tokenizer: token-id prompts), so the servers start in a
moment; tests/test_server.py covers the routes and limits on the default model."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

import kvq.server.launch as launch
from kvq.cli import build_parser, main
from kvq.engine.llm_engine import EngineConfig
from kvq.server.command import options_from_args
from kvq.server.launch import ServerThread, build_server
from kvq.server.options import ServerOptions

KEY = "sk-kvq-test-0123456789"
ORIGIN = "https://app.example"
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
            intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=False,
            torch_dtype="float32")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(TINY))
    return str(path)


def _serve(model: str, options: ServerOptions):
    config = EngineConfig(model=model, load_format="dummy", device="cpu", kv_cache_memory="4MiB", max_num_seqs=4,
                          progress=False)
    app, _ = build_server(config, ["tiny"], max_queue_len=4, options=options)
    thread = ServerThread(app)
    return thread, thread.start()


@pytest.fixture(scope="module")
def servers(tiny_model):
    """{"keyed": key + CORS for ORIGIN + docs, "public": key with --public-metrics}: name -> URL."""
    threads, urls = [], {}
    for name, options in (("keyed", ServerOptions(api_key=KEY, allowed_origins=(ORIGIN,), enable_docs=True)),
                          ("public", ServerOptions(api_key=KEY, public_metrics=True))):
        thread, urls[name] = _serve(tiny_model, options)
        threads.append(thread)
    yield urls
    for thread in threads:
        thread.stop()


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_openai_client_with_and_without_the_key(servers):
    url = servers["keyed"]
    good = _client(url, KEY)
    assert [m.id for m in good.models.list().data] == ["tiny"]
    r = good.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3,
                                extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.usage.completion_tokens == 3
    bad = _client(url, KEY + "x")
    for call in (bad.models.list, lambda: bad.completions.create(model="tiny", prompt=[1, 2], max_tokens=2)):
        with pytest.raises(openai.AuthenticationError) as e:
            call()
        assert e.value.status_code == 401
        assert e.value.body == {"message": "incorrect API key provided", "type": "invalid_request_error",
                                "param": None, "code": "invalid_api_key"}


def test_openai_client_body_must_be_sent_as_json(servers):
    good = _client(servers["keyed"], KEY)
    with pytest.raises(openai.APIStatusError) as e:
        good.completions.create(model="tiny", prompt=[1, 2], max_tokens=2, extra_headers={"Content-Type": "text/plain"})
    assert e.value.status_code == 415 and e.value.body["code"] == "unsupported_media_type"


@pytest.mark.parametrize("server,method,path,auth,status", [
    ("keyed", "GET", "/health", None, 200),  # always open (load balancers)
    ("keyed", "GET", "/metrics", None, 401),
    ("keyed", "GET", "/metrics", f"Bearer {KEY}", 200),
    ("keyed", "GET", "/status", None, 401),
    ("keyed", "GET", "/status?check=1", f"Bearer {KEY}", 200),
    ("keyed", "GET", "/v1/models", None, 401),
    ("keyed", "GET", "/v1/models", f"bearer {KEY}", 200),  # the scheme is case-insensitive
    ("keyed", "GET", "/v1/models", f"Basic {KEY}", 401),
    ("keyed", "GET", "/v1/models", f"Bearer {KEY[:-1]}", 401),
    ("keyed", "GET", "/v1/models", "Bearer", 401),
    ("keyed", "POST", "/v1/completions", None, 401),
    ("keyed", "GET", "/v1/nothing", None, 401),  # unknown /v1 routes cannot be probed without the key
    ("keyed", "GET", "/v1/nothing", f"Bearer {KEY}", 404),
    ("keyed", "GET", "/docs", None, 200),  # --enable-docs
    ("keyed", "GET", "/openapi.json", None, 200),
    ("public", "GET", "/metrics", None, 200),  # --public-metrics
    ("public", "GET", "/status", None, 200),
    ("public", "GET", "/v1/models", None, 401),
    ("public", "GET", "/docs", None, 404),  # docs are off by default
])
def test_what_the_key_guards(servers, server, method, path, auth, status):
    r = httpx.request(method, servers[server] + path, headers={"authorization": auth} if auth else {})
    assert r.status_code == status, r.text
    if status == 401:
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"


def test_cors_only_for_allowed_origins(servers):
    url = servers["keyed"]
    preflight = {"access-control-request-method": "POST",
                 "access-control-request-headers": "authorization,content-type"}
    r = httpx.options(url + "/v1/completions", headers={"origin": ORIGIN, **preflight})  # no key: a preflight has none
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    r = httpx.options(url + "/v1/completions", headers={"origin": "https://evil.example", **preflight})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(url + "/v1/models", headers={"origin": ORIGIN, "authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(servers["public"] + "/v1/models", headers={"origin": ORIGIN, "authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers  # no --allowed-origins: none


# -- the flags ------------------------------------------------------------------------------------
@pytest.fixture
def no_model_load(monkeypatch) -> list:
    """Calls to build_server (which loads the model): a test asserts there were none."""
    calls = []
    monkeypatch.setattr(launch, "build_server", lambda *a, **k: calls.append(a) or pytest.fail("the model loaded"))
    monkeypatch.delenv("KVQ_API_KEY", raising=False)
    return calls


def test_port_in_use_exits_2_before_the_model_loads(no_model_load, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err and err.count("\n") == 1, err
    assert no_model_load == []


@pytest.mark.parametrize("flags,needle", [
    (["--max-n", "0"], "--max-n must be >= 1"),
    (["--max-request-bytes", "lots"], "--max-request-bytes: cannot read 'lots'"),
    (["--max-request-bytes", "100"], "--max-request-bytes must be at least 1KiB"),
    (["--timeout-body", "0"], "--timeout-body must be a positive"),
    (["--timeout-headers", "nan"], "--timeout-headers must be a positive"),
    (["--timeout-keep-alive", "-1"], "--timeout-keep-alive must be a positive"),
    (["--allowed-origins", "app.example.com"], "is not an origin"),
    (["--allowed-origins", "https://app.example.com/"], "is not an origin"),
    (["--api-key", ""], "--api-key / KVQ_API_KEY must be non-empty"),
    (["--api-key", " sk-1 "], "without surrounding whitespace"),
    (["--public-metrics"], "--public-metrics only means something with --api-key"),
])
def test_bad_security_flags_exit_2_before_the_model_loads(no_model_load, capsys, flags, needle):
    assert main(["serve", "--port", "0", *flags]) == 2
    assert needle in capsys.readouterr().err
    assert no_model_load == []


def test_api_key_from_the_environment(monkeypatch):
    def key(*argv):
        return options_from_args(build_parser().parse_args(["serve", *argv])).api_key

    monkeypatch.setenv("KVQ_API_KEY", "sk-env")
    assert key() == "sk-env" and key("--api-key", "sk-flag") == "sk-flag"
    monkeypatch.setenv("KVQ_API_KEY", "")
    assert key() is None


def test_kvq_serve_process_binds_first_and_requires_the_key(tiny_model, tmp_path):
    """The real command: a socket bound before the model loads is the one served, the key comes from
    $KVQ_API_KEY; SIGTERM stops it (uvicorn shuts down, then re-raises the signal)."""
    env = {**os.environ, "KVQ_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvq.cli", "serve", "--model", tiny_model, "--load-format",
                                 "dummy", "--device", "cpu", "--kv-cache-memory", "4MiB", "--port", "0",
                                 "--uvicorn-log-level", "warning"], stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        deadline, url = time.monotonic() + 120, None
        while url is None and proc.poll() is None and time.monotonic() < deadline:
            m = re.search(r"(http://127\.0\.0\.1:\d+); API key required", log.read_text())
            url = m and m.group(1)
            time.sleep(0.1)
        assert url, log.read_text()
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert httpx.get(url + "/v1/models").status_code == 401
        r = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == tiny_model
    finally:
        proc.terminate()
        proc.wait(30)
    assert proc.returncode in (0, -signal.SIGTERM) and "Traceback" not in log.read_text(), log.read_text()
