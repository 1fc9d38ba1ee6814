"""Launcher of the CUDA paged decode kernel for quantized caches (decode8.cu), compiled with NVRTC.

Serves K and V stored in 8 bits (FP8 e4m3 / e5m2 with static, per-token or
per-block scales; INT8 with per-token scales), as KIVI (int4_kivi /
int2_kivi: K per channel over 32 tokens, V per token over 32 channels) or as the
per-token sub-byte formats (int4_per_token / int2_per_token: K and V per token
over 32 channels) or as a rotated 4- or 3-bit codebook with a norm per token, K optionally
centred per channel over 32 tokens (turboquant_4bit_nc, turboquant_3bit_nc, rot4_kc, rot3_kc:
levels from a table, scores against the rotated query, the output rotated back in the
kernel; 3-bit at head_dim 128 and 256), head dims 64/128/256, pages a multiple of 16 tokens (KIVI: 32),
up to 8 query heads per KV head, bf16 or f16 queries, and tables that mix in
high-precision blocks (sinks, recent window) in the same pass.  Compilation
goes through CuPy's NVRTC (CuPy is on the GPU machine;
:func:`unavailable_reason` says whether it runs here); the launch passes raw device
pointers on torch's current stream, so it is captured by CUDA graphs like any
torch kernel.  With more than one split the partials are merged by the Triton
reduce kernel of :mod:`kvq.attention.triton.decode`; with one split the kernel
writes the output itself.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from kvq.cache.pool import LayerKV
from kvq.formats import codebook
from kvq.formats.spec import TensorFormat

_SOURCE = Path(__file__).with_name("decode8.cu")
_KIND = {"float8_e4m3fn": 0, "float8_e5m2": 1, "int8": 2}
HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 8
_LOG2E = 1.4426950408889634

#: Launch shape (warps per CTA, pipeline stages per warp, CTAs per SM the registers must allow).
NWARPS, NSTAGES, MIN_BLOCKS = 4, 3, 3
#: KIVI: one 32-token group per ring item and step (H200, probe_decode 16x32K: int4_kivi 222.9 -> 197.7 us,
#: int2_kivi 198.5 -> 163.0 us; with hp blocks 239.7 -> 205.0 and 217.8 -> 175.7 us); False: two 16-token steps.
KIVI_STEP32 = True


def min_blocks_for(head_dim: int) -> int:
    """CTAs per SM the register allocation is bounded for: head_dim 256 needs more
    registers per thread (its accumulators double) than 3 CTAs per SM leave."""
    return MIN_BLOCKS if head_dim <= 128 else 2


def unavailable_reason() -> str | None:
    """None if the kernel can run here, else why not."""
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy (NVRTC) is not installed"
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        return f"needs compute capability 9.0 or newer (got {major}.x)"
    return None


def scale_mode(t: TensorFormat) -> int:
    """The kernel's code for a tensor format's scales (see decode8.cu); 0 for KIVI and rotated (unused)."""
    if t.scale in ("static", "none") or t.family in ("kivi", "rot"):
        return 0
    if t.scale == "token_head":
        return 1 if t.scale_dtype == "float32" else 2
    if t.scale == "block_head":
        return 3
    raise ValueError(f"{t.name}: no 8-bit CUDA decode for scale {t.scale}")


KIVI_GROUP = 32


def kivi_bits(t: TensorFormat) -> int:
    """4 or 2 for the sub-byte formats this kernel reads (per token over 32 channels; K also KIVI's per
    channel over 32 tokens), else 0."""
    axes = ("channel_group", "token_group") if t.role == "k" else ("token_group",)
    if t.family == "kivi" and t.scale in axes and t.bits in (2, 4) and t.group_size == KIVI_GROUP:
        return t.bits
    return 0


#: Rotated codebooks the kernel reads: these widths, one norm per token (K: also centred over 32 tokens)
ROT_BITS = (4, 3)


def rot_bits(t: TensorFormat) -> int:
    """The code width of a rotated codebook tensor this kernel reads, else 0."""
    scales = ("token_norm", "centred_norm") if t.role == "k" else ("token_norm",)
    ok = t.family == "rot" and t.bits in ROT_BITS and t.scale in scales
    return t.bits if ok and (t.scale != "centred_norm" or t.group_size == KIVI_GROUP) else 0


def fp8_k_rot_v(k: TensorFormat, v: TensorFormat) -> bool:
    """FP8 K (a static scale, not rotated) beside a rotated codebook V (turboquant_k8v4: K8 in decode8.cu)."""
    return (k.family != "rot" and k.storage in ("float8_e4m3fn", "float8_e5m2") and k.scale in ("static", "none")
            and rot_bits(v) > 0)


def centred(k: TensorFormat) -> bool:
    """Whether a rotated K is centred per channel over 32 tokens (KC in decode8.cu)."""
    return rot_bits(k) > 0 and k.scale == "centred_norm"


def k_per_token(k: TensorFormat) -> bool:
    """Whether a sub-byte K is stored per token (int4/int2_per_token: K_TOKEN in decode8.cu)."""
    return kivi_bits(k) > 0 and k.scale == "token_group"


def format_reason(t: TensorFormat) -> str | None:
    """None if this kernel reads tensors of format ``t``, else why not."""
    if t.family == "rot":
        if not rot_bits(t):
            return (f"{t.name}: {t.role.upper()} a rotated codebook of {t.bits} bits scaled per {t.scale} "
                    f"(the kernel reads {' or '.join(map(str, ROT_BITS))} bits with a norm per token, "
                    f"K also centred over {KIVI_GROUP} tokens)")
        return None
    if t.family == "kivi":
        if t.group_size != KIVI_GROUP:
            return f"{t.name}: group size {t.group_size} (the kernel reads groups of {KIVI_GROUP})"
        if not kivi_bits(t):
            return (f"{t.name}: {t.role.upper()} scaled per {t.scale} at {t.bits} bits "
                    "(the kernel reads 4 or 2 bits: K per channel or per token, V per token)")
        return None
    if t.storage not in _KIND or t.bits != 8:
        return f"{t.name} is neither stored in 8 bits nor KIVI"
    if t.scale not in ("static", "none", "token_head", "block_head"):
        return f"{t.name}: scale {t.scale} is not read by the 8-bit kernel"
    if t.scale == "token_head" and t.scale_dtype not in ("float32", "float16"):
        return f"{t.name}: scale dtype {t.scale_dtype}"
    return None


def layer_reason(k: TensorFormat, v: TensorFormat, head_dim: int, block_size: int, group: int) -> str | None:
    """None if this kernel serves decode over a layer of these formats and shape, else why not."""
    for t in (k, v):
        why = format_reason(t)
        if why:
            return why
    rot = rot_bits(k), rot_bits(v)
    if bool(rot[0]) != bool(rot[1]) and not fp8_k_rot_v(k, v):
        return f"K is {k.name} and V {v.name}: both rotated codebooks (or FP8 K beside a rotated V), or neither"
    if all(rot) and k.rotation_seed != v.rotation_seed:
        return f"K and V rotated with different seeds ({k.rotation_seed}, {v.rotation_seed})"
    if 3 in rot and head_dim < 128:
        return f"3-bit rotated codes at head_dim {head_dim} (rows of {head_dim * 3 // 8} bytes; needs 128 or 256)"
    bits = kivi_bits(k), kivi_bits(v)
    if bits[0] != bits[1]:
        return f"K is {k.name} and V {v.name}: both 8-bit, or both KIVI of one width"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} not in {HEAD_DIMS}"
    page = 32 if (bits[0] and not k_per_token(k)) or centred(k) else 16
    if block_size % page:
        return f"page {block_size} is not a multiple of {page}"
    if group > MAX_GROUP:
        return f"{group} query heads per KV head (at most {MAX_GROUP})"
    return None


def routes(layer: LayerKV, group: int, q_dtype: torch.dtype) -> bool:
    """Whether the ``cuda`` backend decodes ``layer`` with this kernel."""
    return unsupported_reason(layer, group, q_dtype) is None


def plane_reason(name: str, t: torch.Tensor, align: int = 16) -> str | None:
    """None if the kernel reads plane ``t`` (``[blocks, ...]``: each block's elements contiguous, blocks
    any multiple of ``align`` bytes apart: a contiguous pool, or a tier's view of a tiered cache's arena,
    kvq.cache.arena), else why not.  The kernel copies planes in 16-byte pieces, except per-block scales
    (one float a block and head, 4-byte copies: ``align`` 4)."""
    want = 1  # each block's elements contiguous: strides of the inner dims as a contiguous tensor's
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != want:
            return f"its {name} plane's blocks are not contiguous (strides {tuple(t.stride())})"
        want *= size
    if t.data_ptr() % align or (t.stride(0) * t.element_size()) % align:
        return f"its {name} plane is not {align}-byte aligned (block stride {t.stride(0) * t.element_size()} bytes)"
    return None


def block_stride(t: torch.Tensor) -> int:
    """Bytes from one block of plane ``t`` to the next."""
    return t.stride(0) * t.element_size()


def unsupported_reason(layer: LayerKV, group: int, q_dtype: torch.dtype) -> str | None:
    """None if this kernel serves decode over ``layer``, else why not."""
    why = layer_reason(layer.fmt.k, layer.fmt.v, layer.head_dim, layer.block_size, group)
    for role, planes, fmt in (("K", layer.k, layer.fmt.k), ("V", layer.v, layer.fmt.v)):
        for name, t in planes.items():
            align = 4 if name == "scale" and why is None and scale_mode(fmt) == 3 else 16
            why = why or plane_reason(f"{role} {name}", t, align)
    if why is None and q_dtype not in (torch.bfloat16, torch.float16):
        why = f"queries must be bfloat16 or float16, not {q_dtype}"
    return why


def stage_bytes(head_dim: int, has_hp: bool, kivi: int = 0, kivi_step32: bool = False, k_token: bool = False,
                v_bits: int | None = None, k8: bool = False) -> int:
    """Shared memory of one pipeline stage (mirrors STAGE in decode8.cu; ``kivi``: K's code width, ``v_bits``
    V's where it differs (rotated codebooks); ``kivi_step32``: a KIVI item holds a whole 32-token group;
    ``k_token``: K per token, K_TOKEN)."""
    if kivi:
        dp = head_dim * kivi // 8  # bytes a row (3-bit codes: both planes)
        if k8:  # FP8 K beside a rotated V: 8-bit K rows
            rsk = head_dim + 16
        elif k_token:
            rsk = 16 if dp == 16 else dp + 16
        else:
            rsk = dp if dp <= 64 else dp + 16
        rsv = (head_dim * (v_bits or kivi) // 8 + 47) // 64 * 64 + 16
        qr = 32 if kivi_step32 else 16
        q_stage = qr * rsk + qr * rsv + 4 * head_dim + 4 * (head_dim // 32) * qr
    else:
        q_stage = 32 * (head_dim + 16) + 128
    hp_stage = 16 * (2 * head_dim + 16)  # an hp chunk's K rows, or its V rows (two stages in a row)
    return (max(q_stage, hp_stage) if has_hp else q_stage) + 16


#: Shared memory one CTA may use on sm_90 (227 KiB).
MAX_SMEM = 227 * 1024


@functools.lru_cache(maxsize=None)
def _kernel(d: int, page: int, group: int, kivi: int, kk: int, vk: int, kscale: int, vscale: int, has_hp: bool,
            bf16: bool, nwarps: int, nstages: int, min_blocks: int, step32: bool = False, k_token: bool = False,
            rot: bool = False, kc: bool = False, v_bits: int = 0, k8: bool = False, defines: tuple = ()):
    import cupy

    opts = ("-std=c++17", f"-DHEAD_DIM={d}", f"-DPAGE={page}", f"-DGROUP={group}", f"-DKIVI_BITS={kivi}",
            f"-DK_KIND={kk}", f"-DV_KIND={vk}", f"-DK_SCALE={kscale}", f"-DV_SCALE={vscale}", f"-DHAS_HP={int(has_hp)}",
            f"-DMODEL_BF16={int(bf16)}", f"-DNWARPS={nwarps}", f"-DNSTAGES={nstages}", f"-DMIN_BLOCKS={min_blocks}",
            f"-DKIVI_STEP32={int(step32)}", f"-DK_TOKEN={int(k_token)}", f"-DROT={int(rot)}", f"-DKC={int(kc)}",
            f"-DV_BITS={v_bits or kivi}", f"-DK8={int(k8)}", *(f"-D{d}" for d in defines))
    # (rotated: K's and V's levels after the rings, f16)
    smem = (nwarps * nstages * stage_bytes(d, has_hp, kivi, step32, k_token, v_bits or None, k8)
            + (2 * ((1 << kivi) + (1 << (v_bits or kivi))) if rot else 0))
    if smem > MAX_SMEM:
        raise ValueError(f"{nwarps} warps x {nstages} stages need {smem} bytes of shared memory (at most {MAX_SMEM})")
    kern = cupy.RawModule(code=_SOURCE.read_text(), options=opts, backend="nvrtc").get_function("kvq_decode8")
    kern.max_dynamic_shared_size_bytes = smem
    return kern, smem


@functools.lru_cache(maxsize=16)
def _rot_tables(k_bits: int, v_bits: int, head_dim: int, seed: int, device: str):
    """K's and V's codebook levels (f16 [2^bits]), the rotation's signs (float32 [head_dim]) and its
    matrix (float32 [head_dim, head_dim], rows rotated: ``x @ it`` is ``codebook.rotate(x)``)."""
    lev = [codebook.tables(b, head_dim, device)[0].to(torch.float16).contiguous() for b in (k_bits, v_bits)]
    mat = codebook.rotate(torch.eye(head_dim, device=device), seed).contiguous()
    return lev[0], lev[1], codebook.signs(seed, head_dim, device).contiguous(), mat


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_splits(batch_heads: int, max_len: int, num_sms: int, ctas_per_sm: int = MIN_BLOCKS,
                  waves: int = 4, nwarps: int = NWARPS) -> int:
    """Splits per sequence: about ``waves`` waves of CTAs over the GPU, each split at
    least two chunks per warp (32 * nwarps tokens); 1 when the batch alone fills it."""
    want = math.ceil(waves * ctas_per_sm * num_sms / max(batch_heads, 1))
    most = max(1, math.ceil(max_len / (32 * nwarps)))
    return max(1, min(want, most))


class _TorchStream:
    """A torch stream handle in CuPy's external-stream protocol."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return 0, self.ptr


