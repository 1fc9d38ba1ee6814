"""The evaluation loop: baseline first, then each format, on the same tokens.

Per format one engine is built (the checkpoint is loaded once and shared), and
one :class:`~kvq.eval.session.CacheSession` runs the text pass
(:mod:`kvq.eval.scoring`) once per passage of the text, then the passkey
haystacks (:mod:`kvq.eval.passkey`).  The baseline's log-probabilities, greedy
continuations and passkey results are kept; every other format is compared with
them position by position as soon as a passage is scored, and keeps only the
per-position figures (NLL, KL, top-1), so memory does not grow with the number
of formats.  Intervals: :mod:`kvq.eval.stats`.
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
from kvq.eval import metrics, stats
from kvq.eval.data import (TEXT_FILE, eval_token_ids, file_sha256, make_haystack, passage_offsets, text_source,
                           tokens_sha256)
from kvq.eval.passkey import accuracy_by_depth, run_haystacks
from kvq.eval.records import Thresholds, make_record
from kvq.eval.scoring import StreamSpec, score_streams
from kvq.eval.session import CacheSession

GIB = 1 << 30
#: A format of the run that is a plan file (``--kv-cache-plan``): ``plan:PATH``.
PLAN_PREFIX = "plan:"


@dataclass(frozen=True)
class EvalSettings:
    model: str = "default"
    baseline: str = "auto"  # the model dtype
    formats: tuple[str, ...] = ()
    bins: tuple[int, ...] = (512, 1024)
    window: int = 128
    passages: int = 4  # passes over different stretches of the text (intervals: kvq.eval.stats)
    chunk: int = 512
    greedy_tokens: int = 16
    passkey_bins: tuple[int, ...] = (512, 1024)
    passkey_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    passkey_trials: int = 1
    memory: int = 8 * GIB  # budget for the capacity figures
    cpu_offload: int = 0  # bytes of a host tier (swap) for the capacity figures; 0: none
    attention_backend: str = "auto"
    prefill_backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    kv: KVCacheConfig = field(default_factory=KVCacheConfig)  # windows, group, skips, block size of every format
    text_file: str | None = None  # UTF-8 text scored instead of the default reference text
    seed: int = 0
    threads: int | None = 1  # torch CPU threads (None: torch's default); see docs/eval.md
    thresholds: Thresholds = field(default_factory=Thresholds)
    progress: bool = True
    kv_scales: str | None = None  # static KV scales file for the formats that take them
    text_tokens: int | None = None  # score only the first N tokens of the text (kvq tune holds out the rest)
    tensor_parallel_size: int = 1  # ranks each format's engine is split over (kvq.parallel)
    workers: int | None = None  # processes running formats side by side (None: one per CPU core, up to 4 on a GPU)
    # sequences side by side in each forward: passages of the text, haystacks of a bin (None: every one
    # on a GPU, where a step costs little more for more sequences; 1 on a CPU, where the haystacks of a
    # bin then reuse each other's prefix)
    batch: int | None = None


def hardware_info(device: torch.device) -> dict:
    info = {"device": device.type, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform()}
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
    if fmt.startswith(PLAN_PREFIX):  # a plan file keeps its own windows and formats
        return KVCacheConfig(plan_file=fmt[len(PLAN_PREFIX):], block_size=s.kv.block_size)
    return s.kv.with_spec(fmt)


def display_name(s: EvalSettings, fmt: str) -> str:
    """How records and reports name a format of the run: the spec, or ``plan:NAME`` for a plan file."""
    if fmt.startswith(PLAN_PREFIX):
        return f"{PLAN_PREFIX}{kv_config(s, fmt).plan_spec.name}"
    return fmt


def resolve_batch(s: EvalSettings, device: torch.device) -> int:
    """Sequences per forward: ``s.batch``, else 1 on a CPU and every passage / haystack of a bin on a GPU."""
    if s.batch is not None:
        return max(1, s.batch)
    if device.type == "cpu":
        return 1
    return max(s.passages, len(s.passkey_depths) * s.passkey_trials, 1)


def kv_memory(s: EvalSettings, batch: int) -> int:
    """KV pool bytes of one format's engine: per batch slot a sequence of the longest bin and its fork,
    the blocks a window keeps twice, rounding -- 3 bins' worth at the model dtype's width."""
    from kvq.models.source import model_shape

    shape = model_shape(s.model)
    width = 4 if _device_of(s).type == "cpu" or s.dtype == "float32" else 2
    hp_token_bytes = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * width
    return max(64 << 20, 3 * batch * max(s.bins + s.passkey_bins) * hp_token_bytes)


def _engine(s: EvalSettings, fmt: str, batch: int):
    from kvq.engine.llm_engine import EngineConfig, LLMEngine
    from kvq.models.source import model_shape

    from kvq.cache.scales_file import static_layers

    shape = model_shape(s.model)
    kv = kv_config(s, fmt)
    scales = s.kv_scales if s.kv_scales and fmt != s.baseline and static_layers(kv.plan(shape)) else None
    memory = kv_memory(s, batch)
    # CUDA graphs (on a GPU) for the greedy decode: one graph per batch size up to the passages side by side
    decode_batch = max(1, min(batch, s.passages))
    return LLMEngine(EngineConfig(
        model=s.model, kv_cache=kv, kv_scales=scales, attention_backend=s.attention_backend,
        prefill_backend=s.prefill_backend, device=s.device, dtype=s.dtype, enforce_eager=False,
        max_num_seqs=decode_batch,
        max_num_batched_tokens=max(s.chunk, 64) * batch, kv_cache_memory=memory, seed=s.seed,
        progress=s.progress, threads=s.threads or 0, tensor_parallel_size=s.tensor_parallel_size))


@dataclass
class Scored:
    """One bin of one passage, reduced to per-position figures against the baseline."""

    bin: int
    positions: tuple[int, int]  # scored text positions [start, end) (absolute in the text)
    nll: torch.Tensor  # [W] float64, this format
    nll_baseline: torch.Tensor  # [W] float64
    kl: torch.Tensor  # [W] float64, KL(baseline || format)
    top1: torch.Tensor  # [W] float64, 1 where the argmaxes agree
    greedy: list[int]
    greedy_baseline: list[int]


@dataclass
class FormatRun:
    """What one format's engine measured, compared with the baseline per position."""

    name: str
    info: dict
    plan: object
    scores: list[list[Scored]]  # [passage][bin]
    passkey: dict  # bin -> list of needle results
    throughput: dict
    seconds: float
    timing: dict = field(default_factory=dict)  # seconds: engine build, text passes, passkey haystacks

    def summary(self) -> str:
        t = self.timing
        parts = ", ".join(f"{k} {t[k]:.1f}" for k in ("engine", "text", "passkey") if k in t)
        return f"[kvq eval] {self.name}: {self.seconds:.0f} s" + (f" ({parts} s)" if parts else "")


