"""Rotated codebook formats (issue 44): the rotation, the Lloyd-Max codebooks, 3-bit packing,
attention in the rotated domain, determinism across processes, and the window rule."""

import subprocess
import sys

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kvq.attention.triton.tiles import _rot_table, rotate_rows, unrotate_rows
from kvq.formats import codebook
from kvq.formats.reference import dequantize, pack, quantize, unpack
from kvq.formats.registry import ROTATION_SEED, resolve_format


@pytest.mark.parametrize("D", [64, 128, 256])
def test_rotation_is_orthogonal_and_its_inverse_exact(D):
    eye = torch.eye(D)
    R = codebook.rotate(eye, 11)  # rows: R e_i, i.e. R^T
    assert torch.allclose(R @ R.T, eye, atol=1e-6)
    x = torch.randn(7, D) * 5
    assert torch.allclose(codebook.unrotate(codebook.rotate(x, 11), 11), x, atol=1e-5)
    assert not torch.allclose(codebook.rotate(x, 11), codebook.rotate(x, 12))  # the seed matters


@triton.jit
def _rotation_kernel(x_ptr, out_ptr, table_ptr, R: tl.constexpr, D: tl.constexpr, INVERSE: tl.constexpr):
    off = tl.arange(0, R)[:, None] * D + tl.arange(0, D)[None, :]
    v = tl.load(x_ptr + off)
    if INVERSE:
        v = unrotate_rows(v, table_ptr, R, D)
    else:
        v = rotate_rows(v, table_ptr, R, D)
    tl.store(out_ptr + off, v)


def _triton_rotation(x, seed, inverse):
    """[R, D] float32 through the kernels' rotation (tiles.rotate_rows / unrotate_rows), on x's device."""
    out = torch.empty_like(x)
    _rotation_kernel[(1,)](x, out, _rot_table(2, seed, x.shape[1], str(x.device)), R=x.shape[0], D=x.shape[1],
                           INVERSE=inverse)
    return out


@pytest.mark.parametrize("D", [64, 128, 256])
def test_kernel_butterflies_are_the_references_bit_for_bit(D):
    """The write, seal and dequantization kernels rotate with the reference's butterflies in the same
    order (tiles.hadamard_rows): the same float32 values, not values within rounding, both ways."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(16, D, generator=g) * 3).to(dev)
    x[:, 5] += 40.0  # an outlier channel
    assert torch.equal(_triton_rotation(x, ROTATION_SEED, False), codebook.rotate(x, ROTATION_SEED))
    assert torch.equal(_triton_rotation(x, ROTATION_SEED, True), codebook.unrotate(x, ROTATION_SEED))


def test_rotation_spreads_an_outlier_channel():
    x = torch.zeros(64)
    x[5] = 30.0
    r = codebook.rotate(x, ROTATION_SEED)
    assert torch.allclose(r.abs(), torch.full((64,), 30.0 / 8))


def test_two_bit_codebook_is_the_brute_force_optimum():
    """Every symmetric 4-level quantizer (+-a, +-b) on a 0.005 grid: none beats Lloyd-Max's (the error of
    each from cumulative moments of the density, nearest level: a below (a + b) / 2, b above)."""
    for D in (64, 128):
        lv, th = codebook.lloyd_max(2, D)
        best = codebook.mse(lv, D)
        u, w = codebook._density(D)
        m0, m1, m2 = (np.concatenate([[0.0], np.cumsum(w * u ** k)]) for k in (0, 1, 2))
        grid = np.arange(0.005, 3.0, 0.005)
        a, b = np.meshgrid(grid, grid, indexing="ij")
        cut = np.searchsorted(u, (a + b) / 2)

        def part(c, lo, hi):  # sum of w (u - c)^2 over grid points [lo, hi)
            return (m2[hi] - m2[lo]) - 2 * c * (m1[hi] - m1[lo]) + c * c * (m0[hi] - m0[lo])

        err = np.where(b > a, part(a, 0, cut) + part(b, cut, len(u)), np.inf)
        assert best <= err.min() + 1e-9 and err.min() <= best + 1e-4  # the grid finds it too
        assert np.allclose(th, [(lv[i] + lv[i + 1]) / 2 for i in range(3)])


@pytest.mark.parametrize("bits", [1, 3, 4])
def test_codebooks_are_stationary_and_locally_optimal(bits):
    """Lloyd-Max's two conditions, and no small move of the levels lowers the error."""
    D = 128
    lv, th = codebook.lloyd_max(bits, D)
    base = codebook.mse(lv, D)
    rng = np.random.default_rng(bits)
    for _ in range(20):
        moved = np.sort(np.asarray(lv) + rng.normal(0, 0.01, len(lv)))
        assert codebook.mse(moved, D) >= base - 1e-9
    if bits == 1:  # the level is E|u|
        u, w = codebook._density(D)
        assert abs(lv[1] - 2 * np.sum(w * u) / (2 * np.sum(w))) < 1e-6


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_packing_roundtrips_every_code(bits):
    D = 64
    codes = (torch.arange(5 * D) % (1 << bits)).to(torch.uint8).view(5, D)
    codes = codes[:, torch.randperm(D)]
    assert pack(codes, bits).shape[-1] == D * bits // 8
    assert torch.equal(unpack(pack(codes, bits), bits), codes)


