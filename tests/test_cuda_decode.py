"""The CUDA 8-bit decode kernel (kvq/attention/cuda/decode8.cu) against the torch reference.

On the GPU machine (``make gpu-test``): every 8-bit format, head dims 64/128,
GQA 1/3/4/8, pages 16/32, bf16 and f16 models, tables mixing resident and
high-precision blocks, odd lengths, one split (the kernel writes the output)
and many (the reduce kernel merges), several launch shapes.  Without a GPU
only the support rules run; the kernel compiles for sm_90a in
tests/test_cuda_compile.py.
"""

import pytest
import torch

from kvq.attention import reference
from kvq.cache.plan import bare_model, make_plan
from kvq.cache.pool import KVPool

GPU = torch.cuda.is_available()
EIGHT_BIT = ["fp8_e4m3", "fp8_e5m2", "fp8_per_token_head", "fp8_per_block", "int8", "int8_per_token_head"]
KIVI = ["int4_kivi", "int2_kivi"]
PER_TOKEN = ["int4_per_token", "int2_per_token"]  # K per token too (K_TOKEN): pages of 16
# levels from a table, the rotated query, the output rotated back (ROT); K centred over 32 tokens (KC)
ROTATED = ["turboquant_4bit_nc", "turboquant_3bit_nc", "turboquant_k3v4_nc", "turboquant_k8v4", "rot4_kc", "rot3_kc"]


