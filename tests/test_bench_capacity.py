"""The capacity-bound loads of benchmarks/bench_engine.py --scenarios and the decode-step floor
(the H200 run is `make bench-capacity`): loads are deterministic and as documented, the floor's
arithmetic is the plan's bytes, and the benchmark serves every request of a load in full."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.scenarios import (H200_BF16_FLOPS, StepFloor, kv_read_bytes, scenario,  # noqa: E402
                                  shrink, step_floor_s)
from kvq.cache.plan import KVCacheConfig  # noqa: E402
from kvq.models.source import model_shape  # noqa: E402


def test_loads_are_the_documented_ones_and_deterministic():
    d, p, m = scenario("decode_heavy"), scenario("prefill_heavy"), scenario("mixed")
    assert len(d.requests) == 512
    assert {(r.input_len, r.output_len, r.arrival_s) for r in d.requests} == {(1024, 2048, 0)}
    assert len(p.requests) == 256 and {(r.input_len, r.output_len) for r in p.requests} == {(7936, 256)}
    assert not d.arrivals_spread and m.arrivals_spread
    assert m == scenario("mixed") and m != scenario("mixed", seed=1)
    arrivals = [r.arrival_s for r in m.requests]
    assert arrivals == sorted(arrivals) and 20 < arrivals[-1] < 32  # 1024 at 40/s: about 25.6 s
    ins = sorted(r.input_len for r in m.requests)
    outs = sorted(r.output_len for r in m.requests)
    assert 64 <= ins[0] and ins[-1] <= 8192 and 800 < ins[len(ins) // 2] < 1300
    assert 16 <= outs[0] and outs[-1] <= 2048 and 300 < outs[len(outs) // 2] < 480
    assert len(scenario("mixed", 0.25).requests) == 256
    small = shrink(m, 96, 16)
    assert max(r.input_len for r in small.requests) == 96 and [r.arrival_s for r in small.requests] == arrivals
    with pytest.raises(ValueError, match="decode_heavy, prefill_heavy, mixed"):
        scenario("chat")
    with pytest.raises(ValueError, match="scale"):
        scenario("mixed", 0)


def test_floor_is_weights_or_flops_plus_the_kv_each_sequence_reads():
    shape = model_shape("llama-3-8b")
    bf16 = KVCacheConfig(dtype="bfloat16").plan(shape)
    kivi = KVCacheConfig(dtype="int4_kivi").plan(shape)
    per_token_bf16 = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
    assert kv_read_bytes(bf16, 3000) == 3000 * per_token_bf16
    # KIVI: the sink and recent-window tokens at bf16 bytes, the rest at the stored bytes
    _, hp_blocks = kivi.blocks_for(3000)
    hp = hp_blocks * kivi.block_size
    assert 128 + 32 <= hp < 3000
    assert kv_read_bytes(kivi, 3000) == pytest.approx(hp * per_token_bf16 + (3000 - hp) * kivi.bytes_per_token)
    assert kv_read_bytes(kivi, 3000) < kv_read_bytes(bf16, 3000) / 2
    bw, w, f = 4e12, 16e9, 14e9
    # weight-bound at a small batch, compute-bound at a large one
    assert step_floor_s(w, f, bf16, [1000], bw) == pytest.approx(w / bw + 1000 * per_token_bf16 / bw)
    big = [10] * 4096
    assert step_floor_s(w, f, bf16, big, bw) == pytest.approx(f * 4096 / H200_BF16_FLOPS + sum(
        kv_read_bytes(bf16, c) for c in big) / bw)
    memo = StepFloor(kivi, w, f, bw)
    for ctx in ([1000], [3000, 17, 3000], big):
        assert memo(ctx) == pytest.approx(step_floor_s(w, f, kivi, ctx, bw))


@pytest.mark.slow
def test_bench_engine_serves_every_request_of_each_load(tmp_path):
    out = tmp_path / "cap.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_engine.py"), "--smoke", "--formats",
                        "bfloat16,int4_kivi", "--scenarios", "decode_heavy,mixed", "--scenario-scale", "0.02",
                        "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = json.loads(out.read_text())["scenarios"]
    assert {(r["kv_cache_dtype"], r["scenario"]) for r in runs} == {
        (f, s) for f in ("bfloat16", "int4_kivi") for s in ("decode_heavy", "mixed")}
    for r in runs:
        assert "error" not in r, r
        assert r["output_tokens"] > 0 and r["output_tok_per_s"] > 0 and r["peak_running"] >= 1
        assert r["ttft_p50_s"] <= r["ttft_p99_s"] and r["decode_steps"] > 0
        assert r["other_steps"] > 0 and 0 < r["other_step_total_s"] < r["wall_s"]  # the prefill steps
        assert r["jit_compiles"] == 0  # the CPU interpreter compiles nothing (on CUDA: compiles in the wave)
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_engine.py"), "--smoke", "--scenarios", "chat"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and "decode_heavy, prefill_heavy, mixed" in bad.stderr


def test_capacity_report_tables_and_plot_from_a_results_file(tmp_path):
    """scripts/capacity_report.py reads what bench_engine --scenarios writes (the smoke run's file):
    a table per load with each format's multiple of bf16, and a picture; a file without runs is an error."""
    out = tmp_path / "cap.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_engine.py"), "--smoke", "--formats",
                        "bfloat16,int4_kivi", "--scenarios", "decode_heavy", "--scenario-scale", "0.02",
                        "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = subprocess.run([sys.executable, str(ROOT / "scripts/capacity_report.py"), "--json", str(out),
                          "--png", str(tmp_path / "cap.png")], capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr[-3000:]
    runs = {r["kv_cache_dtype"]: r for r in json.loads(out.read_text())["scenarios"]}
    ratio = runs["int4_kivi"]["output_tok_per_s"] / runs["bfloat16"]["output_tok_per_s"]
    assert "**decode_heavy**" in rep.stdout and "| `bfloat16` | kvq | " in rep.stdout
    assert f"| {ratio:.2f}x |" in rep.stdout and "| 1.00x |" in rep.stdout
    assert (tmp_path / "cap.png").stat().st_size > 1000
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"meta": {}, "runs": [], "scenarios": []}))
    bad = subprocess.run([sys.executable, str(ROOT / "scripts/capacity_report.py"), "--json", str(empty)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no runs" in bad.stderr


def test_capacity_report_reads_a_file_of_waves(tmp_path):
    """The same report from bench_engine --workloads runs (the committed H200 file's form): one table
    per workload and concurrency, each format's multiple of bf16's tokens/s, and the picture."""
    out = tmp_path / "waves.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_engine.py"), "--smoke", "--formats",
                        "bfloat16,int4_kivi", "--out", str(out)], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = subprocess.run([sys.executable, str(ROOT / "scripts/capacity_report.py"), "--json", str(out),
                          "--png", str(tmp_path / "w.png")], capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert all(r["commit"] and r["commit"] != "unknown" for r in runs)  # the tree the numbers came from
    for c in {r["concurrency"] for r in runs}:
        mine = {r["kv_cache_dtype"]: r for r in runs if r["concurrency"] == c}
        ratio = mine["int4_kivi"]["output_tok_per_s"] / mine["bfloat16"]["output_tok_per_s"]
        assert f"**64/8 c{c}**" in rep.stdout
        assert f"| `int4_kivi` | {mine['int4_kivi']['output_tok_per_s']:.0f} | {ratio:.2f}x |" in rep.stdout
    # the step's floor needs the copy bandwidth, measured on CUDA only: none here, and the table says so
    assert all(r["decode_step_floor_s"] is None and r["roofline_step_s"] is None for r in runs)
    assert "(roofline -)" in rep.stdout
    data = json.loads(out.read_text())
    for i, r in enumerate(data["runs"]):  # a GPU file's fields: the step against its floor
        r["decode_step_floor_s"] = r["decode_step_mean_s"] * (0.5 + 0.1 * i)
    out.write_text(json.dumps(data))
    rep = subprocess.run([sys.executable, str(ROOT / "scripts/capacity_report.py"), "--json", str(out),
                          "--png", str(tmp_path / "w.png")], capture_output=True, text=True, timeout=300)
    for i, r in enumerate(data["runs"]):
        step = r["decode_step_mean_s"]
        assert f"{1e3 * step:.1f} ({1e3 * step * (0.5 + 0.1 * i):.1f}, {1 / (0.5 + 0.1 * i):.2f}x)" in rep.stdout
    assert (tmp_path / "w.png").stat().st_size > 1000


def test_jit_compiles_records_what_tritons_hooks_report():
    """benchmarks/jit_compiles.py through Triton's own hook knobs, called as Triton's JIT calls them
    around a compile (keyword arguments, ``fn`` naming the kernel): counted per kernel while the
    block runs, the hooks restored after, a caller's own hook left alone."""
    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo

    from benchmarks.jit_compiles import JitCompiles

    rt = knobs.runtime
    info = JitFunctionInfo("kvq.attention.triton.prefill", "_prefill_kernel", None)
    with JitCompiles() as jit:
        for _ in range(2):
            assert rt.jit_cache_hook(key=None, repr="", fn=info, compile={}, is_manual_warmup=False,
                                     already_compiled=False) is False  # compile as usual
            rt.jit_post_compile_hook(key=None, repr="", fn=info, compile={}, is_manual_warmup=False,
                                     already_compiled=False)
    rec = jit.record()
    assert rec["jit_compiles"] == 2 and rec["jit_compiled"] == {"_prefill_kernel": 2}
    assert 0 <= rec["jit_compile_max_s"] <= rec["jit_compile_s"]
    assert rt.jit_cache_hook is None and rt.jit_post_compile_hook is None
    mine = lambda **kw: False  # noqa: E731
    rt.jit_cache_hook = mine
    try:
        with JitCompiles() as jit:
            assert rt.jit_cache_hook is mine
        assert jit.record()["jit_compiles"] == 0 and rt.jit_cache_hook is mine
    finally:
        rt.jit_cache_hook = None


def test_bench_engine_rows_carry_the_tiers(tmp_path):
    """bench_engine takes a format spec with tiers (issue 45's runs: `make bench-elastic`); its rows name
    them (``kv_cache_tiers``) beside ``preemptions`` and the demotions."""
    out = tmp_path / "elastic.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_engine.py"), "--smoke", "--formats",
                        "fp8_e4m3>int4_kivi", "--out", str(out)], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert runs and all(r["kv_cache_dtype"] == "fp8_e4m3>int4_kivi" and r["kv_cache_tiers"] == ["int4_kivi"]
                        and "preemptions" in r and "pressure_demotions" in r and "pressure_scans" in r
                        and "error" not in r for r in runs)
