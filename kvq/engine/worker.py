"""One rank's share of an engine: its model (shard), its KV pools and the runner that computes steps.

A :class:`Worker` is built from an :class:`~kvq.engine.config.EngineConfig` on every rank: the
engine's process holds rank 0's (the scheduler, the block manager and the sampler stay with the
engine), and an executor (:mod:`kvq.engine.executor`; tensor parallelism in :mod:`kvq.parallel`)
builds the others, which never build an engine.  Everything that can be wrong with the choices is
checked before the weights load (seconds to minutes): the device, the model files' headers, the
plan against the model's shape, the backend, the max length, and the KV budget against the
device's memory wherever it is known without profiling.
"""

from __future__ import annotations

import math

import torch

from kvq.attention.backends import prefill_kernels, select_backend, select_prefill
from kvq.cache.arena import arena_layout
from kvq.cache.block_manager import BlockRef
from kvq.cache.host_pool import HostKVPool
from kvq.cache.partition import rank_plan
from kvq.cache.plan import CachePlan
from kvq.cache.pool import KVPool
from kvq.cache.window import block_state, can_seal, peak_blocks
from kvq.engine.config import (CPU_DEFAULT_KV_MEMORY, EngineConfig, check_memory_fits, resolve_device, resolve_dtype,
                               resolve_threads)
from kvq.engine.connector import ConnectorContext, make_connector
from kvq.engine.cuda_graphs import DecodeGraphs
from kvq.engine.model_runner import ModelRunner
from kvq.engine.scheduling import ScheduledSeq, SchedulerOutput
from kvq.models.builder import build_model
from kvq.models.source import model_shape, resolve_model
from kvq.units import format_bytes, parse_bytes


class _Zeros:
    """Token ids of a profiling step: all 0."""

    def __init__(self, n: int):
        self.num_tokens = n

    def token_ids(self, start: int, end: int) -> list[int]:
        return [0] * (end - start)


def hp_blocks_needed(plan: CachePlan, max_num_seqs: int, max_batched_tokens: int) -> int:
    """High-precision blocks for every running sequence's sinks, recent window and tail."""
    pol = plan.window_policy
    if not plan.is_quantized or (pol.write_direct and pol.residual_tokens == 0 and pol.sink_blocks == 0):
        return 0
    per_seq = pol.sink_blocks + math.ceil(pol.residual_tokens / pol.block_size) + 2
    return max_num_seqs * per_seq + math.ceil(max_batched_tokens / pol.block_size)


def pool_state(pool) -> list[dict]:
    """Per layer, the pool's tensors by name on the CPU (float8 ones as uint8 views: torch's pickling
    does not carry float8 storages)."""
    out = []
    for layer in pool.layers:
        d = {f"k.{n}": t for n, t in layer.k.items()} | {f"v.{n}": t for n, t in layer.v.items()}
        d |= {"k_hp": layer.k_hp, "v_hp": layer.v_hp, "k_scale": layer.k_scale, "v_scale": layer.v_scale}
        out.append({n: (t.view(torch.uint8) if t.dtype in FLOAT8 else t).detach().cpu().clone()
                    for n, t in d.items()})
    return out


FLOAT8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
          if hasattr(torch, n)}


