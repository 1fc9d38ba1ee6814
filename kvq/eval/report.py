"""The human-readable report: a Markdown summary and three plots.

    report.md                what to use per context-length bin, in plain words (kvq.eval.recommend), one
                             line per format, a ranking table; then per bin the detail table, the paired
                             comparisons (K per channel vs per token, E4M3 vs E5M2), backends; all
                             computed from the records, never written by hand
    quality_vs_context.png   relative perplexity change and mean KL against context length, one line per
                             format, bars for the 95% intervals
    pareto.png               bytes per token against mean KL at the largest bin (lower-left is better)
    passkey_heatmap.png      passkey accuracy, depth x bin, one panel per format
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvq.eval import recommend

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
    """Which of each pair is closer to the baseline, bin by bin, by KL and perplexity."""
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


def _kv_text(r: dict) -> str:
    """The K / V column: what K and V store, and the windows kept in the model dtype."""
    kv = r["kv_cache_dtype"]
    kvs = kv["k"] if kv["k"] == kv["v"] else f"{kv['k']} / {kv['v']}"
    if kv.get("tiers"):  # elastic precision: the ladder, with the ages where blocks move down
        ages = kv.get("tier_ages") or ()
        kvs += "".join(f" > {t}" + (f" from {a} back" if i < len(ages) else "") for i, (t, a) in
                       enumerate(zip(kv["tiers"], [*ages, *[None] * len(kv["tiers"])])))
    windows = [f"{kv[key]} {label}" for key, label in WINDOW_LABELS if kv.get(key)]
    return kvs + (" + " + ", ".join(windows) if windows else "")


def _status_text(r: dict, v: recommend.Verdict | None) -> str:
    """The record's status, its reasons, and the AMD reference-path note where it applies."""
    notes = list(r["status_reasons"])
    if v is not None and v.verdict == "reference_only":
        notes += [n for n in v.reasons if n not in notes]
    return r["status"] + (f" ({'; '.join(notes)})" if notes else "")


