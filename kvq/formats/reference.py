"""Reference quantize / dequantize in plain torch: the definition of correct.

Every kernel that writes or reads the cache is compared against these
functions.  They run on any device.  Inputs are blocks laid out as the pools
hold them (see :mod:`kvq.formats.spec`)::

    x:      [N, H, T, D]   N blocks (or any batch), H KV heads, T tokens, D head dim
    planes: {"data": [N, H, T, Dp], "scale": [N, *sidecar], "zero": [N, *sidecar]}

T is the block size for block-scoped formats; for formats that quantize each
token on its own any T works, and KIVI K needs T to be a multiple of its group.

Rounding rules (kernels must match them bit for bit on identical inputs):

* Divisions are IEEE float32 divisions (correctly rounded), never a multiply by
  a reciprocal.
* int8: ``scale = absmax / 127`` computed in float32 then stored in the scale
  dtype; codes ``round_half_even(x / stored_scale)`` clamped to [-127, 127].
* FP8 with a dynamic scale: ``scale = absmax / fp8_max`` (float32);
  codes = saturating round-to-nearest-even cast of ``x / scale``.
* FP8 static: ``x / static_scale`` cast the same way (scale 1.0 = direct cast).
* KIVI: ``scale = (max - min) / (2**bits - 1)`` and ``zero = min``, both stored
  in fp16; codes ``round_half_even((x - zero) / scale)`` clamped to
  [0, 2**bits - 1], computed with the *stored* fp16 scale and zero.
* A zero scale (all-equal or all-zero values) divides by 1 instead: codes 0,
  and dequantization returns exactly ``zero`` (KIVI) or 0.
* Rotated codebook (family ``rot``, kvq.formats.codebook): K of ``centred_norm`` first loses its
  per-channel group mean, stored in fp16 (the stored value is subtracted); the vector is rotated
  (float32), ``u = sqrt(D) * r / |r|``, each coordinate's code is the number of thresholds below
  it (the nearest level; a tie goes up), and ``norm = |r| / |levels[codes]|`` is stored in fp16
  (plane ``scale``; the mean is plane ``zero``); dequantization is ``unrotate(norm * levels[codes])
  (+ mean)``.  A zero vector stores norm 0.
"""

from __future__ import annotations

import math

import torch

from kvq.formats import codebook
from kvq.formats.fp8 import saturating_cast, torch_dtype
from kvq.formats.spec import TensorFormat

Planes = dict[str, torch.Tensor]


# -- planar sub-byte packing ---------------------------------------------------------
def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D] integer codes in [0, 2**bits) -> [..., D * bits / 8] uint8, planar (3 bits: a 2-bit
    plane, then a 1-bit plane; kvq.formats.spec)."""
    if bits == 3:
        c = codes.to(torch.uint8)
        return torch.cat([pack(c & 3, 2), pack(c >> 2, 1)], dim=-1)
    per = 8 // bits
    D = codes.shape[-1]
    assert D % per == 0, (D, per)
    parts = codes.to(torch.uint8).reshape(*codes.shape[:-1], per, D // per)
    out = torch.zeros(parts.shape[:-2] + parts.shape[-1:], dtype=torch.uint8, device=codes.device)
    for m in range(per):
        out |= parts[..., m, :] << (m * bits)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: [..., Dp] uint8 -> [..., Dp * 8 / bits] uint8 codes."""
    if bits == 3:
        lo = packed.shape[-1] * 2 // 3  # D / 4 bytes of low bits, then D / 8 of high bits
        return unpack(packed[..., :lo], 2) | (unpack(packed[..., lo:], 1) << 2)
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (m * bits)) & mask for m in range(per)]
    return torch.cat(parts, dim=-1)


