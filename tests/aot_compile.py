"""Compile every Triton kernel variant for sm_90 without a GPU.

Run as a script (the test runs it in a subprocess, outside the interpreter mode
the rest of the suite uses): the launchers are called with CPU tensors while
JITFunction.run is replaced by a recorder; each recorded launch is then
compiled ahead of time for an H100/H200 target (front end, LLVM, PTX), and each
code path (a kernel, its argument types and its constexprs other than sizes:
:data:`SIZES`) assembled once by ptxas, at its largest variant.  This catches
code that only the GPU compiler rejects: Triton's passes and LLVM fail by code
path and size, ptxas by instruction (a variant of another size emits the same
kinds), so the other sizes' ptxas runs, 40% of a cold compile, are skipped.  Prints one line per
compiled variant and exits non-zero on the first failure.  ``--shard I/N``
compiles every N-th distinct launch from the I-th on, so N processes share the
work (the test runs its shards as separate tests, spread over the pytest workers).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_TYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
    torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
}
recorded: list[tuple[JITFunction, dict]] = []
#: shared memory one block may take on sm_90 (227 KiB): a launch over it fails on the GPU with
#: OutOfResources, which compiling alone does not report
SM90_SHARED_BYTES = 232448


def _record(self, *args, grid, warmup, **kwargs):
    bound = dict(zip(self.arg_names, args))
    bound.update(kwargs)
    for p in self.params:  # parameters the launch left at their defaults (a constexpr flag's False)
        if p.name not in bound and p.has_default:
            bound[p.name] = p.default
    recorded.append((self, bound))


def launch_signature(fn: JITFunction, bound: dict, hints: bool = False) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of a recorded launch for ``triton.compile``; ``hints``: the
    16-byte divisibility a real launch tells the compiler for its pointers and for integers that
    are multiples of 16, unless the kernel does not specialize on them (what decides vectorized
    loads and pipelining; do_not_specialize, do_not_specialize_on_alignment)."""
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        val = bound[name]
        if i in fn.constexprs:
            sig[name] = "constexpr"
            consts[(i,)] = val
        elif isinstance(val, torch.Tensor):
            sig[name] = "*" + _TYPES[val.dtype]
        elif isinstance(val, bool):
            sig[name] = "i1"
        elif isinstance(val, int):
            sig[name] = "i64" if abs(val) >= 2**31 else "i32"
        elif isinstance(val, float):
            sig[name] = "fp32"
        else:
            sig[name] = "constexpr"
            consts[(i,)] = val
            continue
        if hints and ((isinstance(val, torch.Tensor) and not fn.params[i].do_not_specialize_on_alignment)
                      or (sig[name] in ("i32", "i64") and val % 16 == 0 and not fn.params[i].do_not_specialize)):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


#: formats compiled at head size 64 (the default model's) as well as 128: the 16-bit pages (64's tile shapes
#: in every kernel) and KIVI, whose codes are grouped along the head (two 32-channel groups at 64).  Every
#: other format compiles at 128 only, where shared memory and registers are largest: at 64 the same code with
#: smaller constants (FP8 codes cast, a per-token or per-block scale, a static one, e5m2 codes, 2-bit codes,
#: packed per-token codes grouped like KIVI's V: nothing there depends on the head size).  The GPU tests
#: (`make gpu-test`) compile and run the 64 variants of every format on the default model's K/V.
AT_64 = frozenset({"bfloat16", "int4_kivi"})

#: constexprs that size a kernel's tiles, not its code path: the variants of one path differ only in them
SIZES = frozenset({"D", "GROUP", "PAGE", "BLOCK_M", "BLOCK_N", "BLOCK", "CHUNK", "TB", "SINK_N"})


def _variants() -> list[tuple[JITFunction, dict, dict, dict, tuple, int]]:
    """The distinct recorded launches in order: (fn, signature, constexprs, options, code path, size)."""
    seen, out = set(), []
    for fn, bound in recorded:
        sig, consts, _ = launch_signature(fn, bound)
        opts = {k: bound[k] for k in ("num_warps", "num_stages") if bound.get(k) is not None}
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted((k, str(v)) for k, v in consts.items())),
               tuple(sorted(opts.items())))
        if key in seen:
            continue
        seen.add(key)
        named = {fn.arg_names[i[0]]: v for i, v in consts.items()}
        path = (key[0], key[1], tuple(sorted((k, str(v)) for k, v in named.items() if k not in SIZES)), key[3])
        size = 1
        for k in SIZES & named.keys():
            size *= int(named[k])
        out.append((fn, sig, consts, opts, path, size))
    return out


