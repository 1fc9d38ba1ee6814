"""Triton kernels of :mod:`kvq.models.fused` (CUDA only; imported on first use)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# -- Triton kernels -------------------------------------------------------------------------------
@triton.jit
def _add_rms_norm_kernel(x_ptr, s_x, res_ptr, s_r, w_ptr, out_ptr, s_o, N, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + row * s_x + offs, mask=m, other=0.0)
    if HAS_RES:  # the residual stream: x + residual, rounded like torch's add, written back
        r = tl.load(res_ptr + row * s_r + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + row * s_r + offs, x, mask=m)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rotate(base, s_h, n, c, s, HP: tl.constexpr, HALF: tl.constexpr):
    """Rotate-half RoPE of the ``n`` heads at ``base`` (head stride ``s_h``) in place; c, s: [1, HALF]."""
    h = tl.arange(0, HP)[:, None]
    i = tl.arange(0, HALF)[None, :]
    m = h < n
    p1 = base + h * s_h + i
    x1 = tl.load(p1, mask=m).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=m).to(tl.float32)
    tl.store(p1, (x1 * c - x2 * s).to(base.dtype.element_ty), mask=m)
    tl.store(p1 + HALF, (x2 * c + x1 * s).to(base.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(q_ptr, s_qt, s_qh, k_ptr, s_kt, s_kh, pos_ptr, inv_ptr, HQ, HK,
                 HALF: tl.constexpr, HQP: tl.constexpr, HKP: tl.constexpr):
    """One program per token, every q and k head: cos/sin once per token, not once per head (the
    per-(token, head) version ran at a fifth of copy bandwidth on the H200, its sin/cos 40x over)."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HALF)
    f = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + i)
    c, s = tl.cos(f)[None, :], tl.sin(f)[None, :]
    _rotate(q_ptr + t * s_qt, s_qh, HQ, c, s, HQP, HALF)
    _rotate(k_ptr + t * s_kt, s_kh, HK, c, s, HKP, HALF)


@triton.jit
def _silu_mul_kernel(x_ptr, s_x, out_ptr, s_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(x_ptr + row * s_x + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * s_x + N + offs, mask=m, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * s_o + offs, (a * u).to(out_ptr.dtype.element_ty), mask=m)



def add_rms_norm(x, residual, weight, eps):
    T, N = x.shape
    out = torch.empty_like(x)
    if residual is not None:  # the sum goes to the residual buffer in place
        residual = residual.contiguous()
    _add_rms_norm_kernel[(T,)](x, x.stride(0), residual if residual is not None else x,
                               residual.stride(0) if residual is not None else 0, weight, out, out.stride(0),
                               N, eps, HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(N),
                               num_warps=8 if N >= 2048 else 4)
    return out, (residual if residual is not None else x)


def apply_rope(q, k, positions, inv_freq):
    T, Hq, D = q.shape
    assert q.stride(2) == 1 and k.stride(2) == 1
    if T:
        Hk = k.shape[1]
        _rope_kernel[(T,)](q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), positions, inv_freq, Hq, Hk,
                           HALF=D // 2, HQP=triton.next_power_of_2(Hq), HKP=triton.next_power_of_2(Hk),
                           num_warps=4 if Hq * D >= 2048 else 2)
    return q, k


def silu_mul(gate_up):
    T, N2 = gate_up.shape
    N = N2 // 2
    out = torch.empty(T, N, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(T, triton.cdiv(N, BLOCK))](gate_up, gate_up.stride(0), out, out.stride(0), N, BLOCK=BLOCK)
    return out
