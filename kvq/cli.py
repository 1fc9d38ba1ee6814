"""The ``kvq`` command line.

Every subcommand reports bad input as ``kvq: error: ...`` naming the valid
choices, and exits with code 2 (argparse's convention for usage errors).

Signals while it starts: run as a program (:func:`main` without ``argv``: the ``kvq`` script,
``python -m kvq``, ``python -m kvq.cli``), SIGINT or SIGTERM from the first line of :func:`main`
until the command takes over stop the process at once, with one line on stderr and exit status
128 + the signal (130, 143), never a traceback.  ``kvq serve`` then installs its own handlers for
the model's loading and its drain (kvq/server/command.py); the other commands get Python's back.
So this module imports only the standard library at its top (numpy, torch and the rest load after
:func:`main` has begun): what is left is the interpreter's own start-up, the ~40 ms before any of
kvq's code runs, where Python's handlers answer.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvq.cache.plan import CachePlan

# kvq.engine.args' flag helpers, still importable from here (module __getattr__: loaded when first used)
_ARGS_NAMES = frozenset({"UsageError", "add_device_args", "add_engine_args", "add_kv_args", "add_model_args",
                         "check_range", "engine_config_from_args", "kv_config_from_args", "plan_from_args",
                         "shape_from_args"})


def __getattr__(name: str):
    if name in _ARGS_NAMES:
        from kvq.engine import args

        return getattr(args, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag raises :class:`UsageError`: :func:`main` reports every usage error
    the same way, in one line with exit code 2 (``--help`` still exits 0 through SystemExit)."""

    def error(self, message: str):
        from kvq.engine.args import UsageError

        raise UsageError(f"{message} (see `{self.prog} --help`)")


# -- kvq formats ---------------------------------------------------------------------------------
def cmd_formats(args: argparse.Namespace) -> int:
    from kvq.cache.plan import make_plan
    from kvq.engine.args import shape_from_args
    from kvq.formats.registry import entries, resolve_kv

    shape = shape_from_args(args) if (args.model or args.num_layers) else None
    here = _backends_here(shape) if shape is not None and args.model else {}
    rows = []
    for e in entries():
        fmt = resolve_kv(e.name, model_dtype=shape.dtype if shape else "bfloat16")
        row = {
            "name": e.name,
            "aliases": list(e.aliases),
            "summary": e.summary,
            "bits": {"k": fmt.k.bits, "v": fmt.v.bits},
            "scale": {"k": fmt.k.describe_scale(), "v": fmt.v.describe_scale()},
            "default_sink_tokens": e.default_sink_tokens,
            "default_residual_tokens": e.default_residual_tokens,
            "reference_only": fmt.k.reference_only,
        }
        if shape is not None:
            plan = make_plan(shape, e.name, residual_tokens=0, sink_tokens=0)
            row["model"] = shape.name
            row["bytes_per_token"] = plan.bytes_per_token
            values = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
            row["bits_per_value"] = 8 * plan.bytes_per_token / values
            row["ratio_vs_model_dtype"] = plan.ratio_vs_model_dtype
        if e.name in here:
            row["backend"], row["decode_per_layer"] = here[e.name]
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    head = f"{'format':<20} {'aliases':<26} {'bits k/v':<9} "
    head += f"{'B/token':>9} {'x model':>8}  " if shape else ""
    print(head + "scale (K; V)")
    for r in rows:
        line = f"{r['name']:<20} {','.join(r['aliases']) or '-':<26} {r['bits']['k']}/{r['bits']['v']:<7} "
        if shape:
            line += f"{r['bytes_per_token']:>9.1f} {r['ratio_vs_model_dtype']:>7.2f}x  "
        scale = r["scale"]["k"] if r["scale"]["k"] == r["scale"]["v"] else f"{r['scale']['k']}; {r['scale']['v']}"
        print(line + scale + ("  [reference only]" if r["reference_only"] else "")
              + (f"  -> {r['decode_per_layer']}" if "decode_per_layer" in r else ""))
    if shape:
        print(f"\nbytes per token across all {shape.num_layers} layers of {shape.name}, K+V, scales included, "
              f"without sink/residual windows (`kvq plan` counts those)")
    return 0


