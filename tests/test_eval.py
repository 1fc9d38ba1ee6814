"""`kvq eval`: metrics on cases with known answers, the status rule, records, and a tiny end-to-end run."""

import json
import math

import pytest
import torch

from kvq import cli
from kvq.eval import metrics
from kvq.eval.records import RECORD_FIELDS, Thresholds, decide_status, make_record

# -- metrics --------------------------------------------------------------------------------------


def _lp(rows):
    return torch.log(torch.tensor(rows, dtype=torch.float32))


def test_identical_distributions_give_kl_zero_and_full_agreement():
    lp = metrics.log_softmax(torch.randn(7, 50, generator=torch.Generator().manual_seed(0)))
    assert metrics.mean_kl(lp, lp.clone()) == 0.0
    assert metrics.top1_agreement(lp, lp.clone()) == 1.0


def test_kl_known_value_and_direction():
    p, q = _lp([[0.5, 0.5]]), _lp([[0.9, 0.1]])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # KL(p || q) = 0.5108...
    assert metrics.mean_kl(p, q) == pytest.approx(expected, rel=1e-6)
    assert metrics.mean_kl(q, p) == pytest.approx(0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5), rel=1e-6)
    # a zero-probability token under the baseline contributes nothing (no nan)
    assert metrics.mean_kl(_lp([[1.0, 0.0]]), _lp([[0.5, 0.5]])) == pytest.approx(math.log(2), rel=1e-6)


def test_top1_counts_positions_whose_argmax_matches():
    base = _lp([[0.6, 0.4], [0.3, 0.7], [0.9, 0.1], [0.2, 0.8]])
    test = _lp([[0.4, 0.6], [0.3, 0.7], [0.8, 0.2], [0.6, 0.4]])
    assert metrics.top1_agreement(base, test) == 0.5


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    V = 37
    lp = metrics.log_softmax(torch.zeros(5, V))
    nll = metrics.token_nll(lp, torch.tensor([0, 3, 36, 1, 2]))
    assert metrics.perplexity(nll) == pytest.approx(V, rel=1e-6)
    assert metrics.relative_change(40.7, 37.0) == pytest.approx(0.1)
    assert metrics.relative_change(3.0, 3.0) == 0.0


def test_greedy_agreement():
    g = metrics.greedy_agreement([1, 2, 3, 4], [1, 2, 9, 4])
    assert g == {"prefix_match": 2, "prefix_match_frac": 0.5, "positionwise": 0.75}
    assert metrics.greedy_agreement([5, 6], [5, 6])["prefix_match"] == 2
    with pytest.raises(ValueError):
        metrics.greedy_agreement([1, 2], [1])


# -- status rule and records ----------------------------------------------------------------------

SAME = {"ppl_rel_change": 0.0, "kl_mean": 0.0, "top1_agreement": 1.0, "passkey_drop": 0.0}


def _status(quality=SAME, requested="torch", resolved="torch", ratio=2.0, th=Thresholds()):
    return decide_status(requested_backend=requested, resolved_backend=resolved, capacity_ratio=ratio,
                         quality=quality, thresholds=th)


