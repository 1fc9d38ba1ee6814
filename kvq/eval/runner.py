"""The evaluation loop: baseline first, then each format, on the same tokens.

Per format one engine is built (the checkpoint is loaded once and shared), and
one :class:`~kvq.eval.session.CacheSession` runs the text pass
(:mod:`kvq.eval.scoring`) and the passkey haystacks (:mod:`kvq.eval.passkey`).
The baseline's log-probabilities, greedy continuations and passkey results are
kept; every other format is compared with them position by position.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from kvq.cache.plan import KVCacheConfig
from kvq.eval import metrics
from kvq.eval.data import eval_token_ids, make_haystack, text_source, tokens_sha256
from kvq.eval.passkey import accuracy_by_depth, run_haystack
from kvq.eval.records import Thresholds, make_record
from kvq.eval.scoring import StreamSpec, score_stream
from kvq.eval.session import CacheSession

GIB = 1 << 30


@dataclass(frozen=True)
class EvalSettings:
    model: str = "default"
    baseline: str = "auto"  # the model dtype
    formats: tuple[str, ...] = ()
    bins: tuple[int, ...] = (512, 1024)
    window: int = 128
    chunk: int = 512
    greedy_tokens: int = 16
    passkey_bins: tuple[int, ...] = (512, 1024)
    passkey_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    passkey_trials: int = 1
    memory: int = 8 * GIB  # budget for the capacity figures
    attention_backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    kv: KVCacheConfig = field(default_factory=KVCacheConfig)  # windows, group, skips, block size of every format
    text_file: str | None = None  # UTF-8 text scored instead of the default reference text
    seed: int = 0
    threads: int | None = 1  # torch CPU threads (None: torch's default); see docs/eval.md
    thresholds: Thresholds = field(default_factory=Thresholds)
    progress: bool = True


def hardware_info(device: torch.device) -> dict:
    info = {"device": device.type, "torch": torch.__version__, "platform": platform.platform()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_count"] = torch.cuda.device_count()
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    info.update(cpu=cpu, cpu_cores=os.cpu_count(), torch_threads=torch.get_num_threads())
    return info


def kv_config(s: EvalSettings, fmt: str) -> KVCacheConfig:
    """The whole KV choice for one format of the run: the settings' template with the format
    spec applied (``fp8_e4m3:r128:s4``, :meth:`KVCacheConfig.with_spec`); the baseline keeps
    only the block size (it stores everything in high precision)."""
    if fmt == s.baseline:
        return KVCacheConfig(dtype=fmt, block_size=s.kv.block_size)
    return s.kv.with_spec(fmt)


def _engine(s: EvalSettings, fmt: str):
    from kvq.engine.llm_engine import EngineConfig, LLMEngine
    from kvq.models.source import model_shape

    max_bin = max(s.bins + s.passkey_bins)
    shape = model_shape(s.model)
    hp_token_bytes = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4  # generous: fp32-wide
    return LLMEngine(EngineConfig(
        model=s.model, kv_cache=kv_config(s, fmt), attention_backend=s.attention_backend,
        device=s.device, dtype=s.dtype, enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=max(s.chunk, 64),
        kv_cache_memory=max(64 << 20, 3 * max_bin * hp_token_bytes), seed=s.seed, progress=s.progress))


@dataclass
class FormatRun:
    """What one format's engine measured (raw; compared with the baseline later)."""

    name: str
    info: dict
    plan: object
    scores: list
    passkey: dict  # bin -> list of needle results
    throughput: dict
    seconds: float


def alignment(s: EvalSettings) -> int:
    """One block alignment for every format of the run (so all score the same positions)."""
    from kvq.models.source import model_shape

    shape = model_shape(s.model)
    sizes = [kv_config(s, f).plan(shape).block_size for f in (s.baseline, *s.formats)]
    return math.lcm(32, *sizes)


def haystacks(s: EvalSettings, tokenizer, align: int) -> dict[int, list]:
    """bin -> its passkey haystacks (built up front, so a bin too short fails before any model runs)."""
    head, tail = kept_windows(s)
    return {L: [make_haystack(tokenizer, L, d, t, s.seed, align=align, keep_head=head, keep_tail=tail)
                for d in s.passkey_depths for t in range(s.passkey_trials)]
            for L in sorted(s.passkey_bins)}


