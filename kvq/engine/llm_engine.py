"""The engine loop: requests in, tokens out, over the paged quantized cache.

One :meth:`LLMEngine.step` is::

    connectors.poll()                                  # copies and fills that ended, to the scheduler
    sched = scheduler.schedule()                       # tensor-free decisions (+ seal/copy/swap ops)
    executor.execute(sched)                            # ops, K/V writes, attention, logits
    tokens = sampler(logits).token_ids.tolist()        # the step's one host sync
    scheduler.update(sched, tokens)                    # append, stop checks, free blocks

with the KV connectors (kvq.engine.connector: the CPU prefix tier, a prefill peer, an export) called
at fixed points around the forward and the update.

Everything the user chose (KV format, backend, memory) is resolved once at
start and reported in :attr:`LLMEngine.info` (seed 004: the effective KV dtype,
the resolved backend, and the pool capacity in blocks and tokens).
"""

from __future__ import annotations

import gc
import itertools
import logging
import operator
from dataclasses import dataclass

import torch

from kvq.attention.backends import compact_layers
from kvq.cache.block_manager import BlockManager, SwapOp, WipeOp
from kvq.engine.config import EngineConfig
from kvq.engine.connector import ConnectorContext, ConnectorOutput, KVConnector, make_connector
from kvq.engine.detokenizer import IncrementalDetokenizer
from kvq.engine.errors import RequestError, request_error
from kvq.engine.executor import make_executor
from kvq.engine.outputs import CompletionOutput, RequestOutput, TokenIds
from kvq.engine.prompt_logprobs import PromptLogprobs, PromptRows, score
from kvq.engine.sampler import Sampler, SamplingTensors, SeedState
from kvq.engine.sampling_params import SamplingParams
from kvq.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvq.engine.sequence import Sequence
from kvq.units import format_bytes

GC_THRESHOLD0 = 10_000  # the collector's first threshold while an engine serves (freeze_gc)
logger = logging.getLogger("kvq")

@dataclass
class _Launched:
    """A step whose forward and sampling are enqueued: what reading its results needs."""

    sched: SchedulerOutput
    seqs: dict
    sample_ids: list[int]
    token_ids: torch.Tensor | None  # [R] on the device: feeds the next step's pending tokens
    host: list[torch.Tensor] | None  # token ids (and logprob tensors), copied to the host
    event: object | None  # CUDA event after the copies; None on the CPU
    prompt: PromptRows | None = None  # the step's prompt rows (kvq.engine.prompt_logprobs)
    prompt_host: list[torch.Tensor] | None = None  # their scores, copied to the host

    def feed(self) -> tuple[torch.Tensor, dict[int, int]]:
        """(sampled token ids on the device, their row per sequence id)."""
        return self.token_ids, {sid: row for row, sid in enumerate(self.sample_ids)}