def markdown(result: dict, plots: dict[str, str]) -> str:
    meta, records = result["meta"], result["records"]
    st, hw = meta["settings"], meta["hardware"]
    fm = _by_format(records)
    baseline = meta["baseline"]
    base = recommend.baseline_label(records, baseline)
    advice = recommend.advise(records, baseline)
    verdicts = {(v.name, a.bin): v for a in advice for v in a.ranked + a.avoid}
    where = hw.get("gpu") or f"{hw['cpu']} ({hw['cpu_cores']} cores, {hw['torch_threads']} torch threads)"
    first = records[0]
    text_hash = (f" (file sha256 {meta['text_sha256'][:16]}...)" if meta.get("text_sha256") else "") + (
        f", scored token ids sha256 {meta['text_tokens_sha256'][:16]}..." if meta.get("text_tokens_sha256") else "")
    passages = st.get("passages", 1)
    budget = f"{st['memory'] / (1 << 30):g} GiB"
    out = [
        "# kvq eval report",
        "",
        f"Model **{first['model']['name']}** ({first['model']['checkpoint']}, computed in "
        f"{first['model']['compute_dtype']}) on {hw.get('gpu') or hw['cpu'] + ' CPU'}; every KV cache format is "
        f"compared with `{baseline}` ({base}) on the same tokens.  Capacity: for a {budget} KV budget.",
        "",
        "## What to use",
        "",
        *recommend.advice_lines(records, baseline, advice),
        "",
        "Each format across the bins:",
        "",
        *recommend.format_lines(records, baseline, advice),
        "",
        recommend.rule_text(records, baseline),
        "",
        "Ranking per bin (#1 is the choice; capacity multiple at that bin):",
        "",
        *recommend.ranking_table(records, baseline, advice),
        "",
        "## Details",
        "",
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
        f"Text: {meta['text_source']}{text_hash}.",
        "",
        "Thresholds: " + ", ".join(f"{k} {v:g}" for k, v in st["thresholds"].items()) + ".",
        "",
    ]
    head = ("| format | K / V | B/token | x tokens | seqs @ bin | ppl | ppl change | mean KL | top-1 | "
            "greedy prefix | passkey | verdict | status |")
    for a in advice:
        out += [f"### {a.bin} tokens", "", head, "| --- " * 13 + "|"]
        order = [baseline] + [v.name for v in a.ranked + a.avoid]
        for name in order:
            r = next((r for r in fm.get(name, []) if r["context_length_bin"] == a.bin), None)
            if r is None:
                continue
            q, c, v = _q(r), r["kv_cache_capacity"], verdicts.get((name, a.bin))
            greedy = f"{q['greedy_prefix_match']:.1f}/{q['greedy_tokens']}" if "greedy_tokens" in q else "-"
            pk = (f"{_with_ci(q, 'passkey_accuracy', '.2f')} ({_with_ci(q, 'passkey_accuracy_baseline', '.2f')})"
                  if "passkey_accuracy" in q else "-")
            verdict = "baseline" if v is None else v.short(base)
            seqs = str(c["sequences_at_bin"])
            if "sequences_at_bin_cpu_offload" in c:  # + what the host memory of --cpu-offload-gb holds
                seqs += f" + {c['sequences_at_bin_cpu_offload']} host"
            out.append(f"| `{name}` | {_kv_text(r)} | {c['bytes_per_token']:.0f} | "
                       f"{c['ratio_vs_baseline']:.2f} | {seqs} | {q['ppl']:.3f} | "
                       f"{_with_ci(q, 'ppl_rel_change', '+.2f', 100, '%')} | {_with_ci(q, 'kl_mean')} | "
                       f"{_with_ci(q, 'top1_agreement', '.3f')} | "
                       f"{greedy} | {pk} | {verdict} | {_status_text(r, v)} |")
        out.append("")
    out += ["B/token: resident bytes per token over all layers, K+V, scales included (sink and recent windows "
            "are counted in *seqs @ bin*, the sequences of that length that fit the budget"
            + ("; *+ N host*: those that --cpu-offload-gb of host memory holds besides, swapped or in the CPU "
               "prefix cache, stored in the same format" if any("sequences_at_bin_cpu_offload" in r["kv_cache_capacity"]
                                                                for r in records) else "")
            + ").  x tokens: tokens per "
            "byte against the baseline.  ppl: perplexity of the scored positions.  greedy prefix: greedy tokens equal "
            "to the baseline's before the first difference (mean over passages).  passkey: accuracy (baseline's in "
            "brackets).  verdict: as in *What to use*; status: the record's (ok, quality_regressed, "
            "backend_mismatch, capacity_lost) with the thresholds it crosses.", ""]
    cmp_lines = comparison_lines(records)
    if cmp_lines:
        out += ["## Paired comparisons", ""] + cmp_lines
    out += ["## Backends", "",
            "| format | backend | decode kernel per layer |", "| --- | --- | --- |"]
    for name, recs in fm.items():
        t = recs[0]["throughput_after"] or {}
        out.append(f"| `{name}` | {t.get('backend', '-')} | {t.get('decode_per_layer', '-')} |")
    out += ["", "Speed is not measured here: the evaluation runs its passes one sequence at a time, which says "
            "nothing about serving.  Serving throughput per format (batched, CUDA graphs): "
            "`benchmarks/bench_engine.py`, docs/engine.md.", ""]
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


def _label(name: str, baseline: str, base: str) -> str:
    return f"{name} ({base}, baseline)" if name == baseline and name != base else name


