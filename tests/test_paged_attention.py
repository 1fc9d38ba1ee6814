"""Paged cache + attention: the torch reference against dense attention, and the
Triton kernels against the reference (on the GPU, or under Triton's CPU interpreter).

Two tolerance levels (STYLE.md 6):
* kernel vs reference on the same quantized cache: tight (bytes equal for
  write/seal, outputs within bf16 rounding);
* quantized vs exact attention output: per format, written down in OUT_ERR.
"""

import math

import pytest
import torch

from kvq.attention import reference
from kvq.attention.backends import select_backend
from kvq.formats.registry import entries, resolve_format
from tests.paged_harness import dense_attention, expected_kv, make_harness, step

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
TRITON_FORMATS = [e.name for e in entries() if e.name not in ("auto", "float32", "fp8_e4m3fnuz", "float16")
                  and not any(resolve_format(e.name, r).reference_only for r in ("k", "v"))]
#: K and V in different families or KIVI groups (per-layer plans of `kvq tune`): "K_SPEC/V_SPEC".
MIXED_FORMATS = ["int4_kivi/int2_kivi:g64", "int2_kivi:g64/int4_kivi", "int2_kivi/fp8_e4m3", "int8/int4_kivi:g64",
                 "bfloat16/int2_kivi"]
ALL_FORMATS = [e.name for e in entries() if e.name != "auto"]


def _kernels(name):
    if name == "torch":
        return reference
    if name == "cuda":
        from kvq.attention.cuda import kernels
    else:
        from kvq.attention.triton import kernels
    return kernels


def _run_schedule(h, gen, schedule, q_dtype=torch.float32):
    """Yields each step's results; the cache state is the step's own while the caller checks."""
    for new in schedule:
        q, meta, out = step(h, new, gen, q_dtype)
        h.manager.check_integrity()
        yield new, q, meta, out


SCHEDULE = [{"a": 37, "b": 70}, {"a": 1, "b": 1}, {"a": 1, "c": 20}, {"a": 30, "b": 1, "c": 1}]


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_reference_equals_dense_attention_over_what_the_cache_holds(fmt):
    """Paged tables, hp/q pools, seals and windows read exactly what was stored."""
    gen = torch.Generator().manual_seed(0)
    h = make_harness(fmt, reference, sink=16 if "kivi" in fmt else 4, residual=40 if "kivi" not in fmt else None)
    for new, q, meta, out in _run_schedule(h, gen, SCHEDULE):
        cu = meta.cu_seqlens_q.tolist()
        for b, sid in enumerate(new):
            exp = dense_attention(q[cu[b]:cu[b + 1]], expected_kv(h, sid, "k"), expected_kv(h, sid, "v"), h.group)
            got = out[cu[b]:cu[b + 1]].float()
            assert torch.allclose(got, exp, atol=2e-5, rtol=1e-4), (fmt, sid, (got - exp).abs().max())


# Quantized vs exact attention output (mean relative error over the schedule), random data
# with outlier channels, no windows.  Measured values are about half of these bounds.
OUT_ERR = {
    "bfloat16": 0.01, "float16": 0.01, "float32": 1e-6, "fp8_e4m3": 0.08, "fp8_e5m2": 0.16, "fp8_e4m3fnuz": 0.08,
    "fp8_per_token_head": 0.08, "fp8_per_block": 0.08, "int8": 0.02, "int8_per_token_head": 0.02,
    "int4_kivi": 0.15, "int2_kivi": 0.7,
    "int4_per_token": 0.27, "int2_per_token": 1.5,  # measured 0.134, 0.761: K per token suffers the outlier channels
    # rotated codebooks, measured 0.081, 0.158, 0.097, 0.135, 0.218, 0.269 (int4_kivi 0.064, int2_kivi 0.351 here)
    "rot4_kc": 0.16, "rot3_kc": 0.32, "turboquant_k8v4": 0.2, "turboquant_4bit_nc": 0.27,
    "turboquant_k3v4_nc": 0.44, "turboquant_3bit_nc": 0.54,
}


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_quantized_attention_error_per_format(fmt):
    gen = torch.Generator().manual_seed(1)
    h = make_harness(fmt, reference, sink=0, residual=0)
    errs = []
    for new, q, meta, out in _run_schedule(h, gen, SCHEDULE):
        cu = meta.cu_seqlens_q.tolist()
        for b, sid in enumerate(new):
            exact = dense_attention(q[cu[b]:cu[b + 1]], h.exact_k[sid].float().permute(1, 0, 2),
                                    h.exact_v[sid].float().permute(1, 0, 2), h.group)
            errs.append(((out[cu[b]:cu[b + 1]].float() - exact).norm() / exact.norm()).item())
    mean = sum(errs) / len(errs)
    assert mean < OUT_ERR[fmt], (fmt, mean)
    if fmt not in ("float32", "bfloat16", "float16"):  # the test K/V are bf16 values: stored exactly
        assert mean > OUT_ERR[fmt] / 100, (fmt, mean, "suspiciously exact: is the format quantizing?")


