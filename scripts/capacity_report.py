#!/usr/bin/env python3
"""The capacity-bound serving table and plot, read from bench_engine results only.

    python scripts/capacity_report.py                      # docs/results/bench_capacity.json
    python scripts/capacity_report.py --json F --png P     # another results file / picture

Prints a Markdown table per load: for --scenarios results (benchmarks/scenarios.py) each format's
output tokens/s and its multiple of bf16's, TTFT and TPOT p50/p99, preemptions, peak running
sequences, and the mean decode step against its floor; for a file of waves (bench_engine
--workloads, e.g. docs/results/bench_engine_pressure_h200.json) one table per workload and
concurrency with TTFT/TPOT p50/p95, the decode step against its floor (weights or GEMM compute,
whichever is longer, plus the KV bytes read; the bytes-only roofline in older files) and the time in
prefill steps.  Writes a bar chart of tokens/s per load and format.  Nothing here measures
anything: every number is a field of the results file, which names its device and date.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "docs" / "results" / "bench_capacity.json"
LOADS = ("decode_heavy", "prefill_heavy", "mixed")
BASELINE = "bfloat16"


def _ms(v) -> str:
    return "-" if v is None else f"{1e3 * v:.1f}"


def _s(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _load_tables(runs: list[dict], loads, title, columns: list[str], cells, lead: str | None = None) -> str:
    """One Markdown table per load: format, the run's field ``lead`` if any, tok/s, x bf16, then
    ``columns``, whose cells ``cells(run)`` gives (a run with an error is named instead)."""
    out = []
    for load in loads:
        mine = [r for r in runs if r["scenario"] == load]
        base = next((r for r in mine if r["kv_cache_dtype"] == BASELINE and "error" not in r), None)
        head = ["format", *([lead] if lead else []), "tok/s", "x bf16", *columns]
        out += [f"**{load}** ({title(mine)})", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for r in mine:
            if "error" in r:
                out.append(f"| `{r['kv_cache_dtype']}` | error: {r['error']} |" + " |" * (len(head) - 2))
                continue
            ratio = f"{r['output_tok_per_s'] / base['output_tok_per_s']:.2f}x" if base else "-"
            out.append(" | ".join([f"| `{r['kv_cache_dtype']}`", *([r[lead]] if lead else []),
                                   f"{r['output_tok_per_s']:.0f}", ratio, *cells(r)]) + " |")
        out.append("")
    return "\n".join(out)


def tables(data: dict) -> str:
    """Markdown: one table per load present in ``data["scenarios"]`` (runs with an error are named)."""
    runs = data.get("scenarios", [])
    loads = [x for x in LOADS if any(r["scenario"] == x for r in runs)] + sorted(
        {r["scenario"] for r in runs} - set(LOADS))
    return _load_tables(
        runs, loads, lambda mine: next((r.get("description") for r in mine if r.get("description")), ""),
        ["TTFT p50 / p99 s", "TPOT p50 / p99 ms", "preemptions", "peak running", "decode step ms (floor)"],
        lambda r: [f"{_s(r['ttft_p50_s'])} / {_s(r['ttft_p99_s'])}",
                   f"{_ms(r['tpot_p50_s'])} / {_ms(r['tpot_p99_s'])}", str(r["preemptions"]), str(r["peak_running"]),
                   f"{_ms(r['decode_step_mean_s'])} ({_ms(r.get('decode_step_floor_s'))})"], lead="system")


def wave_load(r: dict) -> str:
    return f"{r['input_len']}/{r['output_len']} c{r['concurrency']}"


def _other_steps_s(r: dict):
    other = r.get("other_step_total_s")
    if other is None and r.get("decode_step_mean_s") is not None:  # files from before it was recorded
        other = r["wall_s"] - r["decode_steps"] * r["decode_step_mean_s"]
    return other


def wave_tables(data: dict) -> str:
    """Markdown: one table per (input, output, concurrency) of ``data["runs"]``."""
    runs = [dict(r, scenario=wave_load(r)) for r in data.get("runs", [])]
    return _load_tables(
        runs, dict.fromkeys(r["scenario"] for r in runs), lambda mine: "all requests at once",
        ["TTFT p50 / p95 s", "TPOT p50 / p95 ms", "preemptions", "decode step ms (floor, x floor)",
         "other steps s"],
        lambda r: [f"{_s(r['ttft_p50_s'])} / {_s(r['ttft_p95_s'])}", f"{_ms(r['tpot_p50_s'])} / {_ms(r['tpot_p95_s'])}",
                   str(r["preemptions"]), _step_vs_floor(r), _s(_other_steps_s(r))])


def _step_vs_floor(r: dict) -> str:
    """The mean decode step against its floor (GEMM compute term included), or against the bytes-only
    roofline in files from before the floor was recorded for waves."""
    floor = r.get("decode_step_floor_s")
    if floor is None:
        return f"{_ms(r['decode_step_mean_s'])} (roofline {_ms(r.get('roofline_step_s'))})"
    return f"{_ms(r['decode_step_mean_s'])} ({_ms(floor)}, {r['decode_step_mean_s'] / floor:.2f}x)"


def plot(data: dict, path: Path) -> None:
    """Output tokens/s per load as a multiple of bf16's (each bar labelled with its tokens/s),
    one bar per format; absolute tokens/s when a load has no bf16 run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in data.get("scenarios", []) if "error" not in r]
    loads = [x for x in LOADS if any(r["scenario"] == x for r in runs)]
    if not runs:  # a file of waves
        runs = [dict(r, scenario=wave_load(r)) for r in data.get("runs", []) if "error" not in r]
        loads = list(dict.fromkeys(r["scenario"] for r in runs))
    tok = {(r["scenario"], r["kv_cache_dtype"]): r["output_tok_per_s"] for r in runs}
    relative = all((x, BASELINE) in tok for x in loads)
    fmts = list(dict.fromkeys(r["kv_cache_dtype"] for r in runs))
    # each load's formats side by side, no slots for formats it did not run; the legend beside the plot
    present = {x: [f for f in fmts if (x, f) in tok] for x in loads}
    width = 0.8 / max(1, max(len(v) for v in present.values()))
    fig, ax = plt.subplots(figsize=(8 + 2.5 * (len(fmts) > 4), 3.6))
    for f in fmts:
        on = [(i, x) for i, x in enumerate(loads) if (x, f) in tok]
        xs = [i + (present[x].index(f) - (len(present[x]) - 1) / 2) * width for i, x in on]
        vals = [tok[(x, f)] for _, x in on]
        ys = [v / tok[(x, BASELINE)] for (_, x), v in zip(on, vals)] if relative else vals
        bars = ax.bar(xs, ys, width, label=f)
        ax.bar_label(bars, [f"{v:.0f}" for v in vals], fontsize=6, rotation=90, padding=2)
    ax.set_xticks(range(len(loads)), loads)
    if relative:
        ax.axhline(1.0, color="#888888", lw=0.8)
        ax.set_ylabel("output tokens/s, x bf16")
        ax.set_ylim(0, max(tok[k] / tok[(k[0], BASELINE)] for k in tok) * 1.25)
    else:
        ax.set_ylabel("output tokens/s")
        ax.set_ylim(0, max(tok.values()) * 1.12)
    meta = data.get("meta", {})
    ax.set_title(f"Capacity-bound serving, {meta.get('model', '?')} on {meta.get('device', '?')} "
                 f"(bar labels: tokens/s)", fontsize=10)
    if len(fmts) > 4:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=str(DEFAULT_JSON), help="bench_engine output (--scenarios, or waves)")
    p.add_argument("--png", default=None, help="the plot (default: beside the JSON, .png)")
    args = p.parse_args(argv)
    src = Path(args.json)
    if not src.is_file():
        p.error(f"{src}: no such file (run `make bench-capacity` on the GPU machine first)")
    data = json.loads(src.read_text())
    if not data.get("scenarios") and not data.get("runs"):
        p.error(f"{src}: no runs in it (bench_engine.py writes them)")
    print(tables(data) if data.get("scenarios") else wave_tables(data))
    png = Path(args.png) if args.png else src.with_suffix(".png")
    plot(data, png)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
