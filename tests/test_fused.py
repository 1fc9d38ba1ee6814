"""The model's fused Triton kernels (add + RMSNorm, RoPE, SiLU·mul) against their torch definitions.

Runs on CUDA when present, else under the Triton CPU interpreter (conftest sets
TRITON_INTERPRET=1 without CUDA), on bf16 and float32 activations with outliers.
"""

from __future__ import annotations

import pytest
import torch

from kvq.models import fused, fused_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float32] if DEV == "cuda" else [torch.float32]


def _x(*shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 2
    x[..., 3] *= 40  # an outlier channel
    return x.to(DEV, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, with_residual):
    T, N = 7, 576
    x, r = _x(T, N, dtype=dtype), _x(T, N + 1, dtype=dtype)[:, :N] if with_residual else None
    w = (1 + 0.1 * _x(N, dtype=torch.float32)).to(dtype)
    want, want_res = fused.add_rms_norm_torch(x, r.clone() if r is not None else None, w, 1e-5)
    got, got_res = fused_triton.add_rms_norm(x, r.clone() if r is not None else None, w, 1e-5)
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)  # the residual add rounds like torch
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert not torch.equal(got, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (9, 3)])  # (9, 3): SmolLM2's heads, tiles padded to 16 and 4
def test_rope_in_place_on_strided_views(dtype, Hq, Hkv):
    T, D = 5, 64
    qkv = _x(T, (Hq + 2 * Hkv) * D, dtype=dtype)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
    v_before = qkv[:, (Hq + Hkv) * D :].clone()
    pos = torch.tensor([0, 1, 17, 900, 8191], device=DEV)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)).float().to(DEV)
    wq, wk = fused.rope_torch(q.clone(), k.clone(), pos, inv)
    gq, gk = fused_triton.apply_rope(q, k, pos, inv)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-4
    torch.testing.assert_close(gq, wq, rtol=tol, atol=tol)
    torch.testing.assert_close(gk, wk, rtol=tol, atol=tol)
    torch.testing.assert_close(q, wq, rtol=tol, atol=tol)  # written in place
    assert torch.equal(qkv[:, (Hq + Hkv) * D :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    T, N = 3, 1536
    x = _x(T, 2 * N, dtype=dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(fused_triton.silu_mul(x), fused.silu_mul_torch(x), rtol=tol, atol=tol)