def _plot_plans(plt, fm, plans, bins, baseline, base, out_dir, save) -> str:
    """plans.png: per bin, bits per cached value against mean KL; uniform formats as labelled points,
    the plans of ``kvq tune`` as one line (by size): the frontier they draw."""
    fig, axes = plt.subplots(1, len(bins), figsize=(4.6 * len(bins), 4.6), layout="constrained", squeeze=False)
    for ax, L in zip(axes[0], bins):
        at = {n: next((r for r in recs if r["context_length_bin"] == L), None) for n, recs in fm.items()
              if n != baseline}
        at = {n: r for n, r in at.items() if r is not None and _q(r)["kl_mean"] > 0}

        def xy(r):
            return r["kv_cache_capacity"]["bits_per_value"], _q(r)["kl_mean"]

        for n, r in at.items():
            if n in plans:
                continue
            x, y = xy(r)
            ax.scatter([x], [y], color="tab:blue", zorder=4)
            ax.annotate(n.split(":")[0], (x, y), fontsize=8, xytext=(5, 4), textcoords="offset points")
        line = sorted(xy(r) for n, r in at.items() if n in plans)
        if line:
            ax.plot([p[0] for p in line], [p[1] for p in line], "o-", color="tab:red", label="kvq tune plans", zorder=5)
        ax.set_yscale("log")
        ax.set_xlabel("bits per cached value (resident blocks, sidecars included)")
        ax.set_title(f"{L} tokens")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"mean KL({base} || format), nats")
    axes[0][0].legend(loc="best", fontsize=8)
    fig.suptitle("Tuned per-layer plans (line) against uniform formats (points); same windows, lower is better")
    fig.savefig(out_dir / "plans.png", **save)
    plt.close(fig)
    return "plans.png"