class _PtxOnly:
    """``triton.compile`` up to PTX: ptxas (the ``cubin`` stage) left out, the result cached apart (an
    empty cubin must never be found by a real launch's compile of the same key)."""

    def __enter__(self):
        from triton import knobs
        from triton.backends.nvidia.compiler import CUDABackend

        self._cls, self._add, self._dir = CUDABackend, CUDABackend.add_stages, knobs.cache.dir

        def add_stages(backend, stages, options, language):
            self._add(backend, stages, options, language)
            stages["cubin"] = lambda src, metadata: b""
        CUDABackend.add_stages = add_stages
        knobs.cache.dir = os.path.join(self._dir, "aot-ptx-only")

    def __exit__(self, *exc):
        from triton import knobs

        self._cls.add_stages = self._add
        knobs.cache.dir = self._dir


def compile_recorded(shard: int = 0, shards: int = 1) -> int:
    """Compile every distinct recorded launch whose index among the distinct ones is ``shard``
    modulo ``shards`` (shards run in parallel processes), assembling the largest variant of each code
    path (the first of equal ones); -> how many this shard compiled."""
    variants = _variants()
    assemble = {}
    for i, (*_, path, size) in enumerate(variants):
        if path not in assemble or size > variants[assemble[path]][5]:
            assemble[path] = i
    assembled = set(assemble.values())
    mine = 0
    for i, (fn, sig, consts, opts, _, _) in enumerate(variants):
        if i % shards != shard:
            continue
        mine += 1
        t0 = time.perf_counter()
        with contextlib.nullcontext() if i in assembled else _PtxOnly():
            ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                target=GPUTarget("cuda", 90, 32), options=opts)
        assert ck.asm["ptx"] and (i not in assembled or ck.asm["cubin"]), (fn.__name__, consts)
        consts = {fn.arg_names[k[0]]: str(v) for k, v in consts.items()}
        shared = ck.metadata.shared
        print("compiled" if i in assembled else "compiled (to PTX)", fn.__name__, consts, opts, f"shared {shared} B",
              f"{time.perf_counter() - t0:.1f} s")
        if shared > SM90_SHARED_BYTES:
            raise SystemExit(f"{fn.__name__} {consts} {opts} needs {shared} B of shared memory, more than an "
                             f"sm_90 block has ({SM90_SHARED_BYTES})")
    print(f"shard {shard}/{shards}: {mine} of {len(variants)} distinct launches, "
          f"{len(assembled & set(range(shard, len(variants), shards)))} assembled by ptxas")
    return mine


