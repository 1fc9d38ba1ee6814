"""What to choose: a ranked recommendation per context-length bin, from the records alone.

Each (format, bin) record gets one *verdict* (first match wins):

    regressed         status ``quality_regressed``: a threshold is crossed by the whole 95% interval
    backend_mismatch  status ``backend_mismatch``: the requested attention backend did not serve it
    capacity_lost     status ``capacity_lost``: it holds fewer tokens than the baseline
    reference_only    no kernel serves the format (the AMD (ROCm) FP8 numerics, ``fp8_e4m3fnuz``):
                      measured through the torch reference for comparison, never recommended
    matches           every threshold passes and the perplexity change is not significant: the
                      95% interval of the change reaches 0 (or lies below it) and, where passkey was
                      measured, the format's Wilson interval overlaps the baseline's
    small_loss        every threshold passes, but the perplexity increase is significant (the whole
                      interval is above 0) or the passkey intervals do not overlap
    passes            every threshold passes; the record has no intervals, so whether it matches the
                      baseline cannot be told (records written before intervals existed)

Capacity multiple at a bin: the bytes one sequence of the bin's length takes with the baseline
divided by the bytes it takes with the format (``kv_cache_capacity.bytes_per_sequence_at_bin`` of
both records), so the sink and recent windows a format keeps in the model dtype are paid for:
``fp8_e4m3:r128:s4`` holds 2x per token but 1.56x at 512 tokens.  Records without the baseline's
record at that bin fall back to the per-token ratio (``ratio_vs_baseline``).

Choice per bin: among ``matches``, the largest capacity multiple; multiples within ``TIE`` (5%) of
the largest are a tie, broken by the lower mean KL.  Where no format matches, the baseline is the
choice.  A ``small_loss`` (or ``passes``) format that holds at least ``GAIN`` (20%) more than the
choice (than the baseline when there is none) is named as the option "if you need the capacity".  The
ranking lists ``matches``, then ``small_loss`` and ``passes`` (each by capacity, ties by KL), then the
formats not to use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: Capacity multiples within this relative distance of the largest count as a tie (broken by KL).
TIE = 0.05

#: A format with a small loss is offered for capacity when it holds at least this much more than the choice.
GAIN = 0.20

#: Verdicts in ranking order; the first three are usable.
VERDICTS = ("matches", "small_loss", "passes", "reference_only", "backend_mismatch", "capacity_lost", "regressed")
USABLE = ("matches", "small_loss", "passes")

#: Short labels of the verdicts (ranking table, detail tables).
SHORT = {
    "baseline": "baseline",
    "matches": "matches {base}",
    "small_loss": "small loss",
    "passes": "passes (no CI)",
    "reference_only": "reference path only",
    "backend_mismatch": "wrong backend",
    "capacity_lost": "capacity lost",
    "regressed": "do not use",
}

AMD_NOTE = "AMD (ROCm) FP8 numerics, reference path only: no kernel serves it, measured for comparison"

_DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass
class Verdict:
    """One (format, bin): its verdict, capacity multiple at the bin and the figures the advice quotes."""

    name: str
    bin: int
    verdict: str
    capacity: float  # at the bin, windows paid in the model dtype
    capacity_per_token: float
    sequences: int | None
    sequences_baseline: int | None
    quality: dict
    reasons: list[str] = field(default_factory=list)
    amd: bool = False  # an AMD (ROCm) fnuz format

    def short(self, base: str) -> str:
        """The verdict in a few words (ranking and detail tables)."""
        if self.verdict == "reference_only" and self.amd:
            return "AMD (ROCm) reference path"
        return SHORT[self.verdict].format(base=base)

    @property
    def kl(self) -> float:
        return self.quality.get("kl_mean", math.inf)


@dataclass
class BinAdvice:
    """The recommendation at one bin."""

    bin: int
    choice: Verdict | None  # None: keep the baseline
    closest: Verdict | None  # the lowest-KL format that matches, when it is not the choice
    capacity_option: Verdict | None  # a small_loss format holding more than the choice
    ranked: list[Verdict]  # usable formats, best first
    avoid: list[Verdict]  # the rest, by verdict


def requested(r: dict) -> str:
    return r["kv_cache_dtype"]["requested"]


def base_name(r: dict) -> str:
    """The registry name of a record's format (the spec without its ``:rN:sN`` options)."""
    return r["kv_cache_dtype"].get("name") or requested(r).split(":")[0]


