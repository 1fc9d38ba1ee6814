"""Lloyd-Max codebooks for rotated K/V coordinates, and the seeded random-sign Hadamard rotation.

A vector ``x`` of ``D`` channels rotated by ``R = H_D diag(s) / sqrt(D)`` (``H_D`` the Walsh-
Hadamard matrix, ``s`` random signs from a seed) keeps its norm, and each coordinate of
``sqrt(D) R x / |x|`` follows, for a random rotation, the marginal of a uniform point on the
sphere of radius ``sqrt(D)``: density ``(1 - u^2 / D)^((D - 3) / 2)`` on ``|u| < sqrt(D)``, close
to a standard normal for D >= 64 (TurboQuant's observation: the outlier channels of K and V
are spread over all coordinates, whatever the model).  A scalar quantizer of ``2^b`` levels
fitted to that density once (Lloyd-Max: each level the centroid of its cell, each threshold the
midpoint of two levels) is then near-optimal for every vector, with one norm per vector.

Everything here is host-side float64 math computed once per (bits, D) and cached; the kernels
and the torch reference read the same tables (``levels``, ``thresholds``) and the same signs.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

#: grid points on [0, sqrt(D)] for the density integrals (the codebooks converge to ~1e-9 with it)
_GRID = 200_001


def _density(D: int) -> tuple[np.ndarray, np.ndarray]:
    """(u, w): grid on [0, sqrt(D)) and the normalized density of one coordinate there (symmetric)."""
    u = np.linspace(0.0, math.sqrt(D), _GRID, endpoint=False)
    logp = (D - 3) / 2 * np.log1p(-u * u / D)
    w = np.exp(logp - logp.max())
    return u, w / w.sum()


@lru_cache(maxsize=None)
def lloyd_max(bits: int, D: int, iters: int = 500) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(levels, thresholds) of the MSE-optimal symmetric quantizer of ``2^bits`` levels for one
    rotated coordinate at head dim ``D`` (module docstring): levels ascending, thresholds the
    ``2^bits - 1`` midpoints between them."""
    if bits not in (1, 2, 3, 4):
        raise ValueError(f"codebooks have 1 to 4 bits, got {bits}")
    u, w = _density(D)
    half = 2 ** (bits - 1)
    # start from the Gaussian's quantiles, then Lloyd iterations on the positive half (symmetric)
    lv = np.array([math.sqrt(2) * _erfinv((2 * i + 1) / (2 * half) * 0.98) for i in range(half)])
    wu = w * u
    cw, cwu = np.concatenate([[0.0], np.cumsum(w)]), np.concatenate([[0.0], np.cumsum(wu)])
    for _ in range(iters):
        th = (lv[:-1] + lv[1:]) / 2
        idx = np.searchsorted(u, np.concatenate([[0.0], th, [u[-1] + 1]]))
        mass = cw[idx[1:]] - cw[idx[:-1]]
        new = (cwu[idx[1:]] - cwu[idx[:-1]]) / np.maximum(mass, 1e-300)
        if np.max(np.abs(new - lv)) < 1e-13:
            lv = new
            break
        lv = new
    levels = np.concatenate([-lv[::-1], lv])
    return tuple(float(x) for x in levels), tuple(float(x) for x in (levels[:-1] + levels[1:]) / 2)


def mse(levels, D: int) -> float:
    """Mean squared error of quantizing one rotated coordinate with ``levels`` (nearest level)."""
    u, w = _density(D)
    lv = np.asarray(levels, dtype=np.float64)
    err = np.min((u[:, None] - lv[None, :]) ** 2, axis=1) + np.min((u[:, None] + lv[None, :]) ** 2, axis=1)
    return float(np.sum(w * err) / 2)  # the density is symmetric: u and -u weigh the same


def _erfinv(y: float) -> float:
    """Inverse error function by Newton's method (a starting codebook only)."""
    x = 0.0
    for _ in range(60):
        x -= (math.erf(x) - y) / (2 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


@lru_cache(maxsize=None)
def _table(bits: int, D: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    lv, th = lloyd_max(bits, D)
    return (torch.tensor(lv, dtype=torch.float32, device=device), torch.tensor(th, dtype=torch.float32, device=device))


def tables(bits: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels [2^bits], thresholds [2^bits - 1]) float32 on ``device``."""
    return _table(bits, D, str(torch.device(device)))


# -- rotation ----------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _signs(seed: int, D: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed))
    return (torch.randint(0, 2, (D,), generator=g) * 2 - 1).to(torch.float32).to(device)


def signs(seed: int, D: int, device) -> torch.Tensor:
    """[D] float32 random signs of the rotation with ``seed`` (the same in every process)."""
    return _signs(seed, D, str(torch.device(device)))


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (a power of two), float32."""
    D = x.shape[-1]
    if D & (D - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head dim, got {D}")
    y = x.float().reshape(-1, D)
    h = 1
    while h < D:
        y = y.view(-1, D // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2)
        h *= 2
    return (y.reshape(x.shape) * (1.0 / math.sqrt(D)))


def rotate(x: torch.Tensor, seed: int) -> torch.Tensor:
    """``H diag(s) x`` over the last dim (float32)."""
    return hadamard(x.float() * signs(seed, x.shape[-1], x.device))


def unrotate(y: torch.Tensor, seed: int) -> torch.Tensor:
    """The inverse of :func:`rotate`: ``diag(s) H y`` (H is symmetric and orthonormal)."""
    return hadamard(y) * signs(seed, y.shape[-1], y.device)
