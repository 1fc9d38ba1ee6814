"""Cache plans: seed 002's byte table, windows, skip layers, capacity identities."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.cache.plan import bare_model, make_plan
from kvq.formats.registry import entries
from kvq.cache.shape import ModelShape

QWEN3B = bare_model(36, 2, 128)  # Qwen2.5-3B: 36 layers, 2 KV heads, head_dim 128
CANONICAL = [e.name for e in entries()]


@pytest.mark.parametrize("name,expected", [("fp16", 589824), ("int8", 299520), ("fp8", 294912)])
def test_seed_002_block_bytes(name, expected):
    assert make_plan(QWEN3B, name, block_size=16).bytes_per_block == expected


def test_defaults_and_windows():
    p = make_plan(QWEN3B, "int4_kivi")
    assert p.block_size == 32 and (p.sink_tokens, p.residual_tokens) == (4, 128)
    assert make_plan(QWEN3B, "fp8").block_size == 16
    assert (make_plan(QWEN3B, "fp8").sink_tokens, make_plan(QWEN3B, "fp8").residual_tokens) == (0, 0)
    p = make_plan(QWEN3B, "fp8", sink_tokens=4, residual_tokens=64)
    assert p.window_policy.sink_blocks == 1 and p.window_policy.write_direct
    assert not make_plan(QWEN3B, "fp8_per_block").window_policy.write_direct
    dense = make_plan(QWEN3B, "bf16", sink_tokens=4, residual_tokens=64)
    assert (dense.sink_tokens, dense.residual_tokens) == (0, 0)


def test_blocks_for_context_with_windows():
    p = make_plan(QWEN3B, "int4_kivi")  # bs 32, 1 sink block, 128 recent tokens
    assert p.blocks_for(8192) == (251, 5)
    assert p.blocks_for(1) == (0, 1)
    assert p.blocks_for(32 + 128 + 32) == (1, 5)
    # per-token formats with no window: every block resident
    assert make_plan(QWEN3B, "int8").blocks_for(100) == (7, 0)
    # per-block FP8 keeps the partial tail in high precision until it is sealed
    assert make_plan(QWEN3B, "fp8_per_block").blocks_for(100) == (6, 1)
    assert make_plan(QWEN3B, "fp8_per_block").blocks_for(96) == (6, 0)


def test_skip_layers():
    m = ModelShape("m", 6, 2, 64, 4, 4096, "bfloat16", sliding_window_layers=(1, 3))
    p = make_plan(m, "fp8", skip_layers=["0", "sliding_window"])
    assert p.skip_layers == (0, 1, 3)
    assert p.layer_names() == ["bfloat16", "bfloat16", "fp8_e4m3", "bfloat16", "fp8_e4m3", "fp8_e4m3"]
    full = make_plan(m, "bf16").bytes_per_block
    assert p.bytes_per_block == full // 2 + full // 12 * 3  # 3 layers at half, 3 at full
    with pytest.raises(ValueError, match="out of range"):
        make_plan(m, "fp8", skip_layers=[6])
    with pytest.raises(ValueError, match="sliding_window"):
        make_plan(m, "fp8", skip_layers=["attention"])


def test_bad_choices_raise():
    with pytest.raises(ValueError, match="multiple of 32"):
        make_plan(QWEN3B, "int4_kivi", block_size=16)
    with pytest.raises(ValueError, match="valid formats"):
        make_plan(QWEN3B, "fp8_e4m4")
    with pytest.raises(ValueError, match=">= 0"):
        make_plan(QWEN3B, "int8", sink_tokens=-1)
    with pytest.raises(ValueError):
        make_plan(QWEN3B, "fp8").capacity(0)


@given(st.sampled_from(CANONICAL), st.integers(1, 1 << 36), st.integers(1, 40_000),
       st.sampled_from([(12, 4, 64), (36, 2, 128), (30, 3, 64), (32, 8, 128)]))
@settings(max_examples=200, deadline=None)
def test_capacity_identities(name, memory, ctx, shape):
    m = bare_model(*shape)
    p = make_plan(m, name)
    cap = p.capacity(memory, ctx)
    assert cap.num_blocks * p.bytes_per_block <= memory < (cap.num_blocks + 1) * p.bytes_per_block
    assert cap.num_tokens == cap.num_blocks * p.block_size
    q, hp = p.blocks_for(ctx)
    assert q + hp == -(-ctx // p.block_size)
    assert cap.bytes_per_sequence == q * p.bytes_per_block + hp * p.hp_bytes_per_block
    assert cap.sequences * cap.bytes_per_sequence <= memory < (cap.sequences + 1) * cap.bytes_per_sequence
    assert p.bytes_per_block <= p.hp_bytes_per_block * (2 if name in ("float32", "fp32") else 1)


def test_ratios():
    assert make_plan(QWEN3B, "fp8").ratio_vs_model_dtype == 2.0
    assert make_plan(QWEN3B, "int4_kivi").ratio_vs_model_dtype == pytest.approx(3.2)
    assert make_plan(QWEN3B, "int2_kivi").ratio_vs_model_dtype == pytest.approx(16 / 3)


def test_plan_name_and_describe_skip_layer_zero():
    """Reports name the stored format, not layer 0's (which a skip list may keep in bf16)."""
    from kvq.cache.plan import bare_model, make_plan

    plan = make_plan(bare_model(4, 2, 64), "fp8_e4m3", skip_layers=[0, 3])
    d = plan.describe()
    assert (d["k"], d["v"]) == ("fp8_e4m3", "fp8_e4m3") and d["skip_layers"] == [0, 3]
    assert d["per_layer"] == ["bfloat16", "fp8_e4m3", "fp8_e4m3", "bfloat16"]
    assert plan.name == "fp8_e4m3 (layers 0,3 in bfloat16)" == d["name"]
    plan = make_plan(bare_model(2, 2, 64), k="int8", v="fp8_e5m2")
    assert plan.describe()["k"] == "int8" and plan.describe()["v"] == "fp8_e5m2"
    assert make_plan(bare_model(2, 2, 64), "int4_kivi").name == "int4_kivi"