def reference_only(name: str) -> tuple[bool, bool]:
    """(no kernel serves it, it is an AMD fnuz format), from the format registry; unknown names: (False, False)."""
    try:
        from kvq.formats.registry import resolve_kv

        kv = resolve_kv(name)
    except (ValueError, ImportError):
        return False, "fnuz" in name
    fmts = (kv.k, kv.v)
    return any(f.reference_only for f in fmts), any("fnuz" in f.storage for f in fmts)


def baseline_label(records: list[dict], baseline: str) -> str:
    """What the baseline stores in plain words (``bf16`` for ``auto`` on a bf16 model)."""
    for r in records:
        if requested(r) == baseline:
            k = r["kv_cache_dtype"].get("k", baseline)
            return _DTYPE_SHORT.get(k, k)
    return _DTYPE_SHORT.get(baseline, baseline)


def _q(r: dict) -> dict:
    return r["quality_by_bin"][str(r["context_length_bin"])]


def _passkey_lower(q: dict) -> bool:
    """The format's passkey accuracy is significantly below the baseline's (Wilson intervals apart);
    without intervals, any needle lost."""
    if q.get("passkey_accuracy") is None:
        return False
    ci, cib = q.get("passkey_accuracy_ci95"), q.get("passkey_accuracy_baseline_ci95")
    if ci and cib:
        return ci[1] < cib[0]
    return q["passkey_accuracy"] < q.get("passkey_accuracy_baseline", q["passkey_accuracy"])


def classify(r: dict, base_at_bin: dict | None) -> Verdict:
    """The verdict of one record (rule in the module docstring)."""
    q, c = _q(r), r["kv_cache_capacity"]
    per_token = c["ratio_vs_baseline"]
    cap = per_token
    if base_at_bin is not None:
        mine, theirs = c.get("bytes_per_sequence_at_bin"), base_at_bin["kv_cache_capacity"].get(
            "bytes_per_sequence_at_bin")
        if mine and theirs:
            cap = theirs / mine
    v = Verdict(requested(r), r["context_length_bin"], "", cap, per_token, c.get("sequences_at_bin"),
                c.get("sequences_at_bin_baseline"), q, list(r.get("status_reasons") or []))
    status = r["status"]
    ref_only, amd = reference_only(base_name(r))
    v.amd = amd
    if status == "quality_regressed":
        v.verdict = "regressed"
    elif status in ("backend_mismatch", "capacity_lost"):
        v.verdict = status
    elif ref_only:
        v.verdict = "reference_only"
        v.reasons.append(AMD_NOTE if amd else "reference path only: no kernel serves it")
    else:
        ci = q.get("ppl_rel_change_ci95")
        if ci is None:
            v.verdict = "passes"
        elif ci[0] > 0:
            v.verdict = "small_loss"
        elif _passkey_lower(q):
            v.verdict = "small_loss"
            v.reasons.append("passkey accuracy significantly below the baseline's")
        else:
            v.verdict = "matches"
    return v


def _by_capacity(vs: list[Verdict]) -> list[Verdict]:
    """Largest capacity first; multiples within TIE of the group's largest are ordered by KL."""
    rest = sorted(vs, key=lambda v: (-v.capacity, v.kl, v.name))
    out = []
    while rest:
        top = rest[0].capacity
        group = [v for v in rest if v.capacity >= (1 - TIE) * top]
        out += sorted(group, key=lambda v: (v.kl, -v.capacity, v.name))
        rest = [v for v in rest if v not in group]
    return out


def advise(records: list[dict], baseline: str) -> list[BinAdvice]:
    """One BinAdvice per bin of the records, smallest bin first."""
    bins = sorted({r["context_length_bin"] for r in records})
    base = {r["context_length_bin"]: r for r in records if requested(r) == baseline}
    out = []
    for L in bins:
        vs = [classify(r, base.get(L)) for r in records if r["context_length_bin"] == L and requested(r) != baseline]
        match = _by_capacity([v for v in vs if v.verdict == "matches"])
        small = _by_capacity([v for v in vs if v.verdict in ("small_loss", "passes")])
        choice = match[0] if match else None
        closest = min(match, key=lambda v: v.kl) if match else None
        if closest is choice:
            closest = None
        floor = choice.capacity if choice else 1.0
        option = next((v for v in small if v.capacity >= floor * (1 + GAIN)), None)
        avoid = sorted((v for v in vs if v.verdict not in USABLE),
                       key=lambda v: (VERDICTS.index(v.verdict), -v.capacity, v.name))
        out.append(BinAdvice(L, choice, closest, option, match + small, avoid))
    return out


# --- plain-words rendering -------------------------------------------------------------------------------------


def _num(x: float) -> str:
    return format(x, ".2g" if abs(x) < 0.01 else ".3g")