def test_windows_cut_low_bit_error():
    """Sinks + a recent window in high precision lower int2 KIVI's error (MEASURED.md)."""
    errs = {}
    for label, sink, residual in (("none", 0, 0), ("windows", 32, 64)):
        gen = torch.Generator().manual_seed(2)
        h = make_harness("int2_kivi", reference, sink=sink, residual=residual)
        total = []
        for new, q, meta, out in _run_schedule(h, gen, [{"a": 150}, {"a": 1}, {"a": 1}]):
            exact = dense_attention(q, h.exact_k["a"].float().permute(1, 0, 2), h.exact_v["a"].float().permute(1, 0, 2),
                                    h.group)
            total.append(((out.float() - exact).norm() / exact.norm()).item())
        errs[label] = sum(total) / len(total)
    assert errs["windows"] < 0.7 * errs["none"], errs


def _pools_equal(a, b):
    for role in ("k", "v"):
        rot = a.layers[0].tensor_format(role).family == "rot"
        same_rows = None
        if rot:  # tokens whose codes agree: a norm-corrected scale follows its codes (below)
            xd, yd = a.layers[0].planes(role)["data"].cpu(), b.layers[0].planes(role)["data"].cpu()
            same_rows = (xd.view(torch.uint8) == yd.view(torch.uint8)).all(-1)
        for name, x in a.layers[0].planes(role).items():
            y = b.layers[0].planes(role)[name]
            if x.element_size() == 1:
                x, y = x.view(torch.uint8), y.view(torch.uint8)
            if rot:  # the rotation: one float32 product in the kernel, a butterfly in the reference (see
                # tests/test_codebook.py): a coordinate within rounding of a threshold may code a level apart;
                # a token's scale (its norm over its reconstruction's, norm-corrected formats) then differs with
                # it, so scales are compared where the token's codes agree
                differ = (x != y).float().mean().item() if name == "data" else 0.0
                x, y = x.float().cpu(), y.float().cpu()
                if name != "data" and x.shape == same_rows.shape:
                    x, y = x[same_rows], y[same_rows]
                close = name == "data" or torch.allclose(x, y, rtol=1e-3, atol=1e-6)
                assert differ <= 1e-3 and close, f"{role}.{name}: {differ:.2e} of the bytes differ"
                continue
            assert torch.equal(x.cpu(), y.cpu()), f"{role}.{name} differs at {int((x != y).sum())} places"
        assert torch.equal(a.layers[0].hp(role).cpu(), b.layers[0].hp(role).cpu()), f"{role} hp differs"


