"""The eval report's recommendation (kvq.eval.recommend) on synthetic records, and the report
rendered from the committed records (no evaluation runs; CPU, matplotlib Agg)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from kvq.eval import recommend
from kvq.eval.records import Thresholds, make_record
from kvq.eval.report import markdown, render_report

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = [ROOT / "docs/results/eval", ROOT / "docs/results/eval_h200"]
BASE_BPT = 23040.0
#: Internal references that must never reach a user-facing report.
JARGON = re.compile(r"\b(issue|seed|finding)\s*\d", re.IGNORECASE)


def _quality(L: int, ppl: float, ppl_ci: tuple[float, float] | None, kl: float = 0.001,
             passkey: tuple[float, list[float]] | None = None) -> dict:
    q = {"bin": L, "ppl": 10 * (1 + ppl), "ppl_baseline": 10.0, "ppl_rel_change": ppl, "kl_mean": kl,
         "top1_agreement": 0.98}
    if ppl_ci is not None:
        q.update(ppl_rel_change_ci95=list(ppl_ci), kl_mean_ci95=[0.8 * kl, 1.2 * kl], top1_agreement_ci95=[0.97, 0.99])
    if passkey is not None:
        acc, ci = passkey
        q.update(passkey_accuracy=acc, passkey_accuracy_ci95=ci, passkey_accuracy_baseline=1.0,
                 passkey_accuracy_baseline_ci95=[0.72, 1.0], passkey_needles=10, passkey_drop=max(0.0, 1 - acc))
    return q


def _record(name: str, L: int, bytes_per_token: float, quality: dict, *, window: int = 0,
            resolved: str = "torch") -> dict:
    """A record as the runner writes it (make_record decides the status from the quality)."""
    base_name = name.split(":")[0]
    kv = {"requested": name, "name": base_name, "k": base_name if name != "auto" else "bfloat16",
          "v": base_name if name != "auto" else "bfloat16", "sink_tokens_kept": 0, "residual_tokens": window}
    per_seq = bytes_per_token * (L - window) + BASE_BPT * window
    cap = {"bytes_per_token": bytes_per_token, "ratio_vs_baseline": BASE_BPT / bytes_per_token,
           "sequences_at_bin": int((8 << 30) // per_seq), "sequences_at_bin_baseline": int((8 << 30) // (BASE_BPT * L)),
           "bytes_per_sequence_at_bin": per_seq, "residual_tokens": window, "sink_tokens": 0}
    thr = {"backend": "torch", "prefill_tokens_per_s": 100.0, "decode_tokens_per_s": 10.0}
    rec = make_record(hardware={"device": "cpu"}, model={"name": "tiny", "checkpoint": "x", "compute_dtype": "float32"},
                      kv_cache_dtype=kv, attention_backend="torch", resolved_backend=resolved, bins=[L], bin=L,
                      quality=quality, capacity=cap, throughput_before=thr, throughput_after=thr,
                      thresholds=Thresholds())
    rec["baseline"] = "auto"
    return rec


def _baseline(L: int) -> dict:
    return _record("auto", L, BASE_BPT, _quality(L, 0.0, (0.0, 0.0), kl=0.0))


def _advice(records: list[dict]) -> dict[int, recommend.BinAdvice]:
    return {a.bin: a for a in recommend.advise(records, "auto")}


def test_regressed_never_recommended_and_largest_capacity_match_is():
    """The largest-capacity format whose perplexity interval reaches 0 is the choice; a regressed
    format (whole interval past a threshold) is never chosen nor offered, however small it is; a
    significant but in-threshold loss is offered only for a real capacity gain."""
    L = 4096
    recs = [
        _baseline(L),
        _record("int8_per_token_head", L, 12240, _quality(L, 0.0005, (-0.002, 0.003), kl=0.0001)),
        _record("int4_kivi", L, 7200, _quality(L, 0.004, (-0.001, 0.009), kl=0.002)),
        _record("int2_kivi", L, 4320, _quality(L, 0.15, (0.10, 0.20), kl=0.12)),  # regressed
        _record("int3_made_up", L, 5400, _quality(L, 0.006, (0.002, 0.010), kl=0.004)),  # small loss, 1.33x int4
    ]
    assert recs[3]["status"] == "quality_regressed" and recs[4]["status"] == "ok"
    a = _advice(recs)[L]
    assert a.choice.name == "int4_kivi" and a.choice.verdict == "matches"
    assert a.closest.name == "int8_per_token_head"
    assert a.capacity_option.name == "int3_made_up" and a.capacity_option.verdict == "small_loss"
    assert [v.name for v in a.avoid] == ["int2_kivi"] and a.avoid[0].verdict == "regressed"
    assert "int2_kivi" not in [v.name for v in a.ranked]
    lines = "\n".join(recommend.advice_lines(recs, "auto"))
    assert f"**At {L} tokens: use `int4_kivi`**" in lines and "use it if you need the capacity" in lines
    assert re.search(r"Do not use at 4096 \(quality significantly regressed\): `int2_kivi`", lines)
    # a format that also crosses the KL threshold significantly stays out even when it is the smallest
    recs.append(_record("int1_made_up", L, 2000, _quality(L, 0.001, (-0.01, 0.012), kl=0.05)))
    assert recs[-1]["status"] == "quality_regressed"
    a = _advice(recs)[L]
    assert a.choice.name == "int4_kivi" and "int1_made_up" in [v.name for v in a.avoid]


def test_capacity_counts_windows_and_ties_go_to_lower_kl():
    """The capacity multiple at a bin pays the high-precision window in the model dtype; multiples
    within 5% are a tie won by the lower KL."""
    L = 512
    recs = [
        _baseline(L),
        _record("fp8_e4m3:r128", L, 11520, _quality(L, 0.0, (-0.003, 0.003), kl=0.002), window=128),
        _record("int8_per_token_head:r128", L, 12240, _quality(L, 0.0, (-0.002, 0.002), kl=0.0001), window=128),
        _record("int4_kivi", L, 7200, _quality(L, 0.0, (-0.004, 0.004), kl=0.003), window=512 - 64),
    ]
    a = _advice(recs)[L]
    caps = {v.name: v.capacity for v in a.ranked}
    assert caps["fp8_e4m3:r128"] == pytest.approx(512 * BASE_BPT / (384 * 11520 + 128 * BASE_BPT))  # 1.60x, not 2x
    assert caps["int4_kivi"] < caps["int8_per_token_head:r128"]  # its window covers most of this bin
    assert abs(caps["fp8_e4m3:r128"] / caps["int8_per_token_head:r128"] - 1) < recommend.TIE
    assert a.choice.name == "int8_per_token_head:r128"  # tie on capacity, lower KL
    assert [v.name for v in a.ranked] == ["int8_per_token_head:r128", "fp8_e4m3:r128", "int4_kivi"]


def test_bin_where_only_the_baseline_passes_says_so():
    """With every quantized format regressed or significantly worse, the bin says to keep bf16."""
    recs = [_baseline(8192), _record("fp8_e5m2", 8192, 11520, _quality(8192, 0.09, (0.05, 0.13), kl=0.08)),
            _record("int2_kivi", 8192, 4320, _quality(8192, 0.2, (0.15, 0.25), kl=0.15)),
            _baseline(512), _record("fp8_e5m2", 512, 11520, _quality(512, 0.001, (-0.002, 0.004), kl=0.004)),
            _record("int2_kivi", 512, 4320, _quality(512, 0.05, (0.02, 0.08), kl=0.06))]
    adv = _advice(recs)
    assert adv[8192].choice is None and adv[8192].ranked == [] and adv[512].choice.name == "fp8_e5m2"
    lines = recommend.advice_lines(recs, "auto")
    head = next(ln for ln in lines if "At 8192 tokens" in ln)
    assert "keep bf16" in head and "every one is significantly worse" in head
    summary = "\n".join(recommend.format_lines(recs, "auto"))
    assert "`int2_kivi`" in summary and "do not use" in summary
    assert re.search(r"`fp8_e5m2`.*recommended at bin 512", summary)
    # passkey: a loss beyond the Wilson intervals keeps a format out of "matches" even with a flat perplexity
    # (within the 0.2 drop threshold); overlapping intervals do not
    q = _quality(512, 0.0, (-0.003, 0.003), passkey=(0.8, [0.7, 0.9]))
    q["passkey_accuracy_baseline_ci95"] = [0.95, 1.0]
    pk = _record("int4_kivi", 512, 7200, q)
    assert pk["status"] == "ok" and recommend.classify(pk, None).verdict == "small_loss"
    q["passkey_accuracy_baseline_ci95"] = [0.72, 1.0]
    assert recommend.classify(_record("int4_kivi", 512, 7200, q), None).verdict == "matches"
    worse = _record("int4_kivi", 512, 7200, _quality(512, 0.0, (-0.003, 0.003), passkey=(0.2, [0.06, 0.51])))
    assert worse["status"] == "quality_regressed" and recommend.classify(worse, None).verdict == "regressed"


def test_fnuz_is_labelled_amd_reference_path_and_never_chosen():
    """fp8_e4m3fnuz passes every threshold (status ok) but no kernel serves it: it is labelled an
    AMD (ROCm) reference path in the advice, the summary and the detail table, and never chosen."""
    L = 1024
    recs = [_baseline(L), _record("fp8_e4m3fnuz", L, 11520, _quality(L, 0.0, (-0.003, 0.003), kl=0.001)),
            _record("fp8_e4m3", L, 11520, _quality(L, 0.001, (-0.002, 0.004), kl=0.0012))]
    assert recs[1]["status"] == "ok"
    a = _advice(recs)[L]
    assert a.choice.name == "fp8_e4m3" and [v.verdict for v in a.avoid] == ["reference_only"]
    text = "\n".join(recommend.advice_lines(recs, "auto") + recommend.format_lines(recs, "auto"))
    assert re.search(r"`fp8_e4m3fnuz` — AMD \(ROCm\) FP8 numerics, reference path only", text)
    result = {"meta": _meta([L]), "records": recs, "formats": []}
    md = markdown(result, {})
    row = next(ln for ln in md.splitlines() if ln.startswith("| `fp8_e4m3fnuz` | fp8_e4m3fnuz |"))
    assert "| AMD (ROCm) reference path | ok (AMD (ROCm) FP8 numerics, reference path only" in row
    ranking = next(ln for ln in md.splitlines() if ln.startswith("| `fp8_e4m3fnuz` |"))
    assert "AMD (ROCm) reference path, 2.00x" in ranking


def _meta(bins: list[int]) -> dict:
    return {"settings": {"bins": bins, "window": 64, "greedy_tokens": 8, "passages": 4, "passkey_bins": bins,
                         "passkey_depths": [0.5], "passkey_trials": 1, "memory": 8 << 30,
                         "thresholds": {"max_ppl_increase": 0.02}},
            "hardware": {"device": "cpu", "cpu": "test cpu", "cpu_cores": 2, "torch_threads": 1, "torch": "x"},
            "baseline": "auto", "requested_backend": "torch", "date": "today", "seconds": 1.0,
            "text_source": "test text"}


def test_records_without_intervals_never_claim_a_match():
    """Records written before intervals existed pass thresholds by value only: the report does not
    claim they match the baseline, and still names the largest within every threshold."""
    L = 512
    recs = [_baseline(L), _record("int8", L, 11880, _quality(L, 0.004, None)),
            _record("int4_kivi", L, 7200, _quality(L, 0.006, None))]
    for r in recs:
        for k in ("ppl_rel_change_ci95", "kl_mean_ci95", "top1_agreement_ci95"):
            r["quality_by_bin"][str(L)].pop(k, None)
    a = _advice(recs)[L]
    assert a.choice is None and {v.verdict for v in a.ranked} == {"passes"}
    assert a.capacity_option.name == "int4_kivi"
    lines = "\n".join(recommend.advice_lines(recs, "auto"))
    assert "no format is shown to match bf16" in lines and "`int4_kivi` holds" in lines


@pytest.mark.parametrize("folder", COMMITTED, ids=lambda p: p.name)
def test_committed_records_render_without_jargon(folder, tmp_path):
    """The committed results render into a report whose first screen is the recommendation, with no
    internal references (issue / seed / finding numbers) in the text, and readable PNGs."""
    src = tmp_path / "results.json"
    shutil.copy(folder / "results.json", src)
    report = render_report(src, tmp_path / "out")
    text = report.read_text()
    assert text.splitlines()[4] == "## What to use"
    assert not JARGON.search(text), JARGON.search(text)
    assert re.search(r"\*\*At 512 tokens: use `[^`]+`\*\* — holds \d\.\d\dx the tokens of bf16", text)
    assert "`int2_kivi:s4`" in text and "Do not use at 8192" in text
    assert text.index("## What to use") < text.index("## Details") < text.index("## Plots")
    for png in ("quality_vs_context.png", "pareto.png", "passkey_heatmap.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the committed report is what this code renders from the committed records
    committed = (folder / "report.md").read_text()
    assert committed == text


def test_plots_carry_no_jargon():
    """Titles and labels of the plots are built from plain words (checked on the source strings)."""
    src = (ROOT / "kvq/eval/report.py").read_text() + (ROOT / "kvq/eval/recommend.py").read_text()
    strings = re.findall(r'"[^"\n]*"', src)
    assert not [s for s in strings if JARGON.search(s)]
    result = json.loads((COMMITTED[0] / "results.json").read_text())
    assert not JARGON.search(json.dumps(recommend.ranking_table(result["records"], result["meta"]["baseline"])))


def test_host_memory_sequences_appear_beside_the_device_ones(tmp_path):
    """`kvq eval --cpu-offload-gb N` records how many sequences of the bin the host memory holds
    besides (swap or the CPU prefix cache); the per-bin table shows them next to the device's."""
    import json

    result = json.loads((COMMITTED[0] / "results.json").read_text())
    rec = next(r for r in result["records"] if r["kv_cache_dtype"]["requested"] == "int4_kivi:s4")
    rec["kv_cache_capacity"].update(cpu_offload_bytes=4 << 30, sequences_at_bin_cpu_offload=290,
                                    sequences_at_bin_cpu_offload_baseline=91)
    src = tmp_path / "results.json"
    src.write_text(json.dumps(result))
    text = render_report(src, tmp_path / "out").read_text()
    want = f"| {rec['kv_cache_capacity']['sequences_at_bin']} + 290 host |"
    assert sum(want in line for line in text.splitlines() if line.startswith("| `int4_kivi:s4`")) >= 1
    assert "*+ N host*" in text
