"""``kvq env``: what this machine will use, and why, in one screen.

torch and its device, the attention backend and decode kernel each KV format
resolves to here (the same :func:`~kvq.attention.backends.select_backend` an
engine calls), CuPy for the CUDA decode kernel, Triton, NIXL for KV transfer,
the default model and its converted copy, and the torch threads an engine
would set.  ``--json`` prints the same as one object.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import_error(module: str) -> str | None:
    """None if ``module`` imports, else why not (one line)."""
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a broken install raises anything; report it, do not fail
        return f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
    return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return platform.processor()


def collect(model: str = "default", device: str = "auto") -> dict:
    import torch

    from kvq.attention.backends import cuda_extra
    from kvq.attention.cuda import decode8
    from kvq.engine.config import resolve_device, resolve_dtype, resolve_threads
    from kvq.models.source import model_shape, resolve_model

    dev = resolve_device(device)
    dtype = resolve_dtype("auto", dev)
    info: dict = {
        "kvq": _version("kvq"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": {"name": _cpu_name(), "cores": os.cpu_count()},
        "torch": {"version": torch.__version__, "built_for_cuda": torch.version.cuda,
                  "cuda_available": torch.cuda.is_available()},
        "device": str(dev),
        "compute_dtype": str(dtype).replace("torch.", ""),
    }
    if torch.cuda.is_available():
        info["torch"]["gpus"] = [
            {"name": torch.cuda.get_device_name(i),
             "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in range(torch.cuda.device_count())]
    threads = resolve_threads(None, dev)
    info["threads"] = {
        "engine": threads if threads is not None else torch.get_num_threads(),
        "why": (f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} is set" if os.environ.get("OMP_NUM_THREADS")
                else "kvq's CPU default; --threads N for more (one never stalls on a busy machine: README, Threads)"
                if dev.type == "cpu" else "torch's own with CUDA"),
    }
    cupy_err = _import_error("cupy") if importlib.util.find_spec("cupy") else "not installed"
    info["triton"] = {"version": _version("triton"), "error": _import_error("triton") if _version("triton") else
                      "not installed (pip install 'kvq[gpu]')"}
    info["cupy"] = {"version": _version("cupy-cuda13x") or _version("cupy-cuda12x") or _version("cupy"),
                    "error": cupy_err, "extra": cuda_extra()}
    why = decode8.unavailable_reason()
    info["cuda_decode_kernel"] = {"available": why is None, "why_not": why}
    info["nixl"] = {"version": _version("nixl"),
                    "error": _import_error("nixl") if _version("nixl") else
                    "not installed (KV transfer, `kvq serve --kv-role`, needs nixl)"}
    try:
        src = resolve_model(model)
        shape = model_shape(src)
        from kvq.models.checkpoint_cache import cached_folder, cache_root

        info["model"] = {"name": src.name, "path": str(src.path), "layers": shape.num_layers,
                         "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
                         "converted_copy": str(cached_folder(src) or "") or None,
                         "cache_dir": str(cache_root()) if cache_root() else "off"}
    except (ValueError, FileNotFoundError) as e:
        info["model"] = {"name": model, "error": str(e)}
        return info
    rows = format_backends(shape, dev, dtype)
    info["formats"] = rows
    return info


def format_backends(shape, dev, dtype) -> list[dict]:
    """Per format of the registry: the backend and decode kernel per layer an engine on ``dev`` would
    resolve with ``--attention-backend auto``, its reason, and why each backend before it was passed over."""
    from kvq.attention.backends import AUTO_ORDER, compact_layers, get_backend, select_backend, select_prefill
    from kvq.cache.plan import KVCacheConfig
    from kvq.formats.registry import entries

    rows = []
    for e in entries():
        try:
            plan = KVCacheConfig(dtype=e.name).plan(shape)
            _, choice = select_backend("auto", plan, dev, dtype)
            choice = select_prefill("auto", choice, plan, dev)
        except ValueError as err:
            rows.append({"format": e.name, "backend": None, "decode_per_layer": None, "prefill": None,
                         "reason": str(err), "passed_over": {}})
            continue
        passed = {c: get_backend(c).unsupported_reason(plan, dev, dtype)
                  for c in AUTO_ORDER[:AUTO_ORDER.index(choice.resolved)]}
        rows.append({"format": e.name, "backend": choice.resolved,
                     "decode_per_layer": compact_layers(choice.decode_per_layer), "prefill": choice.prefill,
                     "prefill_reason": choice.prefill_reason, "reason": choice.reason,
                     "passed_over": passed})
    return rows


def _line(name: str, value: str) -> str:
    return f"{name:<18}{value}"


def render(info: dict) -> str:
    t = info["torch"]
    out = [_line("kvq", f"{info['kvq']}  (Python {info['python']}, {info['platform']})"),
           _line("cpu", f"{info['cpu']['name']}, {info['cpu']['cores']} cores"),
           _line("torch", f"{t['version']}, built for CUDA {t['built_for_cuda'] or '- (CPU build)'}")]
    for g in t.get("gpus", []):
        out.append(_line("gpu", f"{g['name']} (sm_{g['capability'].replace('.', '')}, {g['memory_gib']} GiB)"))
    out.append(_line("device", f"{info['device']}, computes in {info['compute_dtype']}"))
    out.append(_line("threads", f"{info['threads']['engine']} ({info['threads']['why']})"))
    tr, cp, nx, ck = info["triton"], info["cupy"], info["nixl"], info["cuda_decode_kernel"]
    out.append(_line("triton", tr["version"] if not tr["error"] else f"{tr['version'] or '-'}: {tr['error']}"))
    out.append(_line("cupy", cp["version"] if not cp["error"] else f"{cp['error']} (pip install '{cp['extra']}')"))
    out.append(_line("cuda decode", "available (8-bit and KIVI layers decode through decode8.cu)" if ck["available"]
                     else f"not here: {ck['why_not']}"))
    out.append(_line("nixl", nx["version"] if not nx["error"] else nx["error"]))
    m = info["model"]
    if "error" in m:
        out.append(_line("model", f"{m['name']}: {m['error']}"))
        return "\n".join(out)
    out.append(_line("model", f"{m['name']} ({m['layers']} layers, {m['kv_heads']} KV heads, head_dim "
                              f"{m['head_dim']}): {m['path']}"))
    out.append(_line("converted copy", m["converted_copy"] or f"none yet (the first load writes it under "
                                                                f"{m['cache_dir']})"))
    out.append("")
    out.append(f"{'format':<22}{'backend':<9}{'prefill':<17}decode kernel per layer")
    for r in info["formats"]:
        out.append(f"{r['format']:<22}{r['backend'] or '-':<9}{r['prefill'] or '-':<17}"
                   f"{r['decode_per_layer'] or r['reason']}")
    passed: dict[str, list[str]] = {}  # "backend: why" -> the formats it was passed over for
    for r in info["formats"]:
        for cand, why in r["passed_over"].items():
            passed.setdefault(f"{cand}: {why}", []).append(r["format"])
    if passed:
        out.append("")
    for what, fmts in passed.items():
        out.append(f"passed over  {what}" + ("" if len(fmts) == len(info["formats"]) else f" ({', '.join(fmts)})"))
    for why in dict.fromkeys(r.get("prefill_reason") for r in info["formats"] if r.get("prefill_reason")):
        out.append(f"prefill      {why}")
    return "\n".join(out)


def cmd_env(args: argparse.Namespace) -> int:
    info = collect(args.model or "default", args.device)
    print(json.dumps(info, indent=1) if args.json else render(info))
    return 0


def register(sub) -> None:
    p = sub.add_parser("env", aliases=["info"], help="what this machine will use: device, backends, CuPy, NIXL",
                       description="Print what kvq will use on this machine, and why: torch and its device, the "
                       "attention backend, prefill kernel and decode kernel per layer for every KV format (as an "
                       "engine resolves them with --attention-backend auto), CuPy for the CUDA decode kernel, "
                       "Triton, NIXL, the default model and its converted copy, and the torch threads.")
    p.add_argument("--model", default=None, help="model whose shape the backends are resolved for (default: default)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_env)