def test_status_rule():
    assert _status() == ("ok", [])
    assert _status(ratio=1.0) == ("ok", [])  # the baseline against itself
    for key, bad in (("ppl_rel_change", 0.03), ("kl_mean", 0.5), ("top1_agreement", 0.8), ("passkey_drop", 0.4)):
        status, why = _status({**SAME, key: bad})
        assert status == "quality_regressed" and len(why) == 1, (key, why)
    assert _status({**SAME, "kl_mean": 0.02})[0] == "ok"  # equal to the threshold passes
    assert _status({**SAME, "passkey_drop": 0.8 - 0.6})[0] == "ok"  # 0.20000000000000007: rounding, not a drop
    assert _status({**SAME, "kl_mean": 0.5}, th=Thresholds(max_kl=1.0))[0] == "ok"
    # with intervals a threshold fails only when the whole interval is past it
    assert _status({**SAME, "kl_mean": 0.03, "kl_mean_ci95": [0.015, 0.045]})[0] == "ok"
    status, why = _status({**SAME, "kl_mean": 0.03, "kl_mean_ci95": [0.025, 0.035]})
    assert status == "quality_regressed" and "95% CI" in why[0]
    assert _status({**SAME, "top1_agreement": 0.85, "top1_agreement_ci95": [0.8, 0.95]})[0] == "ok"
    assert _status({**SAME, "ppl_rel_change": 0.05, "ppl_rel_change_ci95": [0.021, 0.08]})[0] == "quality_regressed"
    pk = {**SAME, "passkey_drop": 0.3, "passkey_accuracy": 0.6, "passkey_accuracy_baseline": 0.9}
    assert _status({**pk, "passkey_accuracy_ci95": [0.3, 0.85]})[0] == "ok"
    assert _status({**pk, "passkey_accuracy_ci95": [0.5, 0.68]})[0] == "quality_regressed"
    assert _status(resolved="triton")[0] == "backend_mismatch"  # checked before quality
    assert _status({**SAME, "kl_mean": 9.0}, ratio=0.5)[0] == "capacity_lost"
    with pytest.raises(ValueError):
        Thresholds(min_top1=1.5)
    with pytest.raises(ValueError):
        Thresholds(max_kl=-1)


def test_intervals_batch_means_t_and_wilson():
    from kvq.eval import stats

    assert stats.t975(1) == 12.706 and stats.t975(30) == 2.042
    assert abs(stats.t975(40) - 2.021) < 0.002 and abs(stats.t975(120) - 1.980) < 0.002
    assert stats.segment_means([1.0] * 64 + [3.0] * 32) == [1.0, 1.0, 3.0]
    assert stats.segment_means([1.0] * 40) == [1.0]  # a short tail joins the last segment
    m, lo, hi = stats.mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and hi - m == pytest.approx(4.303 / math.sqrt(3)) and m - lo == pytest.approx(hi - m)
    assert stats.mean_ci([0.5]) == (0.5, 0.5, 0.5)
    lo, hi = stats.wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    assert stats.wilson(10, 10)[1] == 1.0 and stats.wilson(0, 10)[0] == 0.0
    # coverage: intervals over 40 units of a known mean hold it about 95% of the time
    g = torch.Generator().manual_seed(0)
    hits = 0
    for _ in range(400):
        x = torch.randn(40, generator=g).tolist()
        _, lo, hi = stats.mean_ci(x)
        hits += lo <= 0.0 <= hi
    assert 0.92 <= hits / 400 <= 0.98


def test_passages_are_disjoint_where_the_text_allows():
    from kvq.eval.data import passage_offsets

    assert passage_offsets(1000, 200, 4, 32) == [0, 200, 400, 600]
    assert passage_offsets(500, 200, 4, 32) == [0, 100, 200, 300]  # overlapping, scored positions differ
    assert passage_offsets(150, 150, 1, 32) == [0]
    with pytest.raises(ValueError, match="--passages 4"):
        passage_offsets(300, 200, 6, 32)
    with pytest.raises(ValueError, match="fewer than the 200"):
        passage_offsets(100, 200, 1, 32)


def test_the_default_text_is_the_shipped_file():
    """Every machine scores the same tokens: the default text is a file in the package, whose hash
    kvq/data/README.md records (an edit to it shows up here)."""
    from kvq.eval.data import TEXT_FILE, file_sha256

    assert file_sha256(TEXT_FILE) == "566ba75ad1f2ca21af3dc167f3ce05fb96b994073de81e410d172f867e3976ea"
    assert file_sha256(TEXT_FILE) in (TEXT_FILE.parent / "README.md").read_text()


