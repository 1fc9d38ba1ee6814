"""Prefill/decode disaggregation end to end on the CPU: two `kvq serve` servers on loopback, real
NIXL/UCX between their pools.

With the same KV format on both sides, greedy output of the pair equals a colocated server's, JSON
and streamed: the decode server holds the very bytes its own prefill would have written.  With a
bf16 prefill server and a quantized decode server, the first token is the bf16 server's own and
the rest decodes over the cast KV (a colocated quantized server's prompt reads its keys quantized,
so its text may part from the pair's: docs/transfer.md).  Each fault (peer unreachable, corrupted payload, stale
generation, a read that never finishes, a request that fails instead of falling back, an
incompatible handshake) ends as docs/transfer.md says, with its metric counted and zero blocks
leaked on either side."""

import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvq.cli import main
from kvq.engine.llm_engine import EngineConfig
from kvq.server.launch import ServerThread, build_server
from kvq.server.options import KVRoleOptions
from kvq.transfer.convert import receiver_table
from kvq.transfer.nixl_transport import TransferHandle

pytest.importorskip("nixl")

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a " * 6]
MAX_TOKENS = 16


def _config(fmt: str) -> EngineConfig:
    return EngineConfig(kv_cache_memory="64MiB", max_num_seqs=4, max_model_len=512, progress=False,
                        kv_cache_dtype=fmt)


def _start(fmt: str, kv: KVRoleOptions | None = None):
    app, engine = build_server(_config(fmt), ["default"], kv=kv)
    thread = ServerThread(app)
    return thread, thread.start(), engine