def compare(base: list, run: list, offset: int, device: torch.device | None = None) -> list[Scored]:
    """Per-position figures of one passage (lists of BinScore, same bins and targets)."""
    out = []
    for b, r in zip(base, run, strict=True):
        assert b.bin == r.bin and torch.equal(b.targets, r.targets)
        start = offset + r.context - len(r.targets)
        dev = device or r.logprobs.device  # default: where the format's log-probs are (its engine's device)
        blp, rlp, tg = b.logprobs.to(dev), r.logprobs.to(dev), r.targets.to(dev)
        figures = (metrics.token_nll(rlp, tg).double(), metrics.token_nll(blp, tg).double(),
                   metrics.kl_per_position(blp, rlp), (blp.argmax(-1) == rlp.argmax(-1)).double())
        out.append(Scored(r.bin, (start, offset + r.context), *(f.cpu() for f in figures), r.greedy, b.greedy))
    return out


def on_host(scores: list) -> list:
    """BinScores with their log-probs moved to the CPU (what is kept across formats)."""
    from dataclasses import replace

    return [replace(x, logprobs=x.logprobs.cpu()) for x in scores]


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


def format_tokens(spec: StreamSpec, offsets: list[int], hays: dict[int, list], align: int) -> int:
    """Tokens one format's run feeds (text passes, greedy spans, haystacks): the progress unit."""
    g = spec.greedy_span(align)
    return (len(offsets) * (max(spec.bins) - g + g * len(spec.bins))
            + sum(len(stacks) * L for L, stacks in hays.items()))


