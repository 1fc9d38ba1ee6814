"""benchmarks/bench_offload.py end to end on a tiny model (the H200 run is `make bench-offload`):
copies of every plane at some rate; under pressure, swap replaces recompute one for one and the
CPU prefix tier stores what preempted and finished requests leave; across two turns of many users,
the device prefix cache keeps a few users' first turn and the tier reloads the others'."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ("bfloat16", "int4_kivi")


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench_offload") / "bench_offload.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_offload.py"), "--smoke", "--formats",
                        ",".join(FORMATS), "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


def _by_mode(rows: list[dict]) -> dict:
    return {(r["kv_cache_dtype"], r["mode"]): r for r in rows}


def _every_request_finished(wave: dict, requests: int, output_len: int) -> None:
    assert wave["requests"] == requests and wave["output_tokens"] == requests * output_len, wave
    assert wave["requests_preempted"] <= requests and wave["ttft_p50_s"] > 0 and wave["tpot_p50_s"] > 0, wave


def test_copies(result):
    assert [r["kv_cache_dtype"] for r in result["copies"]] == list(FORMATS)
    assert all(r["store_GBps"] > 0 and r["load_GBps"] > 0 for r in result["copies"])


def test_pressure_recompute_swap_and_tier(result):
    runs = _by_mode(result["pressure"])
    assert set(runs) == {(f, m) for f in FORMATS for m in ("recompute", "swap", "tier")}
    for fmt in FORMATS:
        rec, swap, tier = runs[(fmt, "recompute")], runs[(fmt, "swap")], runs[(fmt, "tier")]
        for r in (rec, swap, tier):
            _every_request_finished(r, r["concurrency"], r["output_len"])
            assert r["swapped_out"] == r["swapped_in"] and r["swap_fallbacks"] == 0, r
        assert rec["preemption_mode"] == "recompute" and rec["cpu_offload"]["bytes"] == 0, rec
        assert rec["preemptions"] > 0 and rec["swapped_out"] == 0 and rec["host_offload"]["stored_blocks"] == 0, rec
        # swap: every preemption a swap, and the TPOT of a swapped request beside the others'
        assert swap["preemption_mode"] == "swap" and swap["swapped_out"] == swap["preemptions"] > 0, swap
        assert swap["cpu_offload"]["prefix_tier"]["bytes"] == 0 and swap["host_offload"]["stored_blocks"] == 0, swap
        assert 0 < swap["requests_preempted"] < swap["concurrency"], swap
        assert swap["tpot_p50_s_preempted"] > 0 and swap["tpot_p50_s_not_preempted"] > 0, swap
        # tier: recompute preemption, the host budget all prefix tier, filled by what requests left
        assert tier["preemption_mode"] == "recompute" and tier["swapped_out"] == 0 and tier["preemptions"] > 0, tier
        assert tier["cpu_offload"]["q_blocks"] == 0 and tier["cpu_offload"]["prefix_tier"]["bytes"] > 0, tier
        h = tier["host_offload"]
        assert h["stored_blocks"] > 0 and h["store_failed"] == h["load_failed"] == 0, h


def test_multi_turn_device_misses_and_tier_reloads(result):
    runs = _by_mode(result["multi_turn"])
    assert set(runs) == {(f, m) for f in FORMATS for m in ("recompute", "tier")}
    for fmt in FORMATS:
        rec, tier = runs[(fmt, "recompute")], runs[(fmt, "tier")]
        for r in (rec, tier):
            for turn in ("turn1", "turn2"):
                _every_request_finished(r[turn], r["users"], r["output_len"])
            # the scenario: the pool holds a fraction of turn 1, so turn 2 misses the device for most users
            assert r["pool_tokens"] < r["turn1_tokens"] / 2, r
            hits = sum(p["hit_blocks"] for p in r["device_prefix_turn2"].values())
            assert hits < r["reusable_blocks"] / 2, (hits, r["reusable_blocks"])
        assert rec["cpu_offload"]["bytes"] == 0 and rec["host_offload_turn2"]["reloaded_blocks"] == 0, rec
        assert set(tier["turn2_vs_recompute"]) == {"ttft_p50_s", "ttft_p95_s", "wall_s"}, tier
        # turn 1 stores every user's blocks; turn 2 loads the prefixes the device lost back from host
        h1, h2 = tier["host_offload_turn1"], tier["host_offload_turn2"]
        assert h1["stored_blocks"] > 0 and h2["reloaded_blocks"] > 0 and h2["tier_hits"] > 0, (h1, h2)
        assert h2["requests_loaded"] > 0 and h2["reload_GBps"] > 0, h2
        assert h1["store_failed"] == h2["store_failed"] == h2["load_failed"] == 0, (h1, h2)