def test_kv_cache_config_travels_whole():
    from kvq.cache.plan import KVCacheConfig, bare_model, make_plan
    from kvq.engine.llm_engine import EngineConfig

    m = bare_model(4, 2, 128)
    kv = KVCacheConfig(dtype="int4_kivi", skip_layers=(0,), sink_tokens=8, residual_tokens=64, block_size=64)
    assert kv.plan(m) == make_plan(m, "int4_kivi", skip_layers=[0], sink_tokens=8, residual_tokens=64, block_size=64)
    assert EngineConfig(kv_cache=kv).kv_cache_config is kv
    flat = EngineConfig(kv_cache_dtype="int4_kivi", kv_cache_dtype_skip_layers=(0,), kv_sink_tokens=8,
                        kv_residual_tokens=64, block_size=64)
    assert flat.kv_cache_config == kv  # the vLLM-style fields build the same object
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(kv_cache=kv, kv_cache_dtype="fp8")


def test_static_scales_per_role():
    """A mixed format takes static scales for the role that has them only: turboquant_k8v4's K is
    FP8 with static per-head scales, its V computes its own norms (None keeps it out)."""
    import torch

    from kvq.cache.pool import KVPool

    plan = make_plan(bare_model(1, 2, 64), "turboquant_k8v4", sink_tokens=0, residual_tokens=0)
    pool = KVPool.create(plan, 2, 1, static_scales={0: (torch.tensor([0.5, 2.0]), None)})
    assert pool.layers[0].k_scale.tolist() == [0.5, 2.0] and pool.layers[0].v_scale.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="computes its own scales"):
        KVPool.create(plan, 2, 1, static_scales={0: (torch.tensor([0.5, 2.0]), torch.tensor([1.0, 1.0]))})
