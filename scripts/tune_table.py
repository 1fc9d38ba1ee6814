"""Markdown tables of a `kvq eval` run with `kvq tune` plans: per format or plan, its bits per cached
value, then mean KL and perplexity change (95% intervals) per bin; and per plan whether it beats every
uniform format of at most its bytes at every bin.  Used for docs/calibration.md.

    python scripts/tune_table.py docs/results/tune/eval/results.json
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    res = json.loads(open(path).read())
    base = res["meta"]["baseline"]
    rows: dict[str, dict] = {}
    for r in res["records"]:
        name = r["kv_cache_dtype"]["requested"]
        if name == base:
            continue
        L = r["context_length_bin"]
        q = r["quality_by_bin"][str(L)]
        row = rows.setdefault(name, {"bits": r["kv_cache_capacity"]["bits_per_value"], "bins": {}})
        row["bins"][L] = q
    bins = sorted({L for row in rows.values() for L in row["bins"]})
    order = sorted(rows, key=lambda n: (rows[n]["bits"], n))
    print("| format | bits/value | " + " | ".join(f"KL @ {L}" for L in bins) + " | "
          + " | ".join(f"Δppl @ {L}" for L in bins) + " |")
    print("| --- | --- |" + " --- |" * (2 * len(bins)))
    for n in order:
        row = rows[n]
        kl = [f"{row['bins'][L]['kl_mean']:.4f} [{row['bins'][L]['kl_mean_ci95'][0]:.4f}, "
              f"{row['bins'][L]['kl_mean_ci95'][1]:.4f}]" for L in bins]
        pp = [f"{100 * row['bins'][L]['ppl_rel_change']:+.2f}% [{100 * row['bins'][L]['ppl_rel_change_ci95'][0]:+.2f}, "
              f"{100 * row['bins'][L]['ppl_rel_change_ci95'][1]:+.2f}]" for L in bins]
        label = f"**`{n}`**" if n.startswith("plan:") else f"`{n}`"
        print(f"| {label} | {row['bits']:.2f} | " + " | ".join(kl) + " | " + " | ".join(pp) + " |")
    print()
    for n in order:
        if not n.startswith("plan:"):
            continue
        rivals = [m for m in order if not m.startswith("plan:") and rows[m]["bits"] <= rows[n]["bits"] + 1e-9]
        if not rivals:
            print(f"- `{n}` ({rows[n]['bits']:.2f} bits): no uniform format of at most its bytes was evaluated")
            continue
        wins = [L for L in bins if all(rows[n]["bins"][L]["kl_mean"] < rows[m]["bins"][L]["kl_mean"] for m in rivals)]
        best = {L: min(rivals, key=lambda m: rows[m]["bins"][L]["kl_mean"]) for L in bins}
        ratio = ", ".join(f"{L}: {rows[best[L]]['bins'][L]['kl_mean'] / rows[n]['bins'][L]['kl_mean']:.1f}x lower "
                          f"than `{best[L]}`" for L in bins)
        verdict = "beats" if len(wins) == len(bins) else f"beats at {len(wins)} of {len(bins)} bins"
        print(f"- `{n}` ({rows[n]['bits']:.2f} bits) {verdict} every uniform format of at most its bytes "
              f"({', '.join(f'`{m}`' for m in rivals)}); KL {ratio}")
        larger = [m for m in order if not m.startswith("plan:") and rows[m]["bits"] > rows[n]["bits"] + 1e-9]
        beaten = [m for m in larger if all(rows[n]["bins"][L]["kl_mean"] < rows[m]["bins"][L]["kl_mean"]
                                           for L in bins)]
        if larger:
            rest = [m for m in larger if m not in beaten]
            print(f"  - of the larger uniform formats it beats at every bin: "
                  f"{', '.join(f'`{m}`' for m in beaten) or 'none'}; not at every bin: "
                  f"{', '.join(f'`{m}`' for m in rest) or 'none'}")

if __name__ == "__main__":
    main(sys.argv[1])