def plot_all(result: dict, out_dir: Path) -> dict[str, str]:
    """Write the three PNGs; -> {title: file name}.  Every figure is saved with a tight bounding box, so
    no label, legend or title is clipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = result["records"]
    fm = _by_format(records)
    bins = sorted({r["context_length_bin"] for r in records})
    files = {}

    baseline = result["meta"]["baseline"]
    base = recommend.baseline_label(records, baseline)
    advice = {a.bin: {v.name: v for v in a.ranked + a.avoid} for a in recommend.advise(records, baseline)}
    colors = plt.get_cmap("tab20").colors
    style = {n: dict(color=colors[i % len(colors)], marker="osD^v<>px*h"[i % 11], ls="-" if i < 10 else "--")
             for i, n in enumerate(fm)}
    save = dict(dpi=100, bbox_inches="tight", pad_inches=0.2)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, 5.5), layout="constrained")
    for name, recs in fm.items():
        xs = [r["context_length_bin"] for r in recs]
        ppl = [100 * _q(r)["ppl_rel_change"] for r in recs]
        a1.errorbar(xs, ppl, yerr=_yerr(recs, "ppl_rel_change", ppl, 100), label=_label(name, baseline, base),
                    capsize=2, **style[name])
        if name != baseline:  # KL 0 by definition; a log axis cannot show it
            kl = [max(_q(r)["kl_mean"], 1e-9) for r in recs]
            a2.errorbar(xs, kl, yerr=_yerr(recs, "kl_mean", kl, 1, floor=1e-9), label=name, capsize=2, **style[name])
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(bins, [str(b) for b in bins])
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3)
    a1.set_ylabel(f"perplexity change vs {base} (%)")
    a1.set_yscale("symlog", linthresh=1.0)
    a2.set_ylabel(f"mean KL({base} || format), nats")
    a2.set_yscale("log")
    fig.legend(*a1.get_legend_handles_labels(), loc="outside right center", fontsize=9)
    fig.suptitle(f"Quality change against {base} by context length (lower is better; bars: 95% intervals)")
    files["quality vs context length"] = "quality_vs_context.png"
    fig.savefig(out_dir / files["quality vs context length"], **save)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 6), layout="constrained")
    last = max(bins)
    at_last = {n: next(r for r in recs if r["context_length_bin"] == last) for n, recs in fm.items()
               if any(r["context_length_bin"] == last for r in recs)}
    positive = [_q(r)["kl_mean"] for r in at_last.values() if _q(r)["kl_mean"] > 0]
    floor = min(positive, default=1e-3) / 10  # where KL 0 (the baseline) is drawn
    pts = []
    by_size = sorted(at_last.items(), key=lambda kv: kv[1]["kv_cache_capacity"]["bytes_per_token"])
    for i, (name, r) in enumerate(by_size):
        x, y = r["kv_cache_capacity"]["bytes_per_token"], max(_q(r)["kl_mean"], floor)
        pts.append((x, y, name))
        ax.scatter([x], [y], color=style[name]["color"], marker=style[name]["marker"], s=40, zorder=4)
        v = advice[last].get(name)
        verdict = "KL 0, baseline" if v is None else v.short(base)
        ax.annotate(f"{name} ({verdict})", (x, y), fontsize=8, xytext=(7, -14 + 10 * (i % 4)),
                    textcoords="offset points", bbox=dict(fc="white", ec="none", alpha=0.6, pad=1), zorder=3)
    front, best = [], float("inf")
    for x, y, _ in sorted(pts):
        if y < best:
            front.append((x, y))
            best = y
    ax.plot([p[0] for p in front], [p[1] for p in front], "k--", lw=0.8, label="Pareto front")
    xs = [p[0] for p in pts]
    ax.set_xlim(min(xs) * 0.8, max(xs) * 1.45)  # room for the labels right of the widest format
    ax.set_xlabel("bytes per token (all layers, K+V, scales)")
    ax.set_ylabel(f"mean KL at {last} tokens (nats, log)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    ax.set_title(f"Bytes per token vs quality at {last} tokens (lower left is better)")
    files["bytes per token vs quality"] = "pareto.png"
    fig.savefig(out_dir / files["bytes per token vs quality"], **save)
    plt.close(fig)

    plans = [n for n in fm if n.startswith("plan:")]
    if plans:
        files["plans vs uniform formats"] = _plot_plans(plt, fm, plans, bins, baseline, base, out_dir, save)

    with_pk = {n: [r for r in recs if "passkey_by_depth" in _q(r)] for n, recs in fm.items()}
    with_pk = {n: v for n, v in with_pk.items() if v}
    if with_pk:
        n = len(with_pk)
        cols = min(3, n)
        rows = -(-n // cols)
        width = max(len(next(iter(with_pk.values()))), 2)  # bins per panel
        fig, axes = plt.subplots(rows, cols, figsize=((1.2 + 0.9 * width) * cols + 1.5, 3.4 * rows),
                                 squeeze=False, layout="constrained")
        im = None
        for ax, (name, recs) in zip(axes.flat, with_pk.items()):
            depths = sorted(_q(recs[0])["passkey_by_depth"], key=float)
            grid = [[_q(r)["passkey_by_depth"].get(d, float("nan")) for r in recs] for d in depths]
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
            ax.set_xticks(range(len(recs)), [str(r["context_length_bin"]) for r in recs], fontsize=8)
            ax.set_yticks(range(len(depths)), [f"{100 * float(d):.0f}%" for d in depths], fontsize=8)
            ax.set_title(_label(name, baseline, base), fontsize=9)
            for i, row in enumerate(grid):
                for j, v in enumerate(row):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        fig.supxlabel("context length (tokens)")
        fig.supylabel("needle depth")
        fig.suptitle("Passkey accuracy (share of needles retrieved)")
        if im is not None:
            fig.colorbar(im, ax=axes, shrink=0.6)
        files["passkey accuracy"] = "passkey_heatmap.png"
        fig.savefig(out_dir / files["passkey accuracy"], **save)
        plt.close(fig)
    return files


def render_report(records_path: str | Path, out_dir: str | Path | None = None) -> Path:
    """Re-render report.md and the plots from a run's ``results.json`` (or the folder holding it) into
    ``out_dir`` (default: that folder), without evaluating anything; -> the report's path."""
    path = Path(records_path)
    if path.is_dir():
        path = path / "results.json"
    result = json.loads(path.read_text())
    out = Path(out_dir) if out_dir is not None else path.parent
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_all(result, out)
    report = out / "report.md"
    report.write_text(markdown(result, plots))
    return report
