"""FP8 numerics: the start-up check and byte-level storage views.

Two facts this module enforces (seeds 001 and 002):

* OCP E4M3 (``float8_e4m3fn``, max 448) and AMD's FNUZ E4M3 (max 240, no
  negative zero, NaN = 0x80) are different encodings of the same name.  Bytes
  written under one and read under the other are silently wrong, so at start-up
  kvq checks that the running torch encodes each FP8 dtype it is about to use
  the way the spec says, and raises otherwise.
* Some torch builds lack CPU kernels for ``index_select`` / ``index_copy_`` on
  float8 tensors.  Moving FP8 bytes goes through ``uint8`` views, which copy the
  bit patterns unchanged (both are one byte per element).
"""

from __future__ import annotations

import torch

from kvq.formats.spec import FP8_MAX

#: (value, expected byte) pairs that identify an encoding unambiguously.
_KNOWN_BYTES = {
    "float8_e4m3fn": ((448.0, 0x7E), (1.0, 0x38), (-2.0, 0xC0), (0.015625, 0x08)),
    "float8_e5m2": ((57344.0, 0x7B), (1.0, 0x3C), (-2.0, 0xC0), (0.015625, 0x24)),
    "float8_e4m3fnuz": ((240.0, 0x7F), (1.0, 0x40), (-2.0, 0xC8), (0.015625, 0x10)),
}


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype for a storage dtype name of the spec."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"this torch ({torch.__version__}) has no dtype {name!r}")
    return dt


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)


def check_fp8_numerics(storage: str, device: torch.device | str = "cpu") -> None:
    """Raise RuntimeError unless ``storage`` encodes as the spec expects on ``device``.

    Checks the dtype's largest finite value (448 vs 240 tells OCP from FNUZ) and
    the exact bytes of a few values cast on the device that will hold the cache.
    """
    if storage not in FP8_MAX:
        raise ValueError(f"{storage!r} is not an FP8 storage dtype; known: {sorted(FP8_MAX)}")
    dt = torch_dtype(storage)
    got_max = float(torch.finfo(dt).max)
    if got_max != FP8_MAX[storage]:
        raise RuntimeError(
            f"FP8 numerics mismatch: torch reports max {got_max} for {storage}, the KV format spec "
            f"expects {FP8_MAX[storage]} (OCP e4m3fn is 448, FNUZ is 240); refusing to store KV in it"
        )
    values, expected = zip(*_KNOWN_BYTES[storage])
    got = torch.tensor(values, dtype=torch.float32, device=device).to(dt).view(torch.uint8).cpu().tolist()
    if got != list(expected):
        raise RuntimeError(
            f"FP8 numerics mismatch on {device}: {storage} encodes {list(values)} as "
            f"{[hex(b) for b in got]}, expected {[hex(b) for b in expected]}"
        )


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an FP8 tensor (other dtypes returned unchanged)."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def index_select(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``t.index_select(dim, index)`` that also works for FP8 on CPU."""
    return as_bytes(t).index_select(dim, index).view(t.dtype)


def index_copy_(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.index_copy_(dim, index, src)`` that also works for FP8 on CPU."""
    assert dst.dtype == src.dtype, (dst.dtype, src.dtype)
    as_bytes(dst).index_copy_(dim, index, as_bytes(src))
    return dst


def saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round-to-nearest-even cast to FP8, out-of-range values clamped to +-max.

    torch's own cast saturates e4m3fn but turns overflow into inf (e5m2) or NaN
    (fnuz); clamping first gives every FP8 format the same, finite behaviour.
    NaN inputs stay NaN.
    """
    fmax = torch.finfo(dtype).max
    return x.float().clamp(-fmax, fmax).to(dtype)
