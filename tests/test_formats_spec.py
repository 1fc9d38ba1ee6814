"""The resolver and the byte accounting of the KV format spec."""

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.formats.registry import default_window, entries, lookup, resolve_format, resolve_kv, valid_names
from kvq.formats.spec import KVFormat, element_bytes

CANONICAL = [e.name for e in entries()]
SHAPES = st.tuples(st.integers(1, 16), st.sampled_from([32, 64, 128, 256]), st.sampled_from([32, 64, 128]))


def test_every_name_resolves_for_k_and_v():
    for name in valid_names():
        for role in ("k", "v"):
            fmt = resolve_format(name, role)
            assert fmt.role == role
            # the spec's name is canonical: it resolves to itself ("auto" resolves to the model dtype)
            assert lookup(fmt.name).name == fmt.name
            assert lookup(name).name in (fmt.name, "auto")


def test_aliases_mean_the_same_format():
    assert resolve_format("fp8", "k") == resolve_format("fp8_e4m3", "k") == resolve_format("FP8_E4M3FN", "k")
    assert resolve_format("i8", "v") == resolve_format("int8", "v")
    assert resolve_format("bf16", "k") == resolve_format("auto", "k", model_dtype="bfloat16")
    assert resolve_format("auto", "k", model_dtype="float16").storage == "float16"


def test_semantics_of_named_formats():
    fp8 = resolve_format("fp8", "k")
    assert (fp8.storage, fp8.scale, fp8.qmax) == ("float8_e4m3fn", "static", 448.0)
    assert resolve_format("fp8_e5m2", "k").storage == "float8_e5m2"
    fnuz = resolve_format("fp8_e4m3fnuz", "k")
    assert fnuz.qmax == 240.0 and fnuz.reference_only
    assert resolve_format("int8", "k").scale_dtype == "float16"  # seed 002
    assert resolve_format("int8_per_token_head", "k").scale_dtype == "float32"  # vLLM
    blk = resolve_format("fp8_per_block", "v")
    assert blk.scale == "block_head" and not blk.write_direct
    k4, v4 = resolve_format("int4_kivi", "k"), resolve_format("int4_kivi", "v")
    assert (k4.scale, v4.scale) == ("channel_group", "token_group")
    assert k4.group_size == v4.group_size == 32 and k4.zero_point and k4.bits == 4
    assert not k4.write_direct and v4.write_direct
    assert resolve_format("int2_kivi", "k", group_size=64).group_size == 64


@given(st.text(min_size=1, max_size=12))
@settings(max_examples=200, deadline=None)
def test_unknown_names_raise_listing_valid_ones(name):
    if name.strip().lower() in valid_names():
        return
    with pytest.raises(ValueError) as exc:
        resolve_format(name, "k")
    for canonical in CANONICAL:
        assert canonical in str(exc.value)


def test_bad_role_group_and_model_dtype_raise():
    with pytest.raises(ValueError, match="role"):
        resolve_format("fp8", "q")
    with pytest.raises(ValueError, match="power of two"):
        resolve_format("int4_kivi", "k", group_size=24)
    with pytest.raises(ValueError, match="model dtype"):
        resolve_format("auto", "k", model_dtype="int8")


def test_kv_pair_overrides():
    f = resolve_kv("fp8", v="int8")
    assert (f.k.name, f.v.name) == ("fp8_e4m3", "int8")
    assert f.name == "k=fp8_e4m3,v=int8"
    assert resolve_kv("int4_kivi").name == "int4_kivi"
    with pytest.raises(ValueError, match="valid formats"):
        resolve_kv("bf16", k="nope")


