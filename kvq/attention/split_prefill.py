"""Prefill attention through a library kernel (FlashInfer's FA3), quantized pools included.

Same contract as :func:`kvq.attention.reference.paged_attention` (the definition of correct),
three ways by layer:

* a 16-bit layer whose step reads only its resident pages: one library call straight over
  the pool's pages (HND, kvq's signed table read as it is: every entry is a page id); where
  every request of the step is a fresh prompt (no cached past), one ragged call over the
  step's own K/V as computed, which the pool holds bit for bit (:data:`RAGGED_FRESH`);
* a quantized layer read as stored (no per-query window), or a 16-bit layer that holds hp
  blocks (sinks, recent window of a mixed plan): the step's pages go once into a dense scratch
  (kvq.attention.triton.dequant: f16 for quantized pages, an exact bf16 copy for 16-bit ones;
  :func:`scratch_dtype`), then one library call over it; fresh prompts' keys go into the rows of
  their queries instead, for one ragged call (:data:`RAGGED_FRESH`);
* with ``fp8`` (``--prefill-backend flashinfer-fp8``, an opt-in), an fp8_e4m3 layer read as stored:
  one call of the library's FP8 tensor-core kernel over the e4m3 codes in place, the queries cast
  to e4m3 (:data:`FP8_Q_SCALE`), the probabilities in e4m3 inside the kernel;
* a quantized layer under the per-query window rule (kvq.cache.window.exact_from): each query's
  keys split at ``p - (R + P)`` and ``p - R``; everything before the first (past the sinks) is read
  quantized by every query, so one library call covers it, causal with that offset, over the
  scratch's quantized pages; the last ``R`` keys are read exact by every query, a second call
  over the exact pages with a sliding window of ``R``; the sinks and the ``P`` keys between, where
  queries differ, go through kvq.attention.triton.band, which merges both calls' results by
  their log-sum-exps (with :data:`RAGGED_WINDOWED`, fresh prompts' two calls are ragged calls over
  the keys copied from the scratch into rows: the default).

Each library call is planned once per step (host work: page lists, the library's own plan) and
reused by every layer; the per-step key is the step's host metadata object (``host``).
"""

from __future__ import annotations

import torch

from kvq.attention import paged_lib
from kvq.attention.triton import dequant
from kvq.attention.triton.band import band_attention
from kvq.attention.triton.prefill import _dense_args, scratch_groups, window_scratch
from kvq.cache.step import host_ids


#: Dequantize quantized pages into the queries' dtype (bf16 for a bf16 model) instead of f16, so that
#: neither the queries nor the output are cast.  Measured on an H100 (session 30, bench_prefill;
#: docs/results/bench_prefill_s30_h100.json): fp8_e4m3 at 4 x 4096 1239 -> 868 us (bf16 860),
#: int8_per_token_head 1300 -> 897, int4_kivi 2734 -> 2245; never slower (``--f16-scratch`` times
#: the f16 side).  Its cost is bf16's 8 significant bits on each dequantized value and on the
#: library's partial outputs (the bf16 model's own K/V and attention have no more): on the CPU's
#: window tests the error against the definition goes from at most 0.0036 to 0.0084, so those tests
#: run the f16 scratch (tests/test_split_prefill.split_kernels) and this one has its own bound.
MODEL_DTYPE_SCRATCH = True


#: Fresh prompts of a 16-bit layer go through the library's ragged call over the step's own K/V
#: instead of its paged call over the pool: FlashInfer's FA3 loads contiguous K/V by TMA where its
#: paged kernel gathers pages with cp.async.  Both read the same values (the pool stores the new K/V
#: as computed); ``bench_prefill.py --paged-fresh`` times the paged call beside it.
RAGGED_FRESH = True