def _fill(fmt, H, D, group, bs, nq, nhp, dtype, static, gen):
    model = bare_model(1, H, D, num_attention_heads=H * group,
                       dtype="bfloat16" if dtype == torch.bfloat16 else "float16")
    plan = make_plan(model, fmt, block_size=bs, sink_tokens=0, residual_tokens=0)
    scales = None
    if static:  # per role: turboquant_k8v4's K has static scales, its V its own norms
        ks, vs = torch.rand(H, generator=gen) + 0.5, torch.rand(H, generator=gen) * 0.05 + 0.02
        fk, fv = plan.layers[0].k, plan.layers[0].v
        if "static" in (fk.scale, fv.scale):
            scales = {0: (ks if fk.scale == "static" else None, vs if fv.scale == "static" else None)}
    pool = KVPool.create(plan, nq, nhp, "cuda", static_scales=scales)
    layer = pool.layers[0]
    # per-token magnitudes spread over 10x and two outlier channels in K, as in real models
    for x, outlier in ((layer.k_hp, True), (layer.v_hp, False)):
        y = torch.randn(x.shape, generator=gen) * (torch.rand(*x.shape[:3], 1, generator=gen) * 3 + 0.3)
        if outlier:
            y[..., 1] += 6.0
            y[..., D // 2 + 3] -= 4.0
        x.copy_(y.to(dtype))
    src = torch.arange(nq, device="cuda") % nhp
    reference.seal_blocks(layer, src, torch.arange(nq, device="cuda"))
    return layer


def _tables(lens, bs, nq, nhp, hp_ends, gen):
    """Random resident blocks; with ``hp_ends`` the first and last two blocks of each
    table are high-precision blocks (sinks and recent window)."""
    nb = max(-(-n // bs) for n in lens)
    t = torch.randint(0, nq, (len(lens), nb), generator=gen, dtype=torch.int32)
    if hp_ends:
        for r, n in enumerate(lens):
            used = -(-n // bs)
            for j in {0, max(0, used - 2), used - 1}:
                t[r, j] = -int(torch.randint(0, nhp, (1,), generator=gen)) - 1
    return t.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


def _err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


CONFIGS = [dict(H=8, D=128, group=4, bs=16), dict(H=4, D=128, group=8, bs=32), dict(H=3, D=64, group=3, bs=32),
           dict(H=4, D=64, group=1, bs=16), dict(H=2, D=256, group=5, bs=16)]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "H{H}D{D}g{group}bs{bs}".format(**c))
@pytest.mark.parametrize("fmt", EIGHT_BIT + KIVI + PER_TOKEN + ROTATED)
def test_cuda_decode_matches_reference(fmt, cfg):
    _check_against_reference(fmt, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c["D"] >= 128], ids=lambda c: "H{H}D{D}g{group}bs{bs}".format(
    **c))
@pytest.mark.parametrize("fmt", ["turboquant_3bit_nc", "turboquant_k3v4_nc", "rot3_kc"])
def test_cuda_decode_table_levels_match_reference(fmt, cfg):
    """3-bit codes' levels from the shared table (ROT_REG_LUT=0; the default build reads them from
    registers, which test_cuda_decode_matches_reference checks): the A/B probes' other side."""
    _check_against_reference(fmt, cfg, defines=("ROT_REG_LUT=0",))


def _check_against_reference(fmt, cfg, defines=()):
    from kvq.attention.cuda import decode8

    why = decode8.unavailable_reason()
    if why:
        pytest.skip(why)
    gen = torch.Generator().manual_seed(11)
    H, D, group, bs = cfg["H"], cfg["D"], cfg["group"], cfg["bs"]
    if fmt in KIVI or fmt.endswith("_kc"):
        bs = max(bs, 32)
    if fmt in ("turboquant_3bit_nc", "turboquant_k3v4_nc", "rot3_kc") and D < 128:
        pytest.skip("3-bit rotated codes need head_dim >= 128 in this kernel")
    for dtype in (torch.bfloat16, torch.float16):
        layer = _fill(fmt, H, D, group, bs, nq=512, nhp=16, dtype=dtype, static=True, gen=gen)
        sm = D ** -0.5
        lens = [1, 15, 16, 17, 100, 511, 1000, 2053]
        q = torch.randn(len(lens), H * group, D, generator=gen).to(dtype).cuda()
        for hp_ends in (False, True):
            tables, sl = _tables(lens, bs, 512, 16, hp_ends, gen)
            ref = reference.paged_decode(q.float(), layer, tables, sl, sm)
            shapes = [dict(), dict(num_splits=1), dict(num_splits=7)]
            if cfg is CONFIGS[0] and dtype == torch.bfloat16:  # other launch shapes (each one compile)
                shapes += [dict(nwarps=2, nstages=2), dict(nwarps=8, nstages=2, min_blocks=1)]
            for kw in shapes:
                out = decode8.paged_decode(q, layer, tables, sl, sm, max_seq_len=max(lens), has_hp=hp_ends,
                                           defines=defines, **kw)
                assert out.dtype == dtype and torch.isfinite(out).all()
                err = _err(out, ref)
                assert err < 1e-2, (fmt, cfg, dtype, hp_ends, kw, err)
                # per sequence too: a short one must not hide in the norm of long ones
                for r in (0, 1, 3):
                    e = _err(out[r], ref[r])
                    assert e < 2e-2, (fmt, cfg, dtype, hp_ends, kw, r, e)


def test_cuda_decode_support_rules():
    from kvq.attention.cuda import decode8

    plan = make_plan(bare_model(1, 2, 128, num_attention_heads=8), "int4_per_token")  # pages of 16 (K_TOKEN)
    pool = KVPool.create(plan, 2, 2, "cpu")
    assert pool.layers[0].block_size == 16 and decode8.k_per_token(pool.layers[0].fmt.k)
    assert decode8.unsupported_reason(pool.layers[0], 4, torch.bfloat16) is None
    kivi = make_plan(bare_model(1, 2, 128, num_attention_heads=8), "int4_kivi").layers[0]  # K per channel: 32
    assert "not a multiple of 32" in decode8.layer_reason(kivi.k, kivi.v, 128, 16, 4)
    assert decode8.layer_reason(pool.layers[0].fmt.k, pool.layers[0].fmt.v, 128, 16, 4) is None
    plan = make_plan(bare_model(1, 2, 128, num_attention_heads=8), "turboquant_4bit_nc")
    pool = KVPool.create(plan, 2, 2, "cpu")
    assert decode8.unsupported_reason(pool.layers[0], 4, torch.bfloat16) is None
    for fmt, D, why in (("rot3_kc", 128, None), ("rot4_kc", 64, None), ("rot3_kc", 64, "head_dim 64"),
                        ("turboquant_k8v4", 64, None), ("turboquant_k3v4_nc", 128, None),
                        ("turboquant_k3v4_nc", 64, "head_dim 64")):
        plan = make_plan(bare_model(1, 2, D, num_attention_heads=8), fmt)
        pool = KVPool.create(plan, 2, 2, "cpu")
        got = decode8.unsupported_reason(pool.layers[0], 4, torch.bfloat16)
        assert (got is None) if why is None else (why in got), (fmt, D, got)
    plan = make_plan(bare_model(1, 2, 64, num_attention_heads=8), "int2_kivi")  # 16-byte rows (NARROW)
    pool = KVPool.create(plan, 2, 2, "cpu")
    assert decode8.unsupported_reason(pool.layers[0], 4, torch.bfloat16) is None
    plan = make_plan(bare_model(1, 2, 128, num_attention_heads=8), "int4_kivi", group_size=64)
    pool = KVPool.create(plan, 2, 2, "cpu")
    assert "group size 64" in decode8.unsupported_reason(pool.layers[0], 4, torch.bfloat16)
    plan = make_plan(bare_model(1, 2, 128, num_attention_heads=8), "int4_kivi")
    pool = KVPool.create(plan, 2, 2, "cpu")
    assert decode8.unsupported_reason(pool.layers[0], 4, torch.bfloat16) is None
    plan = make_plan(bare_model(1, 2, 128, num_attention_heads=8), k="int4_kivi", v="fp8_e4m3")
    pool = KVPool.create(plan, 2, 2, "cpu")
    assert "both KIVI" in decode8.unsupported_reason(pool.layers[0], 4, torch.bfloat16)
    plan = make_plan(bare_model(1, 2, 128, num_attention_heads=32), "fp8")
    pool = KVPool.create(plan, 2, 2, "cpu")
    assert "at most 8" in decode8.unsupported_reason(pool.layers[0], 16, torch.bfloat16)
    assert "bfloat16 or float16" in decode8.unsupported_reason(pool.layers[0], 4, torch.float32)
    assert decode8.unsupported_reason(pool.layers[0], 4, torch.bfloat16) is None
    plan = make_plan(bare_model(1, 2, 96, num_attention_heads=8), "int8")
    pool = KVPool.create(plan, 2, 2, "cpu")
    assert "head_dim 96" in decode8.unsupported_reason(pool.layers[0], 4, torch.bfloat16)
    # per-block scales are read 4 bytes at a time: 3 heads' floats (12 bytes) a block serve; a 16-byte plane
    # whose blocks are 12 bytes apart does not
    plan = make_plan(bare_model(1, 3, 64, num_attention_heads=9), "fp8_per_block")
    pool = KVPool.create(plan, 2, 2, "cpu")
    assert pool.layers[0].k["scale"].stride(0) * 4 == 12
    assert decode8.unsupported_reason(pool.layers[0], 3, torch.bfloat16) is None
    assert "not 16-byte aligned" in decode8.plane_reason("K scale", pool.layers[0].k["scale"])
    # splits: enough CTAs to fill the GPU a few times over, never a split under two chunks per warp
    assert decode8.choose_splits(2048, 1024, 132) == 1
    assert decode8.choose_splits(32, 131072, 132) == 50
    assert decode8.choose_splits(32, 200, 132) == 2


def test_cuda_backend_choice():
    from kvq.attention.backends import select_backend

    plan = make_plan(bare_model(2, 2, 128, num_attention_heads=8), "fp8_e4m3", skip_layers=[0])
    if not GPU:
        with pytest.raises(ValueError, match="needs a CUDA device"):
            select_backend("cuda", plan, "cpu", torch.bfloat16)
        _, choice = select_backend("auto", plan, "cpu", torch.bfloat16)
        assert choice.resolved in ("triton", "torch") and "cuda: needs a CUDA device" in choice.reason
        return
    from kvq.attention.cuda import decode8

    if decode8.unavailable_reason():
        pytest.skip(decode8.unavailable_reason())
    _, choice = select_backend("auto", plan, "cuda", torch.bfloat16)
    assert choice.resolved == "cuda" and "1 of 2 layers" in choice.reason, choice
    # the per-token sub-byte formats decode through CUDA too (issue 43); a plan with no layer the CUDA decode
    # reads still resolves to the same backend (Triton kernels throughout), so an evaluation's formats all
    # resolve alike and only a real fallback stands out
    for fmt, why in (("int4_per_token", "CUDA decode on all 2 layers"), ("bfloat16", "Triton kernels on all 2 layers")):
        plan = make_plan(bare_model(2, 2, 128, num_attention_heads=8), fmt)
        _, choice = select_backend("auto", plan, "cuda", torch.bfloat16)
        assert choice.resolved == "cuda" and why in choice.reason, choice
    plan = make_plan(bare_model(2, 2, 128, num_attention_heads=8), "fp8_e4m3fnuz")
    _, choice = select_backend("auto", plan, "cuda", torch.bfloat16)
    assert choice.resolved == "torch", choice