@functools.lru_cache(maxsize=64)
def _cupy_stream(ptr: int):
    import cupy

    try:
        return cupy.cuda.Stream.from_external(_TorchStream(ptr))
    except (AttributeError, TypeError, ValueError):  # CuPy before the stream protocol
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return cupy.cuda.ExternalStream(ptr)


def _ptr(t: torch.Tensor):
    import numpy as np

    return np.uint64(t.data_ptr())


def splits_for(q: torch.Tensor, layer: LayerKV, max_seq_len: int, nwarps: int = NWARPS,
               min_blocks: int | None = None) -> int:
    """The split count :func:`paged_decode` chooses for a batch of ``q``'s size over ``layer``."""
    B, H = q.shape[0], layer.num_kv_heads
    return choose_splits(B * H, max_seq_len, _num_sms(q.device.index or 0), min_blocks or min_blocks_for(q.shape[2]),
                         nwarps=nwarps)


def launch_outputs(q: torch.Tensor, num_splits: int, partials: tuple[torch.Tensor, torch.Tensor, int] | None,
                   merge_into: torch.Tensor | None):
    """Where one launch of :func:`paged_decode` writes: -> (po, plse, out, base, total, mode), ``mode`` the
    kernel's MODE: 0 one split written to ``out``; 1 partials written at splits ``base, ...`` of ``total``
    a row (the caller's ``partials``, or this launch's own buffers when it splits); 2 ``merge_into``: one
    split merged with the ``total`` partials earlier launches left in ``partials`` (``base == total``).  A
    non-merging launch with ``partials`` writes them even when it is the only one before the merge
    (total 1: two tiers read by CUDA, one split each)."""
    B, Hq, D = q.shape
    out = torch.empty_like(q) if partials is None else q  # (with partials: unused by the kernel)
    base, total, merge = 0, num_splits, merge_into is not None
    if partials is not None:
        po, plse, base = partials
        total = po.shape[2]
        assert po.shape == (B, Hq, total, D) and plse.shape == (B, Hq, total)
        assert po.is_contiguous() and plse.is_contiguous()
        if merge:
            assert num_splits == 1 and base == total >= 1 and merge_into.shape == q.shape, (num_splits, base, total)
            assert merge_into.dtype == q.dtype and merge_into.stride(2) == 1
            out = merge_into
        else:
            assert base + num_splits <= total, (base, num_splits, total)
    elif merge:
        raise ValueError("merge_into merges other launches' partials: pass them")
    elif num_splits > 1:
        po = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
        plse = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        po = plse = out  # unused by the kernel
    mode = 2 if merge else 1 if partials is not None or num_splits > 1 else 0
    return po, plse, out, base, total, mode


