"""Command-line options shared by every kvq command that plans a cache or builds an engine, and their
translation into :class:`~kvq.cache.plan.KVCacheConfig` / :class:`~kvq.engine.llm_engine.EngineConfig`.

It lives on the engine floor (as vLLM's engine arguments do) so that the commands above it (eval,
calibration, server, cli) share one set of flags without importing each other.  Bad input raises
:class:`UsageError`: the CLI prints it in one line and exits with code 2.
"""

from __future__ import annotations

import argparse

from kvq.cache.plan import CachePlan, KVCacheConfig, bare_model
from kvq.models.source import DEFAULT_MODEL, model_shape


class UsageError(ValueError):
    """Bad command-line input (exit code 2)."""


def check_range(flag: str, value, low=None, high=None, *, optional: bool = True) -> None:
    """UsageError unless ``low <= value <= high`` (either bound may be None); None passes if optional."""
    if value is None and optional:
        return
    if value is None or (low is not None and not value >= low) or (high is not None and not value <= high):
        valid = (f"in [{low}, {high}]" if low is not None and high is not None
                 else f">= {low}" if low is not None else f"<= {high}")
        raise UsageError(f"{flag} must be {valid}, got {value}")


# -- shared option groups -----------------------------------------------------------------------
def add_model_args(p: argparse.ArgumentParser, *, bare: bool = True) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="'default' (SmolLM2-135M-Instruct GGUF), a .gguf file or an HF "
                   "model folder (default: default)")
    if bare:
        g.add_argument("--num-layers", type=int, help="plan for a model not on disk: number of layers")
        g.add_argument("--num-kv-heads", type=int, help="... number of KV heads")
        g.add_argument("--head-dim", type=int, help="... head dimension")
        g.add_argument("--max-model-len", type=int, default=None, help="context length for per-sequence figures")
        g.add_argument("--dtype", default="bfloat16", help="... model dtype (bfloat16, float16, float32)")


def add_kv_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache format")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache format for K and V (see `kvq formats`; default: auto = model dtype)")
    g.add_argument("--kv-cache-dtype-k", default=None, help="format for K only (overrides --kv-cache-dtype)")
    g.add_argument("--kv-cache-dtype-v", default=None, help="format for V only (overrides --kv-cache-dtype)")
    g.add_argument("--kv-cache-dtype-skip-layers", nargs="+", default=(), metavar="LAYER",
                   help="layer indices, or 'sliding_window', kept in the model dtype")
    g.add_argument("--kv-sink-tokens", type=int, default=None,
                   help="first N tokens kept in high precision (default: 4 for KIVI, else 0)")
    g.add_argument("--kv-residual-tokens", type=int, default=None,
                   help="recent window kept in high precision (default: 128 for KIVI, else 0)")
    g.add_argument("--kivi-group-size", type=int, default=None, help="KIVI group size (default 32)")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per cache block (default 16, or a multiple of the KIVI group)")
    g.add_argument("--kv-cache-plan", default=None, metavar="PLAN.json",
                   help="formats per layer and K/V, and windows, from a plan file written by `kvq tune` "
                        "(instead of the format flags above; docs/calibration.md)")
    g.add_argument("--kv-cache-tiers", default=None, metavar="FORMAT[,FORMAT...]",
                   help="elastic precision: formats, each smaller than the one before, that sealed blocks move "
                        "down to, out of one byte budget (e.g. int4_kivi or int4_kivi,int2_kivi; docs/engine.md)")
    g.add_argument("--kv-tier-age", default=None, metavar="TOKENS[,TOKENS...]",
                   help="age policy: a block this many tokens behind its sequence's head moves to the next tier "
                        "(one per tier, or one for all: tier t at t x TOKENS)")
    g.add_argument("--kv-tier-policy", default=None, metavar="POLICY",
                   help="age, pressure (demote the coldest blocks instead of preempting) or age,pressure "
                        "(default: age with --kv-tier-age, else pressure)")


BARE_MODEL_DTYPES = ("bfloat16", "float16", "float32")


def shape_from_args(args: argparse.Namespace):
    bare = [args.num_layers, args.num_kv_heads, args.head_dim]
    if any(x is not None for x in bare):
        if args.model is not None:
            raise UsageError("give either --model or --num-layers/--num-kv-heads/--head-dim, not both")
        if any(x is None for x in bare):
            raise UsageError("a bare config needs all of --num-layers, --num-kv-heads and --head-dim")
        for flag, value in (("--num-layers", args.num_layers), ("--num-kv-heads", args.num_kv_heads),
                            ("--head-dim", args.head_dim), ("--max-model-len", args.max_model_len)):
            check_range(flag, value, 1)
        if args.dtype not in BARE_MODEL_DTYPES:
            raise UsageError(f"unknown --dtype {args.dtype!r} for a bare config; valid: {', '.join(BARE_MODEL_DTYPES)}")
        return bare_model(args.num_layers, args.num_kv_heads, args.head_dim,
                          max_position_embeddings=8192 if args.max_model_len is None else args.max_model_len,
                          dtype=args.dtype)
    return model_shape(args.model or DEFAULT_MODEL)


