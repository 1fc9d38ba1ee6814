"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

One step, host side then device side (habit 8: no host sync in between):

    st = SamplingTensors.from_params(params_list, device, seed_state)   # host lists -> one copy
    out = sampler(logits, st, step_index)                               # device only
    ids = out.token_ids.tolist()                                        # the caller's one sync

Per-row parameter objects are duck-typed: only ``temperature``, ``top_p``,
``top_k``, ``seed`` and ``logprobs`` are read (``kvq.engine.sampling_params.SamplingParams``
has them).  Semantics follow vLLM:

* temperature < 1e-5 is greedy: argmax of the raw logits, ties -> lowest id.
* otherwise logits / temperature, then top-k, then top-p over what top-k kept
  (smallest prefix of the sorted probabilities whose mass is >= top_p; the most
  likely token is always kept), then one draw from the renormalised distribution.
* logprobs are "raw": log_softmax of the logits as given (before temperature and
  masking); top ``k`` = the largest ``logprobs`` asked for in the batch, plus the
  sampled token's logprob and rank.

Top-k keeps exactly k tokens; among logits tied at the k-th value the lower ids
are kept (a stable sort), so top_k=1 is greedy even with ties.  vLLM keeps every
token tied with the k-th, which differs only on exact ties.

On CUDA every row without a top-k/top-p cut goes through one kernel
(:mod:`kvq.models.sampling_triton`): greedy argmax, or the Gumbel-max draw
``argmax(x / T + G)`` with Philox noise keyed by the row's seed, one read of the
logits (the path below costs a pass over ``[B, V]`` floats per operation: about
1.6 ms a step at 512 rows of a 128K vocabulary on the H200).  A seeded row's key is
:func:`row_seed` (seed, step); the unseeded rows' keys follow one 62-bit draw per
step from torch's default CPU generator.  Rows with a cut, and every row elsewhere:

Draws use the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d.
picks id i with probability probs[i] / sum(probs) and needs no normalisation,
no cumsum search and no sync.  Unseeded rows share one batched ``[B, V]`` draw
from torch's default generator.  A seeded row draws its own ``[V]`` noise from a
generator re-seeded from (seed, step_index[row]), so its tokens depend on nothing
but its own logits, seed and position: not on batch size, row order or the other
rows' seeds.  Cost: one extra small kernel (plus a host-side reseed) per seeded
row per step; fine for a handful of rows, linear in their number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20
_MASK64 = (1 << 64) - 1
_TOP_K_CAP = 1 << 24  # top_k travels as float32 (exact below 2**24); larger means "all"


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, step: int) -> int:
    """Generator seed of a seeded request's ``step``-th token (a 64-bit mix of both).

    Hashed rather than ``seed * c + step`` so that nearby (seed, step) pairs do not
    collide; CPU generators use only its low 32 bits, which the mix spreads well.
    """
    return _splitmix64((_splitmix64(seed & _MASK64) + step) & _MASK64)


