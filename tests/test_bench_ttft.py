"""Issue 43's pieces on the CPU: the Llama-3.1-8B config (llama3 rope scaling, 131072 positions) and
the TTFT floor of benchmarks/ttft_floor.py (its FLOP count, its arithmetic, the fastest kernel picked,
a failing kernel recorded), and bench_engine --ttft-floor writing the floor into concurrency-1 rows."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ttft_floor import PrefillShape, attention_kernels, prompt_flops, ttft_floor  # noqa: E402
from kvq.models.builder import _hf_config  # noqa: E402
from kvq.models.llama import LlamaConfig, rope_inv_freq  # noqa: E402
from kvq.models.source import model_shape, read_hf_config, resolve_model, shipped_configs  # noqa: E402

TINY = PrefillShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=256)


def test_llama_3_1_8b_config_resolves_with_llama3_rope_scaling():
    assert "llama-3.1-8b" in shipped_configs()
    src = resolve_model("llama-3.1-8b")
    shape = model_shape(src)
    assert (shape.num_layers, shape.num_attention_heads, shape.num_kv_heads, shape.head_dim) == (32, 32, 8, 128)
    assert shape.max_position_embeddings == 131072
    cfg = LlamaConfig.from_hf(_hf_config(src))
    assert cfg.rope_theta == 500000.0 and cfg.max_position_embeddings == 131072
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    assert cfg.rope_scaling["original_max_position_embeddings"] == 8192
    scaled = rope_inv_freq(cfg)
    plain = rope_inv_freq(LlamaConfig(**{**cfg.__dict__, "rope_scaling": None}))
    assert torch.equal(scaled[0], plain[0])  # high frequencies kept
    assert scaled[-1].item() == pytest.approx(plain[-1].item() / 8, rel=1e-6)  # low ones divided by the factor


def test_prompt_flops_of_llama_3_1_8b():
    s = PrefillShape.from_hf(read_hf_config(resolve_model("llama-3.1-8b").folder))
    L, M = 32768, 8192
    f = prompt_flops(s, L, M)
    assert f["gemm"]["qkv"] == 2 * L * 32 * 4096 * (32 + 16) * 128
    assert f["gemm"]["o"] == 2 * L * 32 * 4096 * 4096
    assert f["gemm"]["gate_up"] == 2 * L * 32 * 4096 * 2 * 14336
    assert f["gemm"]["down"] == 2 * L * 32 * 14336 * 4096
    assert f["gemm"]["lm_head"] == 2 * 4 * 4096 * 128256  # one row per chunk step
    assert f["attention"] == 32 * 4 * 32 * 128 * L * L / 2
    # about 6.98e9 GEMM FLOPs per token: 2 x the parameters of the projections
    assert sum(f["gemm"].values()) / L == pytest.approx(2 * 6.98e9, rel=0.01)


def test_floor_is_the_sum_of_flops_over_rates_with_the_fastest_kernel():
    from benchmarks.ttft_floor import _sdpa

    def slow(q, k, v, shape):
        call = _sdpa("MATH")(q, k, v, shape)
        return lambda: (time.sleep(0.002), call())

    def broken(q, k, v, shape):
        raise RuntimeError("no such kernel\nsecond line")

    kernels = {"slow": slow, "fast": _sdpa("FLASH_ATTENTION"), "broken": broken}
    L, M = 96, 32
    r = ttft_floor(TINY, L, M, "cpu", kernels=kernels, flush_bytes=1 << 20, gemm_iters=3, attention_iters=3)
    f = prompt_flops(TINY, L, M)
    assert r["gemm_flops"] == sum(f["gemm"].values()) and r["attention_flops"] == f["attention"]
    assert {n: (g["M"], g["K"], g["N"]) for n, g in r["gemm"].items()} == TINY.gemms(M)
    gemm_s = sum(f["gemm"][n] / (g["tflops"] * 1e12) for n, g in r["gemm"].items())
    assert r["gemm_s"] == pytest.approx(gemm_s)
    for g in r["gemm"].values():
        assert g["tflops"] == pytest.approx(2 * g["M"] * g["K"] * g["N"] / g["s"] / 1e12)
    assert r["attention"]["broken"] == {"error": "RuntimeError: no such kernel"}
    assert r["attention"]["slow"]["s"] > 0.002 and r["attention_kernel"] == "fast"
    assert r["attention_tflops"] == max(a["tflops"] for a in r["attention"].values() if "tflops" in a)
    assert r["attention_s"] == pytest.approx(f["attention"] / (r["attention_tflops"] * 1e12))
    assert r["ttft_floor_s"] == pytest.approx(r["gemm_s"] + r["attention_s"])
    assert r["attention_len"] == L and r["device"] == "cpu" and r["dtype"] == "float32"
    sq = r["gemm_sequence"]  # beside the floor: the projections back to back (3 steps of 32 rows, 2 layers)
    assert sq["gemms"] == 3 * TINY.layers * 4
    assert sq["flops"] == sum(f["gemm"][n] for n in ("qkv", "o", "gate_up", "down"))
    assert sq["tflops"] == pytest.approx(sq["flops"] / sq["s"] / 1e12)
    assert r["ttft_floor_sequence_s"] == pytest.approx(sq["s"] + r["attention_s"])


def test_gemm_sequence_counts_a_short_last_chunk_at_its_rows():
    from benchmarks.ttft_floor import measure_gemm_sequence

    sq = measure_gemm_sequence(TINY, 80, 32, torch.device("cpu"), torch.float32)  # chunks of 32, 32, 16 rows
    per_row = sum(2 * k * n for _, k, n in (TINY.gemms(1)[g] for g in ("qkv", "o", "gate_up", "down")))
    assert sq["flops"] == 80 * TINY.layers * per_row and sq["gemms"] == 3 * TINY.layers * 4


def test_default_kernels_on_cpu_record_absent_libraries():
    assert "flashinfer_fa3" in attention_kernels(torch.device("cpu"))
    r = ttft_floor(TINY, 48, 64, "cpu", attention_len=32, flush_bytes=1 << 20, gemm_iters=2, attention_iters=2)
    assert r["gemm"]["qkv"]["M"] == 48  # a prompt shorter than the chunk: one step of its length
    assert "error" in r["attention"]["sdpa_cudnn"]  # no cuDNN on the CPU: recorded, not raised
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        assert "error" in r["attention"]["flashinfer_fa3"]
    assert r["attention_kernel"] in ("sdpa_flash", "sdpa_math") and r["attention_len"] == 32
    assert r["ttft_floor_s"] > 0
    none_ran = ttft_floor(TINY, 48, 64, "cpu", kernels={}, flush_bytes=1 << 20, gemm_iters=1)
    assert none_ran["attention_kernel"] is None and none_ran["ttft_floor_s"] is None


def test_bench_engine_ttft_floor_rows(tmp_path):
    out = tmp_path / "ttft.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_engine.py"), "--smoke", "--formats", "bfloat16",
                        "--ttft-floor", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = {r["concurrency"]: r for r in json.loads(out.read_text())["runs"]}
    one, four = runs[1], runs[4]
    assert "error" not in one, one
    fl = one["ttft_floor"]
    assert one["ttft_floor_s"] == fl["ttft_floor_s"] > 0 and fl["prompt_len"] == one["input_len"]
    assert one["ttft_x_floor"] == pytest.approx(one["ttft_p50_s"] / one["ttft_floor_s"])
    assert fl["attention_kernel"] and fl["attention_tflops"] > 0 and fl["gemm_tflops"] > 0
    assert "ttft_floor_s" not in four and "ttft_p50_s" in four  # concurrency 1 only
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_engine.py"), "--smoke", "--ttft-floor",
                          "--tensor-parallel-size", "2"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and "--ttft-floor" in bad.stderr