def kv_config_from_args(args: argparse.Namespace) -> KVCacheConfig:
    """The KV flags as one object (what the plan and the engine take), range-checked, and
    refusing options the chosen format does not use (``--kivi-group-size`` with fp8)."""
    kv = KVCacheConfig(dtype=args.kv_cache_dtype, k=args.kv_cache_dtype_k, v=args.kv_cache_dtype_v,
                       skip_layers=tuple(args.kv_cache_dtype_skip_layers or ()), sink_tokens=args.kv_sink_tokens,
                       residual_tokens=args.kv_residual_tokens, group_size=args.kivi_group_size,
                       block_size=args.block_size, plan_file=getattr(args, "kv_cache_plan", None),
                       tiers=getattr(args, "kv_cache_tiers", None), tier_age=getattr(args, "kv_tier_age", None),
                       tier_policy=getattr(args, "kv_tier_policy", None))
    kv.check_options_apply()
    return kv


def plan_from_args(args: argparse.Namespace, shape=None) -> CachePlan:
    kv = kv_config_from_args(args)  # flags checked before a model file is read
    return kv.plan(shape if shape is not None else shape_from_args(args))


def add_device_args(g) -> None:
    """--attention-backend, --device, --dtype: shared by every command that builds an engine."""
    g.add_argument("--attention-backend", default="auto",
                   help="auto, cuda, triton or torch; auto picks the first that serves the plan (docs/kernels.md)")
    g.add_argument("--prefill-backend", default="auto",
                   help="the prefill attention kernel: auto (FlashInfer's FA3 where `pip install 'kvq[cuda]'` put it "
                        "and the GPU runs it, else the attention backend's own), flashinfer, triton, or "
                        "flashinfer-fp8 (opt-in: fp8_e4m3 layers without windows through FA3's FP8 tensor cores, "
                        "queries in e4m3; docs/kernels.md)")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    g.add_argument("--dtype", default="auto", help="model compute dtype: auto, bfloat16, float16, float32")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    add_device_args(g)
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (chunked prefill)")
    g.add_argument("--kv-cache-memory", default=None, help="bytes for the KV pools (default 1GiB on cpu)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory kvq may use")
    g.add_argument("--load-format", default="auto", help="auto (weights from disk) or dummy (random, real shapes)")
    g.add_argument("--seed", type=int, default=0, help="seed for dummy weights")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (GPU)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch each step before the previous step's tokens are read (outputs "
                        "unchanged; the host prepares a step while the device runs the previous one); "
                        "default: on with CUDA, off on the CPU")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 on the CPU unless OMP_NUM_THREADS is set, torch's own "
                        "with CUDA; 0 = torch's own).  One thread never stalls on a busy machine (2 on a shared "
                        "2-core machine measured 3-13x slower); on an idle machine with many cores, 4-8 run "
                        "1.6-5x faster (README, Threads)")
    g.add_argument("--preemption-mode", default="recompute", choices=("recompute", "swap"),
                   help="what a request preempted for KV space becomes: recompute (its KV dropped, prefilled "
                        "again) or swap (its blocks parked in host memory, --cpu-offload-gb, and resumed before "
                        "new requests; recompute when that tier is full); default recompute")
    g.add_argument("--cpu-offload-gb", type=float, default=0.0,
                   help="GiB of host memory for KV blocks, in the resident format (real bytes: every format's "
                        "scales and high-precision blocks included): the CPU prefix cache (finished requests' "
                        "blocks, reloaded when a later prompt shares their prefix) and, with --preemption-mode "
                        "swap, swapped requests (half each when both are on); needed by --preemption-mode swap")
    g.add_argument("--kv-scales", default="none", metavar="none|warmup[:N]|FILE",
                   help="static KV scales of fp8_e4m3/fp8_e5m2: none (1.0, default); warmup[:N]: absmax per layer "
                        "and KV head over the first N tokens served (default 1024), then frozen and the cache "
                        "re-encoded; or a file written by `kvq calibrate` (per layer and KV head, checked against "
                        "the model)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks the model and its KV heads are split over (torch.distributed: NCCL on GPUs, one "
                        "per rank, gloo on the CPU); kvq starts ranks 1..N-1 itself, or joins torchrun's "
                        "(docs/engine.md, Parallelism); default 1")
    g.add_argument("--distributed-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="seconds a tensor-parallel rank may keep the others waiting before the engine fails "
                        "(default 600; at start, while ranks load weights, at least 600)")
    g.add_argument("--cpu-prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="keep finished requests' computed blocks in host memory by prefix hash and load them back "
                        "on a device prefix miss (default: on when --cpu-offload-gb > 0 and prefix caching is on)")


def engine_config_from_args(args: argparse.Namespace):
    """The engine flags as one EngineConfig; every range is checked here, before a model file is
    opened (ValueError: exit code 2)."""
    from kvq.engine.config import EngineConfig

    kv = kv_config_from_args(args)
    try:
        return EngineConfig(
            model=args.model or DEFAULT_MODEL, kv_cache=kv, attention_backend=args.attention_backend,
            prefill_backend=args.prefill_backend, device=args.device, dtype=args.dtype,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization, load_format=args.load_format, seed=args.seed,
            enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling, threads=args.threads,
            preemption_mode=args.preemption_mode, cpu_offload_gb=args.cpu_offload_gb,
            cpu_prefix_cache=args.cpu_prefix_cache, kv_scales=None if args.kv_scales == "none" else args.kv_scales,
            tensor_parallel_size=args.tensor_parallel_size, distributed_timeout_s=args.distributed_timeout,
        )
    except ValueError as e:  # the API names its fields; here they are flags
        msg = str(e)
        field = msg.split(" ", 1)[0].rstrip(":")
        if field.isidentifier() and hasattr(args, field):
            msg = "--" + field.replace("_", "-") + msg[len(field):]
        raise UsageError(msg) from None
