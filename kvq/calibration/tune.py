"""`kvq tune`: a KV format per layer and per K/V, under a bits budget, written as a plan file.

1. Sensitivity (:mod:`kvq.calibration.sensitivity`): for every layer, K and V, and
   candidate format, the mean token KL against the model dtype with only that
   tensor quantized, through the real cache with the plan's windows, on the last
   ``passages x context`` tokens of a text.
2. Solver (:mod:`kvq.calibration.solver`): exact least summed KL with the bytes of
   one cache block (sidecars included) at most the budget.
3. Validation: ``kvq eval`` of the plan beside every uniform candidate format of at
   most the plan's bytes (same windows, same block size), on the *start* of the
   text (held out: the sensitivity read only its end).  The plan is kept only if
   its mean KL is below the best such uniform format's at every bin; otherwise the
   file holds that uniform format, and says so.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from kvq.calibration.sensitivity import DEFAULT_K, DEFAULT_V

DEFAULT_SINKS, DEFAULT_RESIDUAL, DEFAULT_BLOCK = 4, 128, 32

DESCRIPTION = __doc__.replace(":mod:", "")


def _csv(kind):
    def parse(s: str):
        try:
            return tuple(kind(x.strip()) for x in s.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {s!r}") from None
    return parse


def register(sub) -> None:
    p = sub.add_parser("tune", help="choose a KV format per layer and K/V under a bits budget (a plan file)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="the model (as --model of `kvq generate`; default: default)")
    b = p.add_argument_group("budget (one of)")
    b.add_argument("--budget", type=float, default=None, metavar="BITS",
                   help="bits per cached value of the resident blocks, sidecars (scales, zero points) included; "
                        "int4_kivi is 5.0, int2_kivi 3.0, fp8_e4m3 8.0 (the sink and recent windows, the same for "
                        "every choice, are reported apart)")
    b.add_argument("--budget-bytes-per-token", type=float, default=None, metavar="BYTES",
                   help="the same budget as bytes per token over all layers, K and V")
    c = p.add_argument_group("what to choose among")
    c.add_argument("--candidates-k", type=_csv(str), default=DEFAULT_K, metavar="SPECS",
                   help=f"formats for K, name[:gN] (default {','.join(DEFAULT_K)}; the model dtype always)")
    c.add_argument("--candidates-v", type=_csv(str), default=DEFAULT_V, metavar="SPECS",
                   help=f"formats for V (default {','.join(DEFAULT_V)})")
    c.add_argument("--kv-sink-tokens", type=int, default=DEFAULT_SINKS, help=f"sink tokens (default {DEFAULT_SINKS})")
    c.add_argument("--kv-residual-tokens", type=int, default=DEFAULT_RESIDUAL,
                   help=f"recent window in the model dtype (default {DEFAULT_RESIDUAL})")
    c.add_argument("--block-size", type=int, default=DEFAULT_BLOCK,
                   help=f"cache block size (default {DEFAULT_BLOCK}; KIVI K groups must divide it)")
    m = p.add_argument_group("sensitivity")
    m.add_argument("--text", default=None, metavar="FILE", help="UTF-8 text (default: kvq's reference text)")
    m.add_argument("--context", type=int, default=2048, help="tokens per pass (default 2048)")
    m.add_argument("--scored", type=int, default=256, help="scored positions at the end of each pass (default 256)")
    m.add_argument("--passages", type=int, default=4, help="passes, from the end of the text (default 4)")
    m.add_argument("--sensitivity", type=_csv(str), default=None, metavar="FILE[,...]",
                   help="reuse sensitivities saved by --save-sensitivity, or the shards of one measurement "
                        "(checked: same model, candidates, windows, passes, text; every tensor present)")
    m.add_argument("--save-sensitivity", default=None, metavar="FILE", help="save the measured sensitivities")
    m.add_argument("--shard", default=None, metavar="K/N",
                   help="measure only the K-th of N shares of the single-tensor plans, save them "
                        "(--save-sensitivity) and stop: run N such processes (one per GPU, or several on one), "
                        "then pass their files to --sensitivity")
    v = p.add_argument_group("validation")
    v.add_argument("--validate-bins", type=_csv(int), default=(512, 2048), metavar="BINS",
                   help="kvq eval bins on the held-out start of the text (default 512,2048); "
                        "--no-validate skips the check")
    v.add_argument("--validate-passages", type=int, default=4, help="kvq eval passages (default 4)")
    v.add_argument("--no-validate", action="store_true", help="write the solver's plan without the check")
    v.add_argument("--validate-out", default=None, metavar="DIR", help="also write the kvq eval outputs here")
    e = p.add_argument_group("engine")
    e.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    e.add_argument("--dtype", default="float32",
                   help="compute dtype of the measurement and the validation (default float32: in bfloat16 the "
                        "rounding of another kernel path alone moves the KL by ~1e-3 per tensor on an H200, more "
                        "than an 8- or 4-bit tensor does; on a GPU float32 runs the torch reference attention)")
    e.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: kvq's)")
    p.add_argument("--name", default=None, help="the plan's name in reports (default tuned-<bits>b)")
    p.add_argument("--out", default=None, metavar="PLAN.json", help="the plan file to write (required but with --shard)")  # noqa: E501
    p.add_argument("--no-progress", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_tune)


def check_args(args) -> None:
    """Flag ranges (ValueError: exit 2), before any model file is read."""
    from kvq.engine.args import check_range

    if args.shard is None and (args.budget is None) == (args.budget_bytes_per_token is None):
        raise ValueError("give exactly one of --budget BITS and --budget-bytes-per-token BYTES")
    if args.shard is None and not args.out:
        raise ValueError("--out PLAN.json is required (the plan file to write)")
    for flag, val in (("--budget", args.budget), ("--budget-bytes-per-token", args.budget_bytes_per_token)):
        if val is not None and not 0 < val < float("inf"):
            raise ValueError(f"{flag} must be a positive number, got {val}")
    for flag, val, low in (("--kv-sink-tokens", args.kv_sink_tokens, 0), ("--kv-residual-tokens",
                           args.kv_residual_tokens, 0), ("--block-size", args.block_size, 1),
                           ("--context", args.context, 1), ("--scored", args.scored, 1),
                           ("--passages", args.passages, 1), ("--validate-passages", args.validate_passages, 1)):
        check_range(flag, val, low)
    if args.scored + args.block_size > args.context:
        raise ValueError(f"--scored {args.scored} leaves no context in --context {args.context}")
    for flag, paths in (("text", [args.text] if args.text else []), ("sensitivity", args.sensitivity or [])):
        for path in paths:
            if not Path(path).is_file():
                raise ValueError(f"--{flag} {path}: no such file")
    if args.shard is not None:
        k, _, n = args.shard.partition("/")
        if not (k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
            raise ValueError(f"--shard must be K/N with 0 <= K < N, got {args.shard!r}")
        if not args.save_sensitivity or args.sensitivity:
            raise ValueError("--shard measures a share and saves it: give --save-sensitivity, not --sensitivity")
    if not args.candidates_k and not args.candidates_v:
        raise ValueError("no candidates: give --candidates-k and/or --candidates-v")


def budget_bytes(shape, block_size: int, bits: float | None, bytes_per_token: float | None) -> int:
    """The budget as bytes of one block over all layers, K and V."""
    values = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * block_size
    if bits is not None:
        return int(bits * values / 8 + 1e-9)
    return int(bytes_per_token * block_size + 1e-9)


def solver_items(shape, space, sens):
    """Per (layer, role), the options: the model dtype (loss 0) and each candidate (its measured KL)."""
    from kvq.cache.plan_file import parse_tensor_spec
    from kvq.calibration.solver import Option

    H, D, bs = shape.num_kv_heads, shape.head_dim, space.block_size
    keys, items = [], []
    for i in range(shape.num_layers):
        for role, cands in (("k", space.candidates_k), ("v", space.candidates_v)):
            hp = parse_tensor_spec("auto", role, shape.dtype)
            opts = [Option("auto", hp.block_bytes(H, D, bs), 0.0)]
            for spec in cands:
                t = parse_tensor_spec(spec, role, shape.dtype)
                opts.append(Option(spec, t.block_bytes(H, D, bs), sens.kl[(i, role, spec)]))
            keys.append((i, role))
            items.append(opts)
    return keys, items


def uniform_specs(space, shape, max_bytes: int) -> list[str]:
    """The candidates (of K or V) that can store both K and V at the block size, as uniform formats of
    at most ``max_bytes`` per block (if none, the cheapest one), as kvq eval specs with the tune's windows."""
    from kvq.cache.plan_file import parse_tensor_spec

    H, D, bs = shape.num_kv_heads, shape.head_dim, space.block_size
    cost = {}
    for spec in dict.fromkeys((*space.candidates_k, *space.candidates_v)):
        try:
            ts = [parse_tensor_spec(spec, r, shape.dtype) for r in "kv"]
            for t in ts:
                t.check_shape(H, D, bs)
        except ValueError:
            continue  # e.g. a V group of 64 channels is no K group inside a block of 32 tokens
        cost[spec] = shape.num_layers * sum(t.block_bytes(H, D, bs) for t in ts)
    fit = [s for s in cost if cost[s] <= max_bytes] or sorted(cost, key=cost.get)[:1]
    return [f"{s}:r{space.residual_tokens}:s{space.sink_tokens}" for s in fit]


