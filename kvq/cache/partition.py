"""Which slice of a model each tensor-parallel rank holds (no tensors here).

Attention splits by KV head: rank r holds a contiguous run of KV heads and the query heads of their
groups, so a KV head's codes, scales, zero points and high-precision blocks live on exactly one rank
and every KV format keeps its bytes per head.  When the KV heads do not divide evenly (SmolLM2-135M
has 3), the first ranks take one head more; with more ranks than KV heads (a multiple of them, each
rank an equal share of the query heads), each KV head is replicated on world / heads ranks, as vLLM
does, each computing it from the same weights for its own query heads.  The slowest rank sets the
pace, and the pools of every rank hold the same number of blocks (the fewest any rank can
afford), because one scheduler hands out block ids for all of them.  The MLP's intermediate rows
split the same way; the vocabulary is padded to a multiple of the world size so that every rank's
LM-head logits have one shape (the padded ids are never sampled: they are cut after the gather).
"""

from __future__ import annotations

from dataclasses import dataclass


def split(n: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s share of ``n`` items in contiguous runs; the first ``n % world``
    ranks take one more."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass(frozen=True)
class Partition:
    """Rank ``rank`` of ``world``: its heads, intermediate rows and vocabulary rows."""

    world: int
    rank: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {self.world!r}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} outside 0..{self.world - 1}")
        if self.world > self.num_kv_heads and (self.world % self.num_kv_heads or self.num_heads % self.world):
            valid = [n for n in range(self.num_kv_heads + 1, self.num_heads + 1)
                     if n % self.num_kv_heads == 0 and self.num_heads % n == 0]
            raise ValueError(f"tensor_parallel_size {self.world} exceeds the model's {self.num_kv_heads} KV heads and "
                             f"is not a multiple of them dividing its {self.num_heads} query heads (valid: "
                             f"1..{self.num_kv_heads}{''.join(f', {n}' for n in valid)})")

    @classmethod
    def of(cls, cfg, world: int, rank: int) -> "Partition":
        """For a :class:`~kvq.models.llama.LlamaConfig` (or anything with its field names)."""
        return cls(world, rank, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size)

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def replicas(self) -> int:
        """Ranks that hold each KV head (1 unless there are more ranks than KV heads)."""
        return max(1, self.world // self.num_kv_heads)

    @property
    def kv_heads(self) -> tuple[int, int]:
        if self.replicas > 1:
            j = self.rank // self.replicas
            return j, j + 1
        return split(self.num_kv_heads, self.world, self.rank)

    @property
    def heads(self) -> tuple[int, int]:
        if self.replicas > 1:
            per = self.num_heads // self.world
            return self.rank * per, (self.rank + 1) * per
        a, b = self.kv_heads
        return a * self.group, b * self.group

    @property
    def intermediate(self) -> tuple[int, int]:
        return split(self.intermediate_size, self.world, self.rank)

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.world) * self.world

    @property
    def vocab(self) -> tuple[int, int]:
        """[start, end) of this rank's rows of the padded vocabulary (equal for every rank)."""
        per = self.padded_vocab // self.world
        return self.rank * per, (self.rank + 1) * per

    local_kv_heads = property(lambda self: _width(self.kv_heads))
    local_heads = property(lambda self: _width(self.heads))
    local_intermediate = property(lambda self: _width(self.intermediate))
    local_vocab = property(lambda self: _width(self.vocab))


def _width(run: tuple[int, int]) -> int:
    return run[1] - run[0]


def head_partition(model, world: int, rank: int) -> Partition:
    """The attention heads of rank ``rank`` for a :class:`~kvq.cache.shape.ModelShape` (which
    knows no MLP or vocabulary; those fields are 1)."""
    return Partition(world, rank, model.num_attention_heads, model.num_kv_heads, 1, 1)


def rank_plan(plan, world: int, rank: int):
    """(KV heads [start, end), the plan of rank ``rank``'s own pool): the same formats over its heads."""
    from dataclasses import replace

    def local(r: int):
        part = head_partition(plan.model, world, r)
        return part, replace(plan, model=replace(plan.model, num_kv_heads=part.local_kv_heads,
                                                     num_attention_heads=part.local_heads))

    part, mine = local(rank)
    if plan.tiers and world > 1:  # elastic precision: every rank's arena holds the same blocks a slab
        from kvq.cache.arena import arena_layout, plan_arena_shared

        per = plan_arena_shared([arena_layout(local(r)[1]).block_bytes for r in range(world)])[0].per_slab
        mine = replace(mine, arena_per_slab=per)
    return part.kv_heads, mine


def rank_plans(plan, world: int) -> list:
    """:func:`rank_plan` of every rank."""
    return [rank_plan(plan, world, r) for r in range(world)]


def parallel_capacity(plan, world: int, memory: int, context_len: int | None = None) -> dict:
    """``memory`` bytes on each of ``world`` ranks: every rank's bytes, and what the engine can use
    (each rank's pool holds the fewest blocks any rank can, since one scheduler hands out block ids)."""
    ranks = []
    for (a, b), p in rank_plans(plan, world):
        cap = p.capacity(memory, context_len)
        ranks.append({"rank": len(ranks), "kv_heads": [a, b], "bytes_per_block": p.bytes_per_block,
                      "bytes_per_token": p.bytes_per_token, "num_blocks": cap.num_blocks})
    blocks = min(r["num_blocks"] for r in ranks)
    used = [blocks * r["bytes_per_block"] for r in ranks]
    replicas = head_partition(plan.model, world, 0).replicas
    return {"size": world, "memory_per_rank": memory, "kv_head_replicas": replicas, "ranks": ranks,
            "num_blocks": blocks, "num_tokens": blocks * plan.block_size, "bytes_per_rank": used,
            "bytes_total": sum(used)}