def _complete(url: str, prompt: str, **kw) -> httpx.Response:
    body = {"model": "default", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def _text(url: str, prompt: str) -> str:
    r = _complete(url, prompt)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics").text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def _assert_clean(url: str) -> dict:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = httpx.get(url + "/status").json()
        r, kv = st["requests"], st["kv_transfer"]
        if r["running"] + r["waiting"] + r["live_requests"] == 0 and not kv.get("pending") \
                and not kv.get("staged_transfers"):
            break
        time.sleep(0.05)
    st = httpx.get(url + "/status", params={"check": 1}).json()
    assert st["integrity"]["ok"] and st["integrity"]["leaked_blocks"] == 0, st["integrity"]
    assert not st["kv_transfer"].get("pending") and not st["kv_transfer"].get("staged_transfers"), st["kv_transfer"]
    return st


@pytest.fixture(scope="module")
def prefill():
    thread, url, engine = _start("int4_kivi", KVRoleOptions(role="prefill"))
    yield url, engine
    thread.stop()


@pytest.fixture(scope="module")
def pair(prefill):
    """(decode url, decode engine, colocated url) for int4_kivi, the format the fault tests use."""
    dt, durl, deng = _start("int4_kivi", KVRoleOptions(role="decode", peer=prefill[0], timeout_s=20))
    ct, curl, _ = _start("int4_kivi")
    yield durl, deng, curl
    dt.stop()
    ct.stop()


@pytest.fixture(scope="module")
def expected(pair):
    return {p: _text(pair[2], p) for p in PROMPTS}


# -- greedy output: disaggregated == colocated ------------------------------------------------------
def test_int4_kivi_pair_matches_colocated_json_and_stream(prefill, pair, expected):
    durl = pair[0]
    for p in PROMPTS:
        assert _text(durl, p) == expected[p]
    with httpx.stream("POST", durl + "/v1/completions", timeout=120, json={
            "model": "default", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected[PROMPTS[1]]
    st = _assert_clean(durl)["kv_transfer"]
    assert st["role"] == "decode" and st["fills"]["filled"] >= 3 and st["fills"]["failed"] == 0
    assert st["negotiated"]["wire_layers"] == st["negotiated"]["sender_layers"] == ["int4_kivi"] * 30
    assert _metric(durl, "kvq_kv_transfer_bytes_total", direction="received") > 0
    assert _metric(prefill[0], "kvq_kv_transfer_bytes_total", direction="sent") > 0
    pst = _assert_clean(prefill[0])["kv_transfer"]
    assert pst["role"] == "prefill" and pst["exported"] >= 3 and pst["staged_transfers"] == 0


@pytest.fixture(scope="module")
def bf16_prefill():
    thread, url, engine = _start("bfloat16", KVRoleOptions(role="prefill"))
    yield url, engine
    thread.stop()


@pytest.mark.parametrize("fmt", ["int8", "fp8_per_block"])
def test_bf16_prefill_feeds_a_quantized_decode_server(bf16_prefill, fmt):
    purl = bf16_prefill[0]
    dt, durl, deng = _start(fmt, KVRoleOptions(role="decode", peer=purl, fallback="fail"))
    try:
        for p in PROMPTS:
            first = _complete(purl, p, max_tokens=1).json()["choices"][0]["text"]  # the bf16 server's own
            text = _text(durl, p)
            assert text.startswith(first) and len(text) > len(first)
        st = _assert_clean(durl)["kv_transfer"]
        assert st["fills"]["filled"] == len(PROMPTS) and st["fills"]["failed"] == 0
        assert st["negotiated"]["sender_layers"] == ["bfloat16"] * 30 and st["negotiated"]["wire_layers"] == [fmt] * 30
        # the wire carries the receiver's blocks, as laid out by its own rule: 8-bit blocks about half
        # of bf16 with their scales (a whole-block format keeps a prompt's partial last block in bf16)
        plan = deng.engine.plan
        tables = [receiver_table(plan, len(deng.engine.encode(p)[1])) for p in PROMPTS]
        wire = sum(plan.bytes_per_block if r.pool == "q" else plan.hp_bytes_per_block for t in tables for r in t)
        assert plan.bytes_per_block < 0.52 * plan.hp_bytes_per_block
        assert st["fills"]["bytes"] == wire < 0.75 * sum(len(t) for t in tables) * plan.hp_bytes_per_block
        _assert_clean(purl)
    finally:
        dt.stop()


# -- faults -----------------------------------------------------------------------------------------
def _failures(url: str, reason: str) -> float:
    return _metric(url, "kvq_kv_transfer_failed_total", reason=reason)


def test_unreachable_peer_falls_back_to_local_prefill(pair, expected, monkeypatch):
    durl, deng, _ = pair
    client = deng.engine.connector("remote_prefill").peer
    before = _failures(durl, "peer_unreachable")
    monkeypatch.setattr(client, "url", "http://127.0.0.1:9")  # discard port: connection refused
    assert _text(durl, PROMPTS[0]) == expected[PROMPTS[0]]
    assert _failures(durl, "peer_unreachable") == before + 1
    _assert_clean(durl)


def test_unreachable_peer_without_fallback_fails_the_request(pair, monkeypatch):
    durl, deng, _ = pair
    client = deng.engine.connector("remote_prefill").peer
    monkeypatch.setattr(client, "url", "http://127.0.0.1:9")
    monkeypatch.setattr(client, "fallback", False)
    r = _complete(durl, PROMPTS[0])
    assert r.status_code == 500 and "KV transfer from the prefill peer failed (peer_unreachable)" in \
        r.json()["error"]["message"], r.text
    assert _metric(durl, "kvq_request_finished_total", finished_reason="error") >= 1
    _assert_clean(durl)


def test_corrupted_payload_is_caught_by_the_checksum(prefill, pair, expected, monkeypatch):
    durl, _, _ = pair
    exporter = prefill[1].engine.connector("kv_export").exporter
    real = exporter.export

    def corrupt(request_id, pool, table, n, tag):
        out = real(request_id, pool, table, n, tag)
        layer = exporter.receiver(tag[0]).staging.layers[7]
        # one bit of the first block (a short prompt lies in int4_kivi's high-precision window)
        data, block = (layer.planes("v")["data"], out["q_blocks"][0]) if out["q_blocks"] else \
            (layer.hp("v").view(torch.int16), out["hp_blocks"][0])
        data.view(-1)[data[0].numel() * block + 5] ^= 0x10
        return out

    monkeypatch.setattr(exporter, "export", corrupt)
    before = _failures(durl, "checksum")
    assert _text(durl, PROMPTS[1]) == expected[PROMPTS[1]]  # refused, then prefilled locally
    assert _failures(durl, "checksum") == before + 1
    _assert_clean(durl)
    _assert_clean(prefill[0])


def test_stale_generation_is_refused_before_any_read(prefill, pair, expected, monkeypatch):
    durl, deng, _ = pair
    exporter = prefill[1].engine.connector("kv_export").exporter
    real = exporter.export
    reads = []
    client = deng.engine.connector("remote_prefill").peer
    real_read = client.transport.read_blocks
    monkeypatch.setattr(client.transport, "read_blocks", lambda *a, **k: reads.append(a) or real_read(*a, **k))
    monkeypatch.setattr(exporter, "export", lambda rid, pool, table, n, tag: real(rid, pool, table, n,
                                                                                   (tag[0], tag[1], tag[2] + 1)))
    before = _failures(durl, "bad_reply")
    assert _text(durl, PROMPTS[0]) == expected[PROMPTS[0]]
    assert _failures(durl, "bad_reply") == before + 1 and not reads
    _assert_clean(durl)
    _assert_clean(prefill[0])


class _Hung(TransferHandle):
    def __init__(self):
        super().__init__("peer", "READ", 1, 1)
        self.cancelled = False

    def poll(self) -> str:
        return self._state

    def cancel(self) -> None:
        self.cancelled = True
        self._settle("failed")


def test_a_read_that_never_ends_times_out_and_is_cancelled(prefill, pair, expected, monkeypatch):
    durl, deng, _ = pair
    client = deng.engine.connector("remote_prefill").peer
    hung = _Hung()
    monkeypatch.setattr(client.transport, "read_blocks", lambda *a, **k: hung)
    monkeypatch.setattr(client, "timeout_s", 1.5)
    before = _failures(durl, "timeout")
    assert _text(durl, PROMPTS[0]) == expected[PROMPTS[0]]
    assert hung.cancelled and _failures(durl, "timeout") == before + 1
    _assert_clean(durl)
    _assert_clean(prefill[0])  # released by the decode side (the read never came)


# -- handshake and input errors ---------------------------------------------------------------------
def test_handshake_names_the_field_that_differs(prefill, pair):
    purl = prefill[0]
    desc = httpx.get(pair[0] + "/kv/describe").json()
    assert desc["num_layers"] == 30 and desc["layers"][0]["k"]["name"] == "int4_kivi"
    r = httpx.post(purl + "/kv/connect", json={"description": {**desc, "num_kv_heads": 4}})
    assert r.status_code == 409 and "num_kv_heads: local 3, remote 4" in r.json()["error"]["message"], r.text
    r = httpx.post(purl + "/kv/connect", json={"description": {**desc, "head_dim": "64"}})
    assert r.status_code == 400 and "head_dim" in r.json()["error"]["message"], r.text
    r = httpx.post(purl + "/kv/connect", json={"description": {**desc, "tp_size": 2, "tp_rank": 1}})
    assert r.status_code == 409 and "tp_size: local 1, remote 2" in r.json()["error"]["message"], r.text
    r = httpx.post(purl + "/kv/connect", json={"description": {**desc, "tokenizer_hash": "0" * 64}})
    assert r.status_code == 409 and "tokenizer_hash" in r.json()["error"]["message"]
    r = httpx.post(purl + "/kv/prefill", json={"receiver_id": "nope", "transfer_id": "t", "generation": 1,
                                              "request_id": 1, "token_ids": [1, 2], "sampling": {}})
    assert r.status_code == 409 and "unknown receiver_id" in r.json()["error"]["message"]
    r = httpx.post(purl + "/kv/prefill", json={"transfer_id": "t"})
    assert r.status_code == 400 and "receiver_id: missing" in r.json()["error"]["message"]
    r = httpx.post(purl + "/kv/prefill", json={"receiver_id": "x", "transfer_id": "t", "generation": 1,
                                              "request_id": 1, "token_ids": [1], "sampling": {"max_tokens": 9}})
    assert r.status_code == 400 and "unknown field 'max_tokens'" in r.json()["error"]["message"]
    assert httpx.post(purl + "/kv/release", json={"transfer_id": "never-staged"}).json() == {"released": False}
    _assert_clean(purl)


def test_bad_kv_flags_exit_2(capsys):
    assert main(["serve", "--kv-role", "decode", "--port", "0"]) == 2
    assert "--kv-role decode needs --kv-peer" in capsys.readouterr().err
    assert main(["serve", "--kv-role", "sideways", "--port", "0"]) == 2
    assert "both, prefill, decode" in capsys.readouterr().err
    assert main(["serve", "--kv-peer", "http://127.0.0.1:1", "--port", "0"]) == 2
    assert "only applies to --kv-role decode" in capsys.readouterr().err
    assert main(["serve", "--kv-role", "decode", "--kv-peer", "10.0.0.1:8000", "--port", "0"]) == 2
    assert "http://" in capsys.readouterr().err
    assert main(["serve", "--kv-role", "decode", "--kv-peer", "http://h:1", "--kv-fallback", "retry"]) == 2
    assert "local, fail" in capsys.readouterr().err
    assert main(["serve", "--kv-staging-tokens", "4096", "--port", "0"]) == 2
    assert "only applies to --kv-role prefill" in capsys.readouterr().err
    assert main(["serve", "--kv-role", "prefill", "--no-kv-verify", "--port", "0"]) == 2
    assert "only applies to --kv-role decode" in capsys.readouterr().err


def _spawn(args: list[str], log, env) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "kvq.cli", "serve", "--kv-cache-dtype", "int8", "--kv-cache-memory",
                             "64MiB", "--max-model-len", "512", "--port", "0", "--uvicorn-log-level", "warning", *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline, url = time.monotonic() + 180, None
    while proc.poll() is None and time.monotonic() < deadline:
        m = url or re.search(r"(http://127\.0\.0\.1:\d+); API key required", log.read_text())
        url = m if isinstance(m, str) else m and m.group(1)
        if url:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(log.read_text())


def test_two_kvq_serve_processes_with_an_api_key(tmp_path):
    """The real command, twice: a prefill and a decode process (their own NIXL agents, UCX between
    processes), one API key; the decode process's text equals the prefill process's own (same format)."""
    key = "sk-disagg-test"
    env = {**os.environ, "KVQ_API_KEY": key, "OMP_NUM_THREADS": "1"}
    auth = {"authorization": f"Bearer {key}"}
    procs = []
    try:
        p, purl = _spawn(["--kv-role", "prefill"], tmp_path / "prefill.log", env)
        procs.append(p)
        assert httpx.get(purl + "/kv/describe").status_code == 401  # /kv/* needs the key
        d, durl = _spawn(["--kv-role", "decode", "--kv-peer", purl, "--kv-fallback", "fail"], tmp_path / "decode.log",
                         env)
        procs.append(d)
        body = {"model": "default", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0}
        texts = [httpx.post(u + "/v1/completions", json=body, headers=auth, timeout=120).json()["choices"][0]["text"]
                 for u in (durl, purl)]
        assert texts[0] == texts[1]
        st = httpx.get(durl + "/status", headers=auth).json()["kv_transfer"]
        assert st["fills"]["filled"] == 1 and st["fills"]["failed"] == 0
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    for name in ("prefill", "decode"):
        assert "Traceback" not in (tmp_path / f"{name}.log").read_text()


def test_concurrent_requests_and_an_abort_leave_nothing_behind(prefill, pair, expected):
    """Requests in parallel (fills overlapping each other and decodes), one client leaving mid-stream."""
    from concurrent.futures import ThreadPoolExecutor

    durl = pair[0]
    work = PROMPTS * 4
    with ThreadPoolExecutor(len(work) + 1) as pool:
        def leave():
            with httpx.stream("POST", durl + "/v1/completions", timeout=120, json={
                    "model": "default", "prompt": PROMPTS[1], "max_tokens": 64, "stream": True}) as r:
                next(r.iter_lines())  # then close the connection
        gone = pool.submit(leave)
        texts = list(pool.map(lambda p: _text(durl, p), work))
        gone.result()
    assert texts == [expected[p] for p in work]
    _assert_clean(durl)
    _assert_clean(prefill[0])


def test_static_scales_of_the_decode_server_reach_the_sender(bf16_prefill, tmp_path):
    """A decode server with calibrated FP8 scales (--kv-scales): the prefill server stages in its
    pool with those scales, under its own receiver id, and the pair serves."""
    from kvq.cache.scales_file import KVScales
    from kvq.models.source import resolve_model
    from kvq.transfer.describe import model_identity

    ident = model_identity(resolve_model("default"))
    scales = {i: (torch.full((3,), 0.01 + i / 1000), torch.full((3,), 0.002)) for i in range(30)}
    path = tmp_path / "scales.safetensors"
    KVScales(scales, {"config_hash": ident.config_hash, "weights_hash": ident.weights_hash}).save(path)
    purl, peng = bf16_prefill
    app, deng = build_server(EngineConfig(kv_cache_memory="64MiB", max_num_seqs=4, max_model_len=512,
                                          progress=False, kv_cache_dtype="fp8_e4m3", kv_scales=str(path)),
                             ["default"], kv=KVRoleOptions(role="decode", peer=purl, fallback="fail"))
    thread = ServerThread(app)
    durl = thread.start()
    try:
        first = _complete(purl, PROMPTS[0], max_tokens=1).json()["choices"][0]["text"]
        assert _text(durl, PROMPTS[0]).startswith(first)
        client = deng.engine.connector("remote_prefill").peer
        rec = peng.engine.connector("kv_export").exporter.receiver(client.receiver_id)
        assert client.receiver_id != client.negotiated.digest().hex()  # the scales are part of the id
        for i in (0, 29):
            assert torch.equal(rec.staging.layers[i].static_scale("k").cpu(), scales[i][0])
        assert _assert_clean(durl)["kv_transfer"]["fills"]["filled"] == 1
    finally:
        thread.stop()


# -- elastic precision on either side --------------------------------------------------------------
TIERED = dict(kv_cache_tiers="int4_kivi", kv_tier_age="64", kv_tier_policy="age")
WINDOWS = dict(block_size=32, kv_sink_tokens=4, kv_residual_tokens=32)


def _start_with(kv: KVRoleOptions | None = None, **kw):
    cfg = EngineConfig(kv_cache_memory="64MiB", max_num_seqs=4, max_model_len=512, progress=False,
                       kv_cache_dtype="fp8_e4m3", **WINDOWS, **kw)
    app, engine = build_server(cfg, ["default"], kv=kv)
    thread = ServerThread(app)
    return thread, thread.start(), engine


def _demotions(url: str) -> int:
    return sum(row["demotions"] for row in httpx.get(url + "/status").json()["kv_tiers"]["tiers"])


def test_tiered_servers_on_both_sides_of_a_transfer():
    """Elastic precision on both servers (fp8_e4m3 aged into int4_kivi).  The decode server registers its
    arena with NIXL (tier 0's planes are strided views) and reads the prefill server's blocks into its
    resident tier; then its blocks age as a colocated server's do: greedy text equal, the same
    demotions.  A prompt whose blocks the prefill server holds demoted (it decoded that prompt once: a
    prompt ages from its first decode, not while its chunks run, and its demoted blocks stay cached) is
    sent as that server's attention reads it (its demoted blocks dequantized through their tier and cast
    into the decode server's fp8_e4m3): the request completes from the prefill server's first token.
    Nothing is left behind on either side."""
    pt, purl, _ = _start_with(KVRoleOptions(role="prefill"), max_num_batched_tokens=64, **TIERED)
    dt, durl, _ = _start_with(KVRoleOptions(role="decode", peer=purl, fallback="fail"), **TIERED)
    ct, curl, _ = _start_with(**TIERED)
    try:
        # short: nothing ages while it is prefilled.  The second prompt (85 tokens) has a block demoted at
        # about 130 tokens and decodes over it; the first (5 tokens) ages no block in 56 tokens either, so
        # 16 tokens check its transfer
        for p, n in zip(PROMPTS, (16, 56)):
            want = _complete(curl, p, max_tokens=n).json()["choices"][0]["text"]
            r = _complete(durl, p, max_tokens=n)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
        assert _demotions(purl) == 0 and _demotions(durl) > 0 and _demotions(durl) == _demotions(curl)
        long = PROMPTS[1] * 3
        assert _complete(purl, long, max_tokens=1).status_code == 200
        assert _demotions(purl) == 0  # its chunks aged nothing
        assert _complete(purl, long, max_tokens=8).status_code == 200  # (a prefix hit; its decodes age it)
        assert _demotions(purl) > 0
        assert httpx.get(purl + "/status").json()["kv_tiers"]["tiers"][1]["cached"] > 0  # kept for a prefix hit
        first = _complete(purl, long, max_tokens=1).json()["choices"][0]["text"]  # over the demoted prefix
        text = _text(durl, long)
        assert text.startswith(first) and len(text) > len(first)
        st = _assert_clean(durl)["kv_transfer"]
        assert st["fills"]["filled"] == len(PROMPTS) + 1 and st["fills"]["failed"] == 0
        _assert_clean(purl)
    finally:
        for t in (dt, ct, pt):
            t.stop()
