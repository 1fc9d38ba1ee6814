"""Quantized vs unquantized on real K/V: per-format error bounds, written down.

The fixture (``tests/fixtures/kv_smollm2.pt``, from ``scripts/capture_kv_fixture.py``)
holds post-RoPE K/V and queries of SmolLM2-135M-Instruct, layers 0, 1, 14, 29,
896 tokens of real prose.  Every registered format roundtrips K and V in blocks
of 32 tokens through the reference quantizer; the errors (definitions and
measured values: ``docs/formats_error.md``, made by
``scripts/format_error_table.py``, whose functions are used here) must stay
under bounds set at about 1.5x the measured worst layer, and above a third of
those bounds for quantized formats, so a quantizer that silently stopped
quantizing fails too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvq.formats.registry import entries

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("format_error_table", ROOT / "scripts" / "format_error_table.py")
fet = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fet)

#: Upper bounds on the worst layer's (K rel err, V rel err, attention output rel err
#: with K and V quantized), ~1.5x the measured value rounded up (measured in comments).
#: Dense formats are exact on bf16 data (fp16 only loses bits of values below 2**-14).
BOUNDS: dict[str, tuple[float, float, float]] = {
    "auto": (0.0, 0.0, 0.0),  # measured 0 0 0
    "bfloat16": (0.0, 0.0, 0.0),  # 0 0 0
    "float16": (4e-11, 1.2e-8, 3.2e-9),  # 2.62e-11 7.70e-09 2.07e-09
    "float32": (0.0, 0.0, 0.0),  # 0 0 0
    "fp8_e4m3": (0.041, 0.042, 0.099),  # 0.0272 0.0275 0.0658
    "fp8_e5m2": (0.081, 0.082, 0.20),  # 0.0540 0.0541 0.127
    "fp8_e4m3fnuz": (0.041, 0.041, 0.099),  # 0.0272 0.0270 0.0658
    "fp8_per_token_head": (0.036, 0.038, 0.090),  # 0.0237 0.0248 0.0598
    "fp8_per_block": (0.040, 0.040, 0.099),  # 0.0264 0.0265 0.0654
    "int8": (0.018, 0.019, 0.029),  # 0.0116 0.0124 0.0191
    "int8_per_token_head": (0.018, 0.019, 0.029),  # 0.0116 0.0124 0.0191
    "int4_kivi": (0.073, 0.16, 0.16),  # 0.0481 0.104 0.103
    "int2_kivi": (0.37, 0.84, 0.79),  # 0.242 0.560 0.526
    # K and V both per token (registered formats; the same layouts as the *_kivi_k_per_token rows below).
    "int4_per_token": (0.16, 0.16, 0.23),  # 0.103 0.104 0.152
    "int2_per_token": (0.77, 0.84, 1.7),  # 0.511 0.560 1.12
    # rotated codebooks (kvq.formats.codebook; K centred per channel in the *_kc formats)
    "rot4_kc": (0.091, 0.15, 0.24),  # 0.0606 0.0942 0.160
    "rot3_kc": (0.18, 0.28, 0.43),  # 0.117 0.182 0.282
    "turboquant_k8v4": (0.041, 0.15, 0.13),  # 0.0272 0.0942 0.0856
    "turboquant_4bit_nc": (0.14, 0.15, 0.26),  # 0.0921 0.0942 0.171
    "turboquant_k3v4_nc": (0.27, 0.15, 0.48),  # 0.177 0.0942 0.314
    "turboquant_3bit_nc": (0.27, 0.28, 0.50),  # 0.177 0.182 0.332
    # K stored with the KIVI V format (per token): the baseline of the KIVI finding.
    "int4_kivi_k_per_token": (0.16, 0.16, 0.23),  # 0.103 0.104 0.152
    "int2_kivi_k_per_token": (0.77, 0.84, 1.7),  # 0.511 0.560 1.12
}
#: A quantized format whose error falls under BOUND * LOWER_FRACTION no longer quantizes what it says.
LOWER_FRACTION = 1 / 3
METRIC_NAMES = ("K rel err", "V rel err", "attention output rel err")


@pytest.fixture(scope="module")
def fixture() -> dict:
    return fet.load_fixture()


@pytest.fixture(scope="module")
def rows(fixture) -> dict[str, dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead on a shared 2-core box
    try:
        return fet.measure_all(fixture, block_size=32)
    finally:
        torch.set_num_threads(threads)


def _show(row: dict, metric: str) -> str:
    return f"{metric}: max {row[metric]['max']:.4g}, per layer {[round(x, 5) for x in row[metric]['per_layer']]}"


def test_fixture_is_what_it_claims(fixture):
    meta = fixture["meta"]
    L, T, H, D = fixture["k"].shape
    assert fixture["k"].dtype == fixture["v"].dtype == fixture["q"].dtype == torch.bfloat16
    assert fixture["v"].shape == (L, T, H, D) and (H, D) == (meta["num_kv_heads"], meta["head_dim"])
    assert fixture["q"].shape == (L, len(fixture["q_positions"]), meta["num_query_heads"], D)
    assert fixture["layers"].tolist() == meta["layers"] and 0 in meta["layers"]
    assert meta["rope_applied"] and T == meta["num_tokens"] and T % 32 == 0
    assert int(fixture["q_positions"][-1]) == T - 1
    # The captured Q/K/V (bf16) reproduce the model's own attention output (also bf16).
    for li in range(L):
        out = fet.causal_gqa_attention(fixture["q"][li], fixture["k"][li], fixture["v"][li], fixture["q_positions"])
        err = fet.rel_err(out, fixture["o"][li].float())
        assert err < 1.5e-2, f"layer {meta['layers'][li]}: attention from the fixture vs the model's: {err:.3g}"


def test_every_registered_format_has_bounds():
    missing = [e.name for e in entries() if e.name not in BOUNDS]
    assert not missing, f"formats without measured error bounds (run scripts/format_error_table.py): {missing}"


@pytest.mark.parametrize("name", list(BOUNDS))
def test_error_within_bounds(rows, name):
    row = rows[name]
    for metric, bound, label in zip(("k", "v", "out"), BOUNDS[name], METRIC_NAMES):
        got = row[metric]["max"]
        assert got <= bound, f"{name}: {label} above its bound {bound:.3g}; {_show(row, metric)}"
        if row["quantized"]:
            assert got >= bound * LOWER_FRACTION, (
                f"{name}: {label} suspiciously low (< {bound * LOWER_FRACTION:.3g}): is it still quantizing? "
                f"{_show(row, metric)}"
            )


def _check_order(rows, names: list[str], metrics=("k", "v", "out")):
    for metric in metrics:
        vals = [rows[n][metric]["max"] for n in names]
        assert all(a < b for a, b in zip(vals, vals[1:])), (
            f"expected {' < '.join(names)} on {metric} (worst layer); got "
            + ", ".join(f"{n}={v:.4g}" for n, v in zip(names, vals))
        )


def test_fp8_order(rows):
    _check_order(rows, ["bfloat16", "fp8_e4m3", "fp8_e5m2"])


def test_int8_per_token_head_beats_fp8(rows):
    _check_order(rows, ["int8", "fp8_e4m3"])
    _check_order(rows, ["int8_per_token_head", "fp8_per_token_head"])


def test_bits_order(rows):
    _check_order(rows, ["int8", "int4_kivi", "int2_kivi"])


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_per_channel_k_beats_per_token_k(fixture, rows, bits):
    """KIVI's finding: K quantized per channel hurts attention less than K per token (V exact)."""
    chan, tok = rows[f"int{bits}_kivi"]["out_k"], rows[f"int{bits}_kivi_k_per_token"]["out_k"]
    for layer, a, b in zip(fixture["layers"].tolist(), chan["per_layer"], tok["per_layer"]):
        assert a < b, (
            f"int{bits}, layer {layer}: attention output error with K per channel {a:.4g} is not below "
            f"K per token {b:.4g} (same bits and sidecar bytes)"
        )
