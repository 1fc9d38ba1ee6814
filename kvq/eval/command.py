"""``kvq eval``: what each KV format costs in quality and gains in capacity, bin by bin.

Heavy imports (torch, the engine, matplotlib) stay inside :func:`cmd_eval`, so
``kvq --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: Context-length ladder; the full run takes every bin the model supports.
BIN_LADDER = (512, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
#: Quick settings (the default on a CPU): the formats a user chooses among -- one FP8, one INT8 and one
#: KIVI format, each with the 4 sink and 128 recent tokens the report recommends -- at two bins.
#: Two passages of 256 scored positions each (the 95% intervals pool 16 segments per bin, as 4 x 128 did);
#: passkey at 512 tokens only (a 2K haystack costs as much as a whole text pass; --full tests every bin).
QUICK = {"bins": (512, 2048), "window": 256, "greedy_tokens": 16, "passkey_trials": 1, "passages": 2,
         "passkey_bins": (512,)}
QUICK_FORMATS = ("fp8_e4m3:r128:s4", "int8_per_token_head:r128:s4", "int4_kivi")
FULL = {"window": 256, "greedy_tokens": 32, "passkey_trials": 3, "passages": 6}

DESCRIPTION = """\
Evaluate KV cache formats on a model: quality against the baseline (bf16 / the model dtype) on the same tokens,
per context-length bin, with the quantized past read by attention through the paged cache; passkey retrieval at
several depths; bytes per token, tokens per GiB and sequences per budget; backends; one JSON record per
(format, bin) with a status (ok, quality_regressed, backend_mismatch, capacity_lost), a Markdown report and plots.