class LLMEngine:
    """The engine core: requests in, steps scheduled, handed to an executor, tokens out (module
    docstring).  The executor (:mod:`kvq.engine.executor`) owns the workers that hold the model,
    the KV pools and the runner; the engine keeps the scheduler, the block manager and the sampler."""

    def __init__(self, config: EngineConfig | None = None, **kwargs):
        cfg = config or EngineConfig(**kwargs)
        self.config = cfg
        self._build(cfg)

    def _build(self, cfg: EngineConfig) -> None:
        # the worker checks every choice before the weights load (kvq.engine.worker)
        self.executor = make_executor(cfg)
        w = self.worker = self.executor.worker
        self.tp = self.executor.group
        self.device, self.dtype, self.kv_cache = w.device, w.dtype, w.kv_cache
        self.plan, self.full_plan, self.max_model_len = w.plan, w.full_plan, w.max_model_len
        self.static_scales, self.kv_scales_source = w.static_scales, w.kv_scales_source
        self.backend_choice, self.kernels = w.backend_choice, w.kernels
        self.model, self.tokenizer, self.pool, self.host_pool = w.model, w.tokenizer, w.pool, w.host_pool
        self.runner = w.runner  # rank 0's; every step goes through the executor (all ranks)
        self.async_scheduling = (cfg.async_scheduling if cfg.async_scheduling is not None
                                 else self.device.type == "cuda" and cfg.tensor_parallel_size == 1)
        sched_config = SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=self.plan.block_size,
            max_inflight=2 if self.async_scheduling else 1, preemption_mode=cfg.preemption_mode)
        num_q, num_hp, host, tier = w.num_q_blocks, w.num_hp_blocks, w.host_blocks, w.tier_blocks
        arena = w.arena()  # elastic precision: every tier's blocks out of one arena (kvq.cache.arena)
        self.block_manager = BlockManager(num_q, num_hp, self.plan.window_policy, cfg.enable_prefix_caching,
                                          host_blocks=host, host_tier_blocks=tier,
                                          **({} if arena is None else dict(tiers=self.plan.tier_rule, arena=arena)))
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        self.scheduler = Scheduler(sched_config, self.block_manager, eos_token_id=eos)
        self.connectors: list[KVConnector] = []  # called in this order at each point of the step
        # the CPU prefix tier's copies (idle without a host pool: the block manager then decides none)
        self.add_connector("cpu_prefix_tier")
        if w.warmup_tokens:
            self._start_warmup(w.warmup_tokens)
        self.sampler = Sampler()
        self.sampler.warm_up(self.model.config.vocab_size, self.device, self.dtype)
        self.seed_state = SeedState()
        self._ids = itertools.count()
        self._prompts: dict[int, str | None] = {}
        self._texts: dict[int, str] = {}
        self._logprobs: dict[int, list[dict]] = {}
        self._prompt_logprobs = PromptLogprobs()
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._inflight: _Launched | None = None  # launched, results not read (async_scheduling)
        self._kv_transfer: dict[int, object] = {}  # what a connector carries on a request's output
        self._errors: dict[int, str] = {}
        graphs = w.graphs
        self.info = {
            "model": w.source.name,
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "kv_cache_dtype": {"requested": self.kv_cache.requested, **self.full_plan.describe()},
            "kv_scales": self.kv_scales_source,
            "attention_backend": {"requested": self.backend_choice.requested,
                                  "resolved": self.backend_choice.resolved, "reason": self.backend_choice.reason,
                                  "decode_per_layer": compact_layers(self.backend_choice.decode_per_layer),
                                  "prefill": self.backend_choice.prefill,
                                  "prefill_reason": self.backend_choice.prefill_reason},
            "block_size": self.plan.block_size,
            "kv_pool": {"q_blocks": int(num_q), "hp_blocks": num_hp, "tokens": int(num_q) * self.plan.block_size,
                        "bytes": self.pool.nbytes(), **self._arena_info(arena)},
            "max_model_len": self.max_model_len,
            "preemption_mode": cfg.preemption_mode,
            "cpu_offload": {"q_blocks": host[0], "hp_blocks": host[1],
                            "bytes": self.host_pool.capacity_bytes if self.host_pool else 0,
                            "pinned": bool(self.host_pool and self.host_pool.pinned),
                            "prefix_tier": {"q_blocks": tier[0], "hp_blocks": tier[1],
                                            "tokens": tier[0] * self.plan.block_size,
                                            "bytes": tier[0] * self.plan.bytes_per_block
                                            + tier[1] * self.plan.hp_bytes_per_block}},
            "async_scheduling": self.async_scheduling,
            "threads": torch.get_num_threads(),
            "cuda_graphs": {"batch_sizes": graphs.sizes, "capture_seconds": round(graphs.capture_seconds, 2)}
            if graphs else None,
            "tensor_parallel": self.executor.info(),
        }
        # Everything built so far (model, tokenizer, graphs: ~10^5-10^6 tracked objects) lives as long
        # as the engine; frozen, the collector stops re-scanning it, which otherwise stalls a step for
        # ~170 ms every few dozen steps at 256 sequences (benchmarks/bench_host_step.py).  And the
        # collector's first threshold is raised above what one step keeps alive at once (an output of
        # ~5 tracked objects per running request, held by the caller until the next step): at the
        # default 700 a step of 512 requests tripped 3-4 collections, every tenth of which cascaded
        # into the older generations and about every 130th walked every request's token lists -- 8 s of
        # pauses in an 83 s wave on the H200 (docs/engine.md).  Both process-wide; off by default on
        # the CPU, where tests build many short-lived engines.
        if cfg.freeze_gc if cfg.freeze_gc is not None else self.device.type == "cuda":
            gc.collect()
            gc.freeze()
            t0, t1, t2 = gc.get_threshold()
            gc.set_threshold(max(t0, GC_THRESHOLD0, 20 * cfg.max_num_seqs), t1, t2)
        logger.info("%s", self.describe())
        self.executor.ready()

    def rank_pools(self) -> list[list[dict]]:
        """Each rank's KV cache copied to the CPU (one rank without tensor parallelism): per layer,
        its tensors by name (kvq.engine.worker.pool_state)."""
        return self.executor.rank_pools()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do without them).  Called at exit too."""
        self.executor.shutdown()

    def _start_warmup(self, tokens: int) -> None:
        """``--kv-scales warmup[:N]``: observe the first N tokens, then freeze (kvq.cache.scales_warmup)."""
        from kvq.cache.scales_file import static_layers
        from kvq.cache.scales_warmup import WarmupScales

        def report(scales):
            self.static_scales = scales
            self.kv_scales_source = self.info["kv_scales"] = warmup.source

        warmup = WarmupScales(self.pool, static_layers(self.plan), tokens, on_freeze=report)
        self.pool.observer = self.worker.runner.warmup = warmup

    def _arena_info(self, arena) -> dict:
        """The tiers' arena in the engine's info: slabs, reserve, and per tier its format, blocks a slab
        and bytes a block (elastic precision; empty untiered)."""
        if arena is None:
            return {}
        per, slabs, reserve = arena
        lay = self.pool.layout
        return {"arena": {"slabs": slabs, "reserve_slabs": reserve, "bytes_per_slab": lay.bytes_per_slab,
                          "tiers": [{"tier": t, "format": name, "blocks_per_slab": per[t],
                                     "bytes_per_block": self.plan.tier_bytes_per_block(t),
                                     "tokens_if_all": slabs * per[t] * self.plan.block_size}
                                    for t, name in enumerate(self.plan.tier_names())]}}

    def describe_tiers(self) -> str:
        """Elastic precision in a start line: `` > int4_kivi (age 1152 tokens; pressure)``; empty untiered."""
        kv = self.info["kv_cache_dtype"]
        if not kv.get("tiers"):
            return ""
        ages = f"age {'/'.join(map(str, kv['tier_ages']))} tokens" if kv["tier_ages"] else ""
        policy = "; ".join(x for x in (ages, "pressure" if "pressure" in kv["tier_policy"] else "") if x)
        return "".join(f" > {t}" for t in kv["tiers"]) + f" ({policy})"

    def _pool_blocks(self, memory: int) -> tuple[int, int]:
        """(resident, high-precision) blocks that ``memory`` bytes hold (kvq.engine.worker)."""
        return self.worker._pool_blocks(memory)

    def profile_step(self):
        """The largest step through a runner on a scratch pool (kvq.engine.worker)."""
        return self.worker.profile_step()

    def describe(self) -> str:
        """What the engine resolved, in one line (logged at INFO on the "kvq" logger when built)."""
        i = self.info
        pool = i["kv_pool"]
        return (f"kvq engine: model {i['model']} on {i['device']} ({i['dtype']}); KV {i['kv_cache_dtype']['name']} "
                f"(K {i['kv_cache_dtype']['k']}, V {i['kv_cache_dtype']['v']}){self.describe_tiers()}, block "
                f"{i['block_size']}; pool "
                f"{pool['q_blocks']} blocks = {pool['tokens']} tokens + {pool['hp_blocks']} high-precision blocks "
                f"({format_bytes(pool['bytes'])}); attention {i['attention_backend']['resolved']} "
                f"({i['attention_backend']['reason']}), prefill {i['attention_backend']['prefill']}; "
                f"max_model_len {i['max_model_len']}; threads {i['threads']}; "
                f"async scheduling {'on' if i['async_scheduling'] else 'off'}; "
                f"cuda graphs {'on' if i['cuda_graphs'] else 'off'}" + self.describe_parallel())

    def describe_parallel(self) -> str:
        """Empty, or "; tensor parallel ...": the ranks, their KV heads, the KV bytes of all."""
        tp = self.info["tensor_parallel"]
        if not tp:
            return ""
        heads = ", ".join(f"{a}..{b - 1}" for a, b in tp["kv_heads_per_rank"])
        return (f"; tensor parallel {tp['size']} ranks over {tp['backend']} (KV heads {heads}; "
                f"{format_bytes(tp['kv_pool_bytes_total'])} of KV in all; the pool above is rank 0's)")

    # -- requests -----------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """A prompt (text, or token ids) -> (text or None, token ids); ValueError for anything else."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty", "prompt")
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer (dummy weights): pass token ids", "prompt")
            return prompt, self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__iter__"):
            raise RequestError(f"a prompt is a str or a list of token ids, got {type(prompt).__name__}", "prompt")
        try:  # ints, numpy ints, 0-d integer tensors; not floats or bools
            if any(isinstance(t, bool) for t in prompt):
                raise TypeError
            ids = [operator.index(t) for t in prompt]
        except TypeError:
            raise RequestError("token ids must be ints", "prompt") from None
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(f"token ids must be in [0, {vocab})", "prompt")
        return None, ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    kv_transfer=None) -> int:
        return self.add_requests([prompt], [params], kv_transfer=kv_transfer)[0]

    def add_requests(self, prompts: list, params: list[SamplingParams | None], *, kv_transfer=None) -> list[int]:
        """Queue several requests, all or none: a bad one raises RequestError (a ValueError whose
        ``param`` names the field; prefixed "prompt i: " when there are several) and leaves nothing queued.

        Each request is handed to the KV connectors with ``kv_transfer`` (:meth:`KVConnector.add_request`:
        a prefill engine's ``kv_export`` connector exports its KV to that receiver when its first token
        is sampled, and its ``max_tokens`` must be 1); one that no connector takes is refused.  With a
        connector that ``loads_prompts`` (a decode engine's prefill peer) every prompt is filled from
        outside."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        labels = [f"prompt {i}" if len(prompts) > 1 else None for i in range(len(prompts))]
        encoded = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            sp = SamplingParams() if sp is None else sp
            if not isinstance(sp, SamplingParams):
                raise request_error(RequestError(f"sampling params must be a SamplingParams, got "
                                                 f"{type(sp).__name__}"), labels[i])
            try:
                encoded.append((*self.encode(prompt), sp))
            except ValueError as e:
                raise request_error(e, labels[i]) from None
        remote = any(c.loads_prompts for c in self.connectors)
        added: list[int] = []
        try:
            for i, (text, ids, sp) in enumerate(encoded):
                seq = Sequence(next(self._ids), ids, sp)
                try:  # the scheduler is the judge of length and capacity
                    self.scheduler.add(seq, remote=remote)
                    added.append(seq.seq_id)
                    self._prompts[seq.seq_id] = text
                    self._texts[seq.seq_id] = ""
                    self._prompt_logprobs.add(seq)
                    taken = [c.add_request(seq, kv_transfer) for c in self.connectors]
                    if kv_transfer is not None and not any(taken):
                        raise ValueError("kv_transfer: no KV connector of this engine takes it (a prefill "
                                         "engine's kv_export does)")
                except ValueError as e:
                    raise request_error(e, labels[i]) from None
        except BaseException:
            for rid in added:  # nothing has run: a waiting sequence holds no blocks
                self.abort(rid)
            raise
        return added

    def abort(self, request_id: int) -> None:
        self.scheduler.abort(request_id)
        self._forget(request_id)

    def _forget(self, request_id: int) -> None:
        """Drop a finished request's text and logprobs (a long-running server must not keep them)."""
        for d in (self._prompts, self._texts, self._logprobs, self._detok, self._kv_transfer, self._errors):
            d.pop(request_id, None)
        self._prompt_logprobs.forget(request_id)
        for c in self.connectors:
            c.request_finished(request_id)

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or self._inflight is not None
                or any(c.has_pending() for c in self.connectors))

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step -> the outputs of the sequences it sampled.

        With ``async_scheduling`` the step schedules and launches the next forward
        first, then reads the results of the one launched by the previous call (the
        device runs one while the host prepares the other), so outputs trail the
        forward by one call; :meth:`has_unfinished` stays true until the last is read."""
        moved = self._poll_connectors()  # before the scheduler decides
        launched = self._launch()
        if not self.async_scheduling:
            outputs = self._complete(launched) if launched is not None else []
        else:
            done, self._inflight = self._inflight, launched
            outputs = self._complete(done) if done is not None else []
        if moved:
            outputs = moved + outputs
        elif launched is None and not outputs and any(c.has_pending() for c in self.connectors):
            outputs = self._poll_connectors(wait=True)  # only a connector's work left: wait for it, not spin
        for c in self.connectors:
            c.end_step()
        return outputs

    def _launch(self) -> _Launched | None:
        """Schedule a step and enqueue its forward and sampling; nothing here waits for the device."""
        sched = self.scheduler.schedule()
        if sched.wipes:  # slabs another tier's bytes fill: zeroed before any of the step's writes and copies
            self.executor.apply_ops((WipeOp(sched.wipes),))
            if sched.remote_ops and self.device.type == "cuda":  # a transfer writes outside the stream's order
                torch.cuda.synchronize(self.device)
        for c in self.connectors:
            c.before_forward(sched)
        if any(isinstance(op, SwapOp) for op in sched.ops):  # in order, before the forward: a failed copy's
            self.executor.apply_ops(sched.ops)              # sequence is recomputed, not run on lost KV
            sched = self.scheduler.swap_failed(self.runner.swap.take_failed(), sched)
        if not sched.scheduled:
            if sched.ops:  # a swap-out can come with no work; it must still happen before the next step
                self.executor.apply_ops(sched.ops)
            for c in self.connectors:
                c.after_forward(sched)
            return None
        seqs = {s.seq_id: self.scheduler.get(s.seq_id) for s in sched.scheduled}
        prev = self._inflight  # its samples feed the tokens this step schedules before they are known
        logits, sample_ids = self.executor.execute(sched, seqs, prev.feed() if prev is not None else None)
        for c in self.connectors:
            c.after_forward(sched)
        prompt = PromptRows.of(sched, seqs)  # logits rows after the R sampling rows
        if not sample_ids and prompt is None:
            return _Launched(sched, seqs, [], None, None, None)
        host, token_ids, R = [], None, len(sample_ids)
        if sample_ids:
            params = [seqs[i].params for i in sample_ids]
            st = SamplingTensors.from_params(params, self.device, self.seed_state)
            # each row's output index: tokens it has, plus those still in flight before this one
            out = self.sampler(logits if prompt is None else logits[:R], st,
                               [seqs[i].num_output_tokens + seqs[i].num_pending - 1 for i in sample_ids])
            host, token_ids = [out.token_ids], out.token_ids
            if out.logprobs is not None:
                lp = out.logprobs
                host += [lp.top_logprobs, lp.top_ids, lp.sampled_logprobs]
        prompt_host = score(logits[R:], prompt) if prompt is not None else []
        event = None
        if self.device.type == "cuda":  # pinned copies: the host goes on while they land
            host, prompt_host = ([torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                                  for t in ts] for ts in (host, prompt_host))
            event = torch.cuda.Event()
            event.record()
        return _Launched(sched, seqs, sample_ids, token_ids, host, event, prompt, prompt_host)

    def _complete(self, launched: _Launched) -> list[RequestOutput]:
        """Wait for a launched step's samples, update the scheduler, detokenize, build outputs."""
        sched, seqs, sample_ids = launched.sched, launched.seqs, launched.sample_ids
        sampled: dict[int, int] = {}
        lp_rows = {}
        if launched.event is not None:
            launched.event.synchronize()
        if launched.prompt is not None:  # before any output: a request's first one carries them all
            self._prompt_logprobs.record(launched.prompt, launched.prompt_host, seqs)
        if sample_ids:
            tokens = launched.host[0].tolist()
            sampled = dict(zip(sample_ids, tokens))
            if len(launched.host) > 1:
                tops, ids, chosen = (t.tolist() for t in launched.host[1:])
                for row, sid in enumerate(sample_ids):
                    k = seqs[sid].params.logprobs
                    if k is not None:
                        lp_rows[sid] = {"token_id": tokens[row], "logprob": chosen[row],
                                        "top": list(zip(ids[row][:k], tops[row][:k]))}
        gone = {sid for sid in sample_ids if seqs[sid].is_finished}  # finished while the step ran: no output
        live = [seqs[sid] for sid in sample_ids if sid not in gone]
        for c in self.connectors:  # their KV is written and the blocks of those that finish not yet freed
            self._kv_transfer.update(c.sampled(live))
        self.scheduler.update(sched, sampled)
        outputs = []
        for sid in sample_ids:
            if sid in gone:
                continue
            seq = seqs[sid]
            if sid in lp_rows:
                self._logprobs.setdefault(sid, []).append(lp_rows[sid])
            self._check_stop_strings(seq)
            outputs.append(self._output(seq))
            if seq.is_finished:
                self._forget(sid)
        return outputs

    # -- KV connectors (kvq.engine.connector) ---------------------------------------------------
    def add_connector(self, name: str, **options) -> KVConnector:
        """Build the KV connector registered as ``name`` over this engine's pools, scheduler and block
        manager (``options``: its own, e.g. a prefill peer's transport) and call it at every step from
        now on, before any request is added; -> the connector."""
        ctx = ConnectorContext(self.pool, self.host_pool, self.scheduler, self.block_manager)
        connector = make_connector(name, ctx, **options)
        self.connectors.append(connector)
        return connector

    def connector(self, name: str) -> KVConnector | None:
        """The connector registered as ``name`` that this engine holds, or None."""
        return next((c for c in self.connectors if c.name == name), None)

    def _poll_connectors(self, wait: bool = False) -> list[RequestOutput]:
        """Every connector reports what ended to the scheduler (``wait``: those with pending work wait
        for some first); -> the outputs of the requests they moved on."""
        return [self._moved(m) for c in self.connectors for m in c.poll(wait and c.has_pending())]

    def _moved(self, m: ConnectorOutput) -> RequestOutput:
        seq = m.seq
        if m.error is not None:
            self._errors[seq.seq_id] = m.error
        else:
            if m.logprobs is not None:
                self._logprobs[seq.seq_id] = [m.logprobs]
            self._check_stop_strings(seq)
        out = self._output(seq)
        if seq.is_finished:
            self._forget(seq.seq_id)
        return out

    def poll_host_copies(self, wait: bool = False) -> int:
        """Report the CPU prefix tier's copies that have ended (all, waiting, with ``wait``); -> how many
        are still in flight (kvq.connectors.cpu_prefix_tier)."""
        return self.connector("cpu_prefix_tier").poll_copies(wait)

    def host_offload_stats(self) -> dict:
        """Counters of the CPU prefix tier: blocks and bytes stored and reloaded, seconds, failures,
        timeouts, and the tier's own counters (kvq.connectors.cpu_prefix_tier)."""
        return self.connector("cpu_prefix_tier").stats()

    def discard_inflight(self) -> None:
        """Drop the launched step(s) after a failed step (every live request aborted first)."""
        self._inflight = None
        self.scheduler.discard_inflight()

    def _check_stop_strings(self, seq: Sequence) -> None:
        """Detokenize the new token and finish on a stop string (a stop string completed by
        the final token of an already finished sequence still cuts its text)."""
        if self.tokenizer is None:
            return
        detok = self._detok.get(seq.seq_id)
        if detok is None:
            detok = self._detok[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, seq.params.stop)
        detok.add(seq.output_token_ids[len(detok.ids):])
        if detok.stop_hit is not None and not seq.is_finished:
            self.scheduler.finish(seq.seq_id, "stop", detok.stop_hit)
        self._texts[seq.seq_id] = detok.text

    def _output(self, seq: Sequence) -> RequestOutput:
        ids = seq.output_token_ids
        m = {"ttft": seq.ttft(), "tpot": seq.tpot(), "itl": seq.itls(), "num_preemptions": seq.num_preemptions}
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=self._prompts.get(seq.seq_id),
            prompt_token_ids=seq.prompt_ids,
            outputs=[CompletionOutput(0, self._texts.get(seq.seq_id, ""), list(ids) if seq.is_finished else
                                      TokenIds(ids, len(ids)),
                                      seq.finish_reason, seq.stop_reason, self._logprobs.get(seq.seq_id))],
            finished=seq.is_finished,
            metrics=m,
            error=self._errors.get(seq.seq_id),
            kv_transfer=self._kv_transfer.get(seq.seq_id),
            prompt_logprobs=self._prompt_logprobs.get(seq.seq_id),
        )
