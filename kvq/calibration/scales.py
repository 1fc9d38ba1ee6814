"""Static KV scales from observed K/V: one scale per KV head (``kvq calibrate`` writes them in the
file format of :mod:`kvq.cache.scales_file`)."""

from __future__ import annotations

import math

import torch

from kvq.calibration import OBSERVERS


def scales_from_stats(samples: torch.Tensor, qmax: float, observer: str = "absmax", dtype=None) -> torch.Tensor:
    """One scale per KV head from ``samples`` ``[T, H, D]`` (float): ``absmax / qmax``, or with
    ``"mse"`` the clip ``c * absmax`` (``c`` in 0.50..1.00) whose FP8 round trip (``dtype``) has the
    least squared error per head."""
    if observer not in OBSERVERS:
        raise ValueError(f"unknown observer {observer!r}; valid: {', '.join(OBSERVERS)}")
    x = samples.float().transpose(0, 1).reshape(samples.shape[1], -1)  # [H, T*D]
    amax = x.abs().amax(dim=1).clamp_min(1e-6)
    if observer == "absmax":
        return amax / qmax
    best, best_err = amax / qmax, torch.full_like(amax, math.inf)
    for c in torch.linspace(0.5, 1.0, 26):
        s = (c * amax / qmax)[:, None]
        rt = (x / s).clamp(-qmax, qmax).to(dtype).float() * s
        err = (rt - x).pow(2).mean(dim=1)
        better = err < best_err
        best = torch.where(better, s[:, 0], best)
        best_err = torch.where(better, err, best_err)
    return best
