"""Plain-torch write / seal / paged attention: the definition of correct.

Runs on any device; the Triton kernels have the same signatures and are tested
against these functions.  Shapes:

    k, v (new)     [T, H, D]          T new tokens, H KV heads
    slots          [T] int64          signed slot per token (kvq.cache.pool)
    q              [T, Hq, D]         Hq = H * group (GQA: query head h reads KV head h // group)
    cu_seqlens_q   [B + 1] int32      query tokens of sequence b: q[cu[b]:cu[b+1]]
    block_tables   [B, max_blocks]    signed block ids (kvq.cache.pool), -inf padding unused
    seq_lens       [B] int32          tokens in cache per sequence, the new ones included

The queries of sequence b are its last ``cu[b+1] - cu[b]`` positions; each
attends causally to every cached token up to and including its own position,
read from the cache in its stored format (the new tokens were written first).

With a prefill ``window`` (:class:`kvq.cache.step.PrefillWindow`, windowed
formats) each query reads exact exactly the keys the window rule gives it
(:func:`kvq.cache.window.exact_from`: its recent window and the sinks) and
every other key quantized: q blocks this step wrote are read from the new
K/V (``k_new``, ``v_new``, the prefill rows) by the queries whose window holds
them, and hp blocks past a query's window are read as they will be sealed.
The result no longer depends on how a prompt is cut into chunks.
"""

from __future__ import annotations

import torch

from kvq.cache.pool import TIER_BASE, LayerKV
from kvq.cache.window import exact_from
from kvq.formats import fp8
from kvq.formats.reference import dequantize, quantize, quantize_tokens


