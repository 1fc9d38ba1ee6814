"""Quantization error of every KV format on real K/V from the default model.

Reads the fixture written by ``scripts/capture_kv_fixture.py`` (post-RoPE K, V
and queries of SmolLM2-135M-Instruct on real prose), roundtrips K and V through
the reference quantizer of every registered format, and writes

    docs/formats_error.md             a Markdown table with how it was made
    docs/results/formats_error.json   the same numbers, per layer

    python scripts/format_error_table.py [--fixture PATH] [--md PATH] [--json PATH]

``tests/test_fixture_error.py`` imports :func:`measure_all` from here, so the
numbers in the table are the ones its bounds were set from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvq.formats.reference import roundtrip  # noqa: E402
from kvq.formats.registry import entries, resolve_format  # noqa: E402
from kvq.formats.spec import TensorFormat  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "kv_smollm2.pt"
MD_OUT = ROOT / "docs" / "formats_error.md"
JSON_OUT = ROOT / "docs" / "results" / "formats_error.json"
BLOCK_SIZE = 32
MODEL_DTYPE = "bfloat16"
#: Metrics of one (K format, V format) pair, each measured per layer.
METRICS = ("k", "v", "out_k", "out_v", "out")


def load_fixture(path: Path | str = FIXTURE) -> dict:
    return torch.load(path, weights_only=True)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||x - ref|| / ||ref||, in float64."""
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def causal_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v in float32, query p reading keys 0..positions[p].

    q [P, Hq, D], k/v [T, H, D] -> [P, Hq, D]; query head h reads KV head h // (Hq // H).
    """
    P, Hq, D = q.shape
    T, H, _ = k.shape
    qg = q.float().reshape(P, H, Hq // H, D)  # query heads grouped by the KV head they read
    scores = torch.einsum("phgd,thd->phgt", qg, k.float()) / D**0.5
    future = torch.arange(T).view(1, 1, 1, T) > positions.view(P, 1, 1, 1)
    probs = scores.masked_fill_(future, float("-inf")).softmax(-1)
    return torch.einsum("phgt,thd->phgd", probs, v.float()).reshape(P, Hq, D)


def quantize_roundtrip(fmt: TensorFormat, x: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """[T, H, D] -> the same values after quantize + dequantize as cache blocks of ``fmt``.

    T must be a multiple of ``block_size``; tokens are cut into blocks
    [N, H, block_size, D], the layout the pools hold.
    """
    T, H, D = x.shape
    assert T % block_size == 0, (T, block_size)
    blocks = x.float().reshape(T // block_size, block_size, H, D).permute(0, 2, 1, 3)
    out = roundtrip(fmt, blocks.contiguous())  # [N, H, bs, D]
    return out.permute(0, 2, 1, 3).reshape(T, H, D)


def measure(fixture: dict, k_fmt: TensorFormat, v_fmt: TensorFormat, block_size: int = BLOCK_SIZE) -> dict:
    """Per-layer errors of K/V stored as ``k_fmt``/``v_fmt``: {metric: [one value per layer]}.

    k, v: relative Frobenius error of K and V.  out_k, out_v, out: relative
    error of the attention output of the captured queries with only K, only V,
    or both quantized, against the fixture's exact (bf16) K and V.
    """
    T = fixture["k"].shape[1] // block_size * block_size
    pos = fixture["q_positions"]
    assert int(pos.max()) < T, "query positions must lie in the truncated sequence"
    res: dict[str, list[float]] = {m: [] for m in METRICS}
    for li in range(fixture["k"].shape[0]):
        k, v, q = fixture["k"][li, :T].float(), fixture["v"][li, :T].float(), fixture["q"][li].float()
        kq, vq = quantize_roundtrip(k_fmt, k, block_size), quantize_roundtrip(v_fmt, v, block_size)
        exact = causal_gqa_attention(q, k, v, pos)
        res["k"].append(rel_err(kq, k))
        res["v"].append(rel_err(vq, v))
        res["out_k"].append(rel_err(causal_gqa_attention(q, kq, v, pos), exact))
        res["out_v"].append(rel_err(causal_gqa_attention(q, k, vq, pos), exact))
        res["out"].append(rel_err(causal_gqa_attention(q, kq, vq, pos), exact))
    return res


def format_pairs() -> list[tuple[str, TensorFormat, TensorFormat]]:
    """(row name, K format, V format): every registered format, then KIVI with K per token.

    The per-token K rows store K with the KIVI *V* format (per token over groups
    of channels, same bits and same sidecar bytes), the baseline KIVI's
    per-channel K is meant to beat.
    """
    def fmt(name: str, role: str) -> TensorFormat:
        return resolve_format(name, role, model_dtype=MODEL_DTYPE)

    pairs = [(e.name, fmt(e.name, "k"), fmt(e.name, "v")) for e in entries()]
    for name in ("int4_kivi", "int2_kivi"):
        per_token = fmt(name, "v")
        pairs.append((f"{name}_k_per_token", per_token, per_token))
    return pairs


def measure_all(fixture: dict, block_size: int = BLOCK_SIZE) -> dict[str, dict]:
    """Row name -> {metric: {"per_layer", "mean", "max"}, "bits_k", "bits_v", "k_format", "v_format", "quantized"}."""
    _, _, H, D = fixture["k"].shape
    rows = {}
    for name, kf, vf in format_pairs():
        per_layer = measure(fixture, kf, vf, block_size)
        row = {
            "k_format": f"{kf.name} ({kf.describe_scale()})",
            "v_format": f"{vf.name} ({vf.describe_scale()})",
            "bits_k": kf.bits_per_value(H, D, block_size),
            "bits_v": vf.bits_per_value(H, D, block_size),
            "quantized": kf.is_quantized or vf.is_quantized,
        }
        for m, vals in per_layer.items():
            row[m] = {"per_layer": vals, "mean": sum(vals) / len(vals), "max": max(vals)}
        rows[name] = row
    return rows


def _num(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}" if x >= 1e-3 else f"{x:.2e}"


def _cell(stat: dict) -> str:
    return f"{_num(stat['mean'])} / {_num(stat['max'])}"


def markdown(fixture: dict, rows: dict[str, dict], block_size: int) -> str:
    meta = fixture["meta"]
    layers = ", ".join(str(x) for x in fixture["layers"].tolist())
    T = fixture["k"].shape[1] // block_size * block_size
    P = fixture["q"].shape[1]
    lines = [
        "# KV format error on real K/V",
        "",
        f"Fixture `tests/fixtures/kv_smollm2.pt`: {meta['model']} ({meta['model_file']}, run in "
        f"{meta['model_dtype']} on CPU) over the first {meta['num_tokens']} tokens of {meta['text_source']}. "
        f"It holds post-RoPE K and V (all {meta['num_kv_heads']} KV heads, head dim {meta['head_dim']}, "
        f"stored as bfloat16) of layers {layers}, and the post-RoPE queries of all "
        f"{meta['num_query_heads']} query heads at {P} positions spread over the sequence "
        f"({', '.join(str(p) for p in fixture['q_positions'].tolist())}). Written by "
        "`python scripts/capture_kv_fixture.py`, which asserts that attention recomputed from the captured "
        "Q/K/V reproduces the model's own attention output.",
        "",
        f"K and V ({T} tokens) are cut into cache blocks of {block_size} tokens, [N, H, {block_size}, D], "
        "and roundtripped through `kvq.formats.reference.roundtrip` of each format (model dtype "
        f"{MODEL_DTYPE}; FP8 static formats use scale 1.0, i.e. a direct cast; no sink tokens and no "
        "high-precision residual window, so the low-bit rows are the raw quantizer, not the defaults a "
        "cache would run with). Errors are relative Frobenius norms against the fixture's bf16 values:",
        "",
        "- **K err**, **V err**: ||x_q - x|| / ||x|| over all tokens, heads and channels of one layer.",
        "- **out err**: the same for the attention output softmax(QK^T/sqrt(D))V of the captured queries "
        f"(causal, GQA: query head h reads KV head h // {meta['num_query_heads'] // meta['num_kv_heads']}), "
        "quantized vs exact K/V, in float32; "
        "*K only* / *V only* quantize one of the two.",
        "- Each cell is *mean / max over the layers*; per-layer values are in `docs/results/formats_error.json`.",
        f"- **bits/value** counts data plus scale and zero-point planes, from "
        f"`TensorFormat.bits_per_value(H={fixture['k'].shape[2]}, D={fixture['k'].shape[3]}, bs={block_size})`.",
        "- Rows `*_k_per_token` store K with the KIVI *V* format (per token over groups of channels, same bits "
        "and sidecar bytes): the baseline that KIVI's per-channel K quantization is compared with.",
        "",
        "Regenerate with `python scripts/format_error_table.py` (the fixture with "
        "`python scripts/capture_kv_fixture.py`); `tests/test_fixture_error.py` holds per-format bounds "
        "set from these numbers.",
        "",
        "| format | bits/value K | bits/value V | K err | V err | out err, K only | out err, V only | out err, K+V |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['bits_k']:.2f} | {r['bits_v']:.2f} | {_cell(r['k'])} | {_cell(r['v'])} | "
            f"{_cell(r['out_k'])} | {_cell(r['out_v'])} | {_cell(r['out'])} |"
        )
    lines += [
        "",
        "Attention output error with K and V quantized, per layer:",
        "",
        "| format | " + " | ".join(f"layer {x}" for x in fixture["layers"].tolist()) + " |",
        "| --- |" + " --- |" * len(fixture["layers"]),
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | " + " | ".join(_num(x) for x in r["out"]["per_layer"]) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", type=Path, default=FIXTURE)
    ap.add_argument("--md", type=Path, default=MD_OUT)
    ap.add_argument("--json", type=Path, default=JSON_OUT)
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    args = ap.parse_args()

    torch.set_num_threads(1)  # small tensors: extra threads only add overhead (and contend on a busy box)
    fixture = load_fixture(args.fixture)
    rows = measure_all(fixture, args.block_size)
    args.md.parent.mkdir(parents=True, exist_ok=True)
    args.md.write_text(markdown(fixture, rows, args.block_size))
    record = {
        "fixture": {
            "path": "tests/fixtures/kv_smollm2.pt",
            **fixture["meta"],
            "q_positions": fixture["q_positions"].tolist(),
        },
        "block_size": args.block_size,
        "model_dtype": MODEL_DTYPE,
        "metrics": {
            "k": "relative Frobenius error of K",
            "v": "relative Frobenius error of V",
            "out_k": "relative error of attention output, only K quantized",
            "out_v": "relative error of attention output, only V quantized",
            "out": "relative error of attention output, K and V quantized",
        },
        "formats": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.md} and {args.json}")
    print(f"{'format':28s} {'bits K':>6s} {'bits V':>6s} {'K max':>9s} {'V max':>9s} {'out max':>9s}")
    for name, r in rows.items():
        print(
            f"{name:28s} {r['bits_k']:6.2f} {r['bits_v']:6.2f} {r['k']['max']:9.3g} {r['v']['max']:9.3g} "
            f"{r['out']['max']:9.3g}"
        )


if __name__ == "__main__":
    main()
