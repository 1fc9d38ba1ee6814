"""The model's elementwise work in few kernels: residual add + RMSNorm, RoPE on q and k, SiLU·mul.

A decode step of a Llama-8B runs 32 layers; done with separate torch ops, the
norms, rotary embedding and gated activation launch about 20 small kernels per
layer, which cost as much device time as the attention itself at batch 64.
Here each is one Triton kernel on CUDA (:mod:`kvq.models.fused_triton`).  The plain-torch functions define the
results (the HF transformers conventions: normalize in float32, round to the
model dtype, then scale; rotate-half RoPE in float32; ``silu(gate)`` rounded
before the product) and run everywhere else (CPU, the Triton interpreter).
"""

from __future__ import annotations

import os

import torch


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"


# -- torch definitions -----------------------------------------------------------------------------
def add_rms_norm_torch(x, residual, weight, eps):
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * y, x


def rope_torch(q, k, positions, inv_freq):
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]

    def rot(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rot(q), rot(k)


def silu_mul_torch(gate_up):
    g, u = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


# -- entry points ---------------------------------------------------------------------------------
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """-> (rms_norm(x + residual) * weight, x + residual); ``residual`` None: no add (returns x)."""
    if use_triton(x):
        from kvq.models import fused_triton

        return fused_triton.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_torch(x, residual, weight, eps)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """Rotate-half RoPE of q [T, Hq, D] and k [T, Hkv, D] (in place on CUDA) -> (q, k)."""
    if use_triton(q):
        from kvq.models import fused_triton

        return fused_triton.apply_rope(q, k, positions, inv_freq)
    return rope_torch(q, k, positions, inv_freq)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    if use_triton(gate_up):
        from kvq.models import fused_triton

        return fused_triton.silu_mul(gate_up)
    return silu_mul_torch(gate_up)
