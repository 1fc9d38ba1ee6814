"""`kvq calibrate`: per-layer, per-head static FP8 scales measured on real text (docs/calibration.md).

The model runs over ``--num-tokens`` tokens of a text (``--text FILE``, default
kvq's reference text) in windows of ``--window`` tokens, with its KV cache in
the model dtype; after each window's prefill the engine hands the window's
cached K and V (post-RoPE, what the cache stores) to a collector, and an
observer turns them into one scale per layer, K/V and KV head
(:func:`kvq.calibration.scales.scales_from_stats`).  The file is what
``--kv-scales FILE`` loads.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvq.calibration import OBSERVERS

STATIC_FORMATS = ("fp8_e4m3", "fp8_e5m2")


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="measure static FP8 KV scales per layer and head on a text",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--model", default="default", help="the model (as --model of `kvq generate`; default: default)")
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3", help=f"the static format: {', '.join(STATIC_FORMATS)}")
    p.add_argument("--text", default=None, help="a UTF-8 text file (default: kvq's reference text)")
    p.add_argument("--num-tokens", type=int, default=8192, help="tokens of the text to run (default 8192)")
    p.add_argument("--window", type=int, default=1024, help="tokens per prefill (default 1024)")
    p.add_argument("--observer", default="absmax", help=f"{', '.join(OBSERVERS)} (mse: the clip with the least "
                   "FP8 round-trip error per head, searched between 0.5 and 1.0 of the absmax; default absmax)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--out", required=True, help="the scales file to write (safetensors)")
    p.set_defaults(func=cmd_calibrate)


def check_args(args) -> None:
    if args.kv_cache_dtype not in STATIC_FORMATS:
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype!r} takes no static scales; valid: "
                         f"{', '.join(STATIC_FORMATS)}")
    if args.observer not in OBSERVERS:
        raise ValueError(f"unknown --observer {args.observer!r}; valid: {', '.join(OBSERVERS)}")
    for name in ("num_tokens", "window"):
        if getattr(args, name) < 16:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 16, got {getattr(args, name)}")
    if args.text is not None:
        from pathlib import Path

        if not Path(args.text).is_file():
            raise ValueError(f"--text {args.text}: no such file")


def calibrate(model: str, fmt: str, text: str, num_tokens: int, window: int, observer: str, device: str = "auto",
              progress=None):
    """-> :class:`~kvq.cache.scales_file.KVScales` of ``model`` for ``fmt`` (module docstring)."""
    import torch

    from kvq.attention import reference
    from kvq.cache.pool import encode_table
    from kvq.cache.scales_file import KVScales
    from kvq.calibration.scales import scales_from_stats
    from kvq.engine.llm_engine import EngineConfig, LLMEngine
    from kvq.connectors.kv_export import KVExporter
    from kvq.engine.sampling_params import SamplingParams
    from kvq.formats import fp8
    from kvq.formats.registry import resolve_format
    from kvq.models.source import resolve_model
    from kvq.models.identity import model_identity

    class Collector(KVExporter):
        def __init__(self):
            self.kv: dict[tuple[int, str], list[torch.Tensor]] = {}

        def export(self, request_id, pool, table, num_tokens, tag):
            ids = torch.tensor(encode_table(table), dtype=torch.int64, device=pool.device)
            for i, layer in enumerate(pool.layers):
                for role in ("k", "v"):
                    x = reference.gather_kv(layer, role, ids, num_tokens, torch.float32).transpose(0, 1)
                    self.kv.setdefault((i, role), []).append(x.cpu())  # [n, H, D]
            return None

    engine = LLMEngine(EngineConfig(model=model, device=device, max_model_len=window + 1, max_num_seqs=1,
                                    max_num_batched_tokens=max(2048, window), progress=False,
                                    enable_prefix_caching=False))
    if engine.tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer (dummy weights): calibration needs real text")
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"][:num_tokens]
    if len(ids) < 16:
        raise ValueError(f"the text has {len(ids)} tokens; calibration needs at least 16")
    collector = Collector()
    engine.add_connector("kv_export", exporter=collector)
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    for w, chunk in enumerate(windows):
        engine.add_request(chunk, SamplingParams(max_tokens=1, temperature=0), kv_transfer="calibrate")
        while engine.has_unfinished():
            engine.step()
        if progress:
            progress(w + 1, len(windows))
    tf = resolve_format(fmt, "k", model_dtype=engine.plan.model.dtype)
    store = fp8.torch_dtype(tf.storage)
    scales = {}
    for i in range(len(engine.pool.layers)):
        k, v = (scales_from_stats(torch.cat(collector.kv[(i, r)]), tf.qmax, observer, store) for r in ("k", "v"))
        scales[i] = (k, v)
    ident = model_identity(resolve_model(model))
    meta = {"config_hash": ident.config_hash, "weights_hash": ident.weights_hash, "storage": tf.storage,
            "observer": observer, "tokens": len(ids), "window": window, "model": model}
    return KVScales(scales, meta)


def cmd_calibrate(args: argparse.Namespace) -> int:
    check_args(args)
    if args.text is None:
        from kvq.text import TEXT_SOURCE, reference_text

        text, source = reference_text(), TEXT_SOURCE
    else:
        with open(args.text, encoding="utf-8") as f:
            text, source = f.read(), args.text
    t0 = time.perf_counter()

    def progress(done: int, total: int) -> None:
        print(f"\r[kvq calibrate] window {done}/{total}", end="" if done < total else "\n", file=sys.stderr,
              flush=True)

    result = calibrate(args.model, args.kv_cache_dtype, text, args.num_tokens, args.window, args.observer,
                       args.device, progress)
    result.meta["text"] = str(source)[:200]
    result.save(args.out)
    k = [float(s[0].max()) for s in result.scales.values()]
    print(f"[kvq calibrate] {len(result.scales)} layers, {result.meta['tokens']} tokens, observer "
          f"{args.observer}: K scales {min(k):.4g}..{max(k):.4g}; wrote {args.out} in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