def paged_decode(q: torch.Tensor, layer: LayerKV, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 sm_scale: float, max_seq_len: int | None = None, has_hp: bool | None = None,
                 num_splits: int | None = None, nwarps: int = NWARPS, nstages: int | None = None,
                 min_blocks: int | None = None, kivi_step32: bool | None = None,
                 partials: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                 merge_into: torch.Tensor | None = None,
                 defines: tuple[str, ...] = ()) -> torch.Tensor | None:
    """Same contract as :func:`kvq.attention.reference.paged_decode`.

    ``max_seq_len`` (host int, an upper bound of ``seq_lens``) sizes the split grid
    without a device sync; each sequence splits its own length over the splits, so
    one launch shape serves any lengths (CUDA graphs).  ``has_hp=False`` compiles
    out the high-precision path (no table holds an hp block).

    ``partials`` = (po [B, Hq, S, D] float32, plse [B, Hq, S] float32, base): write this launch's
    ``num_splits`` partial results (channels in natural order, log2-domain log-sum-exps) at splits
    ``base, ...`` of the S a row, for the caller to merge with other launches' (a tiered cache: one
    launch a tier, kvq.attention.cuda.kernels); returns None.  With ``merge_into`` ([B, Hq, D], one split):
    ``po`` / ``plse`` already hold every other launch's partials (all S of a row; ``base`` = S); this
    launch merges them with its own result by log-sum-exp and writes ``merge_into``, which it returns
    (a tiered decode's last launch: no reduce launch).

    ``defines``: ``NAME=VALUE`` compile-time switches of a kernel variant other than the default
    (``ROT_REG_LUT=0``: 3-bit rotated codes' levels from the shared table), for probes and tests."""
    import cupy
    import numpy as np

    from kvq.attention.triton.decode import _decode_reduce_kernel

    B, Hq, D = q.shape
    H = layer.num_kv_heads
    assert Hq % H == 0 and D == layer.head_dim, (Hq, H, D, layer.head_dim)
    group = Hq // H
    why = unsupported_reason(layer, group, q.dtype)
    if why is not None:
        raise ValueError(f"CUDA 8-bit decode cannot serve this: {why}")
    assert q.is_cuda and q.stride(2) == 1 and q.stride(1) % 8 == 0 and q.stride(0) % 8 == 0, q.stride()
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    assert block_tables.stride(1) == 1
    if has_hp is None:
        has_hp = layer.k_hp.shape[0] > 0
    min_blocks = min_blocks or min_blocks_for(D)
    nstages = nstages or NSTAGES
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    if num_splits is None:
        num_splits = splits_for(q, layer, max_seq_len, nwarps, min_blocks)
    fk, fv = layer.fmt.k, layer.fmt.v
    k8 = fp8_k_rot_v(fk, fv)
    rot = bool(rot_bits(fv))
    # (K8: K's code width is V's for the kernel's geometry; K's own rows are 8-bit)
    kivi, k_token = rot_bits(fk) or rot_bits(fv) or kivi_bits(fk), k_per_token(fk)
    step32 = bool(kivi and not k_token and not rot and (KIVI_STEP32 if kivi_step32 is None else kivi_step32))
    kern, smem = _kernel(D, layer.block_size, group, kivi, _KIND.get(fk.storage, 0), _KIND.get(fv.storage, 0),
                         scale_mode(fk), scale_mode(fv), bool(has_hp), q.dtype == torch.bfloat16, nwarps, nstages,
                         min_blocks, step32, k_token, rot, centred(fk), rot_bits(fv), k8, tuple(defines))
    ks = layer.k_scale if scale_mode(fk) == 0 and (not kivi or k8) else layer.k["scale"]  # (rotated: the norms)
    vs = layer.v_scale if scale_mode(fv) == 0 and not kivi else layer.v["scale"]
    kz = layer.k["zero"] if (kivi and not rot) or centred(fk) else ks  # (centred K: the means)
    vz = layer.v["zero"] if kivi and not rot else vs
    if rot:  # the rotated query (float32, one product), K's and V's levels (f16), V's signs for the rotation back
        # (K and V share one seed: layer_reason)
        klut, vlut, rsign, rmat = _rot_tables(fv.bits if k8 else fk.bits, fv.bits, D, fv.rotation_seed, str(q.device))
        qr = q if k8 else q.float() @ rmat
    else:
        qr = klut = vlut = rsign = q
    po, plse, out, base, total, mode = launch_outputs(q, num_splits, partials, merge_into)
    merge = mode == 2
    planes = (layer.k["data"], layer.v["data"], ks, vs, kz, vz)
    blocked = [np.int64(block_stride(t) if t.dim() > 1 else 0) for t in planes]  # (static scales: [H])
    stream = _cupy_stream(torch.cuda.current_stream(q.device).cuda_stream)
    with cupy.cuda.Device(q.device.index or 0), stream:
        kern((num_splits, H, B), (32 * nwarps,), (
            _ptr(q), np.int64(q.stride(0)), np.int64(q.stride(1)),
            _ptr(layer.k["data"]), _ptr(layer.v["data"]), _ptr(ks), _ptr(vs), _ptr(kz), _ptr(vz), *blocked,
            _ptr(layer.k_hp), _ptr(layer.v_hp),
            _ptr(block_tables), np.int64(block_tables.stride(0)), _ptr(seq_lens),
            _ptr(po), _ptr(plse), _ptr(out), np.int64(out.stride(0)), np.int64(out.stride(1)),
            np.float32(sm_scale * _LOG2E), np.int32(H), np.int32(base), np.int32(total), np.int32(mode),
            _ptr(qr), _ptr(klut), _ptr(vlut), _ptr(rsign),
        ), shared_mem=smem)
    if partials is not None:
        return out if merge else None
    if num_splits > 1:
        _decode_reduce_kernel[(B, Hq)](po, plse, out, out.stride(0), out.stride(1), num_splits, Hq,
                                       S_TILE=16, D=D, V_PER=1)
    return out