class SeedState:
    """Reusable ``torch.Generator`` objects, per device, for the seeded rows of a step.

    A generator is re-seeded (host-only, no sync) before each row's draw, so which
    generator a row borrows does not matter; keeping them avoids a new generator
    per row per step.  One ``SeedState`` per engine (per sampler) is enough.
    """

    def __init__(self) -> None:
        self._pools: dict[torch.device, list[torch.Generator]] = {}

    def generators(self, device: torch.device, n: int) -> tuple[torch.Generator, ...]:
        pool = self._pools.setdefault(device, [])
        while len(pool) < n:
            pool.append(torch.Generator(device=device))
        return tuple(pool[:n])


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters of one step, on the logits' device.

    temperature [B] float32  1.0 on greedy rows (never divides by 0)
    top_p       [B] float32  1.0 = off
    top_k       [B] int64    0 = off (-1 is mapped to 0)
    greedy      [B] bool
    cut         [B] bool     a sampled row with top-k or top-p on
    Host-side (read without touching the device):
    seeded_rows  row indices with a seed, ascending; seeds and generators align with it
    all_greedy   no row samples: skip the sampling path
    any_greedy   some row is greedy: merge with argmax
    needs_sort   some sampling row has top-k or top-p on
    max_logprobs largest ``logprobs`` asked for, None if no row asks
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    greedy: torch.Tensor
    cut: torch.Tensor
    seeded_rows: tuple[int, ...]
    seeds: tuple[int, ...]
    generators: tuple[torch.Generator, ...]
    all_greedy: bool
    any_greedy: bool
    needs_sort: bool
    max_logprobs: int | None

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(
        cls, params_list: Sequence, device: torch.device | str, seeds_state: SeedState | None = None
    ) -> SamplingTensors:
        """Validate the rows' parameters and move them to ``device`` in one non-blocking copy."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        temps, top_ps, top_ks, greedy, cut = [], [], [], [], []
        seeded_rows, seeds = [], []
        max_lp: int | None = None
        needs_sort = False
        for row, p in enumerate(params_list):
            t, tp, tk = float(p.temperature), float(p.top_p), int(p.top_k)
            if not t >= 0.0:  # also rejects NaN
                raise ValueError(f"row {row}: temperature must be >= 0, got {p.temperature}")
            if not 0.0 < tp <= 1.0:
                raise ValueError(f"row {row}: top_p must be in (0, 1], got {p.top_p}")
            if tk < -1:
                raise ValueError(f"row {row}: top_k must be -1, 0 (off) or positive, got {p.top_k}")
            lp = getattr(p, "logprobs", None)
            if lp is not None:
                if not 0 <= lp <= MAX_LOGPROBS:
                    raise ValueError(f"row {row}: logprobs must be in [0, {MAX_LOGPROBS}], got {lp}")
                max_lp = lp if max_lp is None else max(max_lp, lp)
            g = t < GREEDY_EPS
            tk = 0 if tk <= 0 else min(tk, _TOP_K_CAP)
            greedy.append(1.0 if g else 0.0)
            temps.append(1.0 if g else t)
            top_ps.append(tp)
            top_ks.append(float(tk))
            cut.append(1.0 if not g and (tk > 0 or tp < 1.0) else 0.0)
            if not g:
                needs_sort |= tk > 0 or tp < 1.0
                seed = getattr(p, "seed", None)
                if seed is not None:
                    seeded_rows.append(row)
                    seeds.append(int(seed))
        n = len(temps)
        # [5, B] float32: temperature, top_p, top_k, greedy, cut -- one host buffer, one copy
        host = torch.tensor([temps, top_ps, top_ks, greedy, cut], dtype=torch.float32).reshape(5, n)
        if device.type == "cuda":
            dev = host.pin_memory().to(device, non_blocking=True)
        else:
            dev = host.to(device)
        state = seeds_state if seeds_state is not None else SeedState()
        return cls(
            temperature=dev[0],
            top_p=dev[1],
            top_k=dev[2].to(torch.int64),
            greedy=dev[3] != 0,
            cut=dev[4] != 0,
            seeded_rows=tuple(seeded_rows),
            seeds=tuple(seeds),
            generators=state.generators(device, len(seeded_rows)),
            all_greedy=all(g != 0 for g in greedy),
            any_greedy=any(g != 0 for g in greedy),
            needs_sort=needs_sort,
            max_logprobs=max_lp,
        )


@dataclass(frozen=True)
class LogprobsTensors:
    """Raw logprobs (log_softmax of the unmodified logits), on the logits' device.

    top_logprobs     [B, k] float32, descending per row; k = SamplingTensors.max_logprobs
    top_ids          [B, k] int64
    sampled_logprobs [B] float32  logprob of token_ids[b]
    sampled_ranks    [B] int64    1 + number of ids with a strictly larger logprob
    A row that asked for fewer than k reads its first ``logprobs`` columns.
    """

    top_logprobs: torch.Tensor
    top_ids: torch.Tensor
    sampled_logprobs: torch.Tensor
    sampled_ranks: torch.Tensor


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: LogprobsTensors | None


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask with -inf every id outside a row's top-k, then outside its top-p nucleus.

    logits [B, V] float32 (temperature already applied); top_k [B] int64, 0 = off;
    top_p [B] float32, 1 = off.  Sorts each row once (stable, descending).
    """
    V = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    pos = torch.arange(V, device=logits.device)
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)
    drop = pos[None, :] >= k[:, None]  # [B, V] in sorted order
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # mass strictly before position j; position 0 has 0 < top_p, so one id always survives.
    # top_p == 1 rows are exempt: a cumsum rounding to 1.0 early must not cut their tail.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    """``Sampler()(logits [B, V], st, step_index) -> SamplerOutput``; stateless, no host sync."""

    def __call__(
        self,
        logits: torch.Tensor,
        st: SamplingTensors,
        step_index: Sequence[int] | torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        logits     [B, V] floating, on st's device; not modified.
        step_index [B] host ints (list or CPU tensor): how many tokens each row's
                   request has generated so far.  Seeds the seeded rows' draws; may be
                   None when no row is seeded.  A device tensor is refused: reading it
                   would sync.
        """
        self._check(logits, st)
        steps = self._steps(step_index, st)
        logits32 = None
        if logits.is_cuda and logits.stride(1) == 1:
            from kvq.models.sampling_triton import sample_rows

            seeds = (torch.empty(st.batch_size, dtype=torch.int64, device=logits.device) if st.all_greedy
                     else self._row_seeds(st, steps, logits.device))  # greedy rows read no noise
            token_ids = sample_rows(logits, st.temperature, st.greedy, seeds, all_greedy=st.all_greedy)
            if st.needs_sort:  # rows with a cut: the exponential race after their sort; the others keep the kernel's
                logits32 = logits.float()
                token_ids = torch.where(st.cut, self._draw(logits32, st, steps), token_ids)
        else:
            logits32 = logits.float()
            token_ids = logits32.argmax(dim=-1) if st.all_greedy else self._draw(logits32, st, steps)
            if st.any_greedy and not st.all_greedy:
                token_ids = torch.where(st.greedy, logits32.argmax(dim=-1), token_ids)

        lp = None
        if st.max_logprobs is not None:
            logprobs = (logits32 if logits32 is not None else logits.float()).log_softmax(dim=-1)
            top_logprobs, top_ids = logprobs.topk(st.max_logprobs, dim=-1)
            sampled = logprobs.gather(1, token_ids[:, None])
            lp = LogprobsTensors(
                top_logprobs=top_logprobs,
                top_ids=top_ids,
                sampled_logprobs=sampled[:, 0],
                sampled_ranks=(logprobs > sampled).sum(dim=-1) + 1,
            )
        return SamplerOutput(token_ids=token_ids, logprobs=lp)

    @staticmethod
    def warm_up(vocab_size: int, device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
        """Compile the CUDA kernels' variants (greedy only; draws) for logits of this width and dtype
        (the model's) before the first step, so that no request waits for a compile; nothing elsewhere."""
        device = torch.device(device)
        if device.type != "cuda":
            return
        from kvq.models.sampling_triton import sample_rows

        x = torch.zeros(1, vocab_size, device=device, dtype=dtype)
        one, no = torch.ones(1, device=device), torch.zeros(1, dtype=torch.bool, device=device)
        for all_greedy in (True, False):
            sample_rows(x, one, no, torch.zeros(1, dtype=torch.int64, device=device), all_greedy=all_greedy)

    @staticmethod
    def _draw(logits32: torch.Tensor, st: SamplingTensors, steps) -> torch.Tensor:
        """The exponential race over every row (temperature, then each row's cut)."""
        x = logits32 / st.temperature[:, None]
        if st.needs_sort:
            x = apply_top_k_top_p(x, st.top_k, st.top_p)
        probs = x.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()  # unseeded rows: one batched draw
        for row, seed, gen in zip(st.seeded_rows, st.seeds, st.generators):
            gen.manual_seed(row_seed(seed, steps[row]))
            q[row].exponential_(generator=gen)
        # q can be 0 in float32; 0/0 would be NaN and argmax picks NaN
        return (probs / q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=-1)

    @staticmethod
    def _row_seeds(st: SamplingTensors, steps, device: torch.device) -> torch.Tensor:
        """[B] int64 Philox keys of the kernel's rows, in one pinned copy: row_seed(seed, step) for a
        seeded row; for the others one draw of torch's default CPU generator (torch.manual_seed
        repeats it) plus the row index."""
        base = int(torch.randint(0, 1 << 62, (1,)).item())  # a CPU tensor: no device sync
        seeds = torch.arange(base, base + st.batch_size, dtype=torch.int64)
        for row, seed in zip(st.seeded_rows, st.seeds):
            seeds[row] = row_seed(seed, steps[row]) & ((1 << 63) - 1)
        return seeds.pin_memory().to(device, non_blocking=True)

    @staticmethod
    def _check(logits: torch.Tensor, st: SamplingTensors) -> None:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        if not logits.is_floating_point():
            raise TypeError(f"logits must be floating point, got {logits.dtype}")
        if logits.shape[0] != st.batch_size:
            raise ValueError(f"logits have {logits.shape[0]} rows, sampling tensors {st.batch_size}")
        if logits.shape[1] == 0:
            raise ValueError("logits have an empty vocabulary dimension")
        if logits.device != st.temperature.device:
            raise ValueError(f"logits on {logits.device}, sampling tensors on {st.temperature.device}")
        if st.max_logprobs is not None and st.max_logprobs > logits.shape[1]:
            raise ValueError(f"logprobs={st.max_logprobs} exceeds the vocabulary size {logits.shape[1]}")

    @staticmethod
    def _steps(step_index, st: SamplingTensors) -> Sequence[int]:
        if step_index is None:
            if st.seeded_rows:
                raise ValueError("seeded rows need step_index")
            return ()
        if isinstance(step_index, torch.Tensor):
            if step_index.device.type != "cpu":
                raise ValueError("step_index must be host ints (a list or CPU tensor); reading a device tensor syncs")
            if step_index.dim() != 1:
                raise ValueError(f"step_index must be [B], got shape {tuple(step_index.shape)}")
            step_index = step_index.tolist()  # CPU tensor: no device sync
        if len(step_index) != st.batch_size:
            raise ValueError(f"step_index has {len(step_index)} entries, batch has {st.batch_size}")
        return step_index
