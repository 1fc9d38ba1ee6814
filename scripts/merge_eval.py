"""Merge the results.json of several `kvq eval` runs made with the same settings on the same machine (runs
split to fit a time limit) into one folder, then re-render its report and plots:

    python scripts/merge_eval.py OUT run_a/results.json run_b/results.json ...
    python -m kvq eval --report-only --out OUT

Refuses runs that differ in anything but their formats (model, bins, scored tokens, dtype, hardware), and
checks that the baselines agree (each run scores its own baseline; they must match to the last digit that
the runs' kernels are deterministic to, or the KL figures of the runs are not comparable).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SAME_SETTINGS = ("model", "baseline", "bins", "window", "passages", "chunk", "dtype", "attention_backend",
                 "device", "text_file", "seed")


def _key(r: dict) -> tuple[str, int]:
    return r["kv_cache_dtype"]["requested"], r["context_length_bin"]


def merge(runs: list[dict]) -> dict:
    first = runs[0]
    for other in runs[1:]:
        for k in SAME_SETTINGS:
            if first["meta"]["settings"].get(k) != other["meta"]["settings"].get(k):
                raise SystemExit(f"runs differ in setting {k!r}: {first['meta']['settings'].get(k)!r} vs "
                                 f"{other['meta']['settings'].get(k)!r}")
        for k in ("text_tokens_sha256", "baseline"):
            if first["meta"][k] != other["meta"][k]:
                raise SystemExit(f"runs differ in {k}")
        if first["meta"]["hardware"].get("gpu") != other["meta"]["hardware"].get("gpu"):
            raise SystemExit("runs come from different machines")
    base = first["meta"]["baseline"]
    records: dict[tuple[str, int], dict] = {}
    formats: dict[str, dict] = {}
    worst = 0.0
    for run in runs:
        for r in run["records"]:
            k = _key(r)
            if k in records and k[0] == base:
                a = records[k]["quality_by_bin"][str(k[1])]["ppl"]
                b = r["quality_by_bin"][str(k[1])]["ppl"]
                worst = max(worst, abs(a - b) / a)
                continue
            if k in records:
                raise SystemExit(f"{k[0]} at bin {k[1]} appears in two runs")
            records[k] = r
        for f in run["formats"]:
            formats.setdefault(f["format"], f)
    if worst > 1e-6:
        raise SystemExit(f"the runs' baselines differ (perplexity by {worst:.2e} relative): not comparable")
    meta = dict(first["meta"])
    meta["seconds"] = sum(run["meta"]["seconds"] for run in runs)
    meta["settings"] = dict(first["meta"]["settings"])
    meta["settings"]["formats"] = [f for run in runs for f in run["meta"]["settings"]["formats"]]
    meta["merged_from"] = [run["meta"]["date"] for run in runs]
    print(f"merged {len(runs)} runs: {len(records)} records, baselines agree to {worst:.1e}", file=sys.stderr)
    return {"meta": meta, "records": list(records.values()), "formats": list(formats.values())}


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        raise SystemExit(__doc__)
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    merged = merge([json.loads(Path(p).read_text()) for p in argv[1:]])
    (out / "results.json").write_text(json.dumps(merged, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