CONFIGS = (  # head_dim 64/128, GQA 1/3/4/8, pages 16/32
    [dict(H=8, D=128, group=4, block_size=16), dict(H=4, D=128, group=8, block_size=32),
     dict(H=3, D=64, group=3, block_size=32), dict(H=4, D=64, group=1, block_size=16)]
    if GPU else [dict(H=2, D=64, group=2, block_size=None)]
)
SCHED_KERNEL = (
    [{"a": 300, "b": 1000, "c": 77}, {"a": 1, "b": 1, "c": 1}, {"a": 1, "d": 513}, {"a": 64, "b": 1, "c": 1, "d": 1}]
    if GPU else [{"a": 37, "b": 70}, {"a": 1, "b": 1}, {"a": 1, "c": 20}]
)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "H{H}D{D}g{group}bs{block_size}".format(**c))
@pytest.mark.parametrize("fmt", TRITON_FORMATS + MIXED_FORMATS)
def test_triton_matches_reference(fmt, cfg):
    """Same schedule through both backends: identical cache bytes after every step
    (write and seal), attention outputs within bf16 rounding."""
    _backend_matches_reference(fmt, cfg, "triton")


def _cuda_reason():
    from kvq.attention.cuda.decode8 import unavailable_reason

    return unavailable_reason()


CUDA_SEAL_FORMATS = ["int4_kivi", "int2_kivi", "fp8_per_block", "int4_kivi/int2_kivi", "int2_kivi/fp8_per_block"]


@pytest.mark.skipif(not GPU, reason="the CUDA backend needs a GPU")
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "H{H}D{D}g{group}bs{block_size}".format(**c))
@pytest.mark.parametrize("fmt", CUDA_SEAL_FORMATS)
def test_cuda_seal_matches_reference(fmt, cfg):
    """The cuda backend's block seals (seal.cu: window seals and a prefill's whole blocks, KIVI
    and per-block FP8) write the reference's bytes, step after step."""
    if _cuda_reason():
        pytest.skip(_cuda_reason())
    _backend_matches_reference(fmt, cfg, "cuda")


@pytest.mark.skipif(not GPU, reason="the CUDA backend needs a GPU")
@pytest.mark.parametrize("fmt", ["int4_kivi", "fp8_per_block"])
def test_cuda_seal_walks_a_padded_pair_list(fmt):
    """seal.cu's CTAs walk a pair list longer than its slots (kvq.attention.cuda.seal.PAIR_SLOTS) with
    padding rows (q block -1) among the real ones: every real pair sealed like the reference's, and
    no padding row touches a block."""
    if _cuda_reason():
        pytest.skip(_cuda_reason())
    from kvq.attention.cuda import seal

    D, H, bs, n = 128, 2, 32, 3 * seal.PAIR_SLOTS + 5
    hr = make_harness(fmt, _kernels("torch"), H=H, D=D, group=2, block_size=bs, num_q=n, num_hp=n, device=DEV)
    hc = make_harness(fmt, _kernels("cuda"), H=H, D=D, group=2, block_size=bs, num_q=n, num_hp=n, device=DEV)
    g = torch.Generator().manual_seed(6)
    hp_k, hp_v = (torch.randn(n, H, bs, D, generator=g).bfloat16().to(DEV) for _ in range(2))
    real = torch.arange(n, device=DEV) % 3 != 1  # every third row is padding
    pairs = torch.stack([torch.arange(n, device=DEV), torch.where(real, torch.randperm(n, device=DEV), -1)], 1)
    for h in (hr, hc):
        h.layer.k_hp.copy_(hp_k)
        h.layer.v_hp.copy_(hp_v)
    reference.seal_blocks(hr.layer, pairs[real, 0], pairs[real, 1])
    seal.seal_pairs(hc.layer, pairs)
    _pools_equal(hr.pool, hc.pool)