def kept_windows(s: EvalSettings) -> tuple[int, int]:
    """(head, tail) tokens that some format of the run keeps in high precision: the largest
    sink block, and the largest recent window plus one block (a block that still overlaps
    the window stays high precision as a whole)."""
    from kvq.models.source import model_shape

    shape = model_shape(s.model)
    head = tail = 0
    for f in (s.baseline, *s.formats):
        plan = kv_config(s, f).plan(shape)
        if plan.is_quantized:
            d = plan.describe()
            head = max(head, d["sink_tokens_kept"])
            tail = max(tail, d["residual_tokens"] + plan.block_size if d["residual_tokens"] else 0)
    return head, tail


def run_format(s: EvalSettings, fmt: str, ids: list[int], spec: StreamSpec, hays: dict[int, list],
               align: int) -> FormatRun:
    t0 = time.perf_counter()
    engine = _engine(s, fmt)
    session = CacheSession(engine)
    g = spec.greedy_span(align)
    hay_total = sum(len(stacks) * L for L, stacks in hays.items())
    total = max(spec.bins) - g + g * len(spec.bins) + hay_total
    with tqdm(total=total, desc=f"{fmt:<20}", unit="tok", disable=not s.progress, leave=True) as bar:
        scores = score_stream(session, ids, spec, align, progress=bar)
        passkey: dict[int, list] = {}
        for L, stacks in hays.items():
            for hay in stacks:
                passkey.setdefault(L, []).extend(run_haystack(session, hay, s.chunk))
                bar.update(L)
    engine.block_manager.check_integrity()
    run = FormatRun(fmt, engine.info, engine.plan, scores, passkey, session.throughput(), time.perf_counter() - t0)
    del session, engine
    gc.collect()
    return run


def bin_quality(base: FormatRun, run: FormatRun, i: int, passkey_bins) -> dict:
    """Quality of ``run`` at its i-th bin against ``base`` (same tokens, same positions)."""
    b, r = base.scores[i], run.scores[i]
    assert b.bin == r.bin and torch.equal(b.targets, r.targets)
    nll_b, nll_r = metrics.token_nll(b.logprobs, b.targets), metrics.token_nll(r.logprobs, r.targets)
    ppl_b, ppl_r = metrics.perplexity(nll_b), metrics.perplexity(nll_r)
    q = {
        "bin": r.bin,
        "scored_positions": [r.context - len(r.targets), r.context],
        "ppl": ppl_r,
        "ppl_baseline": ppl_b,
        "ppl_rel_change": metrics.relative_change(ppl_r, ppl_b),
        "kl_mean": metrics.mean_kl(b.logprobs, r.logprobs),
        "top1_agreement": metrics.top1_agreement(b.logprobs, r.logprobs),
    }
    if b.greedy:
        g = metrics.greedy_agreement(b.greedy, r.greedy)
        q.update(greedy_tokens=len(b.greedy), greedy_prefix_match=g["prefix_match"],
                 greedy_agreement=g["positionwise"])
    if r.bin in passkey_bins:
        acc_r, acc_b = _passkey_acc(run.passkey[r.bin]), _passkey_acc(base.passkey[r.bin])
        q.update(passkey_accuracy=acc_r, passkey_accuracy_baseline=acc_b, passkey_drop=max(0.0, acc_b - acc_r),
                 passkey_by_depth=accuracy_by_depth(run.passkey[r.bin]))
    return q


def _passkey_acc(results: list[dict]) -> float:
    return sum(bool(x["correct"]) for x in results) / len(results)