def main(formats: list[str], shard: int = 0, shards: int = 1) -> None:
    JITFunction.run = _record
    import triton.language as tl

    from types import SimpleNamespace

    from kvq.attention.triton import dequant, kernels, prefill
    from kvq.attention.triton.band import band_attention
    from kvq.attention.triton.decode import layer_args
    from kvq.cache.plan import bare_model, make_plan
    from kvq.formats.registry import resolve_format
    from kvq.cache.pool import KVPool

    for fmt in formats:
        rotated = any(resolve_format(fmt, r).family == "rot" for r in ("k", "v"))
        # rotated: the code is D-generic; the rest: AT_64's note
        for D, group in ((64, 3), (128, 4)) if fmt in AT_64 and not rotated else ((128, 4),):
            plan = make_plan(bare_model(1, 2, D, num_attention_heads=2 * group), fmt, sink_tokens=16,
                             residual_tokens=32)
            layer = KVPool.create(plan, 8, 4).layers[0]
            bs = plan.block_size
            k = torch.zeros(2 * bs, 2, D, dtype=torch.bfloat16)
            slots = torch.arange(2 * bs)
            kernels.write_kv(layer, k, k, slots, torch.tensor([[0, 0], [1, bs]]))
            kernels.seal_blocks(layer, torch.tensor([0]), torch.tensor([1]))
            q = torch.zeros(3, 2 * group, D, dtype=torch.bfloat16)
            tables = torch.zeros(2, 4, dtype=torch.int32)
            lens = torch.tensor([40, 3], dtype=torch.int32)
            for first in (True, False):  # pages dequantized into a scratch first, or in the kernel's loop
                kernels.paged_attention(q, layer, torch.tensor([0, 2, 3], dtype=torch.int32), tables, lens, 0.1,
                                        max_q_len=2, has_hp=True, max_seq_len=40, dequant_first=first)
            # the windowed prefill (per-query exact windows over f16 page scratches)
            kp = torch.zeros(8, 2, bs, D, dtype=torch.float16)
            dargs, dmeta = prefill._dense_args(kp, kp)
            prefill._launch(q, torch.empty_like(q), torch.tensor([0, 2, 3], dtype=torch.int32), dargs, dmeta,
                            tables, tables, lens, 0.1, 2, False, tl.float16, prefill.TILES["window"], bs, 2,
                            sink_tokens=16, residual=32)
            # the library prefill's band (kvq.attention.triton.band), with and without a bulk and an exact tail
            # to merge, and the exact bf16 page copy of a 16-bit layer with hp blocks
            cu = torch.tensor([0, 2, 3], dtype=torch.int32)
            scratch = SimpleNamespace(cu=cu, lens=lens, k=kp, v=kp, tab_exact=tables, tab_q=tables)
            lib_out = (torch.zeros(3, 2 * group, D, dtype=torch.float16), torch.zeros(3, 2 * group))
            for merged, pack in ((lib_out, False), (None, False), (lib_out, True)):  # (each merge: both or neither)
                band_attention(q, torch.empty_like(q), scratch, bs, 2, 0.1, 2, 16, 32, merged, merged, pack_gqa=pack)
            largs, lmeta = layer_args(layer)
            dequant.dequantize_pages(largs, lmeta, tables, lens, 4, 2, bs, D, dtype=torch.bfloat16)
            # fresh prompts' pages into the rows of their queries (the ragged library call's scratch)
            dequant.dequantize_rows(largs, lmeta, tables, lens, cu[:2], 40, 4, 2, bs, D)
            kv_new = torch.zeros(3 * bs, 2, D, dtype=torch.bfloat16)  # a windowed prefill's exact new pages
            dequant.rows_to_pages(kv_new, kv_new, torch.zeros(2, dtype=torch.int64), kp[:2], kp[2:4])
            kernels.paged_decode(q[:2], layer, tables, lens, 0.1, max_seq_len=40, has_hp=True)
            kernels.paged_decode(q[:2], layer, tables, lens, 0.1, max_seq_len=40, has_hp=False)
    # demotion between the tiers of elastic precision (kvq.attention.triton.demote): every ordered pair
    for base, tiers in (("fp8_e4m3", "int4_kivi,int2_kivi"), ("bfloat16", "fp8_e4m3"),
                        ("int8_per_token_head", "int4_per_token")):
        for D, group in ((64, 3), (128, 4)):
            plan = make_plan(bare_model(1, 2, D, num_attention_heads=2 * group), base, tiers=tiers)
            layer = KVPool.create(plan, 0, 2, num_slabs=2).layers[0]
            for src, dst in itertools.combinations(range(plan.num_tiers + 1), 2):
                kernels.demote_pairs(layer, torch.tensor([[0, 0]]), src, dst)
    from kvq.models.sampling_triton import sample_rows

    # the sampler's kernels: logits in a model's dtype, one chunk (no second kernel) or several
    for all_greedy, dt, V in itertools.product((True, False), (torch.bfloat16, torch.float32), (1000, 20000)):
        sample_rows(torch.zeros(2, V, dtype=dt), torch.ones(2), torch.zeros(2, dtype=torch.bool),
                    torch.zeros(2, dtype=torch.int64), all_greedy=all_greedy)
    n = compile_recorded(shard, shards)
    print(f"{n} kernel variants compiled for sm_90")


if __name__ == "__main__":
    args = sys.argv[1:]
    shard, shards = 0, 1
    if args and args[0] == "--shard":  # --shard I/N: the I-th of N parallel parts
        shard, shards = map(int, args[1].split("/"))
        args = args[2:]
    main(args, shard, shards)