def ppl_text(q: dict) -> str:
    """``Δppl +0.44% [-0.09, +0.97]`` (the interval when recorded)."""
    v = f"Δppl {100 * q['ppl_rel_change']:+.2f}%"
    ci = q.get("ppl_rel_change_ci95")
    return v if not ci else f"{v} [{100 * ci[0]:+.2f}, {100 * ci[1]:+.2f}]"


def kl_text(q: dict) -> str:
    v = f"KL {_num(q['kl_mean'])}"
    ci = q.get("kl_mean_ci95")
    return v if not ci else f"{v} [{_num(ci[0])}, {_num(ci[1])}]"


def windows_text(r: dict, base: str) -> str:
    """``128 recent + 16 sink tokens in bf16`` (empty without windows)."""
    kv, c = r["kv_cache_dtype"], r["kv_cache_capacity"]
    recent = kv.get("residual_tokens", c.get("residual_tokens")) or 0
    sink = kv.get("sink_tokens_kept", c.get("sink_tokens")) or 0
    parts = [f"{recent} recent"] * bool(recent) + [f"{sink} sink"] * bool(sink)
    return f"{' + '.join(parts)} tokens in {base}" if parts else ""


def holds(v: Verdict, base: str) -> str:
    seqs = ""
    if v.sequences is not None and v.sequences_baseline is not None:
        seqs = f" ({v.sequences} sequences of {v.bin} tokens in the budget, against {v.sequences_baseline})"
    return f"holds {v.capacity:.2f}x the tokens of {base}{seqs}"


def failed(v: Verdict) -> str:
    """The thresholds a regressed record crosses, in short (from its status reasons)."""
    names = [short for key, short in (("perplexity", "perplexity"), ("mean KL", "KL"), ("top-1", "top-1"),
                                      ("passkey", "passkey")) if any(r.startswith(key) for r in v.reasons)]
    return ", ".join(names) or "a threshold"


def why_not(v: Verdict) -> str:
    if v.verdict == "regressed":
        return "significantly worse than the thresholds allow: " + "; ".join(v.reasons)
    if v.verdict == "reference_only":
        return "; ".join(v.reasons)
    return "; ".join(v.reasons) or v.verdict


def advice_lines(records: list[dict], baseline: str, advice: list[BinAdvice] | None = None) -> list[str]:
    """The first screen: one paragraph per bin in plain words."""
    base = baseline_label(records, baseline)
    advice = advise(records, baseline) if advice is None else advice
    out = []
    for a in advice:
        if a.choice:
            c = a.choice
            out.append(f"- **At {a.bin} tokens: use `{c.name}`** — {holds(c, base)}; quality within {base}'s "
                       f"interval ({ppl_text(c.quality)}, mean {kl_text(c.quality)}).")
        elif a.ranked and all(v.verdict == "passes" for v in a.ranked):
            out.append(f"- **At {a.bin} tokens: no format is shown to match {base}** — these records carry no 95% "
                       f"intervals; {len(a.ranked)} format(s) pass every threshold.")
        else:
            lead = f"- **At {a.bin} tokens: keep {base}** — no quantized format matches {base}'s quality here"
            out.append(lead + (": every one is significantly worse." if not a.ranked else "."))
        if a.closest:
            v = a.closest
            out.append(f"  - Closest to {base}: `{v.name}` — {v.capacity:.2f}x, mean {kl_text(v.quality)}, "
                       f"{ppl_text(v.quality)}.")
        if a.capacity_option:
            v = a.capacity_option
            loss = "within every threshold" if v.verdict == "passes" else "with a small measurable loss"
            out.append(f"  - `{v.name}` holds {v.capacity:.2f}x the tokens of {base} {loss} ({ppl_text(v.quality)}, "
                       f"mean {kl_text(v.quality)}): use it if you need the capacity"
                       + (f" ({v.reasons[0]})." if v.reasons else "."))
        bad = [v for v in a.avoid if v.verdict == "regressed"]
        if bad:
            how = ("significantly regressed" if any(v.quality.get("ppl_rel_change_ci95") for v in bad)
                   else "regressed past a threshold")
            out.append(f"  - Do not use at {a.bin} (quality {how}): "
                       + ", ".join(f"`{v.name}` ({ppl_text(v.quality)}, {kl_text(v.quality)}; fails {failed(v)})"
                                   for v in bad) + ".")
        for v in a.avoid:
            if v.verdict != "regressed":
                out.append(f"  - Not a choice here: `{v.name}` — {why_not(v)}.")
    return out