def _backends_here(shape) -> dict[str, tuple[str, str]]:
    """format -> (backend, "device: decode kernel per layer") on this machine's default device
    (:func:`kvq.environment.format_backends`; `kvq env` says why)."""
    from kvq.engine.config import resolve_device, resolve_dtype
    from kvq.environment import format_backends

    dev = resolve_device("auto")
    return {r["format"]: (r["backend"], f"{dev.type}: {r['decode_per_layer']}")
            for r in format_backends(shape, dev, resolve_dtype("auto", dev)) if r["backend"]}


# -- kvq plan ------------------------------------------------------------------------------------
def plan_record(plan: CachePlan, memory: int, context_len: int | None) -> dict:
    from dataclasses import asdict

    cap = plan.capacity(memory, context_len)
    m = plan.model
    layer0 = next((f for f in plan.layers if f.is_quantized), plan.layers[0])
    return {
        "model": m.name,
        "model_shape": asdict(m),
        "kv_cache_dtype": f"plan:{plan.label}" if plan.label else layer0.requested or layer0.name,
        "k_format": layer0.k.name,
        "v_format": layer0.v.name,
        "layers": plan.layer_names(),
        "skip_layers": list(plan.skip_layers),
        "block_size": plan.block_size,
        "sink_tokens": plan.sink_tokens,
        "residual_tokens": plan.residual_tokens,
        "planes": {
            role: [asdict(p) for p in getattr(layer0, role).planes(m.num_kv_heads, m.head_dim, plan.block_size)]
            for role in ("k", "v")
        },
        "bytes_per_block": plan.bytes_per_block,
        "hp_bytes_per_block": plan.hp_bytes_per_block,
        "bytes_per_token": plan.bytes_per_token,
        "ratio_vs_model_dtype": plan.ratio_vs_model_dtype,
        "capacity": asdict(cap),
        **({"tiers": _tier_record(plan, memory)} if plan.tiers else {}),
    }


def _tier_record(plan: CachePlan, memory: int) -> dict:
    """Elastic precision: the ladder, its policies and what each tier holds of ``memory`` (kvq.cache.arena)."""
    from kvq.cache.arena import arena_layout

    lay = arena_layout(plan)
    slabs = lay.slabs_for(memory)
    rule = plan.tier_rule
    return {"policies": list(rule.policies), "ages": list(rule.ages), "bytes_per_slab": lay.bytes_per_slab,
            "slabs": slabs,
            "ladder": [{"tier": t, "format": name, "bytes_per_block": plan.tier_bytes_per_block(t),
                        "blocks_per_slab": lay.per_slab[t], "slab_unused": round(lay.waste(t), 4),
                        "blocks_if_all": slabs * lay.per_slab[t],
                        "tokens_if_all": slabs * lay.per_slab[t] * plan.block_size}
                       for t, name in enumerate(plan.tier_names())]}