def test_record_has_seed_004_fields():
    rec = make_record(hardware={"device": "cpu"}, model={"name": "m"}, kv_cache_dtype={"requested": "fp8", "k": "a",
                      "v": "b"}, attention_backend="torch", resolved_backend="torch", bins=[512, 2048], bin=512,
                      quality=SAME, capacity={"ratio_vs_baseline": 2.0}, throughput_before=None, throughput_after=None,
                      thresholds=Thresholds())
    assert set(RECORD_FIELDS) <= set(rec) and rec["status"] == "ok"
    assert rec["context_length_bins"] == [512, 2048] and rec["quality_by_bin"] == {"512": SAME}
    json.dumps(rec)


# -- passkey haystacks ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from kvq.models.loader import load_tokenizer

    return load_tokenizer("default")


def test_haystack_layout(tokenizer):
    """One needle per haystack; depth 0 and 1 land just outside the kept sink block and recent
    window; deterministic per (seed, bin, depth, trial); too short a bin is refused."""
    from kvq.eval.data import INTRO, QUESTION_TOKENS, make_haystack

    for head, tail in ((0, 0), (32, 160)):
        starts = []
        for depth in (0.0, 0.5, 1.0):
            h = make_haystack(tokenizer, 512, depth, trial=0, keep_head=head, keep_tail=tail)
            assert len(h.token_ids) % 32 == 0 and len(h.token_ids) + QUESTION_TOKENS <= 512
            (n,) = h.needles
            assert tokenizer.decode(list(n.answer_ids)).strip() == n.key
            ids = list(h.token_ids)
            needle = tokenizer(f" The pass key of {n.name} is {n.key}. Remember it. ", add_special_tokens=False)
            k = len(needle["input_ids"])
            start = next(i for i in range(len(ids)) if ids[i:i + k] == needle["input_ids"])
            assert start >= max(head, len(tokenizer(INTRO, add_special_tokens=False)["input_ids"]))
            assert start + k <= len(ids) - tail
            starts.append(start)
        assert starts == sorted(starts) and starts[0] < starts[-1]
        if tail:
            assert starts[-1] + k == len(ids) - tail  # depth 1: right before the window
    h = make_haystack(tokenizer, 512, 0.5, trial=0)
    assert make_haystack(tokenizer, 512, 0.5, trial=0) == h  # deterministic
    assert make_haystack(tokenizer, 512, 0.5, trial=1).needles != h.needles
    with pytest.raises(ValueError, match="too short"):
        make_haystack(tokenizer, 192, 0.5, trial=0, keep_head=32, keep_tail=160)


# -- the command --------------------------------------------------------------------------------