def make_plan_file(shape, space, name: str, layers, meta: dict):
    from kvq.calibration.sensitivity import model_entry
    from kvq.cache.plan_file import PlanFile

    return PlanFile(name=name, model=model_entry(shape), layers=tuple(layers), sink_tokens=space.sink_tokens,
                    residual_tokens=space.residual_tokens, block_size=space.block_size, meta=meta)


def validate_plan(args, shape, space, plan_path: str, uniforms: list[str], held_out_tokens: int) -> dict:
    """kvq eval of the plan and the uniform formats on the held-out start of the text."""
    from kvq.cache.plan import KVCacheConfig
    from kvq.eval.runner import PLAN_PREFIX, EvalSettings, run_eval

    s = EvalSettings(model=args.model, formats=(*uniforms, PLAN_PREFIX + plan_path), bins=tuple(args.validate_bins),
                     window=128, passages=args.validate_passages, greedy_tokens=0, passkey_bins=(), passkey_trials=0,
                     device=args.device, dtype=args.dtype, kv=KVCacheConfig(block_size=space.block_size),
                     text_file=args.text, text_tokens=held_out_tokens, progress=not args.no_progress,
                     threads=args.threads or 1)
    result = run_eval(s)
    if args.validate_out:
        from kvq.eval.command import write_outputs

        write_outputs(result, Path(args.validate_out))
    table: dict[str, dict[int, dict]] = {}
    for r in result["records"]:
        q = r["quality_by_bin"][str(r["context_length_bin"])]
        table.setdefault(r["kv_cache_dtype"]["requested"], {})[r["context_length_bin"]] = {
            "kl_mean": q["kl_mean"], "kl_mean_ci95": q.get("kl_mean_ci95"), "ppl_rel_change": q["ppl_rel_change"],
            "ppl_rel_change_ci95": q.get("ppl_rel_change_ci95"),
            "bits_per_value": r["kv_cache_capacity"]["bits_per_value"],
            "bytes_per_sequence_at_bin": r["kv_cache_capacity"]["bytes_per_sequence_at_bin"]}
    return table