def run_format(s: EvalSettings, fmt: str, ids: list[int], offsets: list[int], spec: StreamSpec,
               hays: dict[int, list], align: int, base_scores: list[list] | None = None, bar=None
               ) -> tuple[FormatRun, list[list]]:
    """Score every passage and haystack with ``fmt``; -> (the run, its raw bin scores per passage
    when ``base_scores`` is None (the baseline, or a format run in a worker process, compared in
    the parent by :func:`rescore`), else []).  ``bar``: the run's progress bar, advanced by
    :func:`format_tokens` tokens (None: no progress)."""
    t0 = time.perf_counter()
    engine = _engine(s, fmt, batch := resolve_batch(s, _device_of(s)))
    session = CacheSession(engine)
    timing = {"engine": time.perf_counter() - t0}
    need = spec.tokens_needed(align)
    raw, scored = [], []
    for at in range(0, len(offsets), batch):
        group = offsets[at:at + batch]
        for k, (off, got) in enumerate(zip(group, score_streams(session, [ids[o:o + need] for o in group], spec,
                                                                align, progress=bar)), start=at):
            if base_scores is None:
                scored.append(compare(got, got, off))
                raw.append(on_host(got))
            else:
                scored.append(compare(base_scores[k], got, off))  # the logprobs are dropped here
    timing["text"] = time.perf_counter() - t0 - timing["engine"]
    passkey: dict[int, list] = {}
    for L, stacks in hays.items():
        # deepest needle first: the haystacks of a bin share their filler up to the needle, so each later
        # group finds its prefix in the cache (as a server's prefix cache would) and computes only the rest
        order = sorted(range(len(stacks)), key=lambda i: -max(nd.depth for nd in stacks[i].needles))
        got: dict[int, list] = {}
        for at in range(0, len(order), batch):
            group = order[at:at + batch]
            for i, res in zip(group, run_haystacks(session, [stacks[i] for i in group], s.chunk)):
                got[i] = res
            if bar is not None:
                bar.update(L * len(group))
        passkey[L] = [r for i in range(len(stacks)) for r in got[i]]
    timing["passkey"] = time.perf_counter() - t0 - timing["engine"] - timing["text"]
    engine.block_manager.check_integrity()
    engine.shutdown()  # the other tensor-parallel ranks, if any
    run = FormatRun(display_name(s, fmt), engine.info, engine.full_plan, scored, passkey, session.throughput(),
                    time.perf_counter() - t0, timing)
    del session, engine
    gc.collect()
    return run, raw


def _device_of(s: EvalSettings) -> torch.device:
    from kvq.engine.config import resolve_device

    return resolve_device(s.device)


def rescore(run: FormatRun, raw: list[list], base_raw: list[list], offsets: list[int],
            device: torch.device | None = None) -> FormatRun:
    """``run`` (scored against itself in a worker) compared with the baseline's raw scores, on ``device``
    (default: where the raw scores are)."""
    run.scores = [compare(b, r, off, device) for b, r, off in zip(base_raw, raw, offsets, strict=True)]
    return run


class _QueueBar:
    """The part of a tqdm bar a worker process uses: token counts sent to the parent's bar."""

    def __init__(self, queue):
        self.queue = queue

    def update(self, n: int) -> None:
        self.queue.put(n)


def _worker_run(s: EvalSettings, fmt: str, ids, offsets, spec, hays, align, queue):
    from dataclasses import replace

    s = replace(s, progress=False)  # the parent draws the one bar
    if s.threads:
        torch.set_num_threads(s.threads)
    run, raw = run_format(s, fmt, ids, offsets, spec, hays, align, bar=_QueueBar(queue) if queue else None)
    return run, raw


#: Worker processes sharing one GPU by default: a small model leaves the GPU mostly idle while each process
#: builds its engine and compiles its format's kernels, so a few side by side finish the run sooner.
GPU_WORKERS = 4


