"""The README's headline table and plot, read from committed results files only.

    python scripts/headline.py            # prints the Markdown table, writes docs/results/headline.{json,png}

Every number comes from one of SOURCES (measured on one NVIDIA H200; the files
name their dates, commits and commands).  Nothing here measures anything.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RES = ROOT / "docs" / "results"
SOURCES = {
    "decode": "docs/results/bench_decode.json",
    "pressure": "docs/results/bench_engine_pressure_h200.json",
    "eval": "docs/results/eval_h200/results.json",
}
SHAPE = "4x131072"  # decode: 4 sequences of 128K tokens, Llama-3-8B heads (Hq 32, Hkv 8, D 128), page 16
NAMES = {"auto": "bfloat16", "int4_kivi:s4": "int4_kivi", "int2_kivi:s4": "int2_kivi"}  # KIVI: default windows
BIN = 8192  # quality and capacity on the default model at this context length
ROWS = [  # (format as evaluated, decode and engine format)
    ("auto", "bfloat16"),
    ("fp8_e4m3:r128:s4", "fp8_e4m3"),
    ("int8_per_token_head:r128:s4", "int8_per_token_head"),
    ("int4_kivi:s4", "int4_kivi"),
    ("int2_kivi:s4", "int2_kivi"),
]
LOADS = ((1024, 2048, 512), (7936, 256, 256))  # serving under memory pressure: input, output, concurrency


def load(key: str) -> dict:
    return json.loads((ROOT / SOURCES[key]).read_text())


def collect() -> dict:
    dec = {(r["impl"], r["format"]): r["us"] for r in load("decode")["decode"] if r["shape"] == SHAPE}
    bf16_us = dec[("kvq-triton", "bfloat16")]
    ev = load("eval")
    recs = {(r["kv_cache_dtype"]["requested"], r["context_length_bin"]): r for r in ev["records"]}
    eng = {(r["kv_cache_dtype"], r["input_len"], r["output_len"], r["concurrency"]): r
           for r in load("pressure")["runs"] if "error" not in r}
    rows = []
    for ev_name, dec_name in ROWS:
        r = recs[(ev_name, BIN)]
        q = r["quality_by_bin"][str(BIN)]
        cap = r["kv_cache_capacity"]
        base_cap = recs[("auto", BIN)]["kv_cache_capacity"]
        impl = "kvq-triton" if dec_name == "bfloat16" else "kvq-cuda"
        row = {
            "format": NAMES.get(ev_name, ev_name),
            "capacity_x": base_cap["bytes_per_sequence_at_bin"] / cap["bytes_per_sequence_at_bin"],
            "decode_us": dec[(impl, dec_name)],
            "decode_x_bf16": bf16_us / dec[(impl, dec_name)],
            "kl": q["kl_mean"],
            "dppl_pct": 100 * q["ppl_rel_change"],
            "status": r["status"],
        }
        for load_ in LOADS:
            r_, base_ = eng.get((dec_name, *load_)), eng[("bfloat16", *load_)]
            if r_ is not None:
                row["serving"] = row.get("serving", []) + [{
                    "load": "%d/%d c%d" % load_, "tok_per_s": r_["output_tok_per_s"],
                    "x_bf16": r_["output_tok_per_s"] / base_["output_tok_per_s"],
                    "ttft_p50_x_bf16": r_["ttft_p50_s"] / base_["ttft_p50_s"]}]
        rows.append(row)
    return {
        "sources": SOURCES,
        "machine": "one NVIDIA H200 (torch 2.11, Triton 3.6, CuPy 14.2)",
        "decode_shape": SHAPE,
        "flashinfer_tc_fp8_us": dec[("flashinfer-tc", "fp8_e4m3")],
        "flashinfer_tc_bf16_us": dec[("flashinfer-tc", "bfloat16")],
        "eval_bin": BIN,
        "eval_date": ev["meta"]["date"],
        "rows": rows,
    }


def markdown(h: dict) -> str:
    loads = ["%d/%d c%d" % x for x in LOADS]
    out = ["| KV format | capacity at 8K vs bf16 | decode, 4x128K (x bf16) | "
           + " | ".join(f"serving {x} tok/s (x bf16)" for x in loads) + " | quality at 8K: KL, Δppl |",
           "| --- | --- | --- | " + "--- | " * len(loads) + "--- |"]
    for r in h["rows"]:
        got = {s["load"]: s for s in r.get("serving", [])}
        e2e = [f"{got[x]['tok_per_s']:.0f} ({got[x]['x_bf16']:.2f}x)" if x in got else "–" for x in loads]
        bad = " (regressed)" if r["status"] == "quality_regressed" else ""
        out.append(f"| `{r['format']}` | {r['capacity_x']:.2f}x | {r['decode_us']:.0f} µs ({r['decode_x_bf16']:.2f}x) "
                   f"| {' | '.join(e2e)} | {r['kl']:.4f}, {r['dppl_pct']:+.2f}%{bad} |")
    out.append(f"| FlashInfer 0.7.0 (tensor cores) | – | bf16 {h['flashinfer_tc_bf16_us']:.0f} µs, fp8 "
               f"{h['flashinfer_tc_fp8_us']:.0f} µs | " + "– | " * len(loads) + "– |")
    return "\n".join(out)


def plot(h: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [r["format"].split(":")[0] for r in h["rows"]] + ["FlashInfer\nfp8 (TC)"]
    us = [r["decode_us"] for r in h["rows"]] + [h["flashinfer_tc_fp8_us"]]
    colors = ["#888888"] + ["#1f77b4"] * (len(h["rows"]) - 1) + ["#ff7f0e"]
    a.bar(range(len(us)), us, color=colors)
    a.set_xticks(range(len(us)), names, rotation=30, ha="right", fontsize=8)
    a.set_ylabel("µs per decode step (lower is better)")
    a.set_title(f"Paged decode attention, {h['decode_shape'].replace('x', ' x ')} tokens, H200", fontsize=9)
    for r in h["rows"]:
        if r["kl"] <= 0:  # the baseline itself
            continue
        b.scatter(r["capacity_x"], r["kl"], s=40)
        b.annotate(r["format"].split(":")[0], (r["capacity_x"], r["kl"]), fontsize=8,
                   xytext=(4, 4), textcoords="offset points")
    b.set_yscale("log")
    b.set_xlabel(f"sequences of {h['eval_bin']} tokens per KV budget, x bf16")
    b.set_ylabel("mean KL vs bf16 (kvq eval)")
    b.set_title(f"Capacity against quality, SmolLM2-135M at {h['eval_bin']} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    h = collect()
    (RES / "headline.json").write_text(json.dumps(h, indent=1))
    plot(h, RES / "headline.png")
    print(markdown(h))


if __name__ == "__main__":
    main()