def test_three_bit_layout_is_a_two_bit_plane_then_a_one_bit_plane():
    codes = torch.tensor([[5, 2, 7, 0, 1, 6, 3, 4, 0, 0, 0, 0, 0, 0, 0, 7]], dtype=torch.uint8)  # D = 16
    b = pack(codes, 3)
    assert torch.equal(b[:, :4], pack(codes & 3, 2)) and torch.equal(b[:, 4:], pack(codes >> 2, 1))
    # 1-bit plane, D / 8 = 2 bytes: byte j holds channel j + 2 m at bit m; high bits are set on channels 0, 2, 5, 7, 15
    assert b[0, 4:].tolist() == [1 << 0 | 1 << 1, 1 << 2 | 1 << 3 | 1 << 7]


@pytest.mark.parametrize("name", ["turboquant_4bit_nc", "rot3_kc"])
def test_rotated_attention_equals_attention_over_dequantized_values(name):
    """What the kernels will do: q rotated once, scores against the rotated codes (plus q . mean for a
    centred K), probabilities times the rotated V, the output rotated back once."""
    torch.manual_seed(0)
    fk, fv = resolve_format(name, "k"), resolve_format(name, "v")
    D, T = 64, 64
    k, v, q = torch.randn(1, 1, T, D) * 2, torch.randn(1, 1, T, D), torch.randn(3, D)
    k[..., 7] += 9.0
    pk, pv = quantize(fk, k), quantize(fv, v)
    kd, vd = dequantize(fk, pk)[0, 0], dequantize(fv, pv)[0, 0]
    want = torch.softmax(q @ kd.T / 8, -1) @ vd

    def rotated(fmt, planes):  # the codes and norms in the rotated domain, no mean, no inverse rotation
        levels, _ = codebook.tables(fmt.bits, D, "cpu")
        return levels[unpack(planes["data"], fmt.bits).long()][0, 0] * planes["scale"].float()[0, 0, :, None]

    s = codebook.rotate(q, fk.rotation_seed) @ rotated(fk, pk).T
    if fk.scale == "centred_norm":
        s = s + q @ pk["zero"].float()[0, 0].repeat_interleave(fk.group_size, 0).T
    got = codebook.unrotate(torch.softmax(s / 8, -1) @ rotated(fv, pv), fv.rotation_seed)
    assert torch.allclose(got, want, atol=1e-5)


def test_the_same_format_gives_the_same_codes_in_two_processes():
    code = ("import torch; from kvq.formats.reference import quantize; from kvq.formats.registry import "
            "resolve_format; g = torch.Generator().manual_seed(4); x = torch.randn(2, 2, 32, 64, generator=g); "
            "p = quantize(resolve_format('rot3_kc', 'k'), x); "
            "print(sum(int(t.view(torch.uint8).long().sum()) * (i + 1) for i, t in enumerate(p.values())))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert len(outs) == 1 and outs.pop().strip().isdigit()


@pytest.mark.parametrize("backend", ["torch", "triton", "split"])
@pytest.mark.parametrize("fmt,sink,res", [("rot3_kc", 16, 32), ("turboquant_3bit_nc", 4, 24),
                                          ("turboquant_k8v4", 0, 16)])
def test_rotated_formats_read_each_querys_window_exact(fmt, sink, res, backend):
    """The reference, the Triton kernels (rotation and codes in the write/seal kernels, values rotated
    back in the tile loader and the page scratch) and the library prefill, against the per-query
    definition of the window rule."""
    from tests.test_prefill_window import _check_windows

    _check_windows(fmt, sink, res, backend, ({"a": 64, "b": 32}, {"a": 96, "b": 64}))


@pytest.mark.parametrize("name", ["turboquant_4bit_nc", "turboquant_3bit_nc", "rot3_kc", "rot4_kc", "turboquant_k8v4"])
def test_triton_writes_and_seals_store_the_references_codes(name):
    """Token writes (norm per token), block seals from hp blocks and from new tokens (centred K): the
    Triton kernels store the reference's planes.  Both rotate by the same float32 butterflies
    (tiles.hadamard_rows), but a GPU's square root and division may round the norm's scaling the other
    way, so a coordinate within rounding of a threshold may code one level apart: at most one data
    byte in a thousand may differ (none did on the CPU interpreter), norms and means to fp16."""
    from kvq.attention import reference
    from kvq.attention.triton import kernels
    from tests.paged_harness import make_harness

    GPU = torch.cuda.is_available()
    dev = "cuda" if GPU else "cpu"
    ht = make_harness(name, kernels, H=2, D=64, num_q=8, num_hp=8, device=dev)
    hr = make_harness(name, reference, H=2, D=64, num_q=8, num_hp=8, device=dev)
    bs = ht.plan.block_size
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(ht.layer.k_hp.shape, generator=g) * 2).bfloat16().to(dev)
    x[..., 3] += 8.0
    k = torch.randn(2 * bs, 2, 64, generator=g).bfloat16().to(dev)
    slots = torch.arange(2 * bs, 4 * bs, device=dev)  # q blocks 2 and 3, whole
    for h, mod in ((ht, kernels), (hr, reference)):
        h.layer.k_hp.copy_(x)
        h.layer.v_hp.copy_(x)
        mod.seal_blocks(h.layer, torch.tensor([1, 4], device=dev), torch.tensor([5, 6], device=dev))
        mod.write_kv(h.layer, k, k * 0.5, slots)
    for role in ("k", "v"):
        for plane, a in ht.layer.planes(role).items():
            b = hr.layer.planes(role)[plane]
            if plane == "data":
                differ = (a.view(torch.uint8) != b.view(torch.uint8)).float().mean().item()
                assert differ <= 1e-3, (name, role, differ)
            else:
                assert torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-6), (name, role, plane)
    assert bool(ht.layer.k["data"].view(torch.uint8)[5].any())  # something was stored


