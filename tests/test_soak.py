"""benchmarks/soak.py (issue 32's chaos soak): how it sorts outcomes, the host-copy fault hook it sets,
and short soaks of real `kvq serve` processes on the default model (the 3-minute one is `make soak`).

The short soaks assert what the soak exists to show -- nothing lost, no leaked block, no 5xx outside a
shutdown -- and that each injected fault really happened (a drain that ended streams with "abort",
a restart that served, preemptions, failed host copies, a dead NIXL peer, a tensor-parallel server
that exited non-zero in time), and that its counts add up."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_soak():
    spec = importlib.util.spec_from_file_location("kvq_soak", ROOT / "benchmarks/soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvq_soak"] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


soak = _load_soak()
Outcome, classify = soak.Outcome, soak.classify
ERR_503 = {"error": {"message": "the server is shutting down", "type": "service_unavailable",
                     "param": None, "code": "server_shutdown"}}


# -- classification ---------------------------------------------------------------------------------
def _stream(**kw) -> Outcome:
    return Outcome(status=200, **kw)


def test_a_stream_cut_without_done_is_lost_even_in_a_shutdown():
    for in_shutdown in (False, True):
        cat, why = classify(_stream(chunks=5, text={0: "abc"}, transport="RemoteProtocolError"),
                            in_shutdown=in_shutdown)
        assert cat == "lost" and "without [DONE]" in why


def test_abort_then_done_is_a_clear_ending():
    assert classify(_stream(done=True, chunks=3, finish={0: "abort"}))[0] == "clear_error"
    # n = 2: one choice finished, the other ended by the drain
    assert classify(_stream(done=True, finish={0: "length", 1: "abort"}), expected_choices=2)[0] == "clear_error"


def test_a_503_with_an_openai_body_is_a_clear_ending():
    assert classify(Outcome(status=503, body=ERR_503), in_shutdown=True) == \
        ("clear_error", "HTTP 503 server_shutdown")
    res = soak.PhaseResult("x", 1, 10)
    proc = soak.ServerProc("s", soak.ServerSpec("main"), 1, [], Path("/dev/null"))
    proc.started_at = 0.0
    res.record(soak.Plan("completions", {}), Outcome(status=503, body=ERR_503, t_end=5.0), proc)
    assert res.counts["clear_error"] == 1 and res.server_errors_outside_shutdown == 1  # no shutdown: a 5xx
    proc.stopping_at = 4.0
    res.record(soak.Plan("completions", {}), Outcome(status=503, body=ERR_503, t_end=5.0), proc)
    assert res.server_errors_outside_shutdown == 1 and res.server_errors_in_shutdown == 1
    assert res.accepted == 2 and res.status_counts == {"503": 2}


def test_other_endings():
    err500 = {"error": {"message": "the engine failed", "type": "server_error"}}
    assert classify(Outcome(status=500, body=err500))[0] == "lost"  # a 5xx outside a shutdown
    assert classify(Outcome(status=500, body=err500), in_shutdown=True)[0] == "clear_error"
    assert classify(Outcome(status=502, body="<html>bad gateway</html>"), in_shutdown=True)[0] == "lost"
    err429 = {"error": {"message": "overloaded", "type": "rate_limit_error", "code": "overloaded"}}
    assert classify(Outcome(status=429, body=err429)) == ("clear_error", "HTTP 429 overloaded")
    assert classify(Outcome(status=400, body={"error": {"message": "max_tokens", "type": "invalid_request_error"}}),
                    expect_invalid=True)[0] == "clear_error"
    assert classify(Outcome(status=200, body={"choices": []}), expect_invalid=True)[0] == "lost"
    assert classify(Outcome(transport="ConnectError"), in_shutdown=True)[0] == "refused_down"
    assert classify(Outcome(transport="ConnectError"))[0] == "lost"
    assert classify(Outcome(transport="ReadTimeout"), in_shutdown=True)[0] == "lost"
    assert classify(Outcome(left=True, status=200, chunks=2))[0] == "client_left"
    assert classify(_stream(done=True, error_event={"message": "boom"}))[0] == "clear_error"
    assert classify(_stream(done=True, finish={0: "stop"}), expected_choices=2)[0] == "lost"  # choice 1 unfinished
    assert classify(_stream(done=True, finish={0: "stop"}, text={0: "a. b"}), stop=(".",))[0] == "lost"
    assert classify(_stream(done=True, finish={0: "stop"}, text={0: "a b"}), stop=(".",))[0] == "completed"
    ok = {"choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}], "usage": {}}
    assert classify(Outcome(status=200, body=ok))[0] == "completed"
    assert classify(Outcome(status=200, body=ok), want_logprobs=True)[0] == "lost"
    assert classify(Outcome(status=200, body=ok), expected_choices=2)[0] == "lost"


# -- the host-copy fault hook -----------------------------------------------------------------------
def test_host_copy_faults_are_opt_in_seeded_and_checked(monkeypatch):
    from kvq.cache.host_faults import FAULT_ENV, CopyFaults, InjectedCopyFault
    from kvq.cache.host_pool import HostKVPool
    from kvq.cache.plan import bare_model, make_plan
    from kvq.cache.pool import KVPool

    pool = KVPool.create(make_plan(bare_model(1, 1, 8), "bfloat16"), 4, 0, "cpu")
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert HostKVPool.create(pool, 4, 0).faults is None  # off unless asked for
    monkeypatch.setenv(FAULT_ENV, "store=1,load=0")
    host = HostKVPool.create(pool, 4, 0)
    with pytest.raises(InjectedCopyFault, match=FAULT_ENV):
        host.store(pool, [(0, 0)])
    host.load(pool, [(0, 1)]).synchronize()  # load=0: never
    assert host.faults.injected == {"store": 1, "load": 0}
    a, b = CopyFaults.parse("store=0.5,seed=3"), CopyFaults.parse("store=0.5,seed=3")

    def draws(f):
        out = []
        for _ in range(20):
            try:
                f.maybe_fail("store")
                out.append(0)
            except InjectedCopyFault:
                out.append(1)
        return out

    assert draws(a) == draws(b) and 0 < sum(draws(CopyFaults.parse("store=0.5"))) < 20
    for bad in ("store=2", "store", "copy=0.5", "seed=x"):
        with pytest.raises(ValueError, match=FAULT_ENV):
            CopyFaults.parse(bad)


# -- short soaks of real servers ---------------------------------------------------------------------
def _run(tmp_path, *args) -> dict:
    out = tmp_path / "soak.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/soak.py"), "--out", str(out),
                        "--log-dir", str(tmp_path / "logs"), *args], capture_output=True, text=True, timeout=400,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads(out.read_text())
    report["_rc"], report["_out"] = p.returncode, p.stdout[-3000:] + p.stderr[-3000:]
    return report


def _assert_clean(report: dict) -> dict:
    """Nothing lost or leaked, no 5xx outside a shutdown, and the counts add up: every request sent
    ended in exactly one category; accepted ones got an HTTP status."""
    assert report["ok"] and report["_rc"] == 0, (report["failures"], report["_out"])
    for ph in report["phases"]:
        c = ph["counts"]
        assert c["lost"] == 0 and ph["leaked_blocks"] in (0, None) and ph["server_errors_outside_shutdown"] == 0, ph
        assert sum(c.values()) == ph["sent"] > 0, ph
        assert ph["accepted"] == sum(ph["status_counts"].values()) <= ph["sent"] - c["refused_down"], ph
        assert ph["unexpected_400"] == 0 and ph["integrity_ok"] is not False, ph
    t = report["total"]
    assert t["lost"] == t["leaked_blocks"] == t["server_errors_outside_shutdown"] == 0
    return {ph["name"]: ph for ph in report["phases"]}


def test_soak_drain_restart_preemption_and_host_faults(tmp_path):
    """SIGTERM under load (--shutdown-timeout 1: long streams end "abort" then [DONE]) and a restart on the
    same port into a pool too small for the load, with host copies failing."""
    report = _run(tmp_path, "--phases", "sigterm,preempt,host_faults", "--duration", "6", "--concurrency", "4",
                  "--long-chars", "300", "500", "--small-pool", "8MiB", "--host-fault-rates",
                  "store=0.5,load=0.5,seed=1", "--", "--shutdown-timeout", "1")
    ph = _assert_clean(report)
    ev = ph["sigterm"]["evidence"]
    assert ev["exit_code"] == 0 and ev["restarted_as"] == "pressure" and ev["completed_after_restart"] > 0, ev
    assert ev["aborted_streams"] + ev["http_503"] > 0 and ph["sigterm"]["counts"]["refused_down"] > 0, ev
    assert ev["burst_429"] > 0 and ph["sigterm"]["status_counts"].get("429", 0) >= ev["burst_429"]
    assert {"main", "main#2"} <= set(ph["sigterm"]["by_server"])
    assert ph["preempt"]["evidence"]["preemptions"] > 0
    hf = ph["host_faults"]["evidence"]
    assert hf["offload_failed"] + hf["reload_failed"] > 0 and hf["offload_blocks"] > 0, hf
    assert all(code == 0 for code in report["server_exit_codes"].values()), report["server_exit_codes"]


def test_soak_nixl_peer_death_and_tensor_parallel_rank_death(tmp_path):
    """The smallest NIXL and TP phases: the prefill peer SIGKILLed with fills pending (the decode server
    falls back to prefilling locally); rank 1 of a TP=2 server SIGKILLed (the server names it and exits
    non-zero well within --distributed-timeout)."""
    pytest.importorskip("nixl")
    report = _run(tmp_path, "--phases", "nixl,tp", "--duration", "8", "--distributed-timeout", "20")
    ph = _assert_clean(report)
    nx = ph["nixl"]["evidence"]
    assert nx["filled_before_kill"] > 0 and sum(nx["transfer_failures_after_kill"].values()) > 0, nx
    assert nx["completed_after_kill"] > 0, nx
    tp = ph["tp"]["evidence"]
    assert tp["exit_code"] not in (0, None) and tp["death_to_exit_s"] < 20 and tp["loss_reported_in_log"], tp
    assert report["server_exit_codes"]["prefill"] == -9 and report["server_exit_codes"]["tp"] == tp["exit_code"]
    assert report["total"]["tp_death_to_exit_s"] == tp["death_to_exit_s"]


def test_soak_elastic_demotes_then_swaps_with_failing_copies(tmp_path):
    """Issue 45's phase: fp8_e4m3 with an int4_kivi tier in a pool that the load outgrows: blocks move down
    under pressure, then requests are preempted by swap, and the swap copies fail (injected): each such
    request is recomputed; nothing lost or leaked, no 5xx."""
    report = _run(tmp_path, "--phases", "elastic", "--duration", "6", "--concurrency", "4", "--long-chars", "300",
                  "500", "--host-fault-rates", "store=0.5,load=0.5,seed=1")
    ev = _assert_clean(report)["elastic"]["evidence"]
    assert ev["demotions"] > 0 and ev["swapped"] > 0 and ev["swap_failures"] > 0, ev
    assert [t["format"] for t in ev["tiers"]] == ["fp8_e4m3", "int4_kivi"]