def _bins_text(bins: list[int], all_bins: list[int]) -> str:
    if bins == all_bins:
        return "every bin"
    return ("bin " if len(bins) == 1 else "bins ") + ", ".join(str(b) for b in bins)


def format_lines(records: list[dict], baseline: str, advice: list[BinAdvice] | None = None) -> list[str]:
    """One line per format across the bins."""
    base = baseline_label(records, baseline)
    advice = advise(records, baseline) if advice is None else advice
    all_bins = [a.bin for a in advice]
    per: dict[str, list[Verdict]] = {}
    for a in advice:
        for v in a.ranked + a.avoid:
            per.setdefault(v.name, []).append(v)
    chosen: dict[str, list[int]] = {}
    for a in advice:
        if a.choice:
            chosen.setdefault(a.choice.name, []).append(a.bin)
    words = {"matches": f"within {base}'s interval", "small_loss": "a small measurable loss",
             "passes": "within every threshold (no intervals recorded)",
             "regressed": "significantly regressed", "reference_only": "reference path only",
             "backend_mismatch": "not served by the requested backend", "capacity_lost": f"fewer tokens than {base}"}
    recs = {requested(r): r for r in records}
    out = []
    for name, vs in per.items():
        caps = [v.capacity for v in vs]
        cap = f"{min(caps):.2f}x" if max(caps) - min(caps) < 0.005 else f"{min(caps):.2f}-{max(caps):.2f}x"
        per_tok = vs[0].capacity_per_token
        groups: dict[str, list[int]] = {}
        for v in vs:
            groups.setdefault(v.verdict, []).append(v.bin)
        quality = "; ".join(f"{words[k]} at {_bins_text(b, all_bins)}"
                            for k, b in sorted(groups.items(), key=lambda kv: VERDICTS.index(kv[0])))
        win = windows_text(recs[name], base)
        label = f"`{name}`" + (f" ({win})" if win else "")
        line = f"- {label}: {cap} the tokens of {base} ({per_tok:.2f}x per token); {quality}"
        if name in chosen:
            line += f"; **recommended at {_bins_text(chosen[name], all_bins)}**"
        elif all(v.verdict == "regressed" for v in vs):
            line += ": **do not use**"
        if any(v.verdict == "reference_only" for v in vs):
            line += f" — {AMD_NOTE if reference_only(base_name(recs[name]))[1] else 'no kernel serves it'}"
        out.append(line + ".")
    return out


def ranking_table(records: list[dict], baseline: str, advice: list[BinAdvice] | None = None) -> list[str]:
    """Formats x bins: rank among the usable formats, verdict and capacity multiple."""
    base = baseline_label(records, baseline)
    advice = advise(records, baseline) if advice is None else advice
    cells: dict[str, dict[int, str]] = {}
    for a in advice:
        for i, v in enumerate(a.ranked):
            cells.setdefault(v.name, {})[a.bin] = f"#{i + 1} {v.short(base)}, {v.capacity:.2f}x"
        for v in a.avoid:
            cells.setdefault(v.name, {})[a.bin] = f"{v.short(base)}, {v.capacity:.2f}x"
    out = ["| format | " + " | ".join(f"{a.bin} tokens" for a in advice) + " |",
           "| --- |" + " --- |" * len(advice)]
    out.append(f"| `{baseline}` ({base}, baseline) | " + " | ".join("1.00x" for _ in advice) + " |")
    for name, row in cells.items():
        out.append(f"| `{name}` | " + " | ".join(row.get(a.bin, "-") for a in advice) + " |")
    return out


RULE_TEXT = (
    "How the choice is made (from the records only): a format *matches* {base} at a bin when it passes every "
    "threshold and its perplexity change is not significant (the 95% interval reaches 0) and its passkey interval "
    "overlaps {base}'s; it shows a *small loss* when it passes every threshold but the whole perplexity interval "
    "is above 0; it is *regressed* (do not use) when a threshold is crossed by the whole interval.  The choice is "
    "the matching format that holds the most tokens at that bin (capacity multiple: bytes a sequence of the bin's "
    "length takes in {base} / in the format, the high-precision sink and recent windows included); multiples "
    "within {tie:.0%} are a tie, won by the lower mean KL.  If nothing matches, keep {base}.  A format with a "
    "small loss is named for capacity when it holds at least {gain:.0%} more than the choice.  Formats with no "
    "kernel (the AMD ROCm `fp8_e4m3fnuz` reference path) and formats the requested backend did not serve are "
    "never chosen."
)


def rule_text(records: list[dict], baseline: str) -> str:
    return RULE_TEXT.format(base=baseline_label(records, baseline), tie=TIE, gain=GAIN)