class Worker:
    """Model, pools and runner of one rank (module docstring).  ``group``: the rank's tensor-parallel
    process group (``rank``, ``world``, ``device``, ``min_int``; the model's layers use its collectives),
    or None alone."""

    def __init__(self, cfg: EngineConfig, group=None):
        self.config, self.tp = cfg, group
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        src = self.source = resolve_model(cfg.model)
        shape = model_shape(src)
        self.kv_cache = cfg.kv_cache_config
        self.plan = self.full_plan = self.kv_cache.plan(shape)  # under TP, self.plan becomes this rank's
        self.static_scales, self.kv_scales_source = self._static_scales(cfg, src, shape)
        if group is not None:
            self._take_rank(group, shape)
        backend, choice = select_backend(cfg.attention_backend, self.plan, self.device, self.dtype)
        self.backend_choice = select_prefill(cfg.prefill_backend, choice, self.plan, self.device)
        self.kernels = prefill_kernels(backend.kernels(), self.backend_choice, self.device)
        self.max_model_len = cfg.max_model_len or shape.max_position_embeddings
        if self.max_model_len > shape.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"{shape.max_position_embeddings} positions (valid: 1..{shape.max_position_embeddings})")
        offload = int(cfg.cpu_offload_gb * (1 << 30))
        if offload:
            check_memory_fits(offload, torch.device("cpu"), "cpu_offload_gb")
        memory = self._explicit_kv_memory()
        if memory is not None:
            check_memory_fits(memory, self.device)
            self._pool_blocks(memory)  # too small for one block: said now, not after the load
        threads = resolve_threads(cfg.threads, self.device)
        if threads is not None:  # process-wide: torch has one intra-op pool
            torch.set_num_threads(threads)
        self.model, self.tokenizer = build_model(src, load_format=cfg.load_format, dtype=self.dtype,
                                                 device=self.device, seed=cfg.seed,
                                                 progress=cfg.progress and not (group and group.rank), tp=group)
        if memory is None:
            memory = self._profiled_kv_memory()
        num_q, num_hp = self._pool_blocks(memory)
        if group is not None:  # one scheduler hands out block ids for every rank: the fewest any can hold
            num_q, num_hp = group.min_int(num_q), group.min_int(num_hp)  # (whole slabs on every rank: equal per_slab)
        self.num_q_blocks, self.num_hp_blocks = int(num_q), int(num_hp)
        # (not yet under tensor parallelism: NCCL collectives inside captured graphs have not run here)
        use_graphs = (self.device.type == "cuda" and not cfg.enforce_eager and group is None
                      and self.backend_choice.resolved in ("triton", "cuda"))
        # CUDA graphs pad batches with rows that write to a null block outside the manager's range
        if self.plan.tiers:  # the arena in whole slabs (a graph's null block: the first of one more)
            per0 = arena_layout(self.plan).per_slab[0]
            self.pool = KVPool.create(self.plan, 0, num_hp, self.device, self.static_scales,
                                      num_slabs=self.num_q_blocks // per0 + int(use_graphs))
        else:
            self.pool = KVPool.create(self.plan, self.num_q_blocks + int(use_graphs), num_hp, self.device,
                                      self.static_scales)
        # every rank's pool bytes, known to all (a collective: each rank's worker takes part once, here)
        self.rank_pool_bytes = group.all_ints(self.pool.nbytes()) if group is not None else [self.pool.nbytes()]
        # host memory: the swap tier's blocks, then the CPU prefix tier's, in one pool shaped like the
        # device's (pinned on CUDA)
        self.host_blocks, self.tier_blocks = host, tier = self._host_split(offload)
        self.host_pool = HostKVPool.create(self.pool, host[0] + tier[0], host[1] + tier[1]) if offload else None
        self.graphs = None
        if use_graphs:
            self.graphs = DecodeGraphs(self.model, self.pool, self.kernels, self.device, cfg.max_num_seqs,
                                       self.max_model_len, null_block=self.num_q_blocks, has_hp=num_hp > 0,
                                       can_seal=can_seal(self.plan.window_policy))
            self.graphs.capture()
        # request-level swap's copies: the worker side of a KV connector (kvq.engine.connector)
        self.swap = (make_connector("swap", ConnectorContext(self.pool, self.host_pool))
                     if cfg.preemption_mode == "swap" and self.host_pool is not None else None)
        self.runner = ModelRunner(self.model, self.pool, self.kernels, self.device, self.graphs, cfg.max_num_seqs,
                                  swap=self.swap)

    def _static_scales(self, cfg: EngineConfig, src, shape) -> tuple[dict | None, str]:
        """Static KV scales and where they come from: ``--kv-scales FILE``, else the checkpoint's own
        (kvq.cache.scales_checkpoint), else none (1.0).  A checkpoint's scales with a quantized format
        that cannot use them are an error naming both, never dropped in silence."""
        from kvq.cache.scales_checkpoint import checkpoint_scales
        from kvq.cache.scales_file import ScalesError, load_scales, static_layers

        from kvq.cache.scales_warmup import parse_warmup

        self.warmup_tokens = parse_warmup(cfg.kv_scales)
        if self.warmup_tokens:
            if not static_layers(self.plan):
                raise ScalesError(f"--kv-scales {cfg.kv_scales}: the KV format {self.plan.name} takes no static "
                                  "scales; static-scaled formats: fp8_e4m3, fp8_e5m2")
            return None, f"warmup: observing (0/{self.warmup_tokens} tokens)"
        if cfg.kv_scales is not None:
            from kvq.models.identity import model_identity

            return load_scales(cfg.kv_scales, self.plan, model_identity(src)), cfg.kv_scales
        found = checkpoint_scales(src, shape.num_layers, shape.num_kv_heads)
        if found is None:
            return None, "none"
        convention, scales = found
        wanted = static_layers(self.plan)
        if wanted:
            return {i: scales[i] for i in wanted}, f"checkpoint ({convention})"
        if self.plan.is_quantized:
            raise ScalesError(f"{src.name} ships {convention} KV scales for a static FP8 cache, and the KV format "
                              f"{self.plan.name} cannot use them: use --kv-cache-dtype fp8_e4m3 (or fp8_e5m2), "
                              "or a high-precision format")
        return None, f"checkpoint ({convention}): unused, the cache keeps {self.plan.name}"

    def _take_rank(self, group, shape) -> None:
        """This rank's share under tensor parallelism: its device, its KV heads' plan and their static
        scales (``group``: the rank's process group, started by the executor)."""
        n = group.world
        self.device = group.device
        (a, b), self.plan = rank_plan(self.full_plan, n, group.rank)
        if self.static_scales:
            H = shape.num_kv_heads
            self.static_scales = {i: tuple(torch.as_tensor(s, dtype=torch.float32).reshape(-1).expand(H)[a:b].clone()
                                           for s in ks) for i, ks in self.static_scales.items()}

    def _explicit_kv_memory(self) -> int | None:
        """The KV budget where it is known before the model loads: given, or the CPU default."""
        if self.config.kv_cache_memory is not None:
            return parse_bytes(self.config.kv_cache_memory)
        return None if self.device.type == "cuda" else parse_bytes(CPU_DEFAULT_KV_MEMORY)

    def _host_split(self, budget: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(q, hp) blocks of the swap tier and of the CPU prefix tier in ``budget`` bytes of host
        memory: all of it for the one in use, half each when both are."""
        swap = self.config.preemption_mode == "swap"
        tier = self.config.uses_cpu_prefix_cache
        if not budget or not (swap or tier):
            return (0, 0), (0, 0)
        share = budget // 2 if swap and tier else budget
        return (self._host_blocks(share) if swap else (0, 0)), (self._tier_blocks(share) if tier else (0, 0))

    def _tier_blocks(self, budget: int) -> tuple[int, int]:
        """(q, hp) blocks of the CPU prefix tier in ``budget`` bytes.  A cached prefix is reusable
        only with its sink and window blocks (high precision), so the tier keeps them in the
        proportion a prefix of min(max_model_len, 1024) tokens has (shorter prefixes need more
        high-precision blocks per token, longer ones fewer; measured on the H200, sizing for
        256-token prefixes starved 2K-token prompts of resident blocks)."""
        pol, plan = self.plan.window_policy, self.plan
        bs = pol.block_size
        length = max(min(self.max_model_len, 1024), bs)
        hp = sum(block_state(i, length, pol) == "hp" for i in range(length // bs)) if plan.hp_bytes_per_block else 0
        q = max(length // bs - hp, 1)
        per = q * plan.bytes_per_block + hp * plan.hp_bytes_per_block
        num_hp = budget * hp // per if hp else 0
        return self._with_resident(budget, num_hp)

    def _with_resident(self, budget: int, num_hp: int) -> tuple[int, int]:
        """(q, hp) host blocks: ``num_hp`` high-precision ones and resident ones in the rest of ``budget``."""
        plan = self.plan
        num_q = (budget - num_hp * plan.hp_bytes_per_block) // plan.bytes_per_block
        if num_q < 1:
            raise ValueError(f"cpu_offload_gb {format_bytes(budget)} holds no KV block of this plan "
                             f"({format_bytes(plan.bytes_per_block)} per block)")
        return int(num_q), int(num_hp)

    def _host_blocks(self, budget: int) -> tuple[int, int]:
        """(q, hp) blocks of the swap tier in ``budget`` bytes.  Running and swapped requests together
        never exceed max_num_seqs (nothing is admitted while one is swapped), and a request holds at
        most :func:`peak_blocks` hp blocks whatever its length: the tier keeps that many hp blocks (at
        most half the budget) and gives the rest to resident blocks, which grow with the length."""
        pol, plan = self.plan.window_policy, self.plan
        num_hp = 0
        if plan.hp_bytes_per_block and not (pol.write_direct and pol.residual_tokens == 0 and pol.sink_blocks == 0):
            per_seq = peak_blocks(self.max_model_len, pol, self.config.max_num_batched_tokens)[1]
            num_hp = min(self.config.max_num_seqs * per_seq, budget // 2 // plan.hp_bytes_per_block)
        return self._with_resident(budget, num_hp)

    def _pool_blocks(self, memory: int) -> tuple[int, int]:
        """(resident, high-precision) blocks that ``memory`` bytes hold for this plan."""
        num_hp = hp_blocks_needed(self.plan, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        if num_hp:  # at most a quarter of the memory; admission control keeps within what exists
            # one request alone must fit, whatever its length: sinks and two windows while a chunk is reserved
            one_seq = peak_blocks(self.max_model_len, self.plan.window_policy, self.config.max_num_batched_tokens)[1]
            num_hp = max(one_seq, min(num_hp, memory // 4 // self.plan.hp_bytes_per_block))
        unit = self.plan.bytes_per_block
        if self.plan.tiers:  # elastic precision: the resident blocks as whole slabs of the tiers' arena
            lay = arena_layout(self.plan)
            unit = lay.bytes_per_slab
        num_q = (memory - num_hp * self.plan.hp_bytes_per_block) // unit
        if num_q < 1 + bool(self.plan.tiers and self.plan.tier_rule.pressure):
            raise ValueError(f"KV memory {memory} bytes is too small for this plan (needs "
                             f"{num_hp * self.plan.hp_bytes_per_block + 2 * unit} bytes at least)")
        if self.plan.tiers:
            num_q *= lay.per_slab[0]
        return int(num_q), int(num_hp)

    def arena(self) -> tuple[tuple[int, ...], int, int] | None:
        """The block manager's arena of a tiered plan: (blocks of each tier per slab, slabs, reserve
        slabs: one in 128, at least two, with the pressure policy), None untiered.  The reserve bounds what
        pressure can move in one step (a slab freed by a demotion takes no demoted block before the next
        step): about reserve x (per_slab[1] - per_slab[0]) resident blocks a step, which a decode wave
        needs at one new block a sequence every block_size steps."""
        if not self.plan.tiers:
            return None
        per = self.pool.layout.per_slab
        slabs = self.num_q_blocks // per[0]
        return per, slabs, max(2, slabs // 128) if self.plan.tier_rule.pressure else 0

    def _profiled_kv_memory(self) -> int:
        """The KV budget on CUDA without kv_cache_memory: gpu_memory_utilization of the device, less
        what is in use and a profiled forward's activations."""
        cfg = self.config
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        m = self.model.config
        act = self._profile_forward_bytes()
        act += 3 * cfg.max_num_seqs * m.vocab_size * 4  # sampler: probabilities and sorted copies
        if self.device.type == "cuda" and not cfg.enforce_eager:  # graph outputs and one graph's activations
            from kvq.engine.cuda_graphs import capture_sizes

            act += sum(capture_sizes(cfg.max_num_seqs)) * m.vocab_size * 4 + (256 << 20)
        budget = int(total * cfg.gpu_memory_utilization) - used - act
        if budget <= 0:
            raise ValueError("no GPU memory left for the KV cache at this gpu_memory_utilization")
        self.profiled_activation_bytes = act
        return budget

    def profile_step(self):
        """(runner, step, seqs) of the largest step: a ``max_num_batched_tokens`` prefill that
        scores ``max_num_seqs`` rows, through a runner on a scratch pool of its own."""
        cfg, bs = self.config, self.plan.block_size
        T = min(cfg.max_num_batched_tokens, self.max_model_len)
        nb = math.ceil(T / bs)
        slabs = {"num_slabs": 1} if self.plan.tiers else {}  # a tiered pool counts its arena in slabs
        scratch = KVPool.create(self.plan, 0 if slabs else 1, nb, self.device, **slabs)
        runner = ModelRunner(self.model, scratch, self.kernels, self.device, max_num_seqs=1)
        item = ScheduledSeq(0, T, 0, is_prefill=True, sample=False,
                            slots=tuple(("hp", p // bs, p % bs) for p in range(T)), table_start=0,
                            table_refs=tuple(BlockRef("hp", j) for j in range(nb)), table_len=nb,
                            logit_rows=tuple(range(T - min(T, cfg.max_num_seqs), T)))
        return runner, SchedulerOutput((item,), num_batched_tokens=T), {0: _Zeros(T)}

    def _profile_forward_bytes(self) -> int:
        """Peak memory of :meth:`profile_step`'s forward, measured by running it."""
        runner, step, seqs = self.profile_step()
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        runner.execute(step, seqs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del runner
        torch.cuda.empty_cache()
        return int(peak * 1.1)