def resolve_workers(s: EvalSettings, device: torch.device, jobs: int) -> int:
    """Processes for ``jobs`` format runs: ``s.workers``, else one per CPU core on a CPU (each with
    ``s.threads`` torch threads), :data:`GPU_WORKERS` sharing a GPU, and one with tensor parallelism."""
    if s.workers is not None:
        return max(1, min(s.workers, jobs))
    if s.tensor_parallel_size > 1:
        return 1
    if device.type == "cuda":  # as many as the GPU's free memory holds (a pool, a model, a context each)
        free = torch.cuda.mem_get_info(device)[0]
        fit = int(0.8 * free) // (kv_memory(s, resolve_batch(s, device)) + (2 << 30))
        return max(1, min(jobs, GPU_WORKERS, os.cpu_count() or 1, fit))
    return max(1, min(jobs, (os.cpu_count() or 1) // max(1, s.threads or 1)))


def _run_parallel(s: EvalSettings, workers: int, ids, offsets, spec, hays, align, bar) -> list[FormatRun]:
    """Every format in ``workers`` spawned processes, the baseline first; each run's raw scores come back
    to this process and are compared with the baseline's here (formats in the order given)."""
    import concurrent.futures as cf
    import queue as queue_mod

    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q = ctx.Manager().Queue() if bar is not None else None
    fmts = (s.baseline, *s.formats)
    out: dict[int, tuple] = {}
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futs = {pool.submit(_worker_run, s, f, ids, offsets, spec, hays, align, q): i for i, f in enumerate(fmts)}
        pending = set(futs)
        while pending:
            done, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
            while q is not None:
                try:
                    bar.update(q.get_nowait())
                except queue_mod.Empty:
                    break
            for f in done:
                i = futs[f]
                out[i] = f.result()  # a worker's exception is raised here
                if bar is not None:
                    bar.write(out[i][0].summary())
    base, base_raw = out[0]  # scored against itself in its worker, as a baseline is
    dev = _device_of(s)  # the comparisons run where the workers ran (float64 KL on a GPU is fast)
    return [base] + [rescore(out[i][0], out[i][1], base_raw, offsets, dev) for i in range(1, len(fmts))]


def _ci(units: list[float]) -> tuple[float, list[float]]:
    m, lo, hi = stats.mean_ci(units)
    return m, [lo, hi]


def bin_quality(base: FormatRun, run: FormatRun, i: int, passkey_bins) -> dict:
    """Quality of ``run`` at its i-th bin against the baseline (same tokens, same positions),
    over every passage, with 95% intervals (batch means, :mod:`kvq.eval.stats`)."""
    per = [p[i] for p in run.scores]
    L = per[0].bin
    nll_r = torch.cat([x.nll for x in per])
    nll_b = torch.cat([x.nll_baseline for x in per])

    def units(f):
        return [u for x in per for u in stats.segment_means(f(x).tolist())]

    dnll, dnll_ci = _ci(units(lambda x: x.nll - x.nll_baseline))
    kl_units = units(lambda x: x.kl)
    kl, kl_ci = _ci(kl_units)
    top1, top1_ci = _ci(units(lambda x: x.top1))
    q = {
        "bin": L,
        "passages": len(per),
        "scored_positions": [list(x.positions) for x in per],
        "interval_units": len(kl_units),
        "ppl": metrics.perplexity(nll_r),
        "ppl_baseline": metrics.perplexity(nll_b),
        "ppl_rel_change": math.expm1(dnll),
        "ppl_rel_change_ci95": [math.expm1(v) for v in dnll_ci],
        "kl_mean": kl,
        "kl_mean_ci95": kl_ci,
        "top1_agreement": top1,
        "top1_agreement_ci95": top1_ci,
    }
    if per[0].greedy_baseline:
        g = [metrics.greedy_agreement(x.greedy_baseline, x.greedy) for x in per]
        q.update(greedy_tokens=len(per[0].greedy_baseline),
                 greedy_prefix_match=sum(x["prefix_match"] for x in g) / len(g),
                 greedy_agreement=sum(x["positionwise"] for x in g) / len(g))
    if L in passkey_bins:
        res_r, res_b = run.passkey[L], base.passkey[L]
        ok_r, ok_b = sum(bool(x["correct"]) for x in res_r), sum(bool(x["correct"]) for x in res_b)
        acc_r, acc_b = ok_r / len(res_r), ok_b / len(res_b)
        q.update(passkey_accuracy=acc_r, passkey_accuracy_ci95=list(stats.wilson(ok_r, len(res_r))),
                 passkey_accuracy_baseline=acc_b, passkey_accuracy_baseline_ci95=list(stats.wilson(ok_b, len(res_b))),
                 passkey_needles=len(res_r), passkey_drop=max(0.0, acc_b - acc_r),
                 passkey_by_depth=accuracy_by_depth(res_r))
    return q


def capacity(run: FormatRun, base: FormatRun, memory: int, L: int, cpu_offload: int = 0) -> dict:
    plan, bplan = run.plan, base.plan
    cap, bcap = plan.capacity(memory, L), bplan.capacity(memory, L)
    host = {}
    if cpu_offload:  # swapped blocks are stored as on the device (docs/offload.md)
        host = {"cpu_offload_bytes": cpu_offload,
                "sequences_at_bin_cpu_offload": plan.capacity(cpu_offload, L).sequences,
                "sequences_at_bin_cpu_offload_baseline": bplan.capacity(cpu_offload, L).sequences}
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
        **host,
    }


def _throughput(run: FormatRun, hardware: dict) -> dict:
    """What served the run; no speed: the evaluation's one-sequence passes would mislead about serving
    (measure that with benchmarks/bench_engine.py)."""
    be = run.info["attention_backend"]
    return {"device": hardware["device"], "backend": be["resolved"], "decode_per_layer": be.get("decode_per_layer"),
            "tokens_per_s": None, "note": "not measured by kvq eval (one sequence at a time, not a serving "
                                          "setting): see benchmarks/bench_engine.py"}


def validate(s: EvalSettings) -> None:
    """Bad settings raise ValueError naming what is valid (before any model is loaded)."""
    from kvq.formats.registry import lookup
    from kvq.models.source import model_shape

    for name in (s.baseline, *s.formats):
        if not name.startswith(PLAN_PREFIX):
            lookup(KVCacheConfig().with_spec(name).dtype)
    names = [display_name(s, f) for f in s.formats]
    if len(set(names)) != len(names):
        raise ValueError(f"a format or plan name is listed twice in {', '.join(names)}")
    shape = model_shape(s.model)
    for name in (s.baseline, *s.formats):
        kv_config(s, name).plan(shape)  # windows, group size, skip layers, block size: valid for each format
    if s.kv_scales is not None:
        from pathlib import Path

        from kvq.cache.scales_file import static_layers

        if not any(static_layers(kv_config(s, f).plan(shape)) for f in s.formats):
            raise ValueError(f"--kv-scales: none of {', '.join(s.formats) or 'the formats'} takes static scales "
                             "(fp8_e4m3, fp8_e5m2 do)")
        from kvq.cache.scales_warmup import parse_warmup

        if not parse_warmup(s.kv_scales) and not Path(s.kv_scales).is_file():
            raise ValueError(f"--kv-scales {s.kv_scales}: no such file")
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
    if s.passkey_trials < 0 or s.greedy_tokens < 0 or s.window < 1 or s.chunk < 1 or s.passages < 1:
        raise ValueError("trials and greedy tokens must be >= 0, window, chunk and passages >= 1")


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
    from kvq.models.builder import ensure_converted

    ensure_converted(s.model)  # a GGUF once, here: the tokenizer and every engine (worker) read its converted copy
    tokenizer = load_tokenizer(resolve_model(s.model))
    hays = haystacks(s, tokenizer, align)
    ids = eval_token_ids(tokenizer, s.text_file)[:s.text_tokens]
    need = spec.tokens_needed(align)
    offsets = passage_offsets(len(ids), need, s.passages, s.window)
    per_format = format_tokens(spec, offsets, hays, align)
    names = [display_name(s, f) for f in (s.baseline, *s.formats)]
    workers = resolve_workers(s, _device_of(s), len(names))
    # one bar for the whole run (its ETA is the run's, from the first chunk on: rate averaged over the run)
    with tqdm(total=per_format * len(names), unit="tok", disable=not s.progress, smoothing=0,
              desc=f"{len(names)} formats, {workers} at a time" if workers > 1 else f"[1/{len(names)}] {names[0]}"
              ) as bar:
        if workers > 1:
            runs = _run_parallel(s, workers, ids, offsets, spec, hays, align, bar)
        else:
            base, raw = run_format(s, s.baseline, ids, offsets, spec, hays, align, bar=bar)
            bar.write(base.summary())
            runs = [base]
            for i, f in enumerate(s.formats, start=2):
                bar.set_description(f"[{i}/{len(names)}] {names[i - 1]}")
                runs.append(run_format(s, f, ids, offsets, spec, hays, align, raw, bar=bar)[0])
                bar.write(runs[-1].summary())
            del raw
    base = runs[0]
    device = torch.device(base.info["device"])
    hardware = hardware_info(device)
    requested = s.attention_backend if s.attention_backend != "auto" else base.info["attention_backend"]["resolved"]
    records, formats_meta = [], []
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
                capacity=capacity(run, base, s.memory, L, s.cpu_offload), throughput_before=_throughput(base, hardware),
                throughput_after=_throughput(run, hardware), thresholds=s.thresholds)
            rec["baseline"] = s.baseline
            fmt_records.append(rec)
        records += fmt_records
        formats_meta.append({"format": run.name, "seconds": run.seconds, "timing": run.timing,
                           "passkey": {str(k): v for k, v in run.passkey.items()}})
    meta = {
        "settings": {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v) for k, v in asdict(s).items()},
        "text_source": text_source(s.text_file),
        "text_sha256": file_sha256(s.text_file or TEXT_FILE),
        "text_tokens_sha256": tokens_sha256([t for off in offsets for t in ids[off:off + need]]),
        "passage_offsets": offsets,
        "hardware": hardware,
        "seconds": time.perf_counter() - t_start,
        "baseline": s.baseline,
        "requested_backend": requested,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    return {"meta": meta, "records": records, "formats": formats_meta}
