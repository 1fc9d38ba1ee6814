"""`kvq env` reports what this machine will use, and a CUDA machine without CuPy warns once."""

import json
import logging
import sys

import pytest
import torch

from kvq import cli
from kvq.attention import backends
from kvq.attention.cuda import decode8
from kvq.cache.plan import KVCacheConfig, bare_model
from kvq.formats.registry import entries, resolve_kv


def test_kvq_env_names_the_backend_of_every_format(capsys):
    assert cli.main(["env", "--json", "--model", "llama-3-8b"]) == 0  # a shipped config: no weights needed
    info = json.loads(capsys.readouterr().out)
    assert info["torch"]["version"] == torch.__version__ and info["device"] in ("cpu", "cuda")
    rows = {r["format"]: r for r in info["formats"]}
    assert {"bfloat16", "fp8_e4m3", "int8_per_token_head", "int4_kivi", "int2_kivi"} <= set(rows)
    if info["device"] == "cpu":  # the torch reference everywhere, and why the kernels were passed over
        assert all(r["backend"] == "torch" and r["decode_per_layer"] == "torch 0-31" for r in rows.values())
        assert set(rows["int4_kivi"]["passed_over"]) == {"cuda", "triton"}  # each with its reason
        assert all(rows["int4_kivi"]["passed_over"].values())
        assert info["cuda_decode_kernel"] == {"available": False, "why_not": "needs a CUDA device"}
    assert cli.main(["info"]) == 0  # the alias, as one screen of text
    text = capsys.readouterr().out
    assert "decode kernel per layer" in text and "int4_kivi" in text and "threads" in text


def _fake_cuda_without_cupy(monkeypatch):
    """A CUDA sm_90 device as far as the backend choice can tell, and `import cupy` failing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    monkeypatch.setattr(backends, "_warned_cuda", [])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_missing_cupy_on_a_cuda_device_warns_once_naming_the_fix_and_the_cost(monkeypatch, caplog):
    pytest.importorskip("triton")
    _fake_cuda_without_cupy(monkeypatch)
    model = bare_model(4, 2, 128, num_attention_heads=8)
    with caplog.at_level(logging.WARNING, logger="kvq"):
        for fmt in ("int4_kivi", "fp8_e4m3", "int4_kivi"):
            _, choice = backends.select_backend("auto", KVCacheConfig(dtype=fmt).plan(model), "cuda", torch.bfloat16)
            assert choice.resolved == "triton" and choice.decode_per_layer == ("triton",) * 4
            assert "CuPy (NVRTC) is not installed" in choice.reason
        _, choice = backends.select_backend("auto", KVCacheConfig(dtype="bfloat16").plan(model), "cuda",
                                            torch.bfloat16)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # once per process, whatever the number of engines
    assert "pip install 'kvq[" in warnings[0] and "1.04-1.06x with Triton" in warnings[0] and "CuPy" in warnings[0]


def test_bf16_alone_on_a_cuda_device_without_cupy_does_not_warn(monkeypatch, caplog):
    pytest.importorskip("triton")
    _fake_cuda_without_cupy(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kvq"):
        backends.select_backend("auto", KVCacheConfig(dtype="bfloat16").plan(bare_model(2, 2, 128)), "cuda",
                                torch.bfloat16)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]  # the CUDA kernel would serve nothing


def test_decode_per_layer_names_cuda_and_triton_layers():
    assert backends.compact_layers(("triton", "triton", "cuda", "cuda", "cuda")) == "triton 0-1, cuda 2-4"
    assert backends.compact_layers(("torch",)) == "torch 0"


def test_a_tiered_plan_reports_each_tiers_decode_kernel():
    """A tiered layer runs one decode launch a tier: the CUDA kernel for the tiers it reads (8-bit,
    KIVI), Triton for the others, and the report names both in tier order."""
    model = bare_model(2, 2, 128)
    fp8_kivi = KVCacheConfig(dtype="fp8_e4m3", tiers=("int4_kivi",)).plan(model)
    assert backends.decode_per_layer("cuda", fp8_kivi, torch.bfloat16) == ("cuda",) * 2
    assert backends.describe_cuda(fp8_kivi, torch.bfloat16) == "CUDA decode on all 2 layers and tiers"
    bf16_fp8 = KVCacheConfig(dtype="bfloat16", tiers=("fp8_e4m3",)).plan(model)
    assert backends.decode_per_layer("cuda", bf16_fp8, torch.bfloat16) == ("triton+cuda",) * 2
    # the CUDA kernel has no 3-bit rotated variant at head_dim 64: Triton decodes that tier
    rotated = KVCacheConfig(dtype="fp8_e4m3", tiers=("int4_kivi", "turboquant_3bit_nc")).plan(bare_model(2, 2, 64))
    assert backends.decode_per_layer("cuda", rotated, torch.bfloat16) == ("cuda+triton",) * 2
    assert "tier 2 (turboquant_3bit_nc)" in backends.describe_cuda(rotated, torch.bfloat16)
    # int2_kivi at head_dim 64 (its 16-byte rows' variant, on a GPU since session 30): CUDA throughout
    small = KVCacheConfig(dtype="fp8_e4m3", tiers=("int4_kivi", "int2_kivi")).plan(bare_model(2, 2, 64))
    tier2 = small.tier_layers(2)[0]
    assert decode8.layer_reason(tier2.k, tier2.v, 64, small.block_size, 1) is None
    assert backends.decode_per_layer("cuda", small, torch.bfloat16) == ("cuda",) * 2


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_cuda_decode_serves_every_quantized_format_it_reads(head_dim):
    """Issue 43's rule for `kvq env` on a GPU: every 8-bit, KIVI and per-token sub-byte format, and the
    rotated codebooks (3-bit ones from head_dim 128), decodes through the CUDA kernel at head dims 64
    and 128, Llama-3-8B's grouping; the 16-bit formats through Triton."""
    model = bare_model(2, 8, head_dim, num_attention_heads=32)
    for e in entries():
        if e.name in ("auto", "fp8_e4m3fnuz"):  # (auto: the model dtype; fnuz: the reference only)
            continue
        fmt = resolve_kv(e.name)
        plan = KVCacheConfig(dtype=e.name).plan(model)
        want = "triton" if not fmt.is_quantized else "cuda"
        if head_dim < 128 and any(tf.family == "rot" and tf.bits == 3 for tf in (fmt.k, fmt.v)):
            want = "triton"  # 3-bit rotated rows at head_dim 64 are 24 bytes: the kernel refuses them
        assert backends.decode_per_layer("cuda", plan, torch.bfloat16) == (want,) * 2, e.name