def cmd_plan(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kvq.engine.args import UsageError, check_range, plan_from_args
    from kvq.units import format_bytes, parse_bytes

    check_range("--context-len", args.context_len, 1)
    memory = parse_bytes(args.memory)
    plan = plan_from_args(args)  # arithmetic only: no torch (the FP8 numerics check runs where pools are made)
    rec = plan_record(plan, memory, args.context_len)
    g = args.cpu_offload_gb
    if not 0 <= g < float("inf"):
        raise UsageError(f"--cpu-offload-gb must be a number of GiB >= 0, got {g}")
    if g:
        rec["cpu_offload"] = asdict(plan.capacity(int(g * (1 << 30)), args.context_len))
    check_range("--tensor-parallel-size", args.tensor_parallel_size, 1)
    if args.tensor_parallel_size > 1:
        from kvq.cache.partition import parallel_capacity

        rec["tensor_parallel"] = parallel_capacity(plan, args.tensor_parallel_size, memory, args.context_len)
    if args.json:
        print(json.dumps(rec, indent=2))
        return 0
    cap = rec["capacity"]
    print(f"model            {rec['model']}  ({plan.model.num_layers} layers, {plan.model.num_kv_heads} KV heads, "
          f"head_dim {plan.model.head_dim}, {plan.model.dtype})")
    if plan.label:
        counts: dict[str, int] = {}
        for name in plan.layer_names():
            counts[name] = counts.get(name, 0) + 1
        print(f"KV plan          {plan.label}: " + "; ".join(f"{n} x{c}" for n, c in counts.items()))
        print("per layer        " + " | ".join(f"{i}:{n}" for i, n in enumerate(plan.layer_names())))
    else:
        print(f"KV format        K {rec['k_format']}, V {rec['v_format']}"
              + (f"; layers {rec['skip_layers']} kept in {plan.hp.name}" if rec["skip_layers"] else ""))
    print(f"block size       {plan.block_size} tokens")
    print(f"bytes per block  {rec['bytes_per_block']}  (model dtype: {rec['hp_bytes_per_block']}, "
          f"{rec['ratio_vs_model_dtype']:.3f}x the tokens)")
    print(f"bytes per token  {rec['bytes_per_token']:.1f}")
    print(f"memory           {format_bytes(cap['memory_bytes'])}: {cap['num_blocks']} blocks, "
          f"{cap['num_tokens']} tokens")
    if plan.sink_tokens or plan.residual_tokens:
        print(f"windows          {plan.sink_tokens} sink + {plan.residual_tokens} recent tokens in {plan.hp.name}")
    if plan.tiers:
        tr = rec["tiers"]
        ages = f" (ages {', '.join(map(str, tr['ages']))} tokens)" if tr["ages"] else ""
        print(f"tiers            {'+'.join(tr['policies'])}{ages}; {tr['slabs']} slabs of "
              f"{format_bytes(tr['bytes_per_slab'])}")
        rule = plan.tier_rule
        if rule.sink_blocks or rule.residual_tokens:
            print(f"  never moved     {rule.sink_blocks} sink block(s) and the blocks of the last "
                  f"{rule.residual_tokens} tokens stay in tier 0 or the windows")
        for row in tr["ladder"]:
            print(f"  tier {row['tier']:<10} {row['format']:<20} {row['bytes_per_block']} bytes a block, "
                  f"{row['blocks_per_slab']} a slab ({100 * row['slab_unused']:.1f}% unused): "
                  f"{row['tokens_if_all']} tokens if all")
    print(f"at context {cap['context_len']:<6}{cap['sequences']} sequences ({cap['tokens_at_context']} tokens; "
          f"{cap['blocks_per_sequence']} resident + {cap['hp_blocks_per_sequence']} high-precision blocks each)")
    if g:
        host = rec["cpu_offload"]
        print(f"host tier        {format_bytes(host['memory_bytes'])}: {host['num_blocks']} blocks, "
              f"{host['num_tokens']} tokens; {host['sequences']} sequences of {host['context_len']} held at once "
              f"(swapped, or in the CPU prefix cache)")
    tp = rec.get("tensor_parallel")
    if tp:
        for r in tp["ranks"]:
            a, b = r["kv_heads"]
            print(f"rank {r['rank']:<12}KV heads {a}..{b - 1}: {r['bytes_per_token']:.1f} bytes per token, "
                  f"{r['num_blocks']} blocks fit {format_bytes(memory)}")
        print(f"{tp['size']} ranks          {format_bytes(memory)} each: {tp['num_blocks']} blocks on every rank "
              f"(the fewest any holds), {tp['num_tokens']} tokens, {format_bytes(tp['bytes_total'])} of KV in all"
              + (f"; each KV head on {tp['kv_head_replicas']} ranks" if tp["kv_head_replicas"] > 1 else ""))
    return 0


# -- kvq generate --------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    from kvq.engine.args import UsageError, engine_config_from_args
    from kvq.engine.llm import LLM
    from kvq.engine.sampling_params import SamplingParams
    from kvq.models.source import model_shape

    if not args.prompt:
        raise UsageError("the prompt is empty")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sample_seed, stop=tuple(args.stop or ()))
    config = engine_config_from_args(args)
    max_len = config.max_model_len or model_shape(config.model).max_position_embeddings  # the header only
    if args.max_tokens >= max_len:
        raise UsageError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in the "
                         f"{max_len}-token context (--max-model-len)")
    llm = LLM(config=config)
    info = llm.engine.info
    print(f"[kvq] {info['model']} on {info['device']} ({info['dtype']}); KV {info['kv_cache_dtype']['k']}/"
          f"{info['kv_cache_dtype']['v']}{llm.engine.describe_tiers()}, block {info['block_size']}; backend "
          f"{info['attention_backend']['resolved']} "
          f"({info['attention_backend']['reason']}), prefill {info['attention_backend']['prefill']}; "
          f"pool {info['kv_pool']['q_blocks']} blocks = "
          f"{info['kv_pool']['tokens']} tokens; {info['threads']} thread(s)" + llm.engine.describe_parallel(),
          file=sys.stderr, flush=True)
    prompt = args.prompt
    if not args.no_chat and llm.tokenizer is not None and getattr(llm.tokenizer, "chat_template", None):
        prompt = llm.apply_chat_template([{"role": "user", "content": prompt}])
    for delta in llm.stream(prompt, params):
        print(delta, end="", flush=True)
    print()
    return 0