Defaults: on a CPU the quick settings: bf16 against the formats a user chooses among (fp8_e4m3:r128:s4,
int8_per_token_head:r128:s4, int4_kivi) at bins 512,2048, 2 passages of the text with 256 scored positions and 16
greedy tokens per bin each, 1 passkey haystack per depth (5 depths) at 512 tokens, one worker process per CPU core;
on a GPU, or with --full, every format at every bin of the ladder 512,2048,4096,8192,... the model supports, 6
passages with 256 scored positions and 32 greedy tokens each, 3 haystacks per depth and bin (on a GPU without
--full, the formats no GPU kernel serves, fp8_e4m3fnuz, are left out), every passage and every haystack of a
bin side by side in each forward (--batch), greedy decode in CUDA graphs, up to 4 worker processes sharing the
GPU.  Explicit flags override either.
Perplexity change, KL and top-1 carry 95% intervals (batch means over 32-position segments of every passage);
a status threshold fails only when the whole interval is past it."""


def _csv(kind):
    def parse(s: str):
        try:
            return tuple(kind(x) for x in s.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {s!r}") from None
    return parse


def default_formats(served_only: bool = False) -> tuple[str, ...]:
    """Every quantized format of the registry (the baseline runs anyway); ``served_only``: without the
    formats no kernel serves (the AMD fnuz numerics), which a GPU run would compute on the slow torch
    reference path and the report never recommends."""
    from kvq.formats.registry import entries, resolve_kv

    kvs = {e.name: resolve_kv(e.name) for e in entries()}
    return tuple(n for n, kv in kvs.items() if kv.is_quantized
                 and not (served_only and (kv.k.reference_only or kv.v.reference_only)))


def register(sub) -> None:
    from kvq.engine.args import add_device_args, add_model_args

    p = sub.add_parser("eval", help="quality and capacity of KV formats per context-length bin",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, bare=False)
    g = p.add_argument_group("what to evaluate")
    g.add_argument("--kv-cache-dtype", type=_csv(str), default=None,
                   help="comma-separated formats (default: every quantized format of `kvq formats`); each may "
                        "carry its own windows: name[:rN][:sN][:gN] (recent tokens, sink tokens, KIVI group), "
                        "e.g. fp8_e4m3,fp8_e4m3:r128:s4")
    g.add_argument("--kv-cache-plan", type=_csv(str), default=None, metavar="PLAN.json[,...]",
                   help="plan files written by `kvq tune` (formats per layer and K/V), evaluated beside the formats "
                        "and reported as plan:NAME; with no --kv-cache-dtype only the plans (and the baseline) run")
    g.add_argument("--baseline", default="auto", help="baseline KV format (default auto = the model dtype)")
    g.add_argument("--bins", type=_csv(int), default=None, help="context-length bins, e.g. 512,2048,4096,8192")
    g.add_argument("--full", action="store_true", help="full settings (every supported bin, more tokens and trials)")
    g.add_argument("--quick", action="store_true", help="quick settings even on a GPU")
    g.add_argument("--window", type=int, default=None,
                   help="scored positions per bin and passage (quick 128, full 256)")
    g.add_argument("--passages", type=int, default=None,
                   help="passes over different stretches of the text, for the 95%% intervals (quick 4, full 6)")
    g.add_argument("--greedy-tokens", type=int, default=None, help="greedy continuation per bin (quick 16, full 32)")
    g.add_argument("--passkey-bins", type=_csv(int), default=None, help="bins with passkey tests (default: all)")
    g.add_argument("--passkey-trials", type=int, default=None, help="haystacks per bin (quick 1, full 3)")
    g.add_argument("--passkey-depths", type=_csv(float), default=(0.0, 0.25, 0.5, 0.75, 1.0),
                   help="needle depths as fractions (default 0,0.25,0.5,0.75,1)")
    g.add_argument("--chunk", type=int, default=512, help="prefill chunk in tokens (default 512)")
    g.add_argument("--text", default=None, metavar="FILE",
                   help="UTF-8 text to score (default: kvq/data/reference_prose.txt, shipped with kvq: the "
                        "Python 3.11 language reference's prose, the same tokens on every machine); results record "
                        "the file's and the scored tokens' sha256")
    g.add_argument("--memory", default="8GiB", help="KV budget for the capacity figures (default 8GiB)")
    g.add_argument("--cpu-offload-gb", type=float, default=0.0,
                   help="also give the capacity of a host tier of that many GiB (swap; default none)")
    t = p.add_argument_group("status thresholds (per bin, against the baseline)")
    t.add_argument("--max-ppl-increase", type=float, default=0.02, help="relative perplexity increase (default 0.02)")
    t.add_argument("--max-kl", type=float, default=0.02, help="mean KL of next-token distributions, nats (0.02)")
    t.add_argument("--min-top1", type=float, default=0.90, help="top-1 agreement (default 0.90)")
    t.add_argument("--max-passkey-drop", type=float, default=0.20, help="passkey accuracy drop (default 0.20)")
    e = p.add_argument_group("engine")
    add_device_args(e)
    e.add_argument("--block-size", type=int, default=None, help="cache block size (default: each format's)")
    e.add_argument("--kv-scales", default=None, metavar="warmup[:N]|FILE",
                   help="static KV scales for the formats that take them (fp8_e4m3, fp8_e5m2): a file "
                        "(`kvq calibrate`), or warmup[:N] (absmax over each format's first N tokens, then frozen); "
                        "default: their checkpoint's, else 1.0")
    w = p.add_argument_group("high-precision windows and format options (every evaluated format; not the baseline)")
    w.add_argument("--kv-sink-tokens", type=int, default=None,
                   help="first N tokens kept in high precision, rounded up to whole blocks (default: each "
                        "format's, 4 for KIVI, else 0)")
    w.add_argument("--kv-residual-tokens", type=int, default=None,
                   help="recent window kept in high precision (default: each format's, 128 for KIVI, else 0)")
    w.add_argument("--kivi-group-size", type=int, default=None, help="KIVI group size (default 32)")
    w.add_argument("--kv-cache-dtype-skip-layers", nargs="+", default=(), metavar="LAYER",
                   help="layer indices, or 'sliding_window', kept in the model dtype")
    e.add_argument("--seed", type=int, default=0, help="seed of the passkey keys and names")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks each format's engine is split over (docs/engine.md, Parallelism); default 1")
    e.add_argument("--workers", type=int, default=None,
                   help="processes evaluating formats side by side, each with --threads torch threads (default: "
                        "one per CPU core on a CPU, at most one per format; 1 on a GPU or with -tp > 1)")
    e.add_argument("--batch", type=int, default=None,
                   help="sequences side by side in each forward: passages of the text, haystacks of a bin "
                        "(default: all of them on a GPU, 1 on a CPU)")
    e.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the reference path is many small ops, and on a shared "
                        "2-core machine 1 thread measured ~4x faster than 2; 0 = torch's default)")
    p.add_argument("--out", default="kvq-eval", help="output folder (default ./kvq-eval)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--report-only", action="store_true",
                   help="re-render records, report and plots from OUT/results.json without evaluating")
    p.set_defaults(func=cmd_eval)


def check_flags(args: argparse.Namespace) -> None:
    """Ranges of the flags alone (ValueError: exit code 2), before a model file is read;
    :func:`kvq.eval.runner.validate` then checks them against the model."""
    from kvq.attention.backends import PREFILL_NAMES, backend_names
    from kvq.engine.args import check_range
    from kvq.engine.config import DTYPES, check_device_name

    check_device_name(args.device)
    if args.dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {args.dtype!r}; valid: {', '.join(DTYPES)}")
    if args.attention_backend not in backend_names():
        raise ValueError(f"unknown --attention-backend {args.attention_backend!r}; valid: {', '.join(backend_names())}")
    if args.prefill_backend not in PREFILL_NAMES:
        raise ValueError(f"unknown --prefill-backend {args.prefill_backend!r}; valid: {', '.join(PREFILL_NAMES)}")
    for flag, value, low, high in (
            ("--threads", args.threads, 0, None), ("--workers", args.workers, 1, None),
            ("--batch", args.batch, 1, None),
            ("--tensor-parallel-size", args.tensor_parallel_size, 1, None),
            ("--chunk", args.chunk, 1, None), ("--window", args.window, 1, None),
            ("--passages", args.passages, 1, None), ("--greedy-tokens", args.greedy_tokens, 0, None),
            ("--passkey-trials", args.passkey_trials, 0, None), ("--max-ppl-increase", args.max_ppl_increase, 0, None),
            ("--max-kl", args.max_kl, 0, None), ("--min-top1", args.min_top1, 0, 1),
            ("--max-passkey-drop", args.max_passkey_drop, 0, 1)):
        check_range(flag, value, low, high)
    for flag, values in (("--bins", args.bins), ("--passkey-bins", args.passkey_bins)):
        for b in values or ():
            check_range(flag, b, 1)
    if args.kivi_group_size is not None and args.kv_cache_dtype is not None:
        from kvq.cache.plan import KVCacheConfig

        cfgs = [KVCacheConfig(group_size=args.kivi_group_size).with_spec(f) for f in args.kv_cache_dtype]
        errors = []
        for c in cfgs:
            try:
                c.check_options_apply()
            except ValueError as e:
                errors.append(e)
        if errors and len(errors) == len(cfgs):
            raise errors[0]


def _offload_bytes(gb: float) -> int:
    if not 0 <= gb < float("inf"):
        raise ValueError(f"--cpu-offload-gb must be a number of GiB >= 0, got {gb}")
    return int(gb * (1 << 30))


def settings_from_args(args: argparse.Namespace):
    """EvalSettings from the flags (ValueError on bad input, before anything heavy runs)."""
    import torch

    from kvq.cache.plan import KVCacheConfig

    check_flags(args)
    from kvq.eval.records import Thresholds
    from kvq.eval.runner import PLAN_PREFIX, EvalSettings
    from kvq.models.source import DEFAULT_MODEL, model_shape
    from kvq.units import parse_bytes

    if args.full and args.quick:
        raise ValueError("give at most one of --full and --quick")
    model = args.model or DEFAULT_MODEL
    gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    full = args.full or (gpu and not args.quick)
    max_len = model_shape(model).max_position_embeddings
    mode = dict(FULL, bins=BIN_LADDER) if full else dict(QUICK)
    mode["bins"] = tuple(b for b in mode["bins"] if b <= max_len) or (max_len // 32 * 32,)  # what the model supports
    bins = tuple(sorted(set(args.bins or mode["bins"])))
    formats = tuple(args.kv_cache_dtype or ())
    if args.kv_cache_dtype is None and not args.kv_cache_plan:
        formats = default_formats(served_only=not args.full) if full else QUICK_FORMATS
    formats += tuple(f"{PLAN_PREFIX}{p}" for p in args.kv_cache_plan or ())
    return EvalSettings(
        model=model, baseline=args.baseline, formats=tuple(formats), bins=bins,
        window=args.window or mode["window"], chunk=args.chunk,
        passages=mode["passages"] if args.passages is None else args.passages,
        greedy_tokens=mode["greedy_tokens"] if args.greedy_tokens is None else args.greedy_tokens,
        passkey_bins=tuple(sorted(set(args.passkey_bins if args.passkey_bins is not None
                                      else [b for b in mode.get("passkey_bins", bins) if b in bins] or bins))),
        passkey_depths=tuple(args.passkey_depths),
        passkey_trials=mode["passkey_trials"] if args.passkey_trials is None else args.passkey_trials,
        memory=parse_bytes(args.memory), cpu_offload=_offload_bytes(args.cpu_offload_gb),
        attention_backend=args.attention_backend, prefill_backend=args.prefill_backend, device=args.device,
        dtype=args.dtype, seed=args.seed, threads=args.threads or None,
        tensor_parallel_size=args.tensor_parallel_size, workers=args.workers, batch=args.batch,
        kv=KVCacheConfig(block_size=args.block_size, sink_tokens=args.kv_sink_tokens,
                         residual_tokens=args.kv_residual_tokens, group_size=args.kivi_group_size,
                         skip_layers=tuple(args.kv_cache_dtype_skip_layers or ())),
        thresholds=Thresholds(args.max_ppl_increase, args.max_kl, args.min_top1, args.max_passkey_drop),
        progress=not args.no_progress, text_file=args.text, kv_scales=args.kv_scales,
    )


def file_stem(spec: str) -> str:
    """A format spec as a file name: ``:`` written ``-``; a tier ladder's ``>``, ``@``, ``/`` and ``+``
    written ``.to.``, ``.age``, ``.`` and ``.and.`` (``fp8_e4m3-r128-s4.to.int4_kivi.age1152``)."""
    for a, b in ((":", "-"), (">", ".to."), ("@", ".age"), ("/", "."), ("+", ".and.")):
        spec = spec.replace(a, b)
    return spec


def write_outputs(result: dict, out: Path) -> dict[str, str]:
    """records/<format>__<bin>.json, results.json, report.md and the plots; -> the plot files."""
    from kvq.eval.report import markdown, plot_all

    out.mkdir(parents=True, exist_ok=True)
    rec_dir = out / "records"
    rec_dir.mkdir(exist_ok=True)
    for r in result["records"]:
        name = f"{file_stem(r['kv_cache_dtype']['requested'])}__{r['context_length_bin']}.json"
        (rec_dir / name).write_text(json.dumps(r, indent=1))
    (out / "results.json").write_text(json.dumps(result, indent=1))
    plots = plot_all(result, out)
    (out / "report.md").write_text(markdown(result, plots))
    return plots


def cmd_eval(args: argparse.Namespace) -> int:
    from kvq.eval.runner import run_eval, validate

    if args.report_only:
        path = Path(args.out) / "results.json"
        if not path.is_file():
            raise FileNotFoundError(f"--report-only needs {path} from an earlier run")
        write_outputs(json.loads(path.read_text()), Path(args.out))
        print(f"[kvq eval] report: {Path(args.out) / 'report.md'}", file=sys.stderr)
        return 0
    s = settings_from_args(args)
    validate(s)
    print(f"[kvq eval] {s.model}: baseline {s.baseline}, {len(s.formats)} formats, bins {list(s.bins)}, "
          f"passkey bins {list(s.passkey_bins)} x {s.passkey_trials} haystack(s) -> {args.out}",
          file=sys.stderr, flush=True)
    result = run_eval(s)
    write_outputs(result, Path(args.out))
    counts: dict[str, int] = {}
    for r in result["records"]:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"[kvq eval] {len(result['records'])} records ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}) "
          f"in {result['meta']['seconds']:.0f} s; report: {Path(args.out) / 'report.md'}", file=sys.stderr)
    print(what_to_use(result))
    return 0


def what_to_use(result: dict) -> str:
    """The report's *What to use*, as plain text for the terminal."""
    import re

    from kvq.eval.recommend import advice_lines

    lines = advice_lines(result["records"], result["meta"]["baseline"])
    plain = [re.sub(r"\*\*|`", "", ln) for ln in lines]
    bins = sorted({r["context_length_bin"] for r in result["records"]})
    return "\n".join(["", f"What to use (kvq eval at {', '.join(map(str, bins))} tokens):", *plain])
