"""The human-readable report: a Markdown summary and three plots.

    report.md                summary table per (format, bin), capacity, throughput, the two comparisons
                             of issue 5's finding 8 (computed from the records, never written by hand)
    quality_vs_context.png   relative perplexity change and mean KL against context length, one line per
                             format, bars for the 95% intervals
    pareto.png               bytes per token against mean KL at the largest bin (lower-left is better)
    passkey_heatmap.png      passkey accuracy, depth x bin, one panel per format
"""

from __future__ import annotations

import math
from pathlib import Path

#: (A, B, what differs): pairs compared in the report when both were run.
COMPARISONS = (
    ("int2_kivi", "int2_per_token", "2-bit K per channel (KIVI) vs per token; V per token in both"),
    ("int4_kivi", "int4_per_token", "4-bit K per channel (KIVI) vs per token; V per token in both"),
    ("fp8_e4m3", "fp8_e5m2", "FP8 E4M3 vs E5M2, direct cast"),
)


#: Record fields of the high-precision windows, as the report's K / V column names them.
WINDOW_LABELS = (("sink_tokens_kept", "sink"), ("residual_tokens", "recent"))


def _by_format(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["kv_cache_dtype"]["requested"], []).append(r)
    for v in out.values():
        v.sort(key=lambda r: r["context_length_bin"])
    return out


def _q(r: dict) -> dict:
    return r["quality_by_bin"][str(r["context_length_bin"])]


