"""Prefix-cache lookups and prompt planning for :class:`~kvq.cache.block_manager.BlockManager`:
which cached blocks a prompt can reuse (the window rule decides which pool each must be in; a
demoted block of a lower tier serves the resident state as stored), and whether its
reservation fits, without mutating anything."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvq.cache.host_tier import HostBlock
from kvq.cache.window import POOLS, Pool, block_state


class _PromptPlan(NamedTuple):
    """A prompt's reservation: device hits ((pool, block id)), their hashes, whether the lookup missed,
    whether it fits, the reserved length, and the blocks to load from the CPU prefix tier."""

    hits: list[tuple[str, int]]
    hashes: list[int]
    miss: bool
    ok: bool
    L: int
    loads: list[HostBlock]


class PrefixMixin:
    """Prompt planning (state set up by BlockManager.__init__)."""

    def _prefix_blocks(self, token_ids: Sequence[int], use_host: bool = True
                       ) -> tuple[list[int], list[dict[Pool, int]], list[dict[Pool, HostBlock]]]:
        """Hashes of the prompt's leading full blocks found cached, and in which pools of the device
        (block ids) and of the CPU prefix tier (its copies, each naming the device pool it loads
        into), up to the first block neither holds (no mutation).
        The last token is never covered: it is always computed."""
        bs = self.block_size
        hashes: list[int] = []
        found: list[dict[Pool, int]] = []
        host: list[dict[Pool, HostBlock]] = []
        if not self.enable_prefix_caching:
            return hashes, found, host
        tier = self.host_tier if use_host else None
        parent = None
        for i in range((len(token_ids) - 1) // bs):
            toks = token_ids[i * bs:(i + 1) * bs]
            h = self._chain_hash(parent, toks)
            where = {p: b for p in self._alloc if (b := self._alloc[p].probe(h, toks)) is not None}
            there = {} if tier is None else {p: b for p in POOLS if (b := tier.probe_block(p, h, toks)) is not None}
            if not where and not there:
                break
            hashes.append(h)
            found.append(where)
            host.append(there)
            parent = h
        return hashes, found, host

    def _valid_hits(self, found: list[dict[Pool, int]], host: list[dict[Pool, HostBlock]]) -> list[tuple[int, int]]:
        """``(h, k)``, longest ``h`` first and ``(0, 0)`` last: cached prefixes of ``h`` blocks the
        window rule lets a prompt reuse, the first ``k`` from the device and the others loaded from
        the CPU prefix tier.  Block ``i < h`` must be cached in pool ``block_state(i, h * bs)``, the
        pool it has when the first computed token (at ``h * bs``) reads it (so that query reads
        exact what the rule says); ``k`` is the first block the device lacks there, and every
        block from ``k`` on must be in the tier (in that pool; a q block in whichever tier it was
        stored from, loaded back into that tier)."""
        bs, out = self.block_size, []
        for h in range(len(found), 0, -1):
            pools = [block_state(i, h * bs, self.policy) for i in range(h)]
            k = next((i for i in range(h) if self._hit_pool(found[i], pools[i]) is None), h)
            if all(pools[i] in host[i] for i in range(k, h)):
                out.append((h, k))
        return out + [(0, 0)]

    def _hit_pool(self, found: dict[Pool, int], state: Pool) -> str | None:
        """The device pool a cached block serves ``state`` from: ``hp``, or for ``q`` the highest tier
        that holds it (a demoted block is served as stored); None when none does."""
        if state == "hp":
            return "hp" if "hp" in found else None
        return next((p for p in ("q", *(f"q{t}" for t in range(1, self.num_tiers + 1))) if p in found), None)

    def _plan_prompt(self, token_ids: Sequence[int], use_cache: bool = True, end=None,
                     use_host: bool = True, lower_loads: bool = True) -> _PromptPlan:
        """How a prompt would be reserved now, without mutating anything (:class:`_PromptPlan`).

        ``end(hit_tokens)`` is how much of the prompt to reserve for a hit of that many tokens
        (default: all of it).  The longest valid hit whose reservation fits is taken: a shorter hit
        can need fewer blocks (a hit block of the window is a high-precision block that the prompt
        without it would store quantized; a block loaded from the host needs a device block), and
        no hit at all is always a candidate, so the cache never makes a prompt that fits without
        it fail.  ``lower_loads=False`` takes no hit that loads a lower tier's block from the host."""
        bs = self.block_size
        hashes, found, host = self._prefix_blocks(token_ids, use_host) if use_cache else ([], [], [])
        first = None
        for h, k in self._valid_hits(found, host):
            L = len(token_ids) if end is None else end(h * bs)
            assert h * bs < L <= len(token_ids), (h, L, len(token_ids))
            pools = [block_state(i, h * bs, self.policy) for i in range(h)]
            hit_pools = [self._hit_pool(found[i], pools[i]) for i in range(k)]
            hits = [(hit_pools[i], found[i][hit_pools[i]]) for i in range(k)]
            loads = [host[i][pools[i]] for i in range(k, h)]
            if not lower_loads and any(b.pool not in POOLS for b in loads):
                continue
            taken_free = {"q": 0, "hp": 0}  # cached-free hits stop being allocatable
            revived: set[tuple[str, int]] = set()  # idle arena slabs a hit brings back into use
            for pool, bid in hits:
                if self._alloc[pool].refcount(bid) == 0:
                    if pool == "q" or pool == "hp":
                        taken_free[pool] += 1
                    if self.arena is not None and pool != "hp" and self._alloc[pool].is_idle(bid):
                        revived.add((pool, self._alloc[pool].slab_of(bid)))
            if revived:  # another tier's idle slab in use again: tier 0 can no longer reclaim it
                taken_free["q"] += self._alloc["q"].per_slab * sum(p != "q" for p, _ in revived)
            need = {"q": 0, "hp": 0}
            for b in loads:  # a device block to load into (a lower tier's: counted by the trial below)
                need[b.pool] = need.get(b.pool, 0) + 1
            for i in range(h, -(-L // bs)):
                need[block_state(i, L, self.policy)] += 1
            ok = all(need[p] <= self._alloc[p].num_free - taken_free[p] for p in POOLS)
            if ok and len(need) > len(POOLS):  # loads into lower tiers: every q pool takes the arena's slabs
                ok = self._fits_in_free_slabs(need)
            miss = h < (L - 1) // bs and self.enable_prefix_caching and use_cache  # a lookup that did not hit
            plan = _PromptPlan(hits, hashes[:h], miss, ok, L, loads)
            if ok:
                return plan
            first = first or plan
        return first

    def _fits_in_free_slabs(self, need: dict[str, int]) -> bool:
        """Whether the q pools' blocks ``need`` (pool -> count; hp left out) come out of the free ids of
        slabs in use, the arena's free slabs (the reserve left out) and its idle slabs (each tier's
        reclaims another's, whose cached blocks it evicts; a tier's own idle slab is one slab to it).
        A prompt that loads blocks of several tiers needs this: the tiers share the slabs, so no
        tier's count alone can tell.  The allocators' order (a free slab before a tier's own cached
        block) can still waste a slab: :meth:`allocate_prompt` then gives everything back."""
        slabs = 0
        for pool, n in need.items():
            if pool != "hp":
                a = self._alloc[pool]
                slabs += -(-max(0, n - a.num_free_ids_busy) // a.per_slab)
        return slabs <= self.arena.grantable(False) + self.arena.num_idle

    def can_allocate(self, num_tokens: int, token_ids: Sequence[int] | None = None, end=None,
                     use_host: bool = True) -> bool:
        """Whether :meth:`allocate_prompt` of ``num_tokens`` tokens would succeed now.

        With ``token_ids`` the prefix cache is taken into account (``end`` and ``use_host`` as there).
        """
        if token_ids is None:
            if num_tokens < 1:
                raise ValueError(f"a prompt needs at least one token, got {num_tokens}")
            return self._plan_prompt([0] * num_tokens, use_cache=False, end=end).ok
        if len(token_ids) != num_tokens or num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens} with {len(token_ids)} token ids; a prompt needs >= 1")
        return self._plan_prompt(token_ids, end=end, use_host=use_host).ok