@pytest.mark.parametrize("backend,dtype", [("triton", "bfloat16"), ("cuda", "bfloat16"), ("cuda", "float16")])
@pytest.mark.parametrize("fmt", ["int4_kivi", "int2_kivi"])
def test_kivi_seal_is_exact_at_rounding_ties(fmt, backend, dtype):
    """Block seals on K/V whose quotients are exact ties (values at half steps of a group's scale)
    and near-ties (a few bf16 units in the last place off), beside random groups, give the
    reference's bytes: the Triton seal, and seal.cu, which computes KIVI codes with a reciprocal
    product and falls back to the division where the product lies near a half-integer; seal.cu
    also with f16 hp blocks (its min/max and loads differ per dtype)."""
    if backend == "cuda" and (not GPU or _cuda_reason()):
        pytest.skip("the CUDA backend needs a GPU" if not GPU else _cuda_reason())
    D, H, bs = 128, 2, 32
    hr, hc = (make_harness(fmt, _kernels(b), H=H, D=D, group=2, block_size=bs, num_q=8, num_hp=8, device=DEV,
                           dtype=dtype) for b in ("torch", backend))
    hp_dtype = getattr(torch, dtype)
    qmax = 15.0 if fmt == "int4_kivi" else 3.0
    g = torch.Generator().manual_seed(4)
    steps = torch.arange(bs * D, dtype=torch.float32).reshape(bs, D) % (2 * qmax + 1) / 2  # 0, 0.5, ..., qmax
    for blk in range(4):  # per block a scale: powers of two (exact quotients) and 0.37 (rounded ones)
        scale = (2.0 ** (blk - 2)) if blk < 3 else 0.37
        x = steps * scale
        x[0], x[-1] = 0.0, qmax * scale  # each K channel's group spans [0, qmax * scale]
        x[:, 0], x[:, -1] = 0.0, qmax * scale  # and each V row's first and last group
        tie = x.bfloat16()  # the hp blocks hold bf16: near-ties are a few bf16 ulps off
        delta = torch.randint(-2, 3, tie.shape, generator=g, dtype=torch.int16) * (tie > 0)  # 0 stays 0
        nudged = tie.view(torch.int16) + delta
        block = torch.where(torch.rand(tie.shape, generator=g) < 0.5, tie, nudged.view(torch.bfloat16)).float()
        for h in (hr, hc):
            h.layer.k_hp[blk] = block.to(hp_dtype).to(DEV)[None].expand(H, -1, -1)
            h.layer.v_hp[blk] = (block.flip(1) * 1.5).to(hp_dtype).to(DEV)[None].expand(H, -1, -1)
    k_rand, v_rand = (torch.randn(4, H, bs, D, generator=g).to(hp_dtype).to(DEV) for _ in range(2))
    for h in (hr, hc):
        h.layer.k_hp[4:], h.layer.v_hp[4:] = k_rand, v_rand
        h.kernels.seal_blocks(h.layer, torch.arange(8, device=DEV), torch.arange(8, device=DEV))
    _pools_equal(hr.pool, hc.pool)


