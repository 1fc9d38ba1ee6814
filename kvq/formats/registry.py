"""Names and aliases -> frozen :class:`~kvq.formats.spec.TensorFormat`.

The only place that reads a format name.  Aliases follow the names users
already type in vLLM (``fp8``, ``fp8_e4m3``, ``int8_per_token_head``...) and
llama.cpp (``f16``, ``bf16``, ``f32``) where they mean the same thing; an unknown
name is a ``ValueError`` listing every valid one.  Nothing falls back.

Scale dtypes, and why:

* ``int8`` / ``i8``: fp16, one per token and head.  Seed 002's engine stores
  exactly this, so its published block sizes are reproduced byte for byte.
* ``int8_per_token_head``, ``fp8_per_token_head``: float32, as vLLM's formats of
  these names do.  fp32 also keeps heads with a tiny absmax exact: an fp16
  scale ``absmax / 127`` is subnormal below absmax ~ 7.8e-3 and loses bits.
* ``fp8_per_block``: float32, one per head per block; 4 bytes against
  ``block_size * head_dim`` data bytes, so precision is free.
* ``int4_kivi`` / ``int2_kivi``: fp16 scale and zero point, as KIVI stores them.
* ``int4_per_token`` / ``int2_per_token``: KIVI's V layout for K too (per token over
  groups of channels, fp16 scale and zero): the per-token K that KIVI's per-channel
  K is compared with, at the same bits and sidecar bytes and the same windows.
* ``fp8_e4m3`` / ``fp8_e5m2``: static scale per layer (scalar or per KV head,
  float32, default 1.0 i.e. a direct cast); no bytes per block.
* Rotated codebooks (kvq.formats.codebook; TurboQuant's scheme, vLLM's preset names with the
  same bits): fp16 norm per token and head; K of the ``*_kc`` formats also centred per channel
  over groups of 32 tokens (fp16 means, KIVI's lesson: K's channel offsets go before the
  rotation spreads them).  vLLM's presets quantize V uniformly; kvq uses the codebook for V too
  (at equal bits it measured better on the default model, ../shared/MEASURED.md).  The Triton
  kernels serve them (the CUDA decode does not yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvq.formats.spec import FP8_MAX, KVFormat, Role, TensorFormat

#: Defaults of KIVI (arXiv 2402.02750): group 32, residual window 128 tokens.
KIVI_GROUP_SIZE = 32
KIVI_RESIDUAL_TOKENS = 128
#: Sink tokens kept in high precision by default for the low-bit formats; on the
#: default model 4 sinks do as well as 32 (../shared/MEASURED.md).
LOW_BIT_SINK_TOKENS = 4
#: The rotation of the rotated codebook formats (part of each format: a peer with the same
#: format name rotates the same way).
ROTATION_SEED = 0x6B7671

MODEL_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class FormatEntry:
    """A registered format: its canonical name, aliases and how to build it."""

    name: str
    aliases: tuple[str, ...]
    summary: str
    build: Callable[[Role, str, int], TensorFormat]  # (role, model_dtype, group_size)
    default_sink_tokens: int = 0
    default_residual_tokens: int = 0


def _dense(dtype: str | None) -> Callable[[Role, str, int], TensorFormat]:
    def build(role: Role, model_dtype: str, group: int) -> TensorFormat:
        storage = dtype or model_dtype
        return TensorFormat(storage, role, "dense", storage, bits=8 * {"float32": 4}.get(storage, 2))

    return build


def _fp8_static(name: str, storage: str, reference_only: bool = False):
    def build(role: Role, model_dtype: str, group: int) -> TensorFormat:
        return TensorFormat(
            name, role, "fp8", storage, 8, scale="static", qmax=FP8_MAX[storage], reference_only=reference_only
        )

    return build


def _dynamic(name: str, family: str, storage: str, scale: str, scale_dtype: str, qmax: float):
    def build(role: Role, model_dtype: str, group: int) -> TensorFormat:
        return TensorFormat(name, role, family, storage, 8, scale=scale, scale_dtype=scale_dtype, qmax=qmax)

    return build


def _kivi(name: str, bits: int, k_per_token: bool = False):
    def build(role: Role, model_dtype: str, group: int) -> TensorFormat:
        # KIVI: K per channel over a group of tokens; V per token over a group of channels.
        # k_per_token: K stored like V (the per-token baseline KIVI's per-channel K is compared with).
        scale = "channel_group" if role == "k" and not k_per_token else "token_group"
        return TensorFormat(
            name, role, "kivi", "uint8", bits, scale=scale, scale_dtype="float16",
            zero_point=True, group_size=group, qmax=float(2**bits - 1),
        )

    return build


def _rot(name: str, k_bits: int, v_bits: int, k_centred: bool = False):
    """Rotated codebook K and V of ``k_bits``/``v_bits`` (``k_bits`` 8: K in FP8 E4M3, direct cast)."""
    def build(role: Role, model_dtype: str, group: int) -> TensorFormat:
        bits = k_bits if role == "k" else v_bits
        if bits == 8:
            return _fp8_static(name, "float8_e4m3fn")(role, model_dtype, group)
        centred = role == "k" and k_centred
        return TensorFormat(name, role, "rot", "uint8", bits, scale="centred_norm" if centred else "token_norm",
                            scale_dtype="float16", group_size=group if centred else None,
                            rotation_seed=ROTATION_SEED)

    return build


_ENTRIES: tuple[FormatEntry, ...] = (
    FormatEntry("auto", (), "the model's dtype, no quantization", _dense(None)),
    FormatEntry("bfloat16", ("bf16",), "bfloat16, no quantization", _dense("bfloat16")),
    FormatEntry("float16", ("fp16", "f16", "half"), "float16, no quantization", _dense("float16")),
    FormatEntry("float32", ("fp32", "f32"), "float32, no quantization", _dense("float32")),
    FormatEntry(
        "fp8_e4m3", ("fp8", "fp8_e4m3fn", "e4m3"),
        "FP8 E4M3 (OCP), direct cast or static per-tensor/per-head scale", _fp8_static("fp8_e4m3", "float8_e4m3fn"),
    ),
    FormatEntry(
        "fp8_e5m2", ("e5m2",), "FP8 E5M2, direct cast or static per-tensor/per-head scale",
        _fp8_static("fp8_e5m2", "float8_e5m2"),
    ),
    FormatEntry(
        "fp8_e4m3fnuz", ("fnuz", "fp8_fnuz"), "FP8 E4M3 FNUZ (AMD numerics, max 240), reference path only",
        _fp8_static("fp8_e4m3fnuz", "float8_e4m3fnuz", reference_only=True),
    ),
    FormatEntry(
        "fp8_per_token_head", (), "FP8 E4M3, dynamic float32 scale per token and head",
        _dynamic("fp8_per_token_head", "fp8", "float8_e4m3fn", "token_head", "float32", FP8_MAX["float8_e4m3fn"]),
    ),
    FormatEntry(
        "fp8_per_block", ("fp8_block",), "FP8 E4M3, float32 scale per head per cache block, resident with the block",
        _dynamic("fp8_per_block", "fp8", "float8_e4m3fn", "block_head", "float32", FP8_MAX["float8_e4m3fn"]),
    ),
    FormatEntry(
        "int8", ("i8",), "INT8 symmetric absmax, float16 scale per token and head (seed 002)",
        _dynamic("int8", "int", "int8", "token_head", "float16", 127.0),
    ),
    FormatEntry(
        "int8_per_token_head", (), "INT8 symmetric absmax, float32 scale per token and head (vLLM's name)",
        _dynamic("int8_per_token_head", "int", "int8", "token_head", "float32", 127.0),
    ),
    FormatEntry(
        "int4_kivi", ("kivi4", "kivi_int4"), "KIVI 4-bit: K per channel, V per token, scale+zero (fp16)",
        _kivi("int4_kivi", 4), LOW_BIT_SINK_TOKENS, KIVI_RESIDUAL_TOKENS,
    ),
    FormatEntry(
        "int2_kivi", ("kivi2", "kivi_int2"), "KIVI 2-bit: K per channel, V per token, scale+zero (fp16)",
        _kivi("int2_kivi", 2), LOW_BIT_SINK_TOKENS, KIVI_RESIDUAL_TOKENS,
    ),
    FormatEntry(
        "int4_per_token", ("int4_token",), "4-bit K and V both per token over groups of channels, scale+zero (fp16)",
        _kivi("int4_per_token", 4, k_per_token=True), LOW_BIT_SINK_TOKENS, KIVI_RESIDUAL_TOKENS,
    ),
    FormatEntry(
        "int2_per_token", ("int2_token",), "2-bit K and V both per token over groups of channels, scale+zero (fp16)",
        _kivi("int2_per_token", 2, k_per_token=True), LOW_BIT_SINK_TOKENS, KIVI_RESIDUAL_TOKENS,
    ),
    FormatEntry(
        "rot4_kc", (), "rotated codebook 4-bit: K centred per channel over 32 tokens, norms (fp16)",
        _rot("rot4_kc", 4, 4, k_centred=True), LOW_BIT_SINK_TOKENS, KIVI_RESIDUAL_TOKENS,
    ),
    FormatEntry(
        "rot3_kc", (), "rotated codebook 3-bit: K centred per channel over 32 tokens, norms (fp16)",
        _rot("rot3_kc", 3, 3, k_centred=True), LOW_BIT_SINK_TOKENS, KIVI_RESIDUAL_TOKENS,
    ),
    FormatEntry(
        "turboquant_k8v4", (), "K FP8 E4M3, V rotated 4-bit codebook with norm (vLLM's preset name)",
        _rot("turboquant_k8v4", 8, 4), LOW_BIT_SINK_TOKENS, KIVI_RESIDUAL_TOKENS,
    ),
    FormatEntry(
        "turboquant_4bit_nc", (), "K and V rotated 4-bit codebook, norm corrected (vLLM's preset name)",
        _rot("turboquant_4bit_nc", 4, 4), LOW_BIT_SINK_TOKENS, KIVI_RESIDUAL_TOKENS,
    ),
    FormatEntry(
        "turboquant_k3v4_nc", (), "K rotated 3-bit, V rotated 4-bit codebook, norm corrected (vLLM's preset name)",
        _rot("turboquant_k3v4_nc", 3, 4), LOW_BIT_SINK_TOKENS, KIVI_RESIDUAL_TOKENS,
    ),
    FormatEntry(
        "turboquant_3bit_nc", (), "K and V rotated 3-bit codebook, norm corrected (vLLM's preset name)",
        _rot("turboquant_3bit_nc", 3, 3), LOW_BIT_SINK_TOKENS, KIVI_RESIDUAL_TOKENS,
    ),
)

_BY_NAME: dict[str, FormatEntry] = {}
for _e in _ENTRIES:
    for _n in (_e.name, *_e.aliases):
        assert _n not in _BY_NAME, f"duplicate format name {_n}"
        _BY_NAME[_n] = _e


def entries() -> tuple[FormatEntry, ...]:
    """Every registered format, in display order."""
    return _ENTRIES


def valid_names() -> list[str]:
    """Every accepted name, canonical names and aliases."""
    return sorted(_BY_NAME)


def lookup(name: str) -> FormatEntry:
    """The entry for a name or alias (case-insensitive); ValueError listing valid names."""
    if not isinstance(name, str):
        raise ValueError(f"KV cache format must be a string, got {type(name).__name__}")
    entry = _BY_NAME.get(name.strip().lower())
    if entry is None:
        raise ValueError(
            f"unknown KV cache format {name!r}; valid formats: {', '.join(e.name for e in _ENTRIES)} "
            f"(aliases: {', '.join(n for n in valid_names() if _BY_NAME[n].name != n)})"
        )
    return entry


def _check_model_dtype(model_dtype: str) -> str:
    if model_dtype not in MODEL_DTYPES:
        raise ValueError(f"unknown model dtype {model_dtype!r}; valid: {', '.join(MODEL_DTYPES)}")
    return model_dtype


def resolve_format(
    name: str, role: Role, *, model_dtype: str = "bfloat16", group_size: int | None = None
) -> TensorFormat:
    """Resolve one name for K (``role="k"``) or V (``role="v"``)."""
    if role not in ("k", "v"):
        raise ValueError(f"role must be 'k' or 'v', got {role!r}")
    entry = lookup(name)
    group = KIVI_GROUP_SIZE if group_size is None else int(group_size)
    if group < 1 or group & (group - 1):
        raise ValueError(f"group size must be a positive power of two, got {group_size}")
    return entry.build(role, _check_model_dtype(model_dtype), group)


def resolve_kv(
    kv_cache_dtype: str = "auto",
    k: str | None = None,
    v: str | None = None,
    *,
    model_dtype: str = "bfloat16",
    group_size: int | None = None,
) -> KVFormat:
    """Resolve ``--kv-cache-dtype`` with optional ``--kv-cache-dtype-k/-v`` overrides."""
    k_name = k or kv_cache_dtype
    v_name = v or kv_cache_dtype
    requested = kv_cache_dtype if k is None and v is None else f"k={k_name},v={v_name}"
    return KVFormat(
        resolve_format(k_name, "k", model_dtype=model_dtype, group_size=group_size),
        resolve_format(v_name, "v", model_dtype=model_dtype, group_size=group_size),
        requested=requested,
    )


def default_window(fmt: KVFormat) -> tuple[int, int]:
    """(sink_tokens, residual_tokens) a format asks for by default."""
    ek, ev = lookup(fmt.k.name), lookup(fmt.v.name)
    return (
        max(ek.default_sink_tokens, ev.default_sink_tokens),
        max(ek.default_residual_tokens, ev.default_residual_tokens),
    )