# -- write ---------------------------------------------------------------------------------------
def full_block_writes(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """[NB, 2] (q block id, index of its first token in the batch) for every q block
    that ``slots`` fills completely; raises if a q block is only partly written."""
    s = slots.tolist()
    out, i = [], 0
    while i < len(s):
        if s[i] < 0:
            i += 1
            continue
        block = s[i] // block_size
        run = s[i : i + block_size]
        if s[i] % block_size or run != list(range(block * block_size, (block + 1) * block_size)):
            raise ValueError(
                f"q block {block} is written partly (tokens {i}..): formats sealed per block need "
                f"whole, block-aligned blocks in one write"
            )
        out.append((block, i))
        i += block_size
    return torch.tensor(out, dtype=torch.int64, device=slots.device).reshape(-1, 2)


def _write_role(layer: LayerKV, role: str, x: torch.Tensor, slots: torch.Tensor) -> None:
    bs = layer.block_size
    fmt = layer.tensor_format(role)
    # the values the high-precision pool would hold: a block quantized as it is written stores
    # the same bytes as one written in high precision and sealed later (a float32 model on the CPU)
    x = x.to(layer.hp(role).dtype)
    hp_mask = slots < 0
    if bool(hp_mask.any()):
        hp_slots = -slots[hp_mask] - 1
        pool = layer.hp(role)  # [N, H, bs, D]
        pool[hp_slots // bs, :, hp_slots % bs] = x[hp_mask].to(pool.dtype)
    q_mask = ~hp_mask
    if not bool(q_mask.any()):
        return
    planes = layer.planes(role)
    if fmt.write_direct:
        q_slots = slots[q_mask]
        blocks, offs = q_slots // bs, q_slots % bs
        tok = quantize_tokens(fmt, x[q_mask], layer.static_scale(role))  # [T, H, ...]
        for name, val in tok.items():
            dst = fp8.as_bytes(planes[name])
            dst[blocks, :, offs] = fp8.as_bytes(val)  # data [T,H,Dp]; scale [T,H] or [T,H,D/G]
        return
    writes = full_block_writes(torch.where(q_mask, slots, -1), bs)
    starts = writes[:, 1]
    idx = starts[:, None] + torch.arange(bs, device=x.device)[None, :]  # [NB, bs]
    blocks_x = x[idx].permute(0, 2, 1, 3)  # [NB, H, bs, D]
    q = quantize(fmt, blocks_x, layer.static_scale(role))
    for name, val in q.items():
        fp8.index_copy_(planes[name], 0, writes[:, 0], val)


def write_kv(layer: LayerKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, full_blocks=None) -> None:
    """Store new tokens' K and V: hp slots in the model dtype, q slots quantized.

    Per-token formats quantize each token; formats sealed per block (per-block
    FP8, KIVI K) accept q slots only as whole, block-aligned blocks (``full_blocks``,
    the kernels' precomputed list of them, is recomputed and checked here).
    """
    assert k.shape == v.shape and k.dim() == 3 and slots.shape == (k.shape[0],), (k.shape, v.shape, slots.shape)
    _write_role(layer, "k", k, slots)
    _write_role(layer, "v", v, slots)


# -- seal ----------------------------------------------------------------------------------------
def seal_pairs(layer: LayerKV, pairs: torch.Tensor) -> None:
    """:func:`seal_blocks` of ``pairs`` [S, 2] (hp block, q block); rows whose q block is
    negative are padding and skipped."""
    keep = pairs[:, 1] >= 0
    seal_blocks(layer, pairs[keep, 0], pairs[keep, 1])


def seal_blocks(layer: LayerKV, src_hp: torch.Tensor, dst_q: torch.Tensor) -> None:
    """Quantize whole hp blocks ``src_hp[i]`` into q blocks ``dst_q[i]`` (both [S] int64)."""
    if src_hp.numel() == 0:
        return
    for role in ("k", "v"):
        fmt = layer.tensor_format(role)
        x = layer.hp(role).index_select(0, src_hp)
        planes = quantize(fmt, x, layer.static_scale(role))
        for name, val in planes.items():
            fp8.index_copy_(layer.planes(role)[name], 0, dst_q, val)


# -- demote (elastic precision) ------------------------------------------------------------------
def demote_pairs(layer: LayerKV, pairs: torch.Tensor, src_tier: int, dst_tier: int) -> None:
    """Re-store whole blocks in another tier (kvq.cache.tiers): block ``pairs[i, 0]`` of tier
    ``src_tier`` is dequantized to float32 and quantized into block ``pairs[i, 1]`` of tier
    ``dst_tier``, K and V, exactly as a seal of those values would store them; rows whose
    destination is negative are padding and skipped."""
    keep = pairs[:, 1] >= 0
    src_ids, dst_ids = pairs[keep, 0], pairs[keep, 1]
    if dst_ids.numel() == 0:
        return
    src, dst = layer.tier(src_tier), layer.tier(dst_tier)
    for role in ("k", "v"):
        planes = {name: fp8.index_select(t, 0, src_ids) for name, t in src.planes(role).items()}
        x = dequantize(src.tensor_format(role), planes, layer.static_scale(role), torch.float32)
        for name, val in quantize(dst.tensor_format(role), x, layer.static_scale(role)).items():
            fp8.index_copy_(dst.planes(role)[name], 0, dst_ids, val)


def demote_layers(layers: list[LayerKV], pairs: torch.Tensor, src_tier: int, dst_tier: int) -> None:
    """:func:`demote_pairs` in each of ``layers`` (one step's demotions: the same blocks in every layer)."""
    for layer in layers:
        demote_pairs(layer, pairs, src_tier, dst_tier)


# -- read ----------------------------------------------------------------------------------------
def gather_kv(layer: LayerKV, role: str, table: torch.Tensor, n: int, dtype=torch.float32) -> torch.Tensor:
    """Dequantized [H, n, D] of one sequence's first ``n`` tokens (``table`` [>= ceil(n/bs)] signed)."""
    bs = layer.block_size
    nb = -(-n // bs)
    ids = table[:nb].long()
    H, D = layer.num_kv_heads, layer.head_dim
    out = torch.empty(nb, H, bs, D, dtype=dtype, device=ids.device)
    is_hp = ids < 0
    if bool(is_hp.any()):
        out[is_hp] = layer.hp(role).index_select(0, -ids[is_hp] - 1).to(dtype)
    tier = torch.where(is_hp, -1, ids // TIER_BASE)  # elastic precision: each block as its tier stores it
    for t in range(len(layer.tiers) + 1):
        mask = tier == t
        if bool(mask.any()):
            lt = layer.tier(t)
            qids = ids[mask] - t * TIER_BASE
            planes = {name: fp8.index_select(x, 0, qids) for name, x in lt.planes(role).items()}
            out[mask] = dequantize(lt.tensor_format(role), planes, layer.static_scale(role), dtype)
    return out.permute(1, 0, 2, 3).reshape(H, nb * bs, D)[:, :n]


def sealed_values(layer: LayerKV, role: str, hp_ids: list[int], dtype=torch.float32) -> torch.Tensor:
    """[S, H, bs, D] of hp blocks as :func:`seal_blocks` would store them, read back."""
    fmt = layer.tensor_format(role)
    x = layer.hp(role).index_select(0, torch.tensor(hp_ids, dtype=torch.int64, device=layer.k_hp.device))
    return dequantize(fmt, quantize(fmt, x, layer.static_scale(role)), layer.static_scale(role), dtype)


#: Keys are reduced in tiles of this many tokens at fixed positions (0, TILE, 2 TILE, ...), and
#: the query rows of a tile product are padded to a multiple of ROWS: see :func:`_attend`.
TILE = 256
ROWS = 8


def _tile_index(idx: list[int]):
    """Tiles as an index: a slice (views, no copies) when they are consecutive; None when empty."""
    if not idx:
        return None
    if idx == list(range(idx[0], idx[-1] + 1)):
        return slice(idx[0], idx[-1] + 1)
    return idx


def _attend(qb, ke, ve, pos, sm_scale, kq=None, vq=None, quant=None):
    """softmax(q k^T * sm_scale) v of one sequence's queries ``qb`` [t, Hq, D] at positions ``pos``
    [t] over keys ``ke``/``ve`` [H, n, D] (causal: a query sees keys up to its position), in
    float32.  With ``kq``/``vq`` and ``quant`` [t, n] (bool), a (query, key) pair where ``quant``
    holds reads the key from ``kq``/``vq`` instead.

    The arithmetic of a query's row depends only on the keys it reads and which side it reads
    them from, not on the other queries computed with it nor on how many keys follow it: the keys
    go in tiles of :data:`TILE` at fixed positions; per tile and side (exact, quantized) one
    product of fixed shape up to a row count padded to a multiple of :data:`ROWS` (below that the
    CPU GEMM changes kernel); a row's sides are added in a fixed order (a side it does not read
    adds exact zeros), the row maximum is exact, and the tiles' sums are added in position order
    (masked tiles add exact zeros).  So a prompt gives the same bits whether it arrives in one
    chunk or many, alone or batched."""
    t, Hq, D = qb.shape
    H, n = ke.shape[0], ke.shape[1]
    group, nt = Hq // H, -(-n // TILE)
    t_pad, n_pad = -(-t // ROWS) * ROWS, nt * TILE
    dev = qb.device
    ninf = float("-inf")

    def tiles(x):  # [H, n, D] -> [H, nt, TILE, D] (zeros past n: masked)
        return torch.nn.functional.pad(x, (0, 0, 0, n_pad - n)).view(H, nt, TILE, D)

    def by_tile(x, pad_rows):  # [t, n] bool -> [nt, 1, t_pad, TILE] (padding rows: pad_rows)
        x = torch.nn.functional.pad(x, (0, n_pad - n))
        if t_pad > t:
            x = torch.cat([x, torch.full((t_pad - t, n_pad), pad_rows, dtype=torch.bool, device=dev)])
        return x.view(t_pad, nt, TILE).transpose(0, 1)[:, None]

    # Every product runs on t_pad rows; the padding rows (zero queries) see every key with score 0, so
    # their softmax stays finite, and are dropped at the end: a real row's bits never depend on them.
    qh = torch.nn.functional.pad(qb.float().transpose(0, 1), (0, 0, 0, t_pad - t))  # [Hq, t_pad, D]
    visible = by_tile(torch.arange(n, device=dev)[None, :] <= pos[:, None], True)
    qg = qh.reshape(H, 1, group * t_pad, D)  # rows: (query head, query), per KV head
    me = mq = eidx = None
    if quant is not None:
        mq = by_tile(quant, False) & visible  # pairs read from the quantized side
        if not bool(mq.any()):  # every visible pair exact: one side
            mq = None
        else:
            me = by_tile(~quant, False) & visible
            eidx = _tile_index(me.flatten(1).any(1).nonzero().flatten().tolist())
            if eidx is None:  # every visible pair quantized: one side
                ke, ve, mq = kq, vq, None
    # Scores: the quantized side over every tile (pairs it does not read are replaced or masked), then the
    # exact side's pairs on the tiles it reads; a pair's value comes from one side only.
    s = torch.matmul(qg, tiles(ke if mq is None else kq).transpose(2, 3)).view(H, nt, group, t_pad, TILE)
    s.mul_(sm_scale)
    if mq is not None:
        se = torch.matmul(qg, tiles(ke)[:, eidx].transpose(2, 3)).view(H, -1, group, t_pad, TILE).mul_(sm_scale)
        s[:, eidx] = torch.where(me[eidx], se, s[:, eidx])
    s.masked_fill_(~visible, ninf)
    p = s.sub_(s.amax(dim=(1, 4), keepdim=True)).exp_()  # [H, nt, group, t_pad, TILE]
    if mq is None:
        o = torch.matmul(p.view(H, nt, group * t_pad, TILE), tiles(ve))
    else:  # per tile: quantized side's sum + exact side's sum (either may be all zeros)
        o = torch.matmul((p * mq).view(H, nt, group * t_pad, TILE), tiles(vq))
        o[:, eidx] += torch.matmul((p[:, eidx] * me[eidx]).view(H, -1, group * t_pad, TILE), tiles(ve)[:, eidx])
    den = p.sum(dim=4)  # [H, nt, group, t_pad]
    acc, tot = o[:, 0], den[:, 0]
    for i in range(1, nt):  # position order
        acc, tot = acc + o[:, i], tot + den[:, i]
    out = acc.view(H, group, t_pad, D)[:, :, :t] / tot[:, :, :t, None]
    out = out.reshape(Hq, t, D)
    return out.transpose(0, 1)  # [t, Hq, D]


def _windowed(qb, kk, vv, layer, window, k_new, v_new, b, n, sm_scale):
    """Attention of one prefill sequence under the per-query window rule (module docstring)."""
    bs = layer.block_size
    t = qb.shape[0]
    ex = [(i, row) for bb, i, row in window.exact_rows if bb == b]
    se = [(i, hp) for bb, i, hp in window.sealed_rows if bb == b]
    # ke/ve: the keys as the exact side reads them; kq/vq: as the quantized side does.  They
    # differ only in the blocks listed: q blocks this step wrote (exact: the new K/V as the
    # high-precision pool would hold them) and hp blocks some query reads sealed.
    ke, ve, kq, vq = kk.clone(), vv.clone(), kk, vv
    hp = layer.k_hp.dtype
    for i, row in ex:  # [bs, H, D] -> [H, bs, D]
        ke[:, i * bs:(i + 1) * bs] = k_new[row:row + bs].transpose(0, 1).to(hp).float()
        ve[:, i * bs:(i + 1) * bs] = v_new[row:row + bs].transpose(0, 1).to(hp).float()
    if se:
        kq, vq = kk.clone(), vv.clone()
        ks, vs = sealed_values(layer, "k", [hp for _, hp in se]), sealed_values(layer, "v", [hp for _, hp in se])
        for j, (i, _) in enumerate(se):  # [H, bs, D]
            kq[:, i * bs:(i + 1) * bs] = ks[j]
            vq[:, i * bs:(i + 1) * bs] = vs[j]
    dev = qb.device
    pos = torch.arange(n - t, n, device=dev)
    key = torch.arange(n, device=dev)
    start = torch.tensor([exact_from(int(p), window.policy) for p in pos.tolist()], device=dev)
    exact = (key[None, :] < window.sink_tokens) | (key[None, :] >= start[:, None])  # [t, n]
    return _attend(qb, ke, ve, pos, sm_scale, kq, vq, ~exact)


def paged_attention(
    q: torch.Tensor,
    layer: LayerKV,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    max_q_len: int | None = None,
    has_hp: bool | None = None,
    max_seq_len: int | None = None,
    window=None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    host=None,
    tiers=None,
    tiered: bool = False,
) -> torch.Tensor:
    """Causal attention of new tokens over the paged cache (prefill chunks and decode).

    ``max_q_len``, ``has_hp``, ``max_seq_len`` and ``host`` (the host copy of the lengths) are
    launch hints of the kernels, unused here; so are ``tiers`` (kvq.cache.step.TierTables, the
    kernels' per-tier tables) and ``tiered``: this reads each block of a tiered cache as its tier stores it
    from the table's tags (kvq.cache.pool.TIER_BASE).
    ``window`` (with ``k_new``, ``v_new`` [T, H, D], the rows of ``q``): per-query exact
    windows (module docstring)."""
    T, Hq, D = q.shape
    H = layer.num_kv_heads
    assert Hq % H == 0, (Hq, H)
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    windowed = window is not None and layer.fmt.is_quantized
    for b in range(len(lens)):
        qb = q[cu[b] : cu[b + 1]].float()  # [t, Hq, D]
        t, n = qb.shape[0], lens[b]
        if t == 0:
            continue
        assert t <= n, f"sequence {b}: {t} queries but only {n} cached tokens"
        kk = gather_kv(layer, "k", block_tables[b], n)  # [H, n, D]
        vv = gather_kv(layer, "v", block_tables[b], n)
        if windowed:  # every prompt sequence: its pairs split by the rule, whatever the step lists
            out[cu[b] : cu[b + 1]] = _windowed(qb, kk, vv, layer, window, k_new, v_new, b, n, sm_scale).to(q.dtype)
            continue
        pos = torch.arange(n - t, n, device=q.device)  # query i at position n - t + i sees keys 0..n-t+i
        out[cu[b] : cu[b + 1]] = _attend(qb, kk, vv, pos, sm_scale).to(q.dtype)
    return out


def paged_decode(q, layer, block_tables, seq_lens, sm_scale, max_seq_len=None, has_hp=None, tiers=None):
    """One new token per sequence: q [B, Hq, D] -> [B, Hq, D] (``tiers``: see :func:`paged_attention`)."""
    B = q.shape[0]
    cu = torch.arange(B + 1, dtype=torch.int32, device=q.device)
    return paged_attention(q, layer, cu, block_tables, seq_lens, sm_scale)