def capacity(run: FormatRun, base: FormatRun, memory: int, L: int) -> dict:
    plan, bplan = run.plan, base.plan
    cap, bcap = plan.capacity(memory, L), bplan.capacity(memory, L)
    return {
        "bytes_per_token": plan.bytes_per_token,
        "bits_per_value": 8 * plan.bytes_per_token / (2 * plan.model.num_layers * plan.model.num_kv_heads
                                                      * plan.model.head_dim),
        "tokens_per_gib": int(GIB // plan.bytes_per_token),
        "ratio_vs_baseline": bplan.bytes_per_token / plan.bytes_per_token,
        "block_size": plan.block_size,
        "sink_tokens": plan.sink_tokens,
        "residual_tokens": plan.residual_tokens,
        "memory_budget_bytes": memory,
        "context_len": L,
        "sequences_at_bin": cap.sequences,
        "sequences_at_bin_baseline": bcap.sequences,
        "bytes_per_sequence_at_bin": cap.bytes_per_sequence,
    }


def _throughput(run: FormatRun, hardware: dict) -> dict:
    return {"device": hardware["device"], "backend": run.info["attention_backend"]["resolved"],
            "what": "single-sequence prefill chunks and greedy decode steps of this evaluation", **run.throughput}


def validate(s: EvalSettings) -> None:
    """Bad settings raise ValueError naming what is valid (before any model is loaded)."""
    from kvq.formats.registry import lookup
    from kvq.models.source import model_shape

    for name in (s.baseline, *s.formats):
        lookup(KVCacheConfig().with_spec(name).dtype)
    if len(set(s.formats)) != len(s.formats):
        raise ValueError(f"a format is listed twice in {', '.join(s.formats)}")
    shape = model_shape(s.model)
    for name in (s.baseline, *s.formats):
        kv_config(s, name).plan(shape)  # windows, group size, skip layers, block size: valid for each format
    max_len = shape.max_position_embeddings
    for b in (*s.bins, *s.passkey_bins):
        if not 0 < b <= max_len:
            raise ValueError(f"bin {b} is outside 1..{max_len}, the positions {s.model!r} supports")
    if not s.bins:
        raise ValueError("give at least one bin")
    if s.text_file and not os.path.isfile(s.text_file):
        raise ValueError(f"--text {s.text_file}: no such file")
    if not set(s.passkey_bins) <= set(s.bins):
        raise ValueError(f"passkey bins {sorted(s.passkey_bins)} must be among the bins {sorted(s.bins)}")
    if any(not 0 <= d <= 1 for d in s.passkey_depths):
        raise ValueError("passkey depths are fractions in [0, 1]")
    if s.passkey_trials < 0 or s.greedy_tokens < 0 or s.window < 1 or s.chunk < 1:
        raise ValueError("trials and greedy tokens must be >= 0, window and chunk >= 1")


def run_eval(s: EvalSettings) -> dict:
    """Baseline, then every format; -> {"meta", "records", "formats"} (records: one per (format, bin))."""
    validate(s)
    t_start = time.perf_counter()
    from kvq.models.loader import load_tokenizer
    from kvq.models.source import resolve_model

    if s.threads:
        torch.set_num_threads(s.threads)
    align = alignment(s)
    spec = StreamSpec(tuple(sorted(s.bins)), s.window, s.chunk, align, s.greedy_tokens)
    spec.check(align)
    tokenizer = load_tokenizer(resolve_model(s.model))
    hays = haystacks(s, tokenizer, align)
    ids = eval_token_ids(tokenizer, max(s.bins) + 1, s.text_file)
    base = run_format(s, s.baseline, ids, spec, hays, align)
    device = torch.device(base.info["device"])
    hardware = hardware_info(device)
    requested = s.attention_backend if s.attention_backend != "auto" else base.info["attention_backend"]["resolved"]
    runs = [base] + [run_format(s, f, ids, spec, hays, align) for f in s.formats]
    records, per_format = [], []
    bins = sorted(s.bins)
    src = resolve_model(s.model)
    model = {"name": src.name, "checkpoint": src.gguf_file or str(src.folder), "compute_dtype": base.info["dtype"],
             "max_model_len": base.info["max_model_len"]}
    for run in runs:
        fmt_records = []
        for i, L in enumerate(bins):
            q = bin_quality(base, run, i, set(s.passkey_bins) if s.passkey_trials else set())
            kv = {**{k: v for k, v in run.info["kv_cache_dtype"].items() if k != "per_layer"}, "requested": run.name}
            rec = make_record(
                hardware=hardware, model=model,
                kv_cache_dtype=kv, attention_backend=requested,
                resolved_backend=run.info["attention_backend"]["resolved"], bins=bins, bin=L, quality=q,
                capacity=capacity(run, base, s.memory, L), throughput_before=_throughput(base, hardware),
                throughput_after=_throughput(run, hardware), thresholds=s.thresholds)
            rec["baseline"] = s.baseline
            fmt_records.append(rec)
        records += fmt_records
        per_format.append({"format": run.name, "seconds": run.seconds,
                           "passkey": {str(k): v for k, v in run.passkey.items()}})
    meta = {
        "settings": {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v) for k, v in asdict(s).items()},
        "text_source": text_source(s.text_file),
        "text_tokens_sha256": tokens_sha256(ids),
        "hardware": hardware,
        "seconds": time.perf_counter() - t_start,
        "baseline": s.baseline,
        "requested_backend": requested,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    return {"meta": meta, "records": records, "formats": per_format}