@pytest.mark.parametrize("name", ["rot3_kc", "turboquant_k8v4", "turboquant_k3v4_nc", "turboquant_4bit_nc"])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode_in_the_rotated_domain_matches_the_reference(name, splits):
    """The Triton decode scores rotated K against the query rotated once and sums rotated V before one
    rotation back (centred K's group means, and the sinks and recent window of the hp pool in
    natural order, in the same tiles): its output is the reference's (which rotates each block back)
    over a cache whose tables mix sealed blocks, hp blocks and a partial last tile."""
    from kvq.attention import reference
    from kvq.attention.triton import decode, kernels
    from tests.paged_harness import make_harness, step

    GPU = torch.cuda.is_available()
    dev = "cuda" if GPU else "cpu"
    h = make_harness(name, kernels, H=2, D=64, group=3, num_q=24, num_hp=12, sink=16, residual=32, device=dev)
    g = torch.Generator().manual_seed(7)
    step(h, {"a": 230, "b": 97}, g)
    q, meta, _ = step(h, {"a": 1, "b": 1}, g, torch.bfloat16)
    assert bool((meta.block_tables < 0).any()) and bool((meta.block_tables > 0).any())
    want = reference.paged_decode(q, h.layer, meta.block_tables, meta.seq_lens, 64 ** -0.5).float()
    got = decode.paged_decode(q, h.layer, meta.block_tables, meta.seq_lens, 64 ** -0.5, max_seq_len=231,
                              has_hp=True, num_splits=splits).float()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-2, err


@pytest.mark.parametrize("first", [False, True])
def test_rotated_prefill_always_reads_through_the_page_scratch(first, monkeypatch):
    """A rotated tile rotated back inside the prefill kernel's loop does not fit an sm_90 block's
    shared memory, so a rotated layer's prefill goes through the page scratch even when asked for
    the in-loop schedule or when the scratch passes its cap (then group by group): the output is
    the reference's either way."""
    from kvq.attention import reference
    from kvq.attention.triton import dequant, kernels, prefill
    from tests.paged_harness import make_harness, step

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    h = make_harness("turboquant_k3v4_nc", kernels, H=2, D=64, group=2, num_q=24, num_hp=12, sink=0, residual=0,
                     device=dev)
    g = torch.Generator().manual_seed(9)
    step(h, {"a": 100, "b": 60}, g)
    q, meta, _ = step(h, {"a": 20, "b": 7}, g, torch.bfloat16)
    want = reference.paged_attention(q, h.layer, meta.cu_seqlens_q, meta.block_tables, meta.seq_lens, 0.125).float()
    calls = []
    real = dequant.dequantize_pages
    monkeypatch.setattr(dequant, "dequantize_pages", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    if first:  # a cap under one sequence's pages: one group per sequence
        monkeypatch.setattr(dequant, "SCRATCH_CAP_BYTES", 1)
    got = prefill.paged_attention(q, h.layer, meta.cu_seqlens_q, meta.block_tables, meta.seq_lens, 0.125,
                                  dequant_first=first, max_seq_len=120).float()
    assert len(calls) == (2 if first else 1)
    assert ((got - want).norm() / want.norm()).item() < 1e-2