def _reciprocal_traps(qmax: float, scale_dtype: torch.dtype) -> tuple[float, torch.Tensor]:
    """(A, X): a bf16 maximum A and the bf16 values x in (0, A] whose code under the scale that A
    gives, s = fl(A / qmax) in ``scale_dtype``, differs between rne(fl(x * fl(1 / s))) and the
    reference's rne(fl(x / s)): the values a division-free quantizer gets wrong without its
    fallback (float32 CPU arithmetic is IEEE, like the GPU's and the interpreter's)."""
    x_all = torch.arange(0x3C00, 0x4300, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    for a in x_all.flip(0):
        s = (a / torch.tensor(qmax)).to(scale_dtype).float()
        x = x_all[x_all <= a]
        bad = x[torch.round(x * (1 / s)) != torch.round(x / s)]
        if bad.numel():
            return float(a), bad
    raise AssertionError(f"no bf16 value in [2^-7, 128) is a trap for qmax {qmax} and {scale_dtype} scales")


def _trap_kv(T: int, D: int, qmax: float, scale_dtype, symmetric: bool) -> torch.Tensor:
    """[T, D] bf16: the traps of :func:`_reciprocal_traps` (and their negatives where codes are
    symmetric), with every row's 32-channel groups and every channel's 32-token groups pinned to
    [0, A] (KIVI: minimum 0, maximum A) or to A in magnitude (per token): the quantizer's scale
    is the one the traps were found for."""
    a, traps = _reciprocal_traps(qmax, scale_dtype)
    x = traps.repeat(T * D // traps.numel() + 1)[:T * D].reshape(T, D)
    if symmetric:
        x = x * torch.where(torch.arange(D) % 3 == 1, -1.0, 1.0)
    x[:, 0::32], x[:, 31::32] = 0.0, a
    x[0::32], x[31::32] = 0.0, a
    return x.bfloat16()


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("fmt", ["int8_per_token_head", "int4_kivi", "int2_kivi", "int4_per_token"])
def test_writes_are_exact_at_reciprocal_traps(fmt, backend):
    """Token writes (and a prefill's whole-block seals) give the reference's bytes on K/V built from
    values whose code a reciprocal product gets wrong: the Triton write and seal.cu compute the
    quotients from the reciprocal with one fma correction (without it the per-token and KIVI rows
    fail)."""
    if backend == "cuda" and (not GPU or _cuda_reason()):
        pytest.skip("the CUDA backend needs a GPU" if not GPU else _cuda_reason())
    D, H, bs = 128, 2, 32
    hr = make_harness(fmt, _kernels("torch"), H=H, D=D, group=2, block_size=bs, num_q=8, num_hp=8, device=DEV)
    hc = make_harness(fmt, _kernels(backend), H=H, D=D, group=2, block_size=bs, num_q=8, num_hp=8, device=DEV)
    t = hr.layer.fmt.v
    sdt = getattr(torch, t.scale_dtype)
    T = 4 * bs
    k = _trap_kv(T, D, float(t.qmax), sdt, t.family != "kivi")[:, None].expand(T, H, D).contiguous().to(DEV)
    v = k.flip(0).contiguous()
    slots = torch.arange(T, device=DEV)
    full = torch.tensor([[b, b * bs] for b in range(4)], device=DEV)
    for h in (hr, hc):
        h.kernels.write_kv(h.layer, k, v, slots, full)
    _pools_equal(hr.pool, hc.pool)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("fmt", ["fp8_per_block", "int8_per_token_head", "fp8_per_token_head", "int4_kivi"])
def test_writes_are_exact_for_tiles_of_tiny_values(fmt, backend):
    """Normal values near 2e-38 have float32 scales below the normal range, whose reciprocal
    overflows: the quotients by reciprocal must still be the reference's (without the 2^64 rescale
    of such scales every per-token and per-block code differed)."""
    if backend == "cuda" and (not GPU or _cuda_reason()):
        pytest.skip("the CUDA backend needs a GPU" if not GPU else _cuda_reason())
    D, H, bs = 128, 2, 32
    hr = make_harness(fmt, _kernels("torch"), H=H, D=D, group=2, block_size=bs, num_q=8, num_hp=8, device=DEV)
    hc = make_harness(fmt, _kernels(backend), H=H, D=D, group=2, block_size=bs, num_q=8, num_hp=8, device=DEV)
    g = torch.Generator().manual_seed(5)
    T = 4 * bs
    mag = torch.rand(T, H, D, generator=g) + 1
    k = (mag * torch.randn(T, H, D, generator=g).sign() * 2e-38).bfloat16().to(DEV)
    v = k.flip(0).contiguous()
    slots = torch.arange(T, device=DEV)
    full = torch.tensor([[b, b * bs] for b in range(3)], device=DEV)
    for h in (hr, hc):
        h.kernels.write_kv(h.layer, k[:3 * bs], v[:3 * bs], slots[:3 * bs], full)  # whole blocks
        h.kernels.write_kv(h.layer, k[-3:], v[-3:], -1 - slots[:3])  # hp rows 0..2 (no full_blocks given)
    _pools_equal(hr.pool, hc.pool)


def _backend_matches_reference(fmt, cfg, backend):
    if cfg["block_size"]:  # pages of whole K groups (KIVI, centred rotated K: 32 tokens; ":g64": 64)
        least = make_harness(fmt, reference, **dict(cfg, block_size=None)).plan.block_size  # lcm(16, whole groups)
        cfg = dict(cfg, block_size=math.lcm(cfg["block_size"], least))
    windows = dict(sink=16, residual=48) if "kivi" not in fmt else {}
    big = dict(num_q=256, num_hp=64) if GPU else {}
    hr = make_harness(fmt, _kernels("torch"), device=DEV, **cfg, **windows, **big)
    ht = make_harness(fmt, _kernels(backend), device=DEV, **cfg, **windows, **big)
    gr, gt = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for new in SCHED_KERNEL:
        qr, mr, outr = step(hr, new, gr, torch.bfloat16)
        qt, mt, outt = step(ht, new, gt, torch.bfloat16)
        assert torch.equal(qr, qt)
        _pools_equal(hr.pool, ht.pool)
        err = ((outt.float() - outr.float()).norm() / outr.float().norm()).item()
        assert err < 1e-2, (fmt, cfg, new, err)
        # decode path (one query per sequence) through the split-K kernel
        if all(k == 1 for k in new.values()):
            dr = reference.paged_decode(qr, hr.layer, mr.block_tables, mr.seq_lens, qr.shape[-1] ** -0.5)
            from kvq.attention.triton.decode import paged_decode

            dt = paged_decode(qt, ht.layer, mt.block_tables, mt.seq_lens, qt.shape[-1] ** -0.5,
                              max_seq_len=mt.max_seq_len, has_hp=mt.has_hp, block_n=64 if GPU else 16)
            derr = ((dt.float() - dr.float()).norm() / dr.float().norm()).item()
            assert derr < 1e-2, (fmt, cfg, "decode", derr)


@pytest.mark.parametrize("fmt", ["int8_per_token_head", "int4_kivi", "int2_kivi", "int4_per_token", "fp8_per_block",
                                 "fp8_e4m3"])
def test_prefill_dequant_first_matches_in_loop(fmt):
    """Both prefill schedules (pages dequantized once into an f16 scratch, or in the
    kernel's loop) agree with the reference on the same cache, hp windows included,
    and the scratch is sized by max_seq_len, not the table width."""
    from kvq.attention.triton import dequant
    from kvq.attention.triton.prefill import paged_attention

    bs = 32 if "kivi" in fmt else 16
    windows = dict(sink=bs, residual=48) if "kivi" not in fmt else dict(sink=0, residual=64)
    h = make_harness(fmt, _kernels("triton"), device=DEV, H=2, D=64, group=2, block_size=bs, **windows)
    gen = torch.Generator().manual_seed(5)
    step(h, {"a": 150, "b": 70}, gen)
    q, meta, _ = step(h, {"a": 40, "b": 1, "c": 33}, gen)
    sm = q.shape[-1] ** -0.5
    want = reference.paged_attention(q, h.layer, meta.cu_seqlens_q, meta.block_tables, meta.seq_lens, sm).float()
    wide = torch.cat([meta.block_tables, torch.full_like(meta.block_tables, 99)], dim=1)  # unread tail columns
    outs = {}
    for first in (True, False):
        outs[first] = paged_attention(q, h.layer, meta.cu_seqlens_q, wide, meta.seq_lens, sm, has_hp=meta.has_hp,
                                      max_seq_len=meta.max_seq_len, dequant_first=first).float()
        err = ((outs[first] - want).norm() / want.norm()).item()
        assert err < 1e-2, (fmt, first, err)
    if fmt != "fp8_e4m3":  # scaled values round to f16 in the scratch: the two schedules really differ
        assert not torch.equal(outs[True], outs[False])
    B, blocks = meta.seq_lens.shape[0], -(-meta.max_seq_len // bs)
    k, v, table = dequant.dequantize_pages(*_layer_args(h.layer), meta.block_tables, meta.seq_lens, blocks,
                                           h.layer.num_kv_heads, bs, h.layer.head_dim)
    assert k.shape == (B * blocks, 2, bs, 64) and table.shape == (B, blocks)
    ref_k = expected_kv(h, "a", "k")  # [H, n, D]: sequence a's pages, dequantized in natural channel order
    n = ref_k.shape[1]
    got = k[:blocks].permute(1, 0, 2, 3).reshape(2, blocks * bs, 64)[:, :n].float().cpu()
    assert torch.allclose(got, ref_k, rtol=2e-3, atol=2e-3)


def _layer_args(layer):
    from kvq.attention.triton.decode import layer_args

    return layer_args(layer)


def test_backend_selection_is_explicit():
    from kvq.cache.plan import bare_model, make_plan

    plan = make_plan(bare_model(1, 2, 64), "fp8_e4m3fnuz")
    with pytest.raises(ValueError, match="reference implementation"):
        select_backend("triton", plan, DEV, torch.bfloat16)
    _, choice = select_backend("auto", plan, DEV, torch.bfloat16)
    assert choice.resolved == "torch" and "reference implementation" in choice.reason
    with pytest.raises(ValueError, match="valid: auto, cuda, triton, torch"):
        select_backend("flashattn", plan, DEV, torch.bfloat16)
    plan = make_plan(bare_model(1, 2, 64), "fp8")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        select_backend("triton", plan, DEV, torch.float32)
    _, choice = select_backend("triton", plan, DEV, torch.bfloat16)
    assert (choice.requested, choice.resolved) == ("triton", "triton")
    plan = make_plan(bare_model(1, 2, 48), "fp8")
    with pytest.raises(ValueError, match="head_dim 48"):
        select_backend("triton", plan, DEV, torch.bfloat16)


@pytest.mark.parametrize("cover", [True, False], ids=["whole-blocks", "with-hp-rows"])
@pytest.mark.parametrize("fmt", ["int4_kivi", "int2_kivi", "fp8_per_block"])
def test_write_through_a_pair_sealer(fmt, cover):
    """store.write_kv's ``pair_sealer`` (the CUDA backend: both roles in one seal.cu launch) seals a
    write of whole blocks alone, KIVI V too (a role written per token otherwise), and the whole
    blocks of any write where both roles are sealed per block; the reference's bytes either way
    (the pair sealer here: the Triton seal of each role)."""
    from kvq.attention.triton import store

    D, H, bs = 64, 2, 32
    hr, ht = (make_harness(fmt, _kernels(b), H=H, D=D, block_size=bs, num_q=8, num_hp=8, device=DEV)
              for b in ("torch", "triton"))
    g = torch.Generator().manual_seed(9)
    k, v = (torch.randn(3 * bs + 5, H, D, generator=g).bfloat16().to(DEV) for _ in range(2))
    blocks = [5, 2, 7]
    # the last 5 tokens go to hp rows 0..4 (slot -1 - row), each its own: rows sharing one slot race on a GPU
    slots = torch.tensor([blocks[t // bs] * bs + t % bs if t < 3 * bs else 3 * bs - 1 - t for t in range(k.shape[0])],
                         device=DEV)
    if cover:
        k, v, slots = k[:3 * bs], v[:3 * bs], slots[:3 * bs]
    full = reference.full_block_writes(slots, bs).to(DEV)
    calls = []

    def pair(layer, kk, vv, src_ids, s_src, s_head, s_tok, dst_q):
        calls.append(dst_q.tolist())
        for role, x in (("k", kk), ("v", vv)):
            store.seal_from(layer, role, x, src_ids, s_src, s_head, s_tok, dst_q)

    reference.write_kv(hr.layer, k, v, slots)
    store.write_kv(ht.layer, k, v, slots, full, pair_sealer=pair)
    _pools_equal(hr.pool, ht.pool)
    both_sealed = not any(ht.layer.tensor_format(r).write_direct for r in ("k", "v"))
    assert calls == ([blocks] if cover or both_sealed else [])


@pytest.mark.parametrize("fmt", ["bfloat16", "int4_kivi"])
def test_decode_any_split_count_merges_to_the_reference(fmt):
    """The split-merge kernel walks the splits 16 at a time (no variant per split count): one
    split, a few, more than one tile of them (24 tiles of a page each in 40 splits), and more splits
    than the short sequence has tiles (empty splits, log-sum-exp -inf) give the reference's output."""
    from kvq.attention.triton import decode
    from kvq.cache.plan import bare_model, make_plan
    from kvq.cache.pool import KVPool

    H, group, D = 2, 2, 64
    plan = make_plan(bare_model(1, H, D, num_attention_heads=H * group), fmt, sink_tokens=0, residual_tokens=0)
    bs = plan.block_size
    layer = KVPool.create(plan, 30, 4, DEV).layers[0]
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(30 * bs, H, D, generator=g).bfloat16().to(DEV) for _ in range(2))
    reference.write_kv(layer, k, v, torch.arange(30 * bs, device=DEV))
    order = torch.randperm(30, generator=g).to(torch.int32)
    tables = torch.stack([order[:24], torch.cat([order[24:], order[:18]])]).to(DEV)
    lens = torch.tensor([24 * bs, 2 * bs + 5], dtype=torch.int32, device=DEV)
    q = torch.randn(2, H * group, D, generator=g).bfloat16().to(DEV)
    want = reference.paged_decode(q, layer, tables, lens, 0.5).float()  # peaked scores: splits differ
    for splits in (1, 3, 17, 40):
        got = decode.paged_decode(q, layer, tables, lens, 0.5, max_seq_len=24 * bs, has_hp=False, block_n=bs,
                                  num_splits=splits).float()
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2, msg=f"{splits} splits")


@pytest.mark.parametrize("fmt,D", [("int4_kivi", 64), ("int2_kivi", 64), ("int2_kivi", 128), ("int4_per_token", 64),
                                   ("int2_per_token", 128)])
@pytest.mark.parametrize("tile,hp_pages", [(None, 64), (64, 2), (128, 1)])
def test_kivi_decode_kernel_matches_the_reference(fmt, D, tile, hp_pages, monkeypatch):
    """The KIVI decode kernel (kvq.attention.triton.decode_kivi: a branch-free quantized pass, then the
    hp pages) over outlier channels, hp sink, window and mid-table pages, a partial last tile and two
    splits, with tiles of one page and of several, and the hp pass's table chunks of 64, 2 and 1 pages:
    the reference's output."""
    from kvq.attention.triton import decode, decode_kivi
    from kvq.cache.plan import bare_model, make_plan
    from kvq.cache.pool import KVPool

    monkeypatch.setattr(decode_kivi, "HP_PAGES", hp_pages)
    H, group = 2, 3
    plan = make_plan(bare_model(1, H, D, num_attention_heads=H * group), fmt, sink_tokens=32, residual_tokens=32)
    bs = plan.block_size
    layer = KVPool.create(plan, 12, 4, DEV).layers[0]
    assert decode_kivi.serves(layer)
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(12 * bs, H, D, generator=g).bfloat16() * 2 for _ in range(2))
    k[..., 3] += 8  # an outlier channel
    reference.write_kv(layer, k.to(DEV), v.to(DEV), torch.arange(12 * bs, device=DEV))
    layer.k_hp.copy_(torch.randn(layer.k_hp.shape, generator=g).to(layer.k_hp.dtype))
    layer.v_hp.copy_(torch.randn(layer.v_hp.shape, generator=g).to(layer.v_hp.dtype))
    order = torch.randperm(12, generator=g).to(torch.int32)
    hp = torch.tensor([-1], dtype=torch.int32)
    tables = torch.stack([torch.cat([hp, order[:8], hp - 2]),
                          torch.cat([order[8:], hp - 1, order[:5]])]).to(DEV)
    lens = torch.tensor([10 * bs - 7, 5 * bs + 5], dtype=torch.int32, device=DEV)
    q = torch.randn(2, H * group, D, generator=g).bfloat16().to(DEV)
    want = reference.paged_decode(q, layer, tables, lens, D ** -0.5).float()
    for splits in (None, 2):
        got = decode.paged_decode(q, layer, tables, lens, D ** -0.5, max_seq_len=10 * bs, num_splits=splits,
                                  block_n=tile).float()
        torch.testing.assert_close(got, want, rtol=0, atol=3e-2)