def test_bad_input_exits_2_naming_valid_choices(capsys):
    assert cli.main(["eval", "--kv-cache-dtype", "fp9", "--out", "/nonexistent"]) == 2
    assert "valid formats" in capsys.readouterr().err
    assert cli.main(["eval", "--bins", "512,16384", "--kv-cache-dtype", "fp8"]) == 2
    assert "1..8192" in capsys.readouterr().err
    assert cli.main(["eval", "--bins", "192", "--window", "160", "--kv-cache-dtype", "int4_kivi"]) == 2
    assert "too short" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_eval_end_to_end_catches_a_broken_quantizer(tmp_path, monkeypatch):
    """bfloat16 run again equals the baseline exactly (KL 0, status ok); fp8_e4m3 whose *stored* K is read back
    as zeros is flagged quality_regressed.  The breakage is only in how the cache is read, so it is caught only
    because the scored tokens attend over the cache as stored (the teacher-forced trap would miss it)."""
    from kvq.attention import reference

    real = reference.dequantize

    def broken(fmt, planes, static_scale=None, dtype=torch.float32):
        out = real(fmt, planes, static_scale, dtype)
        return out * 0 if fmt.name == "fp8_e4m3" and fmt.role == "k" else out

    monkeypatch.setattr(reference, "dequantize", broken)
    out = tmp_path / "ev"
    rc = cli.main(["eval", "--kv-cache-dtype", "bfloat16,fp8_e4m3", "--bins", "192", "--window", "32",
                   "--greedy-tokens", "4", "--passkey-depths", "0,0.5,1", "--passkey-trials", "1", "--passages", "4",
                   "--workers", "1",  # the broken quantizer is patched into this process only
                   "--attention-backend", "torch", "--device", "cpu", "--out", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    recs = {r["kv_cache_dtype"]["requested"]: r for r in res["records"]}
    assert set(recs) == {"auto", "bfloat16", "fp8_e4m3"}
    for r in recs.values():
        assert set(RECORD_FIELDS) <= set(r)
        assert (out / "records" / f"{r['kv_cache_dtype']['requested']}__192.json").is_file()
    same, bad = recs["bfloat16"]["quality_by_bin"]["192"], recs["fp8_e4m3"]["quality_by_bin"]["192"]
    assert same["kl_mean"] == 0.0 and same["top1_agreement"] == 1.0 and same["ppl_rel_change"] == 0.0
    assert same["greedy_prefix_match"] == 4 and recs["bfloat16"]["status"] == "ok"
    assert recs["fp8_e4m3"]["status"] == "quality_regressed" and bad["kl_mean"] > 0.1
    # 4 passages at disjoint text positions, intervals around each figure
    assert same["passages"] == bad["passages"] == 4 and same["kl_mean_ci95"] == [0.0, 0.0]
    starts = [p[0] for p in bad["scored_positions"]]
    assert len(set(starts)) == 4 and bad["kl_mean_ci95"][0] > 0.1 and bad["interval_units"] == 4
    assert bad["kl_mean_ci95"][0] <= bad["kl_mean"] <= bad["kl_mean_ci95"][1]
    assert res["meta"]["text_sha256"].startswith("566ba75a") and len(res["meta"]["passage_offsets"]) == 4
    assert recs["fp8_e4m3"]["kv_cache_capacity"]["ratio_vs_baseline"] == pytest.approx(2.0)
    assert recs["fp8_e4m3"]["resolved_backend"] == recs["fp8_e4m3"]["attention_backend"] == "torch"
    report = (out / "report.md").read_text()
    assert "| `fp8_e4m3` |" in report and "quality_regressed" in report
    for png in ("quality_vs_context.png", "pareto.png", "passkey_heatmap.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_windows_and_kv_options_reach_every_evaluated_format(capsys):
    """`kvq eval --kv-sink-tokens/--kv-residual-tokens/--kivi-group-size/--block-size` travel as one
    KVCacheConfig to each evaluated format (the baseline keeps only the block size); the plan
    reports the sinks as kept (whole blocks); bad values exit 2 before any model loads."""
    from kvq.eval.command import settings_from_args
    from kvq.eval.runner import kv_config
    from kvq.models.source import model_shape

    p = cli.build_parser()
    args = p.parse_args(["eval", "--kv-cache-dtype", "fp8_e4m3,int4_kivi", "--kv-sink-tokens", "4",
                         "--kv-residual-tokens", "128", "--block-size", "32", "--device", "cpu"])
    s = settings_from_args(args)
    shape = model_shape(s.model)
    fp8 = kv_config(s, "fp8_e4m3").plan(shape).describe()
    assert (fp8["k"], fp8["sink_tokens"], fp8["sink_tokens_kept"], fp8["residual_tokens"], fp8["block_size"]) == \
        ("fp8_e4m3", 4, 32, 128, 32)
    kivi = kv_config(s, "int4_kivi").plan(shape).describe()
    assert (kivi["sink_tokens_kept"], kivi["residual_tokens"]) == (32, 128)
    base = kv_config(s, s.baseline).plan(shape).describe()
    assert (base["sink_tokens_kept"], base["residual_tokens"], base["block_size"]) == (0, 0, 32)
    from dataclasses import replace

    from kvq.eval.runner import kept_windows

    assert kept_windows(s) == (32, 160)  # passkey needles stay outside every format's windows
    from kvq.eval.runner import FormatRun, capacity

    def run(name):
        return FormatRun(name, {}, kv_config(s, name).plan(shape), [], {}, {}, 0.0)

    # --cpu-offload-gb: the host tier's sequences at the bin, stored as on the device
    cap = capacity(run("int4_kivi"), run(s.baseline), 1 << 30, 2048, 4 << 30)
    assert cap["cpu_offload_bytes"] == 4 << 30
    assert abs(cap["sequences_at_bin_cpu_offload"] - 4 * cap["sequences_at_bin"]) <= 4
    assert cap["sequences_at_bin_cpu_offload"] > 2 * cap["sequences_at_bin_cpu_offload_baseline"]
    assert "cpu_offload_bytes" not in capacity(run("int4_kivi"), run(s.baseline), 1 << 30, 2048)
    assert cli.main(["eval", "--cpu-offload-gb", "-1", "--bins", "192"]) == 2
    assert "--cpu-offload-gb" in capsys.readouterr().err
    plain = replace(s, kv=type(s.kv)())
    assert kept_windows(replace(plain, formats=("fp8_e4m3",))) == (0, 0)
    assert kept_windows(replace(plain, formats=("fp8_e4m3", "fp8_e4m3:r128:s4"))) == (16, 144)
    assert cli.main(["eval", "--kv-cache-dtype", "fp8", "--kv-residual-tokens", "-5", "--bins", "192"]) == 2
    assert ">= 0" in capsys.readouterr().err
    assert cli.main(["eval", "--kv-cache-dtype", "int4_kivi", "--kivi-group-size", "24", "--bins", "192"]) == 2
    assert capsys.readouterr().err


def test_format_specs_compare_a_format_with_and_without_its_window(tmp_path, capsys):
    """`fp8_e4m3,fp8_e4m3:r128:s4` in one run: two records, the windowed one with its kept
    sinks and window on record, and a much smaller KL (the scored positions' recent tokens
    are exact); a bad spec exits 2 naming the valid keys."""
    from kvq.cache.plan import KVCacheConfig

    kv = KVCacheConfig(block_size=32).with_spec("int4_kivi:r64:s4:g32")
    assert (kv.dtype, kv.residual_tokens, kv.sink_tokens, kv.group_size, kv.block_size) == ("int4_kivi", 64, 4, 32, 32)
    assert cli.main(["eval", "--kv-cache-dtype", "fp8_e4m3:w128", "--bins", "192"]) == 2
    assert "rN (residual_tokens)" in capsys.readouterr().err
    out = tmp_path / "ev"
    rc = cli.main(["eval", "--kv-cache-dtype", "fp8_e4m3,fp8_e4m3:r128:s4", "--bins", "192", "--window", "32",
                   "--greedy-tokens", "0", "--passkey-trials", "0", "--attention-backend", "torch", "--device", "cpu",
                   "--workers", "1",  # in this process (spawned workers give the same records: test below)
                   "--out", str(out), "--no-progress"])
    assert rc == 0
    recs = {r["kv_cache_dtype"]["requested"]: r for r in json.loads((out / "results.json").read_text())["records"]}
    plain, windowed = recs["fp8_e4m3"], recs["fp8_e4m3:r128:s4"]
    assert (windowed["kv_cache_dtype"]["sink_tokens_kept"], windowed["kv_cache_dtype"]["residual_tokens"]) == (16, 128)
    assert (plain["kv_cache_dtype"]["sink_tokens_kept"], plain["kv_cache_dtype"]["residual_tokens"]) == (0, 0)
    kl_plain = plain["quality_by_bin"]["192"]["kl_mean"]
    kl_win = windowed["quality_by_bin"]["192"]["kl_mean"]
    assert kl_win < kl_plain / 5, (kl_win, kl_plain)
    assert (out / "records" / "fp8_e4m3-r128-s4__192.json").is_file()
    assert "fp8_e4m3 + 16 sink, 128 recent" in (out / "report.md").read_text()


def test_text_option_scores_the_given_file_and_records_its_hash(tmp_path, capsys):
    """`--text FILE` replaces the default text (the same tokens on every machine); the token
    ids' hash identifies what was scored; a missing or too short file is a clear error."""
    from kvq.eval.data import eval_token_ids, text_source, tokens_sha256
    from kvq.models.loader import load_tokenizer
    from kvq.models.source import resolve_model

    assert cli.main(["eval", "--text", str(tmp_path / "none.txt"), "--bins", "192"]) == 2
    assert "no such file" in capsys.readouterr().err
    f = tmp_path / "t.txt"
    f.write_text("A cache keeps what was computed so that it need not be computed again. " * 40, encoding="utf-8")
    tok = load_tokenizer(resolve_model("default"))
    ids = eval_token_ids(tok, str(f))
    assert ids == tok(f.read_text(), add_special_tokens=False)["input_ids"]
    assert tokens_sha256(ids) == tokens_sha256(list(ids)) != tokens_sha256(ids[:-1] + [ids[-1] + 1])
    assert text_source(str(f)) == f"file {f}"
    assert cli.main(["eval", "--text", str(f), "--bins", "4096", "--kv-cache-dtype", "fp8_e4m3",
                     "--device", "cpu", "--no-progress", "--out", str(tmp_path / "o")]) == 2
    assert "fewer than the" in capsys.readouterr().err


#: One format, two passages, haystacks at two depths, greedy continuations: the run the worker and batch
#: options must reproduce.
SIDE_BY_SIDE = ["eval", "--kv-cache-dtype", "int4_kivi:r32", "--bins", "192", "--window", "32", "--greedy-tokens", "4",
                "--passages", "2", "--passkey-depths", "0,1", "--attention-backend", "torch", "--device", "cpu",
                "--no-progress"]


def _records(out) -> dict:
    return {r["kv_cache_dtype"]["requested"]: r for r in json.loads((out / "results.json").read_text())["records"]}


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory) -> dict:
    """SIDE_BY_SIDE in this process, one sequence per forward (run once for the two tests below)."""
    out = tmp_path_factory.mktemp("one")
    assert cli.main([*SIDE_BY_SIDE, "--workers", "1", "--batch", "1", "--out", str(out)]) == 0
    one = _records(out)
    assert set(one) == {"auto", "int4_kivi:r32"}
    assert one["int4_kivi:r32"]["quality_by_bin"]["192"]["kl_mean"] > 0  # compared with the baseline, not itself
    return one


@pytest.mark.slow
def test_formats_in_worker_processes_give_the_records_of_one_process(tmp_path, one_at_a_time):
    """--workers 2 runs the baseline and the formats in spawned processes and compares in the parent:
    every quality figure equals a one-process run's to the bit."""
    assert cli.main([*SIDE_BY_SIDE, "--workers", "2", "--out", str(tmp_path / "two")]) == 0
    two = _records(tmp_path / "two")
    assert set(two) == {"auto", "int4_kivi:r32"}  # the baseline and the format in two processes
    for name in one_at_a_time:
        assert one_at_a_time[name]["quality_by_bin"] == two[name]["quality_by_bin"], name


@pytest.mark.slow
def test_passages_and_haystacks_side_by_side_give_the_records_of_one_at_a_time(tmp_path, one_at_a_time):
    """--batch 2 (the GPU default's shape: passages of the text and haystacks of a bin in one forward,
    greedy continuations decoded together) gives every quality figure of --batch 1 to the bit: on the
    CPU a sequence's numbers do not depend on what runs beside it (tests/test_batch_invariance.py)."""
    assert cli.main([*SIDE_BY_SIDE, "--workers", "1", "--batch", "2", "--out", str(tmp_path / "two")]) == 0
    two = _records(tmp_path / "two")
    assert set(two) == {"auto", "int4_kivi:r32"}
    for name in one_at_a_time:
        assert one_at_a_time[name]["quality_by_bin"] == two[name]["quality_by_bin"], name