# -- entry point -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from kvq.engine.args import add_engine_args, add_kv_args, add_model_args

    p = Parser(prog="kvq", description="kvq: an LLM inference engine core with a quantized, "
                                "paged KV cache.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    f = sub.add_parser("formats", help="list the KV cache formats", description="List every KV cache format, "
                       "its aliases, bits and scale granularity; with a model, its bytes per token.")
    add_model_args(f)
    f.add_argument("--json", action="store_true", help="print JSON")
    f.set_defaults(func=cmd_formats)

    pl = sub.add_parser("plan", help="bytes per block and capacity of a KV format for a model",
                        description="Bytes per cache block (all layers, K+V, scales included), and the blocks, "
                        "tokens and sequences that fit a memory budget.")
    add_model_args(pl)
    add_kv_args(pl)
    pl.add_argument("--memory", default="8GiB", help="memory budget for the KV cache (default 8GiB)")
    pl.add_argument("--context-len", type=int, default=None,
                    help="context length for per-sequence figures (default: the model's maximum)")
    pl.add_argument("--cpu-offload-gb", type=float, default=0.0,
                    help="also the host tier of that many GiB (swap, docs/offload.md): blocks are stored as on "
                         "the device, so the format's ratio holds there too")
    pl.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="split the KV heads over N ranks, --memory on each: per-rank bytes and the total")
    pl.add_argument("--json", action="store_true", help="print JSON")
    pl.set_defaults(func=cmd_plan)

    gen = sub.add_parser("generate", help="generate text with the paged, quantized KV cache",
                         description="Generate a completion (streamed) for one prompt, through the model's chat "
                         "template when it has one.")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default=None, help="'default', a .gguf file or an HF model folder")
    add_kv_args(gen)
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--no-chat", action="store_true", help="plain completion, no chat template")
    gen.set_defaults(func=cmd_generate)

    # Subcommands that live with their concept; each module's register(sub) adds its parser
    # (heavy imports stay inside the command functions).
    for module in ("kvq.eval.command", "kvq.server.command", "kvq.calibration.command", "kvq.calibration.tune",
                   "kvq.environment"):
        importlib.import_module(module).register(sub)
    return p


def _stop_starting(signum: int, frame) -> None:
    """SIGINT/SIGTERM before a command took over: nothing is open yet (no model, no socket), so
    exit now, whatever Python was doing (an import, the parser)."""
    code = 128 + signum
    who = "kvq serve" if sys.argv[1:2] == ["serve"] else "kvq"
    os.write(2, f"[{who}] {signal.Signals(signum).name} while starting: stopped (exit status {code})\n".encode())
    os._exit(code)


def _catch_startup_signals() -> dict | None:
    """Install :func:`_stop_starting` for SIGINT and SIGTERM; the handlers it replaced, or None
    where signals cannot be set (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return {sig: signal.signal(sig, _stop_starting) for sig in (signal.SIGINT, signal.SIGTERM)}


def main(argv: list[str] | None = None) -> int:
    """Run one command -> exit code: 0, or 2 with one line ``kvq: error: ...`` on stderr for bad
    input (flags, files, budgets), found before any model weights load.  ``argv`` None (the
    program's own arguments): signals while it starts end it at once (module docstring)."""
    previous = _catch_startup_signals() if argv is None else None

    def restore() -> None:
        for sig, handler in (previous or {}).items():
            signal.signal(sig, handler)

    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command != "serve":  # serve replaces them with its own (kvq/server/command.py)
            restore()
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:  # bad user input: named, exit code 2
        print(f"kvq: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main())