@given(st.sampled_from(CANONICAL), st.sampled_from(["k", "v"]), SHAPES)
@settings(max_examples=300, deadline=None)
def test_byte_identities(name, role, shape):
    H, D, bs = shape
    fmt = resolve_format(name, role)
    planes = fmt.planes(H, D, bs)
    assert planes[0].name == "data"
    # data bytes are exactly bits/8 per value, whatever the packing
    assert planes[0].nbytes * 8 == H * D * bs * fmt.bits
    assert fmt.block_bytes(H, D, bs) == sum(math.prod(p.shape) * element_bytes(p.dtype) for p in planes)
    # sidecars: per-token and per-group scales grow with the block, per-block ones do not
    b1, b2 = fmt.block_bytes(H, D, bs), fmt.block_bytes(H, D, 2 * bs)
    if fmt.scale == "block_head":
        assert b2 - b1 == planes[0].nbytes
    else:
        assert b2 == 2 * b1
    assert fmt.bits_per_value(H, D, bs) >= fmt.bits
    kv = KVFormat(resolve_format(name, "k"), resolve_format(name, "v"))
    assert kv.block_bytes(H, D, bs) == kv.k.block_bytes(H, D, bs) + kv.v.block_bytes(H, D, bs)


def test_sidecar_shapes_and_dtypes():
    H, D, bs = 8, 128, 32
    p = {pl.name: pl for pl in resolve_format("int4_kivi", "k").planes(H, D, bs)}
    assert p["data"].shape == (H, bs, 64) and p["data"].dtype == "uint8"
    assert p["scale"].shape == p["zero"].shape == (H, 1, D) and p["scale"].dtype == "float16"
    p = {pl.name: pl for pl in resolve_format("int2_kivi", "v").planes(H, D, bs)}
    assert p["data"].shape == (H, bs, 32) and p["scale"].shape == (H, bs, 4)
    p = {pl.name: pl for pl in resolve_format("fp8_per_block", "k").planes(H, D, bs)}
    assert p["scale"].shape == (H,) and p["scale"].dtype == "float32"
    p = {pl.name: pl for pl in resolve_format("int8", "k").planes(H, D, bs)}
    assert p["scale"].shape == (H, bs) and p["scale"].dtype == "float16"
    assert [pl.name for pl in resolve_format("fp8", "k").planes(H, D, bs)] == ["data"]


def test_shapes_a_format_cannot_lay_out_raise():
    with pytest.raises(ValueError, match="multiple of 32"):
        resolve_format("int4_kivi", "k").planes(8, 128, 16)
    with pytest.raises(ValueError, match="head_dim"):
        resolve_format("int4_kivi", "v").planes(8, 48, 32)
    with pytest.raises(ValueError, match=">= 1"):
        resolve_format("fp8", "k").planes(0, 128, 16)


def test_min_block_size():
    assert resolve_kv("fp8").min_block_size() == 1
    assert resolve_kv("int4_kivi").min_block_size() == 32
    assert resolve_kv("int2_kivi", group_size=64).min_block_size() == 64
    assert resolve_kv("bf16", v="int4_kivi").min_block_size() == 1  # V per token only


@pytest.mark.parametrize("bits", [4, 2])
def test_per_token_k_formats_store_k_like_kivi_v(bits):
    """int{4,2}_per_token: K takes KIVI's V layout (per token over channel groups); V is KIVI's V;
    same bits, sidecar bytes and default windows as KIVI, so only K's quantization axis differs."""
    name, kivi = f"int{bits}_per_token", f"int{bits}_kivi"
    fmt, ref = resolve_kv(name), resolve_kv(kivi)
    assert fmt.k.scale == fmt.v.scale == "token_group" and ref.k.scale == "channel_group"
    assert fmt.k.bits == fmt.v.bits == bits and fmt.k.zero_point and fmt.k.scale_dtype == "float16"
    assert dataclasses.replace(ref.v, name=name) == fmt.v  # V identical to KIVI's V
    H, D, bs = 3, 64, 32
    assert fmt.block_bytes(H, D, bs) == ref.block_bytes(H, D, bs)
    assert fmt.write_direct and fmt.min_block_size() == 1  # per token: no sealing needed
    assert default_window(fmt) == default_window(ref) == (4, 128)
    assert resolve_kv(f"int{bits}_token").name == name