def _fmt(x, spec: str = ".4g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def _with_ci(q: dict, key: str, spec: str = ".4g", scale: float = 1.0, unit: str = "") -> str:
    """``value [low, high]`` from ``key`` and ``key_ci95`` (records without intervals: the value)."""
    v = f"{_fmt(scale * q[key], spec)}{unit}"
    ci = q.get(f"{key}_ci95")
    return v if not ci else f"{v} [{_fmt(scale * ci[0], spec)}, {_fmt(scale * ci[1], spec)}]"


def comparison_lines(records: list[dict]) -> list[str]:
    """Finding 8 of issue 5: which of each pair is closer to the baseline, bin by bin, by KL and perplexity."""
    fm = _by_format(records)
    lines = []
    for a, b, what in COMPARISONS:
        if a not in fm or b not in fm:
            continue
        lines.append(f"**{what}** (`{a}` vs `{b}`):")
        lines.append("")
        lines.append(f"| bin | KL `{a}` | KL `{b}` | ppl change `{a}` | ppl change `{b}` | top-1 `{a}` | top-1 `{b}` "
                     f"| closer to baseline (KL) |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        wins = 0
        for ra, rb in zip(fm[a], fm[b]):
            qa, qb = _q(ra), _q(rb)
            better = a if qa["kl_mean"] < qb["kl_mean"] else b if qb["kl_mean"] < qa["kl_mean"] else "tie"
            wins += better == a
            lines.append(f"| {ra['context_length_bin']} | {_with_ci(qa, 'kl_mean')} | {_with_ci(qb, 'kl_mean')} | "
                         f"{_with_ci(qa, 'ppl_rel_change', '+.2f', 100, '%')} | "
                         f"{_with_ci(qb, 'ppl_rel_change', '+.2f', 100, '%')} | "
                         f"{qa['top1_agreement']:.3f} | {qb['top1_agreement']:.3f} | `{better}` |")
        lines.append("")
        lines.append(f"`{a}` is closer to the baseline at {wins} of {len(fm[a])} bins.")
        lines.append("")
    return lines


def markdown(result: dict, plots: dict[str, str]) -> str:
    meta, records = result["meta"], result["records"]
    st, hw = meta["settings"], meta["hardware"]
    fm = _by_format(records)
    where = hw.get("gpu") or f"{hw['cpu']} ({hw['cpu_cores']} cores, {hw['torch_threads']} torch threads)"
    first = records[0]
    text_hash = (f" (file sha256 {meta['text_sha256'][:16]}...)" if meta.get("text_sha256") else "") + (
        f", scored token ids sha256 {meta['text_tokens_sha256'][:16]}..." if meta.get("text_tokens_sha256") else "")
    passages = st.get("passages", 1)
    out = [
        "# kvq eval report",
        "",
        f"Model **{first['model']['name']}** ({first['model']['checkpoint']}, computed in "
        f"{first['model']['compute_dtype']}), baseline KV `{meta['baseline']}`; "
        f"{hw['device']}: {where}; torch {hw['torch']}; attention backend requested "
        f"`{meta['requested_backend']}`.  Run {meta['date']}, {meta['seconds']:.0f} s.",
        "",
        f"Bins {st['bins']}: at each bin L the {st['window']} scored positions end at L minus the greedy span, "
        f"then {st['greedy_tokens']} greedy tokens fill the rest of the bin; {passages} passage(s) of the text "
        f"(offsets {meta.get('passage_offsets', [0])}).  Brackets: 95% intervals (batch means over 32-position "
        f"segments of every passage; Wilson for passkey); a threshold fails only when the whole interval is "
        f"past it.  Passkey: bins {st['passkey_bins']}, "
        f"depths {st['passkey_depths']}, {st['passkey_trials']} single-needle haystack(s) per depth and bin, needles "
        f"outside every format's sink and recent windows.  "
        f"Text: {meta['text_source']}{text_hash}.  Capacity for a {st['memory'] / (1 << 30):g} GiB KV budget.",
        "",
        "Thresholds: " + ", ".join(f"{k} {v:g}" for k, v in st["thresholds"].items()) + ".",
        "",
        "| format | K / V | bin | B/token | x tokens | seqs @ bin | ppl | ppl change | mean KL | top-1 | "
        "greedy prefix | passkey | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, recs in fm.items():
        for r in recs:
            q, c = _q(r), r["kv_cache_capacity"]
            kv = r["kv_cache_dtype"]
            kvs = kv["k"] if kv["k"] == kv["v"] else f"{kv['k']} / {kv['v']}"
            windows = [f"{kv[key]} {label}" for key, label in WINDOW_LABELS if kv.get(key)]
            if windows:  # tokens kept in the model dtype
                kvs += " + " + ", ".join(windows)
            greedy = f"{q['greedy_prefix_match']:.1f}/{q['greedy_tokens']}" if "greedy_tokens" in q else "-"
            pk = (f"{_with_ci(q, 'passkey_accuracy', '.2f')} ({_with_ci(q, 'passkey_accuracy_baseline', '.2f')})"
                  if "passkey_accuracy" in q else "-")
            status = r["status"] + (f" ({'; '.join(r['status_reasons'])})" if r["status_reasons"] else "")
            out.append(f"| `{name}` | {kvs} | {r['context_length_bin']} | {c['bytes_per_token']:.0f} | "
                       f"{c['ratio_vs_baseline']:.2f} | {c['sequences_at_bin']} | {q['ppl']:.3f} | "
                       f"{_with_ci(q, 'ppl_rel_change', '+.2f', 100, '%')} | {_with_ci(q, 'kl_mean')} | "
                       f"{_with_ci(q, 'top1_agreement', '.3f')} | "
                       f"{greedy} | {pk} | {status} |")
    out += ["", "B/token: resident bytes per token over all layers, K+V, scales included (sink and recent windows "
            "are counted in *seqs @ bin*, the sequences of that length that fit the budget).  x tokens: tokens per "
            "byte against the baseline.  ppl: perplexity of the scored positions.  greedy prefix: greedy tokens equal "
            "to the baseline's before the first difference (mean over passages).  passkey: accuracy (baseline's in "
            "brackets).", ""]
    cmp_lines = comparison_lines(records)
    if cmp_lines:
        out += ["## Comparisons (issue 5, finding 8)", ""] + cmp_lines
    out += ["## Throughput measured during this run", "",
            "| format | backend | prefill tok/s | decode tok/s |", "| --- | --- | --- | --- |"]
    for name, recs in fm.items():
        t = recs[0]["throughput_after"]
        out.append(f"| `{name}` | {t['backend']} | {_fmt(t['prefill_tokens_per_s'], '.1f')} | "
                   f"{_fmt(t['decode_tokens_per_s'], '.1f')} |")
    out += ["", "Single-sequence prefill chunks and decode steps of this evaluation on the device above; on a CPU "
            "these time the torch reference backend, not the GPU kernels.", ""]
    out += ["## Plots", ""] + [f"![{k}]({v})" for k, v in plots.items()] + [""]
    return "\n".join(out)


def _yerr(recs: list[dict], key: str, ys: list[float], scale: float, floor: float | None = None):
    """Error bars (below, above) from the records' 95% intervals; None when they have none."""
    cis = [_q(r).get(f"{key}_ci95") for r in recs]
    if any(c is None for c in cis):
        return None
    lo = [y - (max(scale * c[0], floor) if floor is not None else scale * c[0]) for y, c in zip(ys, cis)]
    hi = [scale * c[1] - y for y, c in zip(ys, cis)]
    return [[max(v, 0.0) for v in lo], [max(v, 0.0) for v in hi]]


def plot_all(result: dict, out_dir: Path) -> dict[str, str]:
    """Write the three PNGs; -> {title: file name}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fm = _by_format(result["records"])
    bins = sorted({r["context_length_bin"] for r in result["records"]})
    files = {}

    baseline = result["meta"]["baseline"]
    colors = plt.get_cmap("tab20").colors
    style = {n: dict(color=colors[i % len(colors)], marker="osD^v<>px*h"[i % 11], ls="-" if i < 10 else "--")
             for i, n in enumerate(fm)}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, recs in fm.items():
        xs = [r["context_length_bin"] for r in recs]
        ppl = [100 * _q(r)["ppl_rel_change"] for r in recs]
        a1.errorbar(xs, ppl, yerr=_yerr(recs, "ppl_rel_change", ppl, 100), label=name, capsize=2, **style[name])
        if name != baseline:  # KL 0 by definition; a log axis cannot show it
            kl = [max(_q(r)["kl_mean"], 1e-9) for r in recs]
            a2.errorbar(xs, kl, yerr=_yerr(recs, "kl_mean", kl, 1, floor=1e-9), label=name, capsize=2, **style[name])
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(bins, [str(b) for b in bins])
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3)
    a1.set_ylabel("perplexity change vs baseline (%)")
    a1.set_yscale("symlog", linthresh=1.0)
    a2.set_ylabel("mean KL(baseline || format), nats")
    a2.set_yscale("log")
    fig.legend(*a1.get_legend_handles_labels(), loc="center right", fontsize=8)
    fig.suptitle(f"Quality change against context length (baseline {baseline}; lower is better; bars: 95% intervals)")
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    files["quality vs context length"] = "quality_vs_context.png"
    fig.savefig(out_dir / files["quality vs context length"], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 5))
    last = max(bins)
    at_last = {n: next(r for r in recs if r["context_length_bin"] == last) for n, recs in fm.items()}
    positive = [_q(r)["kl_mean"] for r in at_last.values() if _q(r)["kl_mean"] > 0]
    floor = min(positive, default=1e-3) / 10  # where KL 0 (the baseline) is drawn
    pts = []
    by_size = sorted(at_last.items(), key=lambda kv: kv[1]["kv_cache_capacity"]["bytes_per_token"])
    for i, (name, r) in enumerate(by_size):
        x, y = r["kv_cache_capacity"]["bytes_per_token"], max(_q(r)["kl_mean"], floor)
        pts.append((x, y, name))
        ax.scatter([x], [y], color=style[name]["color"], marker=style[name]["marker"])
        label = f"{name} (KL 0)" if _q(r)["kl_mean"] == 0 else name
        ax.annotate(label, (x, y), fontsize=7, xytext=(5, -14 + 9 * (i % 4)), textcoords="offset points")
    front, best = [], float("inf")
    for x, y, _ in sorted(pts):
        if y < best:
            front.append((x, y))
            best = y
    ax.plot([p[0] for p in front], [p[1] for p in front], "k--", lw=0.8, label="Pareto front")
    ax.set_xlabel("bytes per token (all layers, K+V, scales)")
    ax.set_ylabel(f"mean KL at {last} tokens (nats, log)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Bytes per token vs quality")
    fig.tight_layout()
    files["bytes per token vs quality"] = "pareto.png"
    fig.savefig(out_dir / files["bytes per token vs quality"], dpi=90)
    plt.close(fig)

    with_pk = {n: [r for r in recs if "passkey_by_depth" in _q(r)] for n, recs in fm.items()}
    with_pk = {n: v for n, v in with_pk.items() if v}
    if with_pk:
        n = len(with_pk)
        cols = min(4, n)
        rows = -(-n // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False)
        im = None
        for ax, (name, recs) in zip(axes.flat, with_pk.items()):
            depths = sorted(_q(recs[0])["passkey_by_depth"], key=float)
            grid = [[_q(r)["passkey_by_depth"][d] for r in recs] for d in depths]
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
            ax.set_xticks(range(len(recs)), [str(r["context_length_bin"]) for r in recs], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{100 * float(d):.0f}%" for d in depths], fontsize=7)
            ax.set_title(name, fontsize=8)
            for i, row in enumerate(grid):
                for j, v in enumerate(row):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        fig.supxlabel("context length (tokens)")
        fig.supylabel("needle depth")
        fig.suptitle("Passkey accuracy")
        if im is not None:
            fig.colorbar(im, ax=axes, shrink=0.6)
        files["passkey accuracy"] = "passkey_heatmap.png"
        fig.savefig(out_dir / files["passkey accuracy"], dpi=90)
        plt.close(fig)
    return files