# -- helpers ------------------------------------------------------------------------------
def _safe(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _div(x: torch.Tensor, c: float) -> torch.Tensor:
    """``x / c``, correctly rounded on every device.  (On CUDA, torch divides by a
    Python scalar as a multiply by its reciprocal, which is off by an ulp at times.)"""
    return x / torch.full_like(x, c)


def _static(static_scale: torch.Tensor | float | None, H: int, device) -> torch.Tensor:
    """Static scale as a [1, H, 1, 1] float32 tensor (scalar or per head)."""
    if static_scale is None:
        static_scale = 1.0
    s = torch.as_tensor(static_scale, dtype=torch.float32, device=device)
    if s.numel() == 1:
        s = s.reshape(1).expand(H)
    if s.shape != (H,):
        raise ValueError(f"static KV scale must be a scalar or have one value per KV head ({H}), got {tuple(s.shape)}")
    if not bool(torch.all(s > 0)):
        raise ValueError("static KV scales must be positive")
    return s.view(1, H, 1, 1)


def _int_codes(y: torch.Tensor, qmin: float, qmax: float) -> torch.Tensor:
    return torch.round(y).clamp_(qmin, qmax)


# -- quantize / dequantize -------------------------------------------------------------------
def quantize(fmt: TensorFormat, x: torch.Tensor, static_scale=None) -> Planes:
    """Quantize [N, H, T, D] values into the planes of ``fmt``."""
    assert x.dim() == 4, x.shape
    N, H, T, D = x.shape
    xf = x.float()
    store = torch_dtype(fmt.storage)
    if fmt.family == "dense":
        return {"data": x.to(store)}
    if fmt.scale == "static":
        return {"data": saturating_cast(xf / _static(static_scale, H, x.device), store)}
    if fmt.scale in ("token_head", "block_head"):
        dims = (-1,) if fmt.scale == "token_head" else (-2, -1)
        amax = xf.abs().amax(dim=dims, keepdim=True)
        scale = _div(amax, fmt.qmax).to(torch_dtype(fmt.scale_dtype))
        y = xf / _safe(scale.float())
        if fmt.family == "fp8":
            data = saturating_cast(y, store)
        else:
            data = _int_codes(y, -fmt.qmax, fmt.qmax).to(store)
        return {"data": data, "scale": scale.reshape(N, H, T) if fmt.scale == "token_head" else scale.reshape(N, H)}
    if fmt.family == "rot":
        return _rot_quantize(fmt, xf)
    if fmt.family == "kivi":
        G = fmt.group_size
        if fmt.scale == "channel_group":  # K: groups of G tokens, one scale per channel
            if T % G:
                raise ValueError(f"{fmt.name} K needs whole groups of {G} tokens, got {T}")
            g = xf.reshape(N, H, T // G, G, D)
            red = 3
        else:  # V: groups of G channels, one scale per token
            g = xf.reshape(N, H, T, D // G, G)
            red = 4
        mn, mx = g.amin(dim=red, keepdim=True), g.amax(dim=red, keepdim=True)
        sdt = torch_dtype(fmt.scale_dtype)
        scale, zero = _div(mx - mn, fmt.qmax).to(sdt), mn.to(sdt)
        codes = _int_codes((g - zero.float()) / _safe(scale.float()), 0, fmt.qmax).reshape(N, H, T, D)
        return {"data": pack(codes, fmt.bits), "scale": scale.squeeze(red), "zero": zero.squeeze(red)}
    raise AssertionError(f"no reference quantizer for {fmt}")


def dequantize(fmt: TensorFormat, planes: Planes, static_scale=None, dtype=torch.float32) -> torch.Tensor:
    """Planes of ``fmt`` -> [N, H, T, D] values in ``dtype``."""
    data = planes["data"]
    N, H, T = data.shape[:3]
    if fmt.family == "dense":
        return data.to(dtype)
    if fmt.scale == "static":
        return (data.float() * _static(static_scale, H, data.device)).to(dtype)
    if fmt.scale == "token_head":
        return (data.float() * planes["scale"].float().unsqueeze(-1)).to(dtype)
    if fmt.scale == "block_head":
        return (data.float() * planes["scale"].float().view(N, H, 1, 1)).to(dtype)
    if fmt.family == "rot":
        return _rot_dequantize(fmt, planes).to(dtype)
    if fmt.family == "kivi":
        G = fmt.group_size
        codes = unpack(data, fmt.bits).float()
        D = codes.shape[-1]
        scale, zero = planes["scale"].float(), planes["zero"].float()
        if fmt.scale == "channel_group":
            g = codes.reshape(N, H, T // G, G, D) * scale.unsqueeze(3) + zero.unsqueeze(3)
        else:
            g = codes.reshape(N, H, T, D // G, G) * scale.unsqueeze(4) + zero.unsqueeze(4)
        return g.reshape(N, H, T, D).to(dtype)
    raise AssertionError(f"no reference dequantizer for {fmt}")


def _rot_quantize(fmt: TensorFormat, xf: torch.Tensor) -> Planes:
    N, H, T, D = xf.shape
    sdt = torch_dtype(fmt.scale_dtype)
    out = {}
    if fmt.scale == "centred_norm":
        G = fmt.group_size
        if T % G:
            raise ValueError(f"{fmt.name} K needs whole groups of {G} tokens, got {T}")
        g = xf.reshape(N, H, T // G, G, D)
        mean = g.mean(dim=3).to(sdt)  # [N, H, T/G, D]
        xf = (g - mean.float().unsqueeze(3)).reshape(N, H, T, D)
        out["zero"] = mean
    levels, thresholds = codebook.tables(fmt.bits, D, xf.device)
    r = codebook.rotate(xf, fmt.rotation_seed)
    n = r.norm(dim=-1, keepdim=True)
    u = r / _safe(n) * math.sqrt(D)
    codes = torch.bucketize(u, thresholds, right=True)  # thresholds below u: the nearest level
    uh = levels[codes]
    norm = (n / _safe(uh.norm(dim=-1, keepdim=True))).squeeze(-1).to(sdt)
    return {"data": pack(codes, fmt.bits), "scale": norm, **out}


def _rot_dequantize(fmt: TensorFormat, planes: Planes) -> torch.Tensor:
    data = planes["data"]
    N, H, T = data.shape[:3]
    codes = unpack(data, fmt.bits).long()
    levels, _ = codebook.tables(fmt.bits, codes.shape[-1], data.device)
    x = codebook.unrotate(levels[codes] * planes["scale"].float().unsqueeze(-1), fmt.rotation_seed)
    if fmt.scale == "centred_norm":
        G, D = fmt.group_size, x.shape[-1]
        x = (x.reshape(N, H, T // G, G, D) + planes["zero"].float().unsqueeze(3)).reshape(N, H, T, D)
    return x


def roundtrip(fmt: TensorFormat, x: torch.Tensor, static_scale=None) -> torch.Tensor:
    """dequantize(quantize(x)) in float32."""
    return dequantize(fmt, quantize(fmt, x, static_scale), static_scale)


def quantize_tokens(fmt: TensorFormat, x: torch.Tensor, static_scale=None) -> Planes:
    """Quantize [T, H, D] new tokens, one token at a time (``write_direct`` formats).

    Returns planes shaped per token: data [T, H, Dp] and sidecars [T, H, ...],
    ready to be scattered into their (block, offset) slots.
    """
    if not fmt.write_direct:
        raise ValueError(f"{fmt.name} ({fmt.role}) is quantized per block/group; "
                         "write tokens in high precision and seal")
    T, H, D = x.shape
    planes = quantize(fmt, x.permute(1, 0, 2).reshape(1, H, T, D), static_scale)
    # [1, H, T, ...] -> [T, H, ...]
    return {k: v[0].transpose(0, 1).contiguous() for k, v in planes.items()}