def cmd_tune(args: argparse.Namespace) -> int:
    check_args(args)
    from kvq.calibration import sensitivity as S
    from kvq.calibration.solver import solve
    from kvq.models.source import model_shape

    shape = model_shape(args.model)
    ck = S.check_candidates(shape, args.candidates_k, "k", args.block_size)
    cv = S.check_candidates(shape, args.candidates_v, "v", args.block_size)
    budget = budget_bytes(shape, args.block_size, args.budget, args.budget_bytes_per_token) if not args.shard else 0
    values = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * args.block_size

    def say(msg: str) -> None:
        print(f"[kvq tune] {msg}", file=sys.stderr, flush=True)

    from kvq.eval.data import eval_token_ids, tokens_sha256
    from kvq.models.loader import load_tokenizer
    from kvq.models.source import resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model))
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer: kvq tune measures on real text")
    ids = eval_token_ids(tokenizer, args.text)
    space = S.Space(args.model, ck, cv, args.kv_sink_tokens, args.kv_residual_tokens, args.block_size,
                    args.context, args.scored, args.passages)
    windows = S.calibration_windows(ids, space)
    space = S.Space(**{**space.__dict__, "text_sha256": tokens_sha256([t for w in windows for t in w])})
    t0 = time.perf_counter()
    if args.sensitivity:
        parts = [S.Sensitivity.load(p) for p in args.sensitivity]
        for path, part in zip(args.sensitivity, parts):
            if part.space != space:
                diff = [k for k in space.__dict__ if getattr(part.space, k) != getattr(space, k)]
                raise ValueError(f"--sensitivity {path} was measured for other settings ({', '.join(diff)})")
        sens = S.merge(parts)
        gaps = S.missing(sens, shape.num_layers)
        if gaps:
            raise ValueError(f"--sensitivity: {len(gaps)} single-tensor plans were not measured, e.g. layer "
                             f"{gaps[0][0]} {gaps[0][1].upper()} {gaps[0][2]} (a shard missing?)")
        say(f"sensitivities from {', '.join(args.sensitivity)} ({len(sens.kl)} tensors x formats)")
        if args.save_sensitivity:
            sens.save(args.save_sensitivity)
    else:
        shard = tuple(int(x) for x in args.shard.split("/")) if args.shard else (0, 1)
        n = len(S.all_jobs(space, shape.num_layers)[shard[0]::shard[1]])
        say(f"{args.model}: measuring {n} single-tensor plans ({shape.num_layers} layers x K {len(ck)} + V {len(cv)} "
            f"formats), {args.passages} passes of {args.context} tokens, {args.scored} scored each")

        def progress(done, total, key, kl):
            if not args.no_progress and (done == total or done % max(1, total // 20) == 0):
                say(f"  {done}/{total}  layer {key[0]} {key[1].upper()} {key[2]}: KL {kl:.3g}  "
                    f"({time.perf_counter() - t0:.0f} s)")

        sens = S.measure(space, windows, device=args.device, dtype=args.dtype, threads=args.threads, shard=shard,
                         progress=progress)
        if args.save_sensitivity:
            sens.save(args.save_sensitivity)
            say(f"sensitivities saved to {args.save_sensitivity}")
        if args.shard:
            say(f"shard {args.shard} done in {time.perf_counter() - t0:.0f} s; merge the shards with --sensitivity")
            return 0
    keys, items = solver_items(shape, space, sens)
    sol = solve(items, budget)
    layers = [["auto", "auto"] for _ in range(shape.num_layers)]
    for (i, role), opts, j in zip(keys, items, sol.choice):
        layers[i][0 if role == "k" else 1] = opts[j].name
    bits = 8 * sol.cost / values
    name = args.name or f"tuned-{bits:.2f}b"
    counts: dict[str, int] = {}
    for (i, role), opts, j in zip(keys, items, sol.choice):
        counts[f"{role.upper()} {opts[j].name}"] = counts.get(f"{role.upper()} {opts[j].name}", 0) + 1
    say(f"plan {name}: {bits:.3f} bits per value (budget {8 * budget / values:.3f}), predicted KL {sol.loss:.4g} "
        f"(sum over tensors); " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    meta = {"tool": "kvq tune", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "model": args.model,
            "budget_bits_per_value": 8 * budget / values, "bits_per_value": bits,
            "bytes_per_token": sol.cost / args.block_size, "predicted_kl_sum": sol.loss,
            "sensitivity": {"space": space.__dict__, **sens.meta,
                            "chosen": {f"{i}{r}": sens.kl.get((i, r, layers[i][0 if r == "k" else 1]), 0.0)
                                       for i in range(shape.num_layers) for r in "kv"}},
            "kept": "tuned"}
    pf = make_plan_file(shape, space, name, [tuple(x) for x in layers], meta)
    if not args.no_validate:
        held_out = len(ids) - (args.context + 1) * args.passages
        uniforms = uniform_specs(space, shape, sol.cost)
        say(f"validating against {', '.join(uniforms)} at bins {list(args.validate_bins)} on the first {held_out} "
            "tokens of the text (held out)")
        with tempfile.TemporaryDirectory(prefix="kvq-tune-") as tmp:
            path = str(Path(tmp) / "plan.json")
            pf.save(path)
            table = validate_plan(args, shape, space, path, uniforms, held_out)
        mine = table[f"plan:{name}"]
        rivals = {k: v for k, v in table.items() if k not in (f"plan:{name}", "auto")}
        best = {L: min(rivals, key=lambda k: rivals[k][L]["kl_mean"]) for L in mine}
        beats = all(mine[L]["kl_mean"] < rivals[best[L]][L]["kl_mean"] for L in mine)
        for L in sorted(mine):
            r = rivals[best[L]][L]
            say(f"  bin {L}: plan KL {mine[L]['kl_mean']:.4g}, Δppl {100 * mine[L]['ppl_rel_change']:+.2f}%; best "
                f"uniform {best[L]} KL {r['kl_mean']:.4g}, Δppl {100 * r['ppl_rel_change']:+.2f}%")
        meta["validation"] = {"bins": list(args.validate_bins), "held_out_tokens": held_out, "results": {
            k: {str(L): v for L, v in per.items()} for k, per in table.items()}, "beats_best_uniform": beats}
        if not beats:
            top = max(mine)
            keep = best[top].split(":")[0]
            g = [o for o in best[top].split(":")[1:] if o.startswith("g")]
            spec = keep + (f":{g[0]}" if g else "")
            meta["kept"] = f"uniform {spec}"
            say(f"the tuned plan does not beat {best[top]} at every bin: writing {spec} for every layer instead")
            pf = make_plan_file(shape, space, f"uniform-{spec.replace(':', '-')}",
                                [(spec, spec)] * shape.num_layers, meta)
    pf.save(args.out)
    say(f"wrote {args.out} ({pf.name}) in {time.perf_counter() - t0:.0f} s; use it with --kv-cache-plan {args.out}")
    return 0