#: Fresh prompts of a quantized layer under the window rule: the bulk (keys read quantized by every
#: query) and the exact tail go through the library's ragged call over the keys copied from the page
#: scratch into contiguous rows, instead of its paged call over the scratch (the band kernel and its
#: merge are unchanged).  Timed on an H100 (session 31, docs/results/bench_prefill_s31_band_h100.json;
#: ``bench_prefill.py --paged-windowed`` times the other side), int4_kivi x kvq bf16: 128K 1.24 -> 1.04, 32K 1.31 ->
#: 1.13, 8K 1.90 -> 1.72, 4 x 4096 2.49 -> 2.31; 8 x 1024 4.60 -> 5.24, where the GPU's work is a little
#: less (556 against 574 us of kernels) and the host's enqueueing (1.3 ms) is what the call waits for.
RAGGED_WINDOWED = True

#: Requests with a cached past (a long prompt's later chunks, a prefix hit) go through the library's ragged
#: call too: each request's keys, the past's and the chunk's, copied (16-bit pages) or dequantized into
#: contiguous rows first, one launch a scratch group, instead of its paged call over the pool's pages or
#: the page scratch.  FlashInfer's FA3 loads contiguous K/V by TMA and gathers pages with cp.async: on an
#: H100 (session 34, docs/results/s34_h100/) one 131072-token prompt's attention ran at 648 TFLOP/s
#: through the ragged call and 542 through the paged one, and the paged calls were 521 of the 552 ms of
#: attention in a 32K-token prompt's four 8192-token chunks.  kvq's A/B on an H100 (session 35,
#: docs/results/s35_h100/; ``bench_prefill.py --paged-past`` times the other side): 1 x 122880 + 8192
#: bf16 29.7 -> 25.2 ms, fp8_e4m3 28.9 -> 24.0 ms; one 131071-token prompt's TTFT (bf16) 11.29 -> 10.06 s.
RAGGED_PAST = True

#: FP8 tensor cores (``--prefill-backend flashinfer-fp8``): queries cast to e4m3 as they are (query
#: scale 1.0, vLLM's default for FP8 attention; clamped to e4m3's range), so a request's result never
#: depends on the other requests of its step.
FP8_Q_SCALE = 1.0
FP8_MAX = 448.0


def fp8_tensor_cores_reason(fmt) -> str | None:
    """Why an FP8 tensor-core prefill cannot read a layer of :class:`~kvq.formats.spec.KVFormat` ``fmt``
    as stored (None: it can): K and V both e4m3 codes with static per-head scales."""
    for role, tf in (("K", fmt.k), ("V", fmt.v)):
        if tf.storage != "float8_e4m3fn" or tf.scale != "static":
            return f"{role} is {tf.name}, not fp8_e4m3 with static scales"
    return None


def scratch_dtype(q_dtype: torch.dtype, model_dtype: bool = MODEL_DTYPE_SCRATCH) -> torch.dtype:
    """The dtype quantized pages are dequantized to for the library (``model_dtype``:
    :data:`MODEL_DTYPE_SCRATCH`)."""
    if model_dtype and q_dtype in (torch.bfloat16, torch.float16):
        return q_dtype
    return torch.float16


