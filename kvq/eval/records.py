"""The evaluation record (seed 004's fields), its status rule and thresholds.

One record per (format, context-length bin)::

    hardware             CPU model and cores, or GPU name
    model                model name (and shape)
    kv_cache_dtype       {"requested", "k", "v"}: what was asked and what K and V store
    attention_backend    the backend requested (--attention-backend; "auto" = the baseline's)
    resolved_backend     the backend the engine resolved for this format
    context_length_bins  every bin of the run; ``context_length_bin`` is this record's
    quality_by_bin       {bin: quality metrics against the baseline on the same tokens}
    kv_cache_capacity    bytes per token, tokens per GiB, sequences at this bin in a budget
    throughput_before    the baseline's device, backend and decode kernel per layer (no speed: kvq eval's
                         one-sequence passes are not a serving setting; benchmarks/bench_engine.py measures it)
    throughput_after     this format's
    status               ok | quality_regressed | backend_mismatch | capacity_lost

Status, first match wins:

1. ``backend_mismatch``: the resolved backend differs from the requested one
   (with ``auto``, from the backend the baseline resolved to: the format made
   the selector pick another implementation, seed 004's silent fallback).
2. ``capacity_lost``: the format stores fewer tokens per byte than the
   baseline (e.g. float32 against bf16); not one of seed 004's three, kept
   apart so that a wider format is never reported as a gain.
3. ``quality_regressed``: any threshold of :class:`Thresholds` is crossed
   *significantly*: by the whole 95% interval of the figure where the record
   has one (kvq.eval.stats), so a format is not failed for an unlucky passage;
   by the point value where it has none.
4. ``ok``: capacity at least the baseline's and quality within every threshold.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

EPS = 1e-9
STATUSES = ("ok", "quality_regressed", "backend_mismatch", "capacity_lost")

RECORD_FIELDS = (
    "hardware", "model", "kv_cache_dtype", "attention_backend", "resolved_backend", "context_length_bins",
    "context_length_bin", "quality_by_bin", "kv_cache_capacity", "throughput_before", "throughput_after", "status",
    "status_reasons",
)


@dataclass(frozen=True)
class Thresholds:
    """Largest tolerated quality change against the baseline, per bin (``--max-*`` / ``--min-*`` flags).

    max_ppl_increase       relative perplexity increase (0.02 = +2 %)
    max_kl                 mean KL(baseline || format) of next-token distributions, nats
    min_top1               share of positions whose argmax matches the baseline's
    max_passkey_drop       passkey accuracy lost against the baseline (absolute, 0..1)
    """

    max_ppl_increase: float = 0.02
    max_kl: float = 0.02
    min_top1: float = 0.90
    max_passkey_drop: float = 0.20

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or v != v or v < 0:
                raise ValueError(f"threshold {f.name} must be a number >= 0, got {v!r}")
        if self.min_top1 > 1 or self.max_passkey_drop > 1:
            raise ValueError("min_top1 and max_passkey_drop are shares in [0, 1]")

    def violations(self, q: dict) -> list[str]:
        """Why the quality ``q`` of one bin (keys of ``runner.bin_quality``) fails; empty if it passes.
        A figure fails when even the favourable end of its 95% interval (``*_ci95``; the point
        value without one) is past its threshold; a value equal to it passes (1e-9 tolerance)."""
        def best(key: str, low_is_good: bool) -> float:
            ci = q.get(f"{key}_ci95")
            return q[key] if ci is None else (ci[0] if low_is_good else ci[1])

        def shown(key: str, scale: float = 1.0, fmt: str = ".4g", unit: str = "") -> str:
            ci = q.get(f"{key}_ci95")
            ends = f" (95% CI {scale * ci[0]:{fmt}}{unit}..{scale * ci[1]:{fmt}}{unit})" if ci else ""
            return f"{scale * q[key]:{fmt}}{unit}{ends}"

        out = []
        if best("ppl_rel_change", True) > self.max_ppl_increase + EPS:
            out.append(f"perplexity {shown('ppl_rel_change', 100, '+.2f', '%')} > +{100 * self.max_ppl_increase:g}%")
        if best("kl_mean", True) > self.max_kl + EPS:
            out.append(f"mean KL {shown('kl_mean')} > {self.max_kl:g}")
        if best("top1_agreement", False) < self.min_top1 - EPS:
            out.append(f"top-1 agreement {shown('top1_agreement', fmt='.3f')} < {self.min_top1:g}")
        if q.get("passkey_drop") is not None:
            ci = q.get("passkey_accuracy_ci95")
            drop = q["passkey_accuracy_baseline"] - ci[1] if ci else q["passkey_drop"]
            if drop > self.max_passkey_drop + EPS:
                out.append(f"passkey accuracy -{drop:.2f}" + (" (even at the top of its 95% interval)" if ci else "")
                           + f" > {self.max_passkey_drop:g}")
        return out


def decide_status(*, requested_backend: str, resolved_backend: str, capacity_ratio: float, quality: dict,
                  thresholds: Thresholds) -> tuple[str, list[str]]:
    """(status, reasons) by the rule in the module docstring."""
    if resolved_backend != requested_backend:
        return "backend_mismatch", [f"resolved backend {resolved_backend!r} differs from requested "
                                    f"{requested_backend!r}"]
    if capacity_ratio < 1.0:
        return "capacity_lost", [f"stores {capacity_ratio:.3f}x the baseline's tokens per byte"]
    why = thresholds.violations(quality)
    return ("quality_regressed", why) if why else ("ok", [])


def make_record(*, hardware: dict, model: dict, kv_cache_dtype: dict, attention_backend: str, resolved_backend: str,
                bins: list[int], bin: int, quality: dict, capacity: dict, throughput_before: dict | None,
                throughput_after: dict | None, thresholds: Thresholds) -> dict:
    """One record for (format, bin), with its status decided here."""
    status, reasons = decide_status(requested_backend=attention_backend, resolved_backend=resolved_backend,
                                    capacity_ratio=capacity["ratio_vs_baseline"], quality=quality,
                                    thresholds=thresholds)
    rec = {
        "hardware": hardware,
        "model": model,
        "kv_cache_dtype": kv_cache_dtype,
        "attention_backend": attention_backend,
        "resolved_backend": resolved_backend,
        "context_length_bins": list(bins),
        "context_length_bin": bin,
        "quality_by_bin": {str(bin): quality},
        "kv_cache_capacity": capacity,
        "throughput_before": throughput_before,
        "throughput_after": throughput_after,
        "status": status,
        "status_reasons": reasons,
        "thresholds": asdict(thresholds),
    }
    assert all(k in rec for k in RECORD_FIELDS)
    return rec