class SplitPrefill:
    """``paged_attention`` with the kernels' signature, over ``lib`` (kvq.attention.paged_lib.TorchLib,
    kvq.attention.flashinfer_lib.FlashInferLib)."""

    def __init__(self, lib, model_dtype_scratch: bool = MODEL_DTYPE_SCRATCH, ragged_fresh: bool = RAGGED_FRESH,
                 fp8: bool = False, ragged_windowed: bool = RAGGED_WINDOWED, band_gqa: bool | None = None,
                 ragged_past: bool = RAGGED_PAST):
        self.lib = lib
        self.model_dtype_scratch = model_dtype_scratch
        self.ragged_fresh = ragged_fresh
        self.ragged_windowed = ragged_windowed
        self.band_gqa = band_gqa  # None: kvq.attention.triton.band.PACK_GQA
        self.ragged_past = ragged_past
        self.fp8 = fp8  # fp8_e4m3 layers read as stored through the library's FP8 tensor-core kernel
        self._step = None  # the host metadata object the cached plans belong to
        self._plans: dict = {}

    @property
    def name(self) -> str:
        return self.lib.name

    def _plan(self, host, key, build):
        if self._step is not host:
            self._step, self._plans = host, {}
            self.lib.new_step()
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]

    def paged_attention(self, q, layer, cu_seqlens_q, block_tables, seq_lens, sm_scale, max_q_len=None, has_hp=None,
                        max_seq_len=None, window=None, k_new=None, v_new=None, host=None, tiered=False):
        """``host``: ``(cu, lens)`` of these sequences as host tuples (kvq.cache.step.StepMetadata's
        ``prefill_host``); without it they are read from the device (one sync).  ``tiered``: the tables
        hold lower tiers' tagged blocks (elastic precision, kvq.cache.pool.TIER_BASE): every page read
        through its own tier into the scratch (the per-query windows as before), never in place."""
        T, Hq, D = q.shape
        out = torch.empty_like(q)
        if T == 0:
            return out
        if host is None:
            host = (tuple(cu_seqlens_q.tolist()), tuple(seq_lens.tolist()))
        cu, lens = host
        if max_q_len is None:
            max_q_len = max(b - a for a, b in zip(cu, cu[1:]))
        if has_hp is None:
            has_hp = bool((block_tables < 0).any())
        if window is not None and layer.fmt.is_quantized and (window.exact_rows or window.sealed_rows):
            self._windowed(q, out, layer, cu_seqlens_q, block_tables, seq_lens, sm_scale, max_q_len, window, k_new,
                           v_new, host, tiered)
            return out
        H, P = layer.num_kv_heads, layer.block_size
        qo = [b - a for a, b in zip(cu, cu[1:])]
        data = layer.k.get("data")
        fresh = self.ragged_fresh and all(n == t for n, t in zip(lens, qo))  # no request has a cached past
        if self.fp8 and not has_hp and not tiered and fp8_tensor_cores_reason(layer.fmt) is None:
            # the e4m3 codes in place (per-head static scales), the queries cast to e4m3, P in e4m3 inside
            handle = self._plan(host, ("fp8",), lambda: self.lib.prepare(
                paged_lib.make_plan(qo, lens, [0] * len(lens), block_tables, P), Hq, H, D, torch.float8_e4m3fn,
                sm_scale, out_dtype=q.dtype))
            q8 = q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            self.lib.run_fp8(handle, q8, layer.k["data"], layer.v["data"], FP8_Q_SCALE, layer.k_scale, layer.v_scale,
                             out=out)
            return out
        if not layer.fmt.is_quantized and not has_hp and data is not None and data.dtype == q.dtype:
            if fresh and k_new is not None and v_new is not None and k_new.dtype == q.dtype:  # their own K/V: all keys
                handle = self._plan(host, ("ragged",), lambda: self.lib.prepare_ragged(qo, Hq, H, D, q.dtype, sm_scale,
                                                                                       q.device))
                self.lib.run_ragged(handle, q, k_new, v_new, out=out)
                return out
            if not self.ragged_past and not tiered:
                handle = self._plan(host, ("direct",), lambda: self.lib.prepare(
                    paged_lib.make_plan(qo, lens, [0] * len(lens), block_tables, P), Hq, H, D, q.dtype, sm_scale))
                self.lib.run(handle, q, layer.k["data"], layer.v["data"], out=out)
                return out
        dtype = scratch_dtype(q.dtype, self.model_dtype_scratch) if layer.fmt.is_quantized else layer.k_hp.dtype
        ragged = fresh or self.ragged_past
        if tiered and not ragged:
            self._tiered(q, out, layer, cu_seqlens_q, block_tables, seq_lens, sm_scale, dtype, host)
            return out
        for gi, (b0, b1, width) in enumerate(scratch_groups(lens, H, P, D)):
            r0, r1 = cu[b0], cu[b1]
            if ragged:  # each request's keys (dequantized, or copied; a tiered page through its tier) into rows,
                kv = paged_lib.indptr(lens[b0:b1])  # one ragged call (fresh prompts: the rows of their queries)
                starts = self._plan(host, ("rows", gi, H, P, D), lambda: host_ids(kv[:-1], torch.int32, q.device))
                k, v = dequant.dequantize_layer_rows(layer, block_tables[b0:b1, :width], seq_lens[b0:b1], starts,
                                                     kv[-1], width, dtype=dtype, tiered=tiered)
                handle = self._plan(host, ("ragged-scratch", gi, H, P, D, dtype), lambda: self.lib.prepare_ragged(
                    qo[b0:b1], Hq, H, D, dtype, sm_scale, q.device, kv_lens=lens[b0:b1]))
                run = self.lib.run_ragged
            else:
                k, v, ident = dequant.dequantize_layer_pages(layer, block_tables[b0:b1, :width], seq_lens[b0:b1], width,
                                                             dtype=dtype)
                handle = self._plan(host, ("scratch", gi, dtype), lambda: self.lib.prepare(
                    paged_lib.make_plan(qo[b0:b1], lens[b0:b1], [0] * (b1 - b0), ident, P), Hq, H, D, dtype, sm_scale))
                run = self.lib.run
            # every row sees a key (its own), so the library writes all of the buffer it is given (FlashInfer
            # zero-fills one it allocates: 21-41 us a call at 8 x 1024 / 4 x 4096, H100 profile)
            if dtype == q.dtype:  # straight from the queries into the output
                run(handle, q[r0:r1], k, v, out=out[r0:r1])
            else:
                qs = q[r0:r1].to(dtype)
                out[r0:r1] = run(handle, qs, k, v, out=torch.empty_like(qs))[0]
        return out

    def _tiered(self, q, out, layer, cu_t, tables, lens_t, sm_scale, dtype, host):
        """A tiered layer read as stored through paged calls (``ragged_past`` off; the ragged read takes
        each page through its tier straight into rows): the step's pages, each through its tier, into the
        scratch (:func:`window_scratch` without a window, as the Triton prefill reads them), then one
        library call a scratch group over all of each request's keys."""
        cu, lens = host
        memo = lambda key, build: self._plan(host, key, build)  # noqa: E731  (the step's layers share them)
        for gi, g in enumerate(window_scratch(layer, cu_t, tables, lens_t, None, None, None, dtype=dtype, host=host,
                                              tiered=True, memo=memo)):
            qo = [cu[b + 1] - cu[b] for b in range(g.b0, g.b1)]
            # straight into the output where the scratch has the queries' dtype (a copy a layer otherwise:
            # 0.9 ms a prompt step at 384 x 1024, H100 profile)
            direct = out[g.r0:g.r1] if dtype == q.dtype else None
            o, _ = self._over_scratch(host, ("tiered", gi), g, q[g.r0:g.r1].to(dtype), qo, sm_scale, g.tab_exact, 0,
                                      0, list(lens[g.b0:g.b1]), False, out=direct)
            if direct is None:
                out[g.r0:g.r1] = o

    def _windowed(self, q, out, layer, cu_t, tables, lens_t, sm_scale, max_q_len, window, k_new, v_new, host,
                  tiered=False):
        H, P = layer.num_kv_heads, layer.block_size
        pol = window.policy
        split = pol.residual_tokens + P
        sink = window.sink_tokens
        dtype = scratch_dtype(q.dtype, self.model_dtype_scratch)
        fresh = all(n == b - a for n, a, b in zip(window.lens, window.cu, window.cu[1:]))  # no cached past
        ragged = self.ragged_windowed and (fresh or self.ragged_past)
        memo = lambda key, build: self._plan(host, key, build)  # noqa: E731  (the step's layers share them)
        for gi, g in enumerate(window_scratch(layer, cu_t, tables, lens_t, window, k_new, v_new, dtype=dtype,
                                              tiered=tiered, memo=memo)):
            lens = window.lens[g.b0:g.b1]
            qo = [window.cu[b + 1] - window.cu[b] for b in range(g.b0, g.b1)]
            bulk = [n - split - sink for n in lens]  # keys [sink, p - split] of the last query
            tail = [n - sink for n in lens]  # keys [sink, p] of the last query, of which the last R
            qg = q[g.r0:g.r1].to(dtype)  # (a view where the dtypes agree)
            o_bulk = o_tail = None
            if max(bulk) > 0:  # keys [sink, n - split) of each sequence, read quantized
                o_bulk = self._over_scratch(host, ("window", gi), g, qg, qo, sm_scale, g.tab_q, sink, pol.sink_blocks,
                                            bulk, ragged)
            if pol.residual_tokens and max(tail) > 0:  # keys [sink, n) exact, each query's last R of them
                o_tail = self._over_scratch(host, ("tail", gi), g, qg, qo, sm_scale, g.tab_exact, sink, pol.sink_blocks,
                                            tail, ragged, window_left=pol.residual_tokens - 1)
            band_attention(q[g.r0:g.r1], out[g.r0:g.r1], g, P, H, sm_scale, max_q_len, sink, pol.residual_tokens,
                           o_bulk, o_tail, pack_gqa=self.band_gqa)

    def _over_scratch(self, host, key, g, qg, qo, sm_scale, tab, start, first_block, counts, ragged,
                      window_left=-1, out=None):
        """One library call of group ``g``'s queries ``qg`` over keys ``[start, start + counts[r])`` of each
        request ``r`` (``start``: block ``first_block``'s first key), read from the page scratch through
        ``tab`` (``tab_q`` or ``tab_exact``): the paged call over the scratch, or (``ragged``) the keys
        gathered into contiguous rows and the ragged call.  -> (out, lse).  A request with no such key
        reads one dummy key, whose rows no caller reads (the band merges a call's rows only for
        sequences that sent it keys).  ``out``: where the library writes (a view of the layer's output).
        """
        Hq, D = qg.shape[1], qg.shape[2]
        H, P = g.k.shape[1], g.k.shape[2]
        if not ragged:
            handle = self._plan(host, key, lambda: self.lib.prepare(
                paged_lib.make_plan(qo, counts, [first_block] * len(qo), tab, P, window_left=window_left), Hq, H, D,
                g.k.dtype, sm_scale))
            return self.lib.run(handle, qg, g.k, g.v, out=out)
        n = [max(c, 1) for c in counts]

        def plan():
            dev = g.k.device
            first = paged_lib.indptr(n)
            dummy = [first[r] for r, c in enumerate(counts) if c <= 0]
            return (host_ids(first[:-1], torch.int32, dev), host_ids([max(c, 0) for c in counts], torch.int32, dev),
                    host_ids(dummy, torch.int64, dev) if dummy else None,
                    self.lib.prepare_ragged(qo, Hq, H, D, g.k.dtype, sm_scale, qg.device, kv_lens=n,
                                            window_left=window_left))
        starts, lens, dummy, handle = self._plan(host, key + ("ragged",), plan)
        # each request's keys copied from the scratch's pages into its rows in one launch (the dequant kernel
        # reading the scratch as a dense pool); torch's gather through (page, offset) indices ran at a tenth
        # of the copy bandwidth (3.8 ms of a 223 ms 128K-token prompt, H100)
        args, meta = _dense_args(g.k, g.v)
        k, v = dequant.dequantize_rows(args, meta, tab[:, first_block:], lens, starts, sum(n),
                                       tab.shape[1] - first_block, H, P, D, dtype=g.k.dtype)
        if dummy is not None:  # the dummy keys finite, so the call's arithmetic stays clean
            k[dummy] = 0
            v[dummy] = 0
        return self.lib.run_ragged(handle, qg, k, v, out=out)
